"""Builds libmoeblaze_capi.so into the package.

  MOEBLAZE_PREBUILT_LIB=/path/libmoeblaze_capi.so   copy this library (built elsewhere, e.g. on a
                                                    CPU machine with nvcc) instead of building
  otherwise: CMake on the repository (python/..), CUDA backend ON when nvcc is found, into
  $MOEBLAZE_BUILD_DIR (default <repo>/build-python), target moeblaze_capi only, $MOEBLAZE_JOBS
  parallel jobs (default: all cores). MOEBLAZE_CUDA=OFF|ON|AUTO overrides the CUDA choice.
  A CUDA build without the CUTLASS headers in third_party/cutlass fetches them from PyPI first
  (scripts/fetch_cutlass.sh); a CPU-only build needs nothing but CMake and a C++17 compiler.

The wheel is tagged py3-none-manylinux_2_<N>_x86_64 (no CPython extension: the library is loaded
with ctypes), N read from the symbol versions the library needs (manylinux_tag below). It is 28,
PyTorch's own tag, for a library built with CMake's MOEBLAZE_CAPI_MANYLINUX (ON by default on
Linux x86_64 with GCC) whatever the build machine's glibc: that build links libstdc++ statically
and hidden, takes the unwinder from libgcc_s.so.1, defines the few newer glibc symbols
libstdc++.a uses (src/capi/glibc-compat/shims.cpp) and binds the functions glibc 2.34 moved into
libc to their old versions (src/capi/glibc-compat/old-versions.txt), so it needs no GLIBC_
version above 2.28 and no GLIBCXX_/CXXABI_ one. scripts/check_wheel_abi.py checks a built wheel
against the manylinux_2_28 policy (scripts/wheel_smoke.sh runs it); a library built without the
option gets the larger N its symbol versions need. The measurements behind this:
docs/notes/manylinux-wheel.md.
"""
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.dist import Distribution
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist
try:
    from setuptools.command.bdist_wheel import bdist_wheel  # setuptools >= 70.1
except ImportError:  # an older setuptools (--no-build-isolation) with the wheel package
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
# The library's sources: the repository (python/..), or the copy an sdist carries in native/.
ROOT = HERE.parent if (HERE.parent / "CMakeLists.txt").exists() else HERE / "native"
NATIVE = ["CMakeLists.txt", "include", "src", "tools", "scripts/fetch_cutlass.sh"]  # CMake reads
LIB = "libmoeblaze_capi.so"


def _nvcc():
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


def build_library():
    prebuilt = os.environ.get("MOEBLAZE_PREBUILT_LIB")
    if prebuilt:
        if not os.path.exists(prebuilt):
            raise RuntimeError(f"MOEBLAZE_PREBUILT_LIB={prebuilt} does not exist")
        print(f"moeblaze: using the prebuilt {prebuilt}")
        return Path(prebuilt)
    if not (ROOT / "CMakeLists.txt").exists():
        raise RuntimeError(f"moeblaze: no CMakeLists.txt at {ROOT}; build from the repository "
                           "or set MOEBLAZE_PREBUILT_LIB")
    build = Path(os.environ.get("MOEBLAZE_BUILD_DIR", ROOT / "build-python"))
    cuda = os.environ.get("MOEBLAZE_CUDA") or ("ON" if _nvcc() else "OFF")
    args = ["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
            f"-DMOEBLAZE_CUDA={cuda}", "-DMOEBLAZE_BUILD_TESTS=OFF"]
    if cuda == "ON" and _nvcc() and not shutil.which("nvcc"):
        args.append(f"-DCMAKE_CUDA_COMPILER={_nvcc()}")
    if cuda != "OFF" and _nvcc():  # CUTLASS is a build requirement of the CUDA backend only
        subprocess.check_call(["bash", str(ROOT / "scripts" / "fetch_cutlass.sh")])
    if shutil.which("ninja") and not (build / "CMakeCache.txt").exists():
        args += ["-G", "Ninja"]
    # The command-line tool's CLI11 is only looked up at configure time; a GPU machine without
    # it has the copy scripts/gpu_check.sh --pack-deps made.
    packed = ROOT / "third_party" / "gpudeps" / "include"
    if not os.path.exists("/usr/include/CLI/CLI.hpp") and packed.exists():
        args.append(f"-DCLI11_INCLUDE_DIR={packed}")
    print("moeblaze:", " ".join(args))
    subprocess.check_call(args)
    jobs = os.environ.get("MOEBLAZE_JOBS", str(os.cpu_count() or 2))
    subprocess.check_call(["cmake", "--build", str(build), "-j", jobs, "--target",
                           "moeblaze_capi"])
    return build / LIB


