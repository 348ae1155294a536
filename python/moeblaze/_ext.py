"""The eager moe_experts step's and MoE router's C++ fast path (csrc/: eager_experts.cpp, the
module and the experts; eager_router.cpp, the router; eager.h): compiled at first use against the
installed torch with the system's C++ compiler and cached, so the package still pins no torch
ABI; where it cannot be built (no compiler, no torch headers) moe_experts and MoE keep the Python
path (layer._ExpertsFn, _RouteFn, _RoundFn), which makes the same C calls.

    moeblaze.use_extension(False)   # the Python path only (True: the default)
    with moeblaze.use_extension(False): ...   # the same, for the block only
    moeblaze.extension_status()     # "loaded: <path>", "disabled", or why it is unavailable

The cache folder is ~/.cache/moeblaze (XDG_CACHE_HOME honoured); one file per (sources, capi.h,
torch version, Python version), written atomically, so concurrent first uses are safe.
"""
import ctypes
import hashlib
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path

from . import _lib

_HERE = Path(__file__).resolve().parent
_CSRC = _HERE / "csrc"
_lock = threading.Lock()
_state = {"enabled": True, "module": None, "status": "not built yet"}


def _include_dir():
    """The folder holding moeblaze/capi.h: the package's copy (wheel), else the repository's."""
    for d in (_HERE / "include", _HERE.parent.parent / "include"):
        if (d / "moeblaze" / "capi.h").exists():
            return d
    return None


def _cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moeblaze"


def _sources():
    """The translation units (each compiled on its own, at once) and every file the build reads
    from csrc/ (the cache key)."""
    cpp = sorted(_CSRC.glob("*.cpp"))
    return cpp, cpp + sorted(_CSRC.glob("*.h"))


def _build(include, out):
    """Compiles the extension into `out` (atomically); raises RuntimeError with the compiler's
    output when it fails."""
    import torch
    from torch.utils import cpp_extension
    cxx = os.environ.get("CXX", "c++")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_cmd = [cxx, "-O2", "-std=c++20", "-fPIC", "-fvisibility=hidden",
                   f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_API_INCLUDE_EXTENSION_H",
                   f"-I{include}", f"-I{sysconfig.get_paths()['include']}"]
    compile_cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = cpp_extension.library_paths()
    link_cmd = [cxx, "-shared"] + [f"-L{p}" for p in libs] + [f"-Wl,-rpath,{p}" for p in libs]
    link_libs = ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=out.parent) as objdir:
            srcs = _sources()[0]
            objs = [os.path.join(objdir, f"{src.stem}.o") for src in srcs]
            # One compiler per translation unit, all at once: each parses torch's headers.
            _run_all([compile_cmd + ["-c", str(src), "-o", obj] for src, obj in zip(srcs, objs)])
            _run_all([link_cmd + objs + link_libs + ["-o", tmp]])
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _run_all(cmds):
    """Runs the commands concurrently; RuntimeError with the first failure's output."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    outs = [p.communicate()[0] for p in procs]
    for cmd, p, text in zip(cmds, procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{text[-3000:]}")


def _load():
    """The loaded module, building it first if its cache file is missing; None (and the reason in
    _state['status']) where it cannot be had."""
    import torch
    include = _include_dir()
    if include is None or not (_CSRC / "eager_experts.cpp").exists():
        _state["status"] = "unavailable: the package has no csrc/eager_experts.cpp or capi.h"
        return None
    h = hashlib.sha256()
    for part in ([f.read_bytes() for f in _sources()[1]] +
                 [(include / "moeblaze" / "capi.h").read_bytes(), torch.__version__.encode(),
                  sys.version.encode()]):
        h.update(part)
    out = _cache_dir() / f"moeblaze_eager-{h.hexdigest()[:16]}.so"
    if not out.exists():
        print(f"moeblaze: building the C++ fast path of moe_experts and MoE for torch {torch.__version__} "
              f"(once; cached in {out.parent}) ...", file=sys.stderr, flush=True)
        try:
            _build(include, out)
        except (OSError, RuntimeError) as err:
            _state["status"] = f"unavailable: the build failed ({str(err)[:2000]})"
            warnings.warn(f"moeblaze: the C++ fast path of moe_experts and MoE could not be built; the "
                          f"Python path (same results, more host time per step) is used: {err}")
            return None
    spec = importlib.util.spec_from_file_location("moeblaze_eager", out)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if mod.capi_version != _lib.lib().moeblaze_capi_version():
        _state["status"] = (f"unavailable: built for C ABI version {mod.capi_version}, the "
                            f"library is {_lib.lib().moeblaze_capi_version()}")
        return None
    lib = _lib.lib()
    mod.init({name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
              for name in mod.capi_functions})
    _state["status"] = f"loaded: {out}"
    return mod


def get():
    """The extension module, or None (disabled, or not buildable here: the Python path runs)."""
    if not _state["enabled"]:
        return None
    if _state["module"] is not None or _state["status"] != "not built yet":
        return _state["module"]  # every call after the first: no lock
    with _lock:
        if _state["module"] is None and _state["status"] == "not built yet":
            _state["module"] = _load()
    return _state["module"]


class use_extension:
    """Whether eager moe_experts / experts_from_routing calls take the C++ fast path (default
    True). False: the Python path only (same C calls and bits; more host time per step). Set at
    the call; as a context manager, the previous setting comes back at the block's end."""

    def __init__(self, enabled=True):
        self._previous = _state["enabled"]
        _state["enabled"] = bool(enabled)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _state["enabled"] = self._previous


def extension_status():
    """'loaded: <path>', 'disabled', 'not built yet', or 'unavailable: <why>'."""
    return "disabled" if not _state["enabled"] else _state["status"]
