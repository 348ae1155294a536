#!/usr/bin/env bash
# Loads the C ABI library in an older glibc userland and runs it: Debian bullseye (glibc 2.31,
# from Debian's own mirror via debootstrap) under chroot, Python's ctypes as the package loads it:
# what scripts/check_wheel_abi.py reads from the symbol versions, tried for real. Needs root and
# network the first time (the root file system, about 350 MB on disk, is kept for later runs).
#   scripts/check_old_glibc.sh [LIB]       LIB: default build/libmoeblaze_capi.so
#   MOEBLAZE_OLD_ROOTFS=/path              where the root file system is made (or reused);
#                                          default /tmp/moeblaze-bullseye; / runs on this machine
#   MOEBLAZE_OLD_LIBPATH=dir:dir           where to find NEEDED libraries bullseye lacks (a CUDA
#                                          build's libcudart: torch's nvidia/cu13/lib); copied in
#   MOEBLAZE_OLD_OPTIONAL=1                no root, or no root file system to be had (no
#                                          network): say so and exit 0 (scripts/wheel_smoke.sh)
# It calls the library three ways: its version; a plan from out-of-range expert ids (the C++
# exception thrown inside the library must be caught there: error code 1 and the message); a
# CPU layer forward on OpenMP threads. The forward's output checksum is printed so that a run on
# the build machine (MOEBLAZE_OLD_ROOTFS=/) can be compared with it.
set -euo pipefail
cd "$(dirname "$0")/.."
lib=$(realpath "${1:-build/libmoeblaze_capi.so}")
root=${MOEBLAZE_OLD_ROOTFS:-/tmp/moeblaze-bullseye}
export DEBIAN_FRONTEND=noninteractive
skip() {
  echo "moeblaze: glibc 2.31 check SKIPPED: $1"
  [ -n "${MOEBLAZE_OLD_OPTIONAL:-}" ] && exit 0
  exit 1
}

