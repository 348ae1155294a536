/* moeblaze C ABI: a thin, stable C interface over the C++ API for foreign callers (the PyTorch
 * front end loads it with ctypes; docs/PYTORCH.md explains why a C ABI rather than a torch C++
 * extension). Built as the shared library libmoeblaze_capi.so (CMake target moeblaze_capi).
 *
 * Conventions
 *  - Every function returns MOEBLAZE_OK (0) or an error code; moeblaze_last_error() then holds
 *    the message (per thread), which names the argument and the rule it broke, exactly as the
 *    C++ API's exceptions do. Nothing is written to an output when a host-side check fails.
 *  - The caller owns every byte: inputs, outputs, what forward keeps for backward (H, the routing
 *    plan) and the workspaces. Pointers are host memory for device 0 (cpu) and device memory of
 *    the current CUDA device for device 1 (cuda); tensors are dense, row-major.
 *  - CUDA calls are enqueued on `stream` (a cudaStream_t, NULL = the legacy default stream) and
 *    never synchronise with the host, so they can be captured in a CUDA graph; bad values that
 *    can only be seen on the device (NaN logits, an out-of-range expert id) raise the `flags`
 *    array (4 int32 on the device, zeroed by the caller; 5 for moeblaze_check_plan_async)
 *    instead of failing the call: [0] expert out of range, [1] expert repeated in a token,
 *    [2] non-finite value, [3] bad pair offsets, [4] bad plan contents.
 *    moeblaze_routing_flags_error() turns raised flags into the validator's message. The one
 *    exception is moeblaze_token_round, which reads its pair count back (documented there).
 *  - Codes: dtype 0 fp32, 1 bf16; compute 0 storage, 1 fp8, 2 fp8-wgrad; device 0 cpu, 1 cuda; activation 0 swiglu, 1 geglu, 2 relu,
 *    3 silu, 4 gelu, 5 relu2, 6 swiglu_oai; router 0 softmax_topk, 1 topk_softmax,
 *    2 sigmoid_bias; mode 0 keep_h, 1 recompute; rounding 0 nr-f, 1 sr-f, 2 up, 3 down (the C++
 *    enums' values).
 *  - No output may overlap an input or another output (including h, the workspace and the
 *    plan's arrays): the layer calls and the plan builds reject any overlap with
 *    MOEBLAZE_ERR_INVALID_ARGUMENT naming both arguments (in-place results would be wrong, not
 *    merely slow).
 *  - The auxiliary losses (load balancing, z-loss) are separate calls: moeblaze_router_losses
 *    and moeblaze_router_backward_losses (moeblaze_route and moeblaze_router_backward ignore
 *    them), so a caller with autograd may also compute them itself from the logits.
 */
#ifndef MOEBLAZE_CAPI_H_
#define MOEBLAZE_CAPI_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOEBLAZE_CAPI_VERSION 6 /* 2: moeblaze_layer_cfg.compute; 3: two-call token rounding;
                                   4: the router losses; 5: FP8 weight caches; 6: compute 2 */

enum {
  MOEBLAZE_OK = 0,
  MOEBLAZE_ERR_INVALID_ARGUMENT = 1, /* moeblaze::InvalidArgument */
  MOEBLAZE_ERR_UNSUPPORTED = 2,      /* moeblaze::Unsupported (e.g. GPU needs d % 64 == 0) */
  MOEBLAZE_ERR_DEVICE = 3,           /* moeblaze::DeviceError (a CUDA call failed) */
  MOEBLAZE_ERR_OTHER = 4             /* anything else (bad_alloc, ...) */
};

/* The layer's shape and options (LayerConfig + LayerOptions). */
typedef struct {
  int64_t T, d, n, E, K;
  int32_t activation;
  int32_t dtype;
  int32_t mode;        /* 0 keep_h, 1 recompute, 2 keep_h whose backward writes dH over h
                          (CUDA: less workspace; h is garbage afterwards) */
  int32_t num_threads; /* CPU threads, 0 = all */
  int32_t compute;     /* 0 storage dtype, 1 fp8 (e4m3 operands, bf16 storage; CUDA: d and n
                          multiples of 128), 2 fp8-wgrad (1 with the weight gradients in FP8
                          too): LayerConfig::compute */
  void* fp8_weights;   /* with compute 1 or 2: a cache from moeblaze_fp8_weight_cache_create (W1 and
                          W2's e4m3 codes kept between calls), or NULL (quantized in every call);
                          NULL with compute 0. LayerOptions::fp8_weights */
} moeblaze_layer_cfg;

