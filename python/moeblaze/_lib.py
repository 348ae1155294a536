"""ctypes binding of libmoeblaze_capi.so (include/moeblaze/capi.h).

The library is looked up in this order: $MOEBLAZE_LIB (a path to the .so), then the copy
installed inside this package. torch is imported first so that the CUDA runtime, cuBLAS and
NCCL that a CUDA build of the library links against are the ones PyTorch already loaded.
"""
import ctypes
import os

import torch  # noqa: F401  (loads libcudart & co. before the library needs them)

CAPI_VERSION = 6  # capi.h's MOEBLAZE_CAPI_VERSION

# Error codes (capi.h).
OK, ERR_INVALID_ARGUMENT, ERR_UNSUPPORTED, ERR_DEVICE, ERR_OTHER = range(5)

# Enum codes shared with the C++ API.
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
ID_DTYPES = {torch.int32: 0, torch.int64: 1}  # moeblaze_plan_from_ids' ids_dtype
COMPUTES = {"storage": 0, "fp8": 1, "fp8-wgrad": 2}  # LayerCfg.compute
ACTIVATIONS = {"swiglu": 0, "geglu": 1, "relu": 2, "silu": 3, "gelu": 4, "relu2": 5,
               "swiglu_oai": 6}
GATED = {"swiglu", "geglu", "swiglu_oai"}
ROUTERS = {"softmax_topk": 0, "topk_softmax": 1, "sigmoid_bias": 2}
ROUNDINGS = {"nr-f": 0, "sr-f": 1, "up": 2, "down": 3}


class MoeblazeError(RuntimeError):
    """A moeblaze call failed for a reason other than a bad argument (device error, ...)."""


class UnsupportedError(ValueError):
    """Valid arguments the chosen backend cannot take (e.g. the GPU needs d % 64 == 0)."""


class LayerCfg(ctypes.Structure):
    _fields_ = [("T", ctypes.c_int64), ("d", ctypes.c_int64), ("n", ctypes.c_int64),
                ("E", ctypes.c_int64), ("K", ctypes.c_int64), ("activation", ctypes.c_int32),
                ("dtype", ctypes.c_int32), ("mode", ctypes.c_int32),
                ("num_threads", ctypes.c_int32), ("compute", ctypes.c_int32),
                ("fp8_weights", ctypes.c_void_p)]


class RouterCfg(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("top_k", ctypes.c_int32),
                ("renormalize", ctypes.c_int32)]


class Routing(ctypes.Structure):
    _fields_ = [("T", ctypes.c_int64), ("E", ctypes.c_int64), ("P", ctypes.c_int64),
                ("pair_offsets", ctypes.c_void_p), ("pair_experts", ctypes.c_void_p),
                ("pair_weights", ctypes.c_void_p)]


class Plan(ctypes.Structure):
    _fields_ = [("T", ctypes.c_int64), ("E", ctypes.c_int64), ("S", ctypes.c_int64),
                ("expert_token_offsets", ctypes.c_void_p),
                ("expert_token_indices", ctypes.c_void_p), ("slot_weights", ctypes.c_void_p),
                ("token_pair_offsets", ctypes.c_void_p),
                ("token_expert_indices", ctypes.c_void_p), ("token_index_map", ctypes.c_void_p)]