if [ "$root" != / ] && [ ! -x "$root/usr/bin/python3" ]; then
  [ "$(id -u)" = 0 ] || skip "making a root file system needs root"
  if ! command -v debootstrap >/dev/null; then
    { apt-get install -y -qq debootstrap ||
      { apt-get update -qq && apt-get install -y -qq debootstrap; }; } >/dev/null 2>&1 ||
      skip "could not install debootstrap"
  fi
  # The Debian mirror this machine's apt already uses (its main archive, not the security one).
  # A missing listed file (bookworm has no /etc/apt/sources.list) makes grep exit 2: not a failure.
  mirror=$({ grep -h -o -E 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list \
               /etc/apt/sources.list.d/* 2>/dev/null || true; } |
           grep -v -- -security | head -n 1 | tr -d ' ')
  [ -n "$mirror" ] || skip "no Debian mirror in this machine's apt sources"
  echo "moeblaze: making a Debian bullseye root file system in $root (debootstrap) ..."
  rm -rf "$root"
  if ! { debootstrap --variant=minbase bullseye "$root" "$mirror" &&
         chroot "$root" apt-get install -y --no-install-recommends python3 libgomp1; } \
       >"$root.log" 2>&1; then
    tail -5 "$root.log"
    rm -rf "$root"
    skip "debootstrap of bullseye failed (log: $root.log)"
  fi
fi
[ "$root" = / ] || [ "$(id -u)" = 0 ] || skip "chroot needs root"
check="$root/tmp/moeblaze-check"
rm -rf "$check"
mkdir -p "$check/lib"
cp "$lib" "$check/libmoeblaze_capi.so"
# NEEDED libraries the root file system lacks, from MOEBLAZE_OLD_LIBPATH.
for soname in $(objdump -p "$lib" | awk '$1 == "NEEDED" {print $2}'); do
  ls "$root"/lib/x86_64-linux-gnu/"$soname" "$root"/usr/lib/x86_64-linux-gnu/"$soname" \
    >/dev/null 2>&1 && continue
  found=
  IFS=: read -r -a dirs <<<"${MOEBLAZE_OLD_LIBPATH:-}"
  for dir in "${dirs[@]}"; do
    if [ -n "$dir" ] && [ -e "$dir/$soname" ]; then
      cp -L "$dir/$soname" "$check/lib/"; found=1; break
    fi
  done
  [ -n "$found" ] || [ "$root" = / ] ||
    echo "moeblaze: $soname: not in $root nor in MOEBLAZE_OLD_LIBPATH"
done
cat >"$root/tmp/moeblaze-check/run.py" <<'EOF'
import ctypes, os, platform, struct, zlib

lib = ctypes.CDLL(os.path.join(os.path.dirname(__file__), "libmoeblaze_capi.so"))
lib.moeblaze_last_error.restype = ctypes.c_char_p
print("glibc", platform.libc_ver()[1], "| C ABI version", lib.moeblaze_capi_version(),
      "| cuda", lib.moeblaze_has_cuda())

I32, I64, F32, P = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class Plan(ctypes.Structure):
    _fields_ = [("T", I64), ("E", I64), ("S", I64)] + [
        (n, P) for n in ("expert_token_offsets", "expert_token_indices", "slot_weights",
                         "token_pair_offsets", "token_expert_indices", "token_index_map")]


class LayerCfg(ctypes.Structure):
    _fields_ = [(n, I64) for n in "TdnEK"] + [
        (n, I32) for n in ("activation", "dtype", "mode", "num_threads", "compute")] + [
        ("fp8_weights", P)]


T, d, n, E, K = 16, 32, 24, 4, 2
S = T * K
bufs = [(I32 * (E + 1))(), (I32 * S)(), (F32 * S)(), (I32 * (T + 1))(), (I32 * S)(), (I32 * S)()]
plan = Plan(T, E, S, *[ctypes.cast(b, P) for b in bufs])
args = lambda ids: (ids, 0, wts, 0, I64(T), I64(K), I64(E), 0, None, ctypes.byref(plan), None,
                    ctypes.c_uint64(0), None)
wts = (F32 * S)(*[0.5] * S)

bad = (I32 * S)(*[(t + k) % E for t in range(T) for k in range(K)])
bad[3] = 7  # token 1, k 1: out of range
rc = lib.moeblaze_plan_from_ids(*args(bad))
msg = lib.moeblaze_last_error().decode()
print(f"bad expert id: code {rc}, message: {msg}")
assert rc == 1 and "expert_ids[1, 1]" in msg, (rc, msg)

ids = (I32 * S)(*[(t + k) % E for t in range(T) for k in range(K)])
assert lib.moeblaze_plan_from_ids(*args(ids)) == 0, lib.moeblaze_last_error()
cfg = LayerCfg(T, d, n, E, K, 0, 0, 1, 2, 0, None)  # swiglu, fp32, recompute, 2 threads
val = lambda i: ((i * 2654435761) % 1000) / 1000.0 - 0.5
x = (F32 * (T * d))(*[val(i) for i in range(T * d)])
w1 = (F32 * (E * 2 * n * d))(*[0.1 * val(i + 7) for i in range(E * 2 * n * d)])
w2 = (F32 * (E * n * d))(*[0.1 * val(i + 13) for i in range(E * n * d)])
out = (F32 * (T * d))()
rc = lib.moeblaze_layer_forward(ctypes.byref(cfg), ctypes.byref(plan), 0, None, x, w1, w2, out,
                                None, None, ctypes.c_uint64(0))
assert rc == 0, lib.moeblaze_last_error()
raw = bytes(out)
assert any(struct.unpack(f"{T * d}f", raw)), "all-zero output"
print(f"layer forward (CPU, 2 threads): ok, output crc32 {zlib.crc32(raw):08x}")
EOF
echo "moeblaze: running $lib in $root"
if [ "$root" = / ]; then
  LD_LIBRARY_PATH=/tmp/moeblaze-check/lib python3 /tmp/moeblaze-check/run.py
else
  chroot "$root" env LD_LIBRARY_PATH=/tmp/moeblaze-check/lib python3 /tmp/moeblaze-check/run.py
fi