/* The router (RouterConfig without the loss coefficients). */
typedef struct {
  int32_t kind;
  int32_t top_k;
  int32_t renormalize;
} moeblaze_router_cfg;

/* A routing: CSR over tokens. pair_offsets (T+1,), pair_experts (P,), pair_weights (P,). */
typedef struct {
  int64_t T, E, P;
  int32_t* pair_offsets;
  int32_t* pair_experts;
  float* pair_weights;
} moeblaze_routing;

/* A routing plan over caller storage (routing_plan.hpp's arrays; S = the routing's P). */
typedef struct {
  int64_t T, E, S;
  int32_t* expert_token_offsets; /* (E+1,) */
  int32_t* expert_token_indices; /* (S,) */
  float* slot_weights;           /* (S,) */
  int32_t* token_pair_offsets;   /* (T+1,) */
  int32_t* token_expert_indices; /* (S,) */
  int32_t* token_index_map;      /* (S,) */
} moeblaze_plan;

int moeblaze_capi_version(void);
int moeblaze_has_cuda(void);           /* 1 when built with the CUDA backend */
const char* moeblaze_last_error(void); /* message of this thread's last failed call, or "" */

/* Library-owned bytes (memory_stats): what moeblaze allocated itself. Caller memory passed in
 * through this ABI is not counted. */
int moeblaze_memory_stats(int32_t device, uint64_t* current, uint64_t* peak);
int moeblaze_reset_peak(int32_t device);

/* Router forward: logits (T, E) fp32/bf16 [+ bias (E,) fp32 for sigmoid_bias] → top-K routing
 * into `out` (P = T*K; the caller sets out->T, E, P and the three arrays). workspace: CPU none;
 * CUDA none either (0 bytes). */
int moeblaze_route(const moeblaze_router_cfg* cfg, const void* logits, int32_t logits_dtype,
                   int64_t T, int64_t E, const float* bias, int32_t device, void* stream,
                   const moeblaze_routing* out, int32_t* flags);

/* Router backward: d_logits (T, E) fp32 from d_pair_weights (P,) fp32, for a routing of these
 * logits (top-K or token-rounded). */
int moeblaze_router_backward(const moeblaze_router_cfg* cfg, const void* logits,
                             int32_t logits_dtype, int64_t T, int64_t E, const float* bias,
                             int32_t device, void* stream, const moeblaze_routing* routing,
                             const float* d_pair_weights, float* d_logits, int32_t* flags);

/* Router auxiliary losses of a routing of these logits (the C++ route()'s RouterLosses, bitwise,
 * for any routing: top-K or token-rounded), each rounded once to fp32:
 * aux_loss = aux_coef * E * sum_e f_e * mean_t q_t,e (q the softmax, or for sigmoid-bias the
 * normalised sigmoid, which ignores the bias) and z_loss = z_coef * mean_t logsumexp(logits_t)^2,
 * 0 where a coefficient is 0; f_e = count_e / P is the share of the routing's pairs on expert e.
 * aux_loss, z_loss (one float each) and f (E,) are written where not NULL
 * (moeblaze_router_backward_losses takes f). Both coefficients must be finite and >= 0. bias:
 * as moeblaze_route's (checked, not read). routing: one of these logits, as moeblaze_route or the
 * token rounding return it; the CPU checks its ids, CUDA does not (an id outside [0, E) would go
 * uncounted): validate a routing from elsewhere first (moeblaze_build_plan's flags). Deterministic (no atomics, fixed summation order);
 * cuda's f is cpu's bit for bit, its losses agree to fp32 rounding (z's logsumexp uses logf).
 * CUDA: no host sync, a workspace of moeblaze_router_losses_workspace_bytes (CPU: none). */
