#include "table.hpp"

#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace moeblaze::tools {

Table::Table(std::vector<Column> columns) : columns_(std::move(columns)) {}

void Table::add_row(std::vector<std::string> cells) {
  if (cells.size() != columns_.size())
    throw std::logic_error("Table::add_row: " + std::to_string(cells.size()) + " cells for " +
                           std::to_string(columns_.size()) + " columns");
  rows_.push_back(std::move(cells));
}

void Table::print(std::ostream& os) const {
  std::vector<size_t> width(columns_.size());
  for (size_t c = 0; c < columns_.size(); ++c) {
    width[c] = columns_[c].header.size();
    for (const auto& r : rows_) width[c] = std::max(width[c], r[c].size());
  }
  auto cell = [&](const std::string& s, size_t c) {
    const std::string pad(width[c] - s.size(), ' ');
    return columns_[c].align == Align::left ? s + pad : pad + s;
  };
  auto line = [&](auto get) {
    std::string s;
    for (size_t c = 0; c < columns_.size(); ++c) {
      if (c) s += " | ";
      s += cell(get(c), c);
    }
    while (!s.empty() && s.back() == ' ') s.pop_back();  // no trailing blanks in pasted output
    os << s << '\n';
  };
  line([&](size_t c) { return columns_[c].header; });
  std::string rule;
  for (size_t c = 0; c < columns_.size(); ++c) {
    if (c) rule += "-|-";
    rule += std::string(width[c], '-');
  }
  os << rule << '\n';
  for (const auto& r : rows_) line([&](size_t c) { return r[c]; });
}

std::string json_escape(const std::string& s) {
  std::string out = "\"";
  for (unsigned char ch : s) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (ch < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", ch);
          out += buf;
        } else {
          out += static_cast<char>(ch);
        }
    }
  }
  return out + "\"";
}

JsonLine& JsonLine::add(const std::string& key, const std::string& value) {
  fields_.emplace_back(key, json_escape(value));
  return *this;
}
JsonLine& JsonLine::add(const std::string& key, const char* value) {
  return add(key, std::string(value));
}
JsonLine& JsonLine::add(const std::string& key, int64_t value) {
  fields_.emplace_back(key, std::to_string(value));
  return *this;
}
JsonLine& JsonLine::add(const std::string& key, uint64_t value) {
  fields_.emplace_back(key, std::to_string(value));
  return *this;
}
JsonLine& JsonLine::add(const std::string& key, double value) {
  if (!std::isfinite(value)) return add_null(key);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", value);  // 6 significant digits: beyond timing noise
  fields_.emplace_back(key, buf);
  return *this;
}
JsonLine& JsonLine::add(const std::string& key, bool value) {
  fields_.emplace_back(key, value ? "true" : "false");
  return *this;
}
JsonLine& JsonLine::add(const std::string& key, const std::vector<double>& values) {
  std::string a = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) a += ", ";
    if (!std::isfinite(values[i])) {
      a += "null";
      continue;
    }
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.6g", values[i]);
    a += buf;
  }
  fields_.emplace_back(key, a + "]");
  return *this;
}
JsonLine& JsonLine::add(const std::string& key, const JsonLine& object) {
  fields_.emplace_back(key, object.str());
  return *this;
}
JsonLine& JsonLine::add_null(const std::string& key) {
  fields_.emplace_back(key, "null");
  return *this;
}

std::string JsonLine::str() const {
  std::string s = "{";
  for (size_t i = 0; i < fields_.size(); ++i) {
    if (i) s += ", ";
    s += json_escape(fields_[i].first) + ": " + fields_[i].second;
  }
  return s + "}";
}

std::string fixed(double v, int decimals) {
  if (!std::isfinite(v)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

std::string scientific(double v, int digits) {
  if (!std::isfinite(v)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*e", digits, v);
  return buf;
}

std::string human_bytes(double b) {
  if (b < 1024) return std::to_string(static_cast<long long>(b)) + " B";
  if (b < 1024.0 * 1024) return fixed(b / 1024, 1) + " KiB";
  if (b < 1024.0 * 1024 * 1024) return fixed(b / (1024.0 * 1024), 1) + " MiB";
  return fixed(b / (1024.0 * 1024 * 1024), 2) + " GiB";
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) break;
    size_t b = line.find_first_not_of(" \t", colon + 1);
    if (b == std::string::npos) break;
    return line.substr(b);
  }
  return "unknown cpu";
}

namespace {

// First line of a shell command's stdout, or "" when it fails.
std::string first_line_of(const std::string& cmd, int* status = nullptr) {
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return "";
  std::array<char, 256> buf{};
  std::string out;
  if (std::fgets(buf.data(), static_cast<int>(buf.size()), p)) out = buf.data();
  while (std::fgets(buf.data(), static_cast<int>(buf.size()), p)) {
  }
  const int rc = pclose(p);
  if (status) *status = rc;
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return rc == 0 ? out : "";
}

// Folder of the running executable: the build folder, which lives inside the source tree for
// every build the scripts make, so git finds the commit the binary was built from even when the
// command runs from elsewhere.
std::string exe_dir() {
  std::array<char, 4096> buf{};
  const ssize_t n = readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) return ".";
  std::string p(buf.data(), static_cast<size_t>(n));
  const size_t slash = p.rfind('/');
  return slash == std::string::npos ? "." : p.substr(0, slash);
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

}  // namespace

std::string git_commit() {
  // A copy of the tree without .git cannot name its commit; the scripts pass it along.
  const char* env = std::getenv("MOEBLAZE_COMMIT");
  if (env && *env) return env;
  const std::string dir = shell_quote(exe_dir());
  const std::string head = first_line_of("git -C " + dir + " rev-parse --short HEAD 2>/dev/null");
  if (head.empty()) return "unknown";
  int status = 0;
  first_line_of("git -C " + dir + " diff --quiet HEAD -- 2>/dev/null", &status);
  return status == 0 ? head : head + "-dirty";
}

std::string utc_date_iso() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream is(s);
  while (std::getline(is, cur, ',')) {
    cur.erase(0, cur.find_first_not_of(" \t"));
    cur.erase(cur.find_last_not_of(" \t") + 1);
    out.push_back(cur);
  }
  return out;
}

}  // namespace moeblaze::tools
