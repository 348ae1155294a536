// In-process transport: world_size simulated ranks (threads) sharing host memory. Every
// collective is post → barrier → each rank copies what it receives from the posted send buffers
// → barrier (so no rank reuses a send buffer while a peer still reads it). Each rank writes only
// its own receive buffer, so the result does not depend on thread timing.
//
// A failed rank aborts the group: ranks waiting at a barrier, and any later collective, throw
// Error instead of blocking forever (run_in_process does this for the caller's exceptions).
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "moeblaze/error.hpp"
#include "moeblaze/expert_parallel.hpp"

namespace moeblaze {
namespace {

// What a rank throws when the group was aborted by another rank's failure.
class GroupAborted : public Error {
 public:
  GroupAborted() : Error("in-process transport: the group was aborted by a failed rank") {}
};

struct Posted {
  const void* send = nullptr;
  const int64_t* send_counts = nullptr;   // (W,) bytes
  const int64_t* send_offsets = nullptr;  // (W,) bytes
  int64_t count = 0;                      // all_gather: values per rank
};

class Group {
 public:
  explicit Group(int world) : world_(world), posted_(static_cast<size_t>(world)) {}
  int world() const { return world_; }
  Posted& posted(int r) { return posted_[static_cast<size_t>(r)]; }

  void barrier() {
    std::unique_lock<std::mutex> lock(mu_);
    if (aborted_) throw GroupAborted();
    const uint64_t gen = generation_;
    if (++arrived_ == world_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != gen || aborted_; });
    if (generation_ == gen) throw GroupAborted();
  }

  void abort() {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
    cv_.notify_all();
  }

  // A rank found the current collective inconsistent. It still passes the closing barrier (its
  // posted buffers must outlive the peers' copies); after it, every rank sees the flag and throws.
  void mark_failed() {
    std::lock_guard<std::mutex> lock(mu_);
    failed_ = true;
  }
  bool failed() {
    std::lock_guard<std::mutex> lock(mu_);
    return failed_;
  }

 private:
  const int world_;
  std::vector<Posted> posted_;  // (W,) what each rank offers in the current collective
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  bool failed_ = false;
};

class InProcessTransport final : public Transport {
 public:
  InProcessTransport(std::shared_ptr<Group> group, int rank)
      : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return group_->world(); }
  Device device() const override { return Device::cpu; }

  void all_to_all_v(const void* send, const int64_t* send_counts, const int64_t* send_offsets,
                    void* recv, const int64_t* recv_counts,
                    const int64_t* recv_offsets) override {
    Posted& me = group_->posted(rank_);
    me.send = send;
    me.send_counts = send_counts;
    me.send_offsets = send_offsets;
    group_->barrier();
    std::string error;
    for (int s = 0; s < world_size(); ++s) {
      const Posted& peer = group_->posted(s);
      const int64_t n = peer.send_counts[rank_];
      if (n != recv_counts[s]) {
        error = detail::concat("all_to_all_v: rank ", rank_, " expects ", recv_counts[s],
                               " bytes from rank ", s, ", which sends ", n);
        break;
      }
      if (n > 0)
        std::memcpy(static_cast<char*>(recv) + recv_offsets[s],
                    static_cast<const char*>(peer.send) + peer.send_offsets[rank_],
                    static_cast<size_t>(n));
    }
    finish(error);
  }

  void all_gather(const int64_t* send, int64_t count, int64_t* recv) override {
    Posted& me = group_->posted(rank_);
    me.send = send;
    me.count = count;
    group_->barrier();
    std::string error;
    for (int s = 0; s < world_size(); ++s) {
      const Posted& peer = group_->posted(s);
      if (peer.count != count) {
        error = detail::concat("all_gather: rank ", rank_, " gathers ", count, " values, rank ",
                               s, " ", peer.count);
        break;
      }
      if (count > 0)
        std::memcpy(recv + s * count, peer.send, sizeof(int64_t) * static_cast<size_t>(count));
    }
    finish(error);
  }

  Group& group() { return *group_; }

 private:
  // The closing barrier of a collective, then its verdict: the rank that found an inconsistency
  // throws it, the others throw GroupAborted, and the group stays aborted.
  void finish(const std::string& error) {
    if (!error.empty()) group_->mark_failed();
    group_->barrier();
    if (!group_->failed()) return;
    group_->abort();
    if (!error.empty()) throw Error(error);
    throw GroupAborted();
  }

 private:
  std::shared_ptr<Group> group_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Transport>> make_in_process_transports(int world_size) {
  MOEBLAZE_REQUIRE(world_size >= 1, "world_size (", world_size, ") must be >= 1");
  auto group = std::make_shared<Group>(world_size);
  std::vector<std::unique_ptr<Transport>> out;
  for (int r = 0; r < world_size; ++r) out.push_back(std::make_unique<InProcessTransport>(group, r));
  return out;
}

void run_in_process(int world_size, const std::function<void(Transport&)>& fn) {
  MOEBLAZE_REQUIRE(world_size >= 1, "world_size (", world_size, ") must be >= 1");
  MOEBLAZE_REQUIRE(static_cast<bool>(fn), "fn is empty");
  std::vector<std::unique_ptr<Transport>> transports = make_in_process_transports(world_size);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world_size));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      auto& t = static_cast<InProcessTransport&>(*transports[static_cast<size_t>(r)]);
      try {
        fn(t);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
        t.group().abort();
      }
    });
  }
  for (std::thread& th : threads) th.join();
  // A rank's own failure explains the others' (aborted collectives, RemoteRankError); the lowest
  // such rank is reported, so the choice does not depend on thread timing.
  std::exception_ptr first_any;
  for (const std::exception_ptr& e : errors) {
    if (!e) continue;
    if (!first_any) first_any = e;
    try {
      std::rethrow_exception(e);
    } catch (const GroupAborted&) {
    } catch (const RemoteRankError&) {
    } catch (...) {
      std::rethrow_exception(e);
    }
  }
  if (first_any) std::rethrow_exception(first_any);
}

}  // namespace moeblaze