int moeblaze_router_losses_workspace_bytes(int64_t T, int64_t E, int64_t P, int32_t device,
                                           uint64_t* bytes);
int moeblaze_router_losses(const moeblaze_router_cfg* cfg, float aux_coef, float z_coef,
                           const void* logits, int32_t logits_dtype, int64_t T, int64_t E,
                           const float* bias, int32_t device, void* stream,
                           const moeblaze_routing* routing, void* workspace,
                           uint64_t workspace_bytes, float* aux_loss, float* z_loss, float* f);

/* moeblaze_router_backward with the losses' gradients added in the same pass:
 * d_logits = d(pair weights) + g_aux * d aux_loss / d logits + g_z * d z_loss / d logits.
 * g_aux, g_z: one fp32 each on `device`, the upstream gradients of the two losses (what
 * autograd hands them; read on the device, no host sync), or NULL for none. f: the (E,) output
 * of moeblaze_router_losses for this routing, required when aux_coef > 0 and g_aux is given. */
int moeblaze_router_backward_losses(const moeblaze_router_cfg* cfg, float aux_coef, float z_coef,
                                    const void* logits, int32_t logits_dtype, int64_t T,
                                    int64_t E, const float* bias, int32_t device, void* stream,
                                    const moeblaze_routing* routing, const float* d_pair_weights,
                                    const float* f, const float* g_aux, const float* g_z,
                                    float* d_logits, int32_t* flags);

/* Token rounding (SonicMoE): from the logits and their top-K routing to a rounded routing whose
 * pair count P' is only known after the call. Phase 1 computes it into a handle and returns P'
 * (CUDA: reads it back to the host, one synchronisation: not graph-capturable); phase 2 copies
 * it into caller arrays of P' pairs (moeblaze_routing_take, which frees the handle; or
 * moeblaze_routing_free to drop it). */
int moeblaze_token_round(const moeblaze_router_cfg* cfg, int32_t m_tile, int32_t rounding,
                         uint64_t seed, const void* logits, int32_t logits_dtype, int64_t T,
                         int64_t E, const float* bias, int32_t device, void* stream,
                         const moeblaze_routing* topk, void** handle, int64_t* rounded_pairs);
int moeblaze_routing_take(void* handle, const moeblaze_routing* out, void* stream);
void moeblaze_routing_free(void* handle);

/* The same token rounding in two calls, CUDA only, on the caller's stream over a caller workspace
 * of moeblaze_token_round_workspace_bytes (it must live until the fill is done): count validates
 * topk and the logits and returns P' with one synchronisation (its only one: no allocation, no
 * copy through the default stream); fill writes the rounded routing into `out` (P = P') without
 * one. A bad topk or a NaN/Inf logit fails count with the CPU's message. */
int moeblaze_token_round_workspace_bytes(int64_t T, int64_t E, int32_t device, uint64_t* bytes);
int moeblaze_token_round_count(const moeblaze_router_cfg* cfg, int32_t m_tile, int32_t rounding,
                               uint64_t seed, const void* logits, int32_t logits_dtype,
                               int64_t T, int64_t E, const float* bias, int32_t device,
                               void* stream, const moeblaze_routing* topk, void* workspace,
                               uint64_t workspace_bytes, int64_t* rounded_pairs);
int moeblaze_token_round_fill(const moeblaze_router_cfg* cfg, const void* logits,
                              int32_t logits_dtype, int64_t T, int64_t E, int32_t device,
                              void* stream, const void* workspace, uint64_t workspace_bytes,
                              const moeblaze_routing* out);

/* Routing plan (atomic-free builder) over caller storage. The CPU validates the routing (error
 * naming the first bad entry); CUDA raises `flags` instead. */
int moeblaze_plan_workspace_bytes(int64_t T, int64_t E, int64_t P, int32_t device,
                                  uint64_t* bytes);
int moeblaze_build_plan(const moeblaze_routing* routing, int32_t device, void* stream,
                        const moeblaze_plan* plan, void* workspace, uint64_t workspace_bytes,
                        int32_t* flags);