_P = ctypes.c_void_p
_I32, _I64, _U64 = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64
_SIGNATURES = {
    "moeblaze_capi_version": ([], ctypes.c_int),
    "moeblaze_has_cuda": ([], ctypes.c_int),
    "moeblaze_last_error": ([], ctypes.c_char_p),
    "moeblaze_memory_stats": ([_I32, ctypes.POINTER(_U64), ctypes.POINTER(_U64)], ctypes.c_int),
    "moeblaze_reset_peak": ([_I32], ctypes.c_int),
    "moeblaze_route": ([ctypes.POINTER(RouterCfg), _P, _I32, _I64, _I64, _P, _I32, _P,
                        ctypes.POINTER(Routing), _P], ctypes.c_int),
    "moeblaze_router_backward": ([ctypes.POINTER(RouterCfg), _P, _I32, _I64, _I64, _P, _I32, _P,
                                  ctypes.POINTER(Routing), _P, _P, _P], ctypes.c_int),
    "moeblaze_token_round": ([ctypes.POINTER(RouterCfg), _I32, _I32, _U64, _P, _I32, _I64, _I64,
                              _P, _I32, _P, ctypes.POINTER(Routing), ctypes.POINTER(_P),
                              ctypes.POINTER(_I64)], ctypes.c_int),
    "moeblaze_routing_take": ([_P, ctypes.POINTER(Routing), _P], ctypes.c_int),
    "moeblaze_routing_free": ([_P], None),
    "moeblaze_token_round_workspace_bytes": ([_I64, _I64, _I32, ctypes.POINTER(_U64)],
                                             ctypes.c_int),
    "moeblaze_token_round_count": ([ctypes.POINTER(RouterCfg), _I32, _I32, _U64, _P, _I32, _I64,
                                    _I64, _P, _I32, _P, ctypes.POINTER(Routing), _P, _U64,
                                    ctypes.POINTER(_I64)], ctypes.c_int),
    "moeblaze_token_round_fill": ([ctypes.POINTER(RouterCfg), _P, _I32, _I64, _I64, _I32, _P, _P,
                                   _U64, ctypes.POINTER(Routing)], ctypes.c_int),
    "moeblaze_plan_workspace_bytes": ([_I64, _I64, _I64, _I32, ctypes.POINTER(_U64)], ctypes.c_int),
    "moeblaze_build_plan": ([ctypes.POINTER(Routing), _I32, _P, ctypes.POINTER(Plan), _P, _U64, _P],
                            ctypes.c_int),
    "moeblaze_plan_from_ids_workspace_bytes": ([_I64, _I64, _I64, _I32, ctypes.POINTER(_U64)],
                                               ctypes.c_int),
    "moeblaze_plan_from_ids": ([_P, _I32, _P, _I32, _I64, _I64, _I64, _I32, _P,
                                ctypes.POINTER(Plan), _P, _U64, _P], ctypes.c_int),
    "moeblaze_routing_flags_error": ([_P, ctypes.POINTER(Routing), _I32], ctypes.c_int),
    "moeblaze_validate_plan_sync": ([ctypes.POINTER(Plan), _I32, _P], ctypes.c_int),
    "moeblaze_fp8_weight_cache_create": ([ctypes.POINTER(_P)], ctypes.c_int),
    "moeblaze_fp8_weight_cache_destroy": ([_P], ctypes.c_int),
    "moeblaze_fp8_weight_cache_weights_changed": ([_P], ctypes.c_int),
    "moeblaze_fp8_weight_cache_stats": ([_P, ctypes.POINTER(_U64), ctypes.POINTER(_I64)],
                                        ctypes.c_int),
    "moeblaze_layer_kept_h_bytes": ([ctypes.POINTER(LayerCfg), _I64, ctypes.POINTER(_U64)],
                                    ctypes.c_int),
    "moeblaze_layer_workspace_bytes": ([ctypes.POINTER(LayerCfg), _I64, _I32, ctypes.POINTER(_U64)],
                                       ctypes.c_int),
    "moeblaze_layer_pass_workspace_bytes": ([ctypes.POINTER(LayerCfg), _I64, _I32, _I32,
                                             ctypes.POINTER(_U64)], ctypes.c_int),
    "moeblaze_layer_forward": ([ctypes.POINTER(LayerCfg), ctypes.POINTER(Plan), _I32, _P, _P, _P, _P,
                                _P, _P, _P, _U64], ctypes.c_int),
    "moeblaze_layer_backward": ([ctypes.POINTER(LayerCfg), ctypes.POINTER(Plan), _I32, _P, _P, _P,
                                 _P, _P, _P, _P, _P, _P, _P, _P, _U64], ctypes.c_int),
    "moeblaze_layer_forward_biased": ([ctypes.POINTER(LayerCfg), ctypes.POINTER(Plan), _I32, _P, _P,
                                       _P, _P, _P, _P, _P, _P, _P, _U64], ctypes.c_int),
    "moeblaze_layer_backward_biased": ([ctypes.POINTER(LayerCfg), ctypes.POINTER(Plan), _I32, _P,
                                        _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P,
                                        _U64], ctypes.c_int),
}

_lib = None


def library_path():
    env = os.environ.get("MOEBLAZE_LIB")
    if env:
        return env
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libmoeblaze_capi.so")


def lib():
    """The loaded library (loaded on first use)."""
    global _lib
    if _lib is None:
        path = library_path()
        if not os.path.exists(path):
            raise ImportError(
                f"moeblaze: {path} not found; install the package (pip install ./python, which "
                "builds it with CMake) or point MOEBLAZE_LIB at a built libmoeblaze_capi.so")
        handle = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)  # its symbols stay out of the process's scope
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(handle, name)
            fn.argtypes = args
            fn.restype = res
        if handle.moeblaze_capi_version() != CAPI_VERSION:
            raise ImportError(f"moeblaze: {path} has C ABI version "
                              f"{handle.moeblaze_capi_version()}, this package expects "
                              f"{CAPI_VERSION}")
        _lib = handle
    return _lib


def check(rc):
    """Raises the Python error of a failed call: ValueError for a bad argument (the message names
    the argument and the rule), UnsupportedError, or MoeblazeError."""
    if rc == OK:
        return
    msg = "moeblaze: " + lib().moeblaze_last_error().decode("utf-8", "replace")
    if rc == ERR_INVALID_ARGUMENT:
        raise ValueError(msg)
    if rc == ERR_UNSUPPORTED:
        raise UnsupportedError(msg)
    raise MoeblazeError(msg)


def has_cuda():
    return bool(lib().moeblaze_has_cuda())


def ptr(t):
    """Data pointer of a tensor, or None for an absent / empty one."""
    if t is None or t.numel() == 0:
        return None
    return t.data_ptr()


def device_code(t):
    if t.is_cpu:  # is_cpu / is_cuda: no torch.device object built
        return 0
    if t.is_cuda:
        return 1
    raise ValueError(f"moeblaze: tensors on {t.device} are not supported (cpu or cuda)")


def stream_of(t):
    """The cudaStream_t of PyTorch's current stream on t's device (None on the CPU)."""
    if not t.is_cuda:
        return None
    # torch.cuda.current_stream(t.device).cuda_stream without building a Stream object.
    return torch._C._cuda_getCurrentRawStream(t.get_device())


def memory_stats(device="cuda"):
    """moeblaze's own allocations (bytes): {'current', 'peak'}. Memory passed in from PyTorch
    (H, plans, workspaces allocated by this package) is counted by PyTorch's allocator instead."""
    cur, peak = _U64(), _U64()
    check(lib().moeblaze_memory_stats(0 if str(device).startswith("cpu") else 1,
                                      ctypes.byref(cur), ctypes.byref(peak)))
    return {"current": cur.value, "peak": peak.value}


def reset_peak(device="cuda"):
    check(lib().moeblaze_reset_peak(0 if str(device).startswith("cpu") else 1))
