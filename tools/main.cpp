// The `moeblaze` command: parses the command line with CLI11 and runs one subcommand.
// Exit status: 0 success, 1 the run failed, 2 bad flags or arguments (see commands.hpp).
#include <CLI/CLI.hpp>
#include <iostream>
#include <new>

#include "commands.hpp"
#include "moeblaze/error.hpp"

int main(int argc, char** argv) {
  using namespace moeblaze::tools;
  CLI::App app{
      "moeblaze: Mixture-of-Experts layers whose routing is indexing, not copying.\n"
      "Run `moeblaze run` for forward+backward of the embedded default layer on the CPU."};
  app.name("moeblaze");
  app.require_subcommand(1);
  app.fallthrough(false);

  add_run_command(app);
#ifdef MOEBLAZE_WITH_CUDA
  CLI::App* bench = app.add_subcommand("bench", "GPU benchmarks (CUDA builds only)");
  bench->require_subcommand(1);
  add_bench_routing_command(*bench);
  add_bench_layer_command(*bench);
  add_bench_gemm_command(*bench);
  add_bench_kernels_command(*bench);
  add_bench_ep_command(*bench);
#endif

  try {
    app.parse(argc, argv);
  } catch (const CLI::RuntimeError& e) {
    return e.get_exit_code();  // a subcommand's chosen status; it printed its own message
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints --help, or the error and a pointer to --help
    return code == 0 ? kExitOk : kExitUsage;
  } catch (const moeblaze::InvalidArgument& e) {
    std::cerr << "moeblaze: error: " << e.what() << "\n";
    return kExitUsage;
  } catch (const moeblaze::Unsupported& e) {
    std::cerr << "moeblaze: unsupported: " << e.what() << "\n";
    return kExitUsage;
  } catch (const std::bad_alloc&) {
    std::cerr << "moeblaze: error: out of memory (try a smaller --config or --T)\n";
    return kExitFailure;
  } catch (const std::exception& e) {
    std::cerr << "moeblaze: error: " << e.what() << "\n";
    return kExitFailure;
  }
  return kExitOk;
}