/* The plan straight from a fixed-K routing as frameworks hold it: expert_ids (T, K) int32 or
 * int64 (ids_dtype, below) and expert_weights (T, K) fp32 or bf16 (weights_dtype, a dtype code),
 * row-major, 1 <= K <= E. The same plan, and the same checks, as converting them to a
 * moeblaze_routing (offsets t*K, int32 ids, fp32 weights) and calling moeblaze_build_plan, in one
 * call: CUDA adds one kernel, no host sync, and zeroes `flags` itself first; an id of any width
 * outside [0, E) stays out of range (never wraps into a valid one). The CPU names a bad id as
 * expert_ids[t, k]. Workspace: moeblaze_plan_from_ids_workspace_bytes (0 on the CPU). */
enum { MOEBLAZE_IDS_INT32 = 0, MOEBLAZE_IDS_INT64 = 1 };
int moeblaze_plan_from_ids_workspace_bytes(int64_t T, int64_t K, int64_t E, int32_t device,
                                           uint64_t* bytes);
int moeblaze_plan_from_ids(const void* expert_ids, int32_t ids_dtype, const void* expert_weights,
                           int32_t weights_dtype, int64_t T, int64_t K, int64_t E,
                           int32_t device, void* stream, const moeblaze_plan* plan,
                           void* workspace, uint64_t workspace_bytes, int32_t* flags);

/* After a CUDA call raised flags: copy them (4 int32, host) and the routing here; returns
 * MOEBLAZE_ERR_INVALID_ARGUMENT with the CPU validator's message naming the first bad entry
 * (one synchronising copy; the error path only), MOEBLAZE_OK if no flag is raised. For the
 * router's flags (non-finite logits) pass routing = NULL: the message then says so. */
int moeblaze_routing_flags_error(const int32_t* host_flags, const moeblaze_routing* routing,
                                 int32_t device);

/* Checks a routing plan in host memory (validate_routing_plan's rules: offsets monotone from 0
 * to S, every index in range, token_index_map a permutation under which the two views agree,
 * slot weights finite); MOEBLAZE_ERR_INVALID_ARGUMENT naming the first bad entry otherwise.
 * The CPU layer calls below run this check on every plan they are given, before any output is
 * written. A plan on cuda is not read by the host: it is as good as the routing it was built
 * from, which moeblaze_build_plan checks on the device (`flags`); a caller who fills device
 * plan arrays any other way checks them with the two calls below (or a host copy here). */
int moeblaze_validate_plan(const moeblaze_plan* plan);

/* The same rules on the plan's device, for a plan in device memory that moeblaze_build_plan did
 * not fill. moeblaze_check_plan_async (CUDA) enqueues the check on `stream` with no host sync
 * (graph-capturable): a broken rule sets flags[4] (bad_plan) to 1; `flags` is then 5 int32 on
 * the device, zeroed by the caller (entries 0-3 are the routing checks', so one array of 5 can
 * serve every call); workspace needs moeblaze_plan_check_workspace_bytes (ceil(S/32)*4 bytes).
 * On cpu it is moeblaze_validate_plan (workspace and flags unused, may be NULL).
 * moeblaze_validate_plan_sync is the opt-in synchronous check: the same kernel on `stream` with
 * the library's own workspace, one host sync, then MOEBLAZE_ERR_INVALID_ARGUMENT with
 * moeblaze_validate_plan's message naming the first bad entry (from a host copy, the error path
 * only). Call it before moeblaze_layer_forward/backward with a caller-filled device plan: those
 * calls read the plan without checking its contents (a bad one reads out of bounds), and after
 * flags[4] was raised, to get the message. */
int moeblaze_plan_check_workspace_bytes(int64_t S, int32_t device, uint64_t* bytes);
int moeblaze_check_plan_async(const moeblaze_plan* plan, int32_t device, void* stream,
                              void* workspace, uint64_t workspace_bytes, int32_t* flags);
int moeblaze_validate_plan_sync(const moeblaze_plan* plan, int32_t device, void* stream);

