"""Builds libmoeblaze_capi.so into the package.

  MOEBLAZE_PREBUILT_LIB=/path/libmoeblaze_capi.so   copy this library (built elsewhere, e.g. on a
                                                    CPU machine with nvcc) instead of building
  otherwise: CMake on the repository (python/..), CUDA backend ON when nvcc is found, into
  $MOEBLAZE_BUILD_DIR (default <repo>/build-python), target moeblaze_capi only, $MOEBLAZE_JOBS
  parallel jobs (default: all cores). MOEBLAZE_CUDA=OFF|ON|AUTO overrides the CUDA choice.
  A CUDA build without the CUTLASS headers in third_party/cutlass fetches them from PyPI first
  (scripts/fetch_cutlass.sh); a CPU-only build needs nothing but CMake and a C++17 compiler.
"""
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.dist import Distribution
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
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
        raise RuntimeError(f"moeblaze: no CMakeLists.txt at {ROOT}; install from the repository "
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


class BinaryDistribution(Distribution):
    def has_ext_modules(self):  # a platform wheel: the package carries a shared library
        return True


setup(cmdclass={"build_py": BuildPyWithLib}, package_data={"moeblaze": [LIB]},
      distclass=BinaryDistribution)
