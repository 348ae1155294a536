// The subcommands of the `moeblaze` command. Each lives in its own tools/cmd_*.cpp and is added
// by one registration function, called from main.cpp; a new subcommand is a new file plus one
// declaration here and one call in main.cpp.
//
// Conventions every subcommand follows (main.cpp enforces the exit codes):
//  - the callback validates every flag before doing any work; a bad flag throws
//    moeblaze::InvalidArgument naming the flag and the rule → "moeblaze: error: ..." and exit 2;
//  - to exit with a specific status, throw CLI::RuntimeError(status) (printed nothing extra);
//  - results go to stdout (a table, or JSON lines with --json); notices and progress to stderr.
#pragma once

namespace CLI {
class App;
}

namespace moeblaze::tools {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;  // the run itself failed (e.g. --check found an error too large)
constexpr int kExitUsage = 2;    // bad flags or arguments

// `moeblaze run`: forward+backward of one MoE layer on the CPU backend (tools/cmd_run.cpp).
void add_run_command(CLI::App& app);

#ifdef MOEBLAZE_WITH_CUDA
// `moeblaze bench routing` and `moeblaze bench layer` (tools/cmd_bench_routing.cpp,
// tools/cmd_bench_layer.cpp), added under the `bench` subcommand that main.cpp creates.
void add_bench_routing_command(CLI::App& bench);
void add_bench_layer_command(CLI::App& bench);
// `moeblaze bench gemm`: the grouped GEMM kernels alone (tools/cmd_bench_gemm.cpp).
void add_bench_gemm_command(CLI::App& bench);
// `moeblaze bench kernels`: the kernel each grouped GEMM runs per config (no GPU needed).
void add_bench_kernels_command(CLI::App& bench);
// `moeblaze bench ep`: expert parallelism over NCCL at W GPUs against the single-GPU layer
// (tools/cmd_bench_ep.cpp).
void add_bench_ep_command(CLI::App& bench);
#endif

}  // namespace moeblaze::tools