class BuildPyWithLib(build_py):
    def run(self):
        super().run()
        lib = build_library()
        dst = Path(self.build_lib) / "moeblaze" / LIB
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, dst)
        # The C ABI's header beside it: _ext.py compiles csrc/ against it at first use.
        header = Path(self.build_lib) / "moeblaze" / "include" / "moeblaze" / "capi.h"
        header.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / "include" / "moeblaze" / "capi.h", header)


# manylinux_2_N policies for x86_64 (auditwheel 6.8's manylinux-policy.json): the newest
# libstdc++ (GLIBCXX 3.4.x, CXXABI 1.3.x) and libgcc_s (GCC_x.y) symbol versions each allows,
# listed where they change; a library needing newer ones than manylinux_2_N's needs a larger N.
_MANYLINUX = [  # (N, GLIBCXX, CXXABI, GCC)
    (17, (3, 4, 19), (1, 3, 7), (4, 8)), (24, (3, 4, 22), (1, 3, 10), (4, 8)),
    (27, (3, 4, 24), (1, 3, 11), (7, 0)), (31, (3, 4, 28), (1, 3, 12), (7, 0)),
    (34, (3, 4, 29), (1, 3, 13), (7, 0)), (35, (3, 4, 30), (1, 3, 13), (12, 0)),
    (39, (3, 4, 33), (1, 3, 15), (14, 0))]


def manylinux_tag(lib):
    """The oldest manylinux_2_N_x86_64, N >= 28, whose glibc (2.N), libstdc++ and libgcc_s provide
    every symbol version the library needs: the GLIBC_/GLIBCXX_/CXXABI_/GCC_ names in its
    .dynstr, what `objdump -T lib` lists. N is never below 28: torch, which moeblaze requires,
    ships manylinux_2_28 wheels for x86_64, so an older tag installs nowhere more, and 28 is the
    policy scripts/check_wheel_abi.py checks (the MOEBLAZE_CAPI_MANYLINUX build needs GLIBC_2.27,
    GCC_4.2.0 and no GLIBCXX). A build without that option needs what the build machine's glibc
    and GCC give (GCC 12 on glibc 2.36: GLIBC_2.36, so manylinux_2_36). libgomp.so.1 (and, in a
    CUDA build, libcudart/libcublas/libnccl) are outside every policy but are loaded by torch
    (its wheels carry them), a declared dependency that moeblaze._lib imports first, and the
    dynamic loader binds a NEEDED soname to the copy already loaded."""
    if platform.machine() != "x86_64":
        return None
    dynstr = Path(lib).read_bytes()

    def need(name):
        found = re.findall(rb"(?<=\x00)" + name + rb"_([0-9][0-9.]*)(?=\x00)", dynstr)
        return max((tuple(int(p) for p in v.split(b".")) for v in found), default=())

    glibc, cxx = need(b"GLIBC") or (2, 0), (need(b"GLIBCXX"), need(b"CXXABI"), need(b"GCC"))
    n = next((n for n, *newest in _MANYLINUX if all(v <= m for v, m in zip(cxx, newest))), None)
    return None if n is None else f"manylinux_2_{max(n, glibc[1], 28)}_x86_64"


class SdistWithSources(sdist):
    """An sdist that builds anywhere (python -m build builds the wheel from it): the C++ sources
    CMake needs go into native/, since setuptools takes no files from outside python/."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        for name in NATIVE:
            src, dst = ROOT / name, Path(base_dir) / "native" / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(src, dst) if src.is_dir() else shutil.copy2(src, dst)


class BinaryDistribution(Distribution):
    def has_ext_modules(self):  # the package carries a shared library: platlib, root_is_pure False
        return True


class BdistWheelPy3(bdist_wheel):
    """One wheel for every Python 3: the package has no CPython extension, only a shared library
    loaded through ctypes, so the tag is py3-none-<platform>, not cp3XX-cp3XX-<platform>."""

    def get_tag(self):
        lib = Path(self.get_finalized_command("build_py").build_lib) / "moeblaze" / LIB
        plat = None if self.plat_name_supplied or not lib.exists() else manylinux_tag(lib)
        if plat is None:  # --plat-name, not x86_64, or newer than the table: setuptools' choice
            plat = super().get_tag()[2]
        print(f"moeblaze: wheel tag py3-none-{plat}")
        return "py3", "none", plat


setup(cmdclass={"build_py": BuildPyWithLib, "bdist_wheel": BdistWheelPy3,
                "sdist": SdistWithSources},
      package_data={"moeblaze": [LIB, "csrc/*.cpp", "csrc/*.h"]}, distclass=BinaryDistribution)