/* FP8 weight caches (Fp8WeightCache, include/moeblaze/layer.hpp). The first FP8 layer call given
 * a cache (cfg.fp8_weights) on CUDA quantizes W1 and W2 into it; later calls reuse the codes until
 * moeblaze_fp8_weight_cache_weights_changed, which the caller makes after every in-place update
 * of the weights (the library cannot see one); a call with other weight pointers or shapes
 * requantizes by itself. Its first call at a shape allocates (a host sync; refused inside a CUDA
 * graph capture). The CPU backend quantizes in every call and leaves the cache empty. A handle
 * is used by one stream at a time. destroy waits for the device before it frees the codes and
 * takes NULL; any other call with a handle that create did not return, or that was destroyed,
 * fails with MOEBLAZE_ERR_INVALID_ARGUMENT. stats: bytes held (device memory), and how many
 * calls (re)quantized the weights. */
int moeblaze_fp8_weight_cache_create(void** cache);
int moeblaze_fp8_weight_cache_destroy(void* cache);
int moeblaze_fp8_weight_cache_weights_changed(void* cache);
int moeblaze_fp8_weight_cache_stats(void* cache, uint64_t* bytes, int64_t* quantizations);

/* Layer. The workspace (NULL = the library allocates its own, accounted) needs at least
 * moeblaze_layer_workspace_bytes for this call's thread count (CPU) and must be 64-byte
 * aligned. h: moeblaze_layer_kept_h_bytes, 16-byte aligned ((S, w1_rows) cfg dtype; with fp8
 * compute e4m3 codes then fp32 scales), written by forward and read by backward in keep_h mode;
 * NULL in recompute mode. */
int moeblaze_layer_kept_h_bytes(const moeblaze_layer_cfg* cfg, int64_t S, uint64_t* bytes);
int moeblaze_layer_workspace_bytes(const moeblaze_layer_cfg* cfg, int64_t S, int32_t device,
                                   uint64_t* bytes);
/* One pass's workspace alone: pass 0 forward, 1 backward (mode 2 needs less there). */
int moeblaze_layer_pass_workspace_bytes(const moeblaze_layer_cfg* cfg, int64_t S, int32_t device,
                                        int32_t pass, uint64_t* bytes);
int moeblaze_layer_forward(const moeblaze_layer_cfg* cfg, const moeblaze_plan* plan,
                           int32_t device, void* stream, const void* x, const void* w1,
                           const void* w2, void* out, void* h, void* workspace,
                           uint64_t workspace_bytes);
/* Backward on CUDA in mode 0, 1 or 2 takes plan->token_expert_indices = NULL (it never reads
 * that array, so a caller may free it after forward); the CPU, and opts.check_plan, need it. */
int moeblaze_layer_backward(const moeblaze_layer_cfg* cfg, const moeblaze_plan* plan,
                            int32_t device, void* stream, const void* x, const void* w1,
                            const void* w2, const void* d_out, const void* h, void* dx,
                            void* dw1, void* dw2, float* d_pair_weights, void* workspace,
                            uint64_t workspace_bytes);

/* The same with expert biases (gpt-oss): b1 (E, w1_rows) added to H before the activation, b2
 * (E, d) to each expert's output before the weighted sum; cfg dtype, each may be NULL (no such
 * bias). Backward writes db1 / db2 (shaped like the bias; fp32 accumulation in slot order),
 * given exactly when the bias is (NULL otherwise). keep_h / recompute on the CPU and CUDA
 * backends; the materialized mode returns MOEBLAZE_ERR_UNSUPPORTED for a bias. */
int moeblaze_layer_forward_biased(const moeblaze_layer_cfg* cfg, const moeblaze_plan* plan,
                                  int32_t device, void* stream, const void* x, const void* w1,
                                  const void* w2, const void* b1, const void* b2, void* out,
                                  void* h, void* workspace, uint64_t workspace_bytes);
int moeblaze_layer_backward_biased(const moeblaze_layer_cfg* cfg, const moeblaze_plan* plan,
                                   int32_t device, void* stream, const void* x, const void* w1,
                                   const void* w2, const void* b1, const void* b2,
                                   const void* d_out, const void* h, void* dx, void* dw1,
                                   void* dw2, float* d_pair_weights, void* db1, void* db2,
                                   void* workspace, uint64_t workspace_bytes);

#ifdef __cplusplus
}
#endif

#endif /* MOEBLAZE_CAPI_H_ */
