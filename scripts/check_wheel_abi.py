#!/usr/bin/env python3
"""Checks that a wheel's (or a shared library's) native code loads where its manylinux tag says.

  python3 scripts/check_wheel_abi.py dist/moeblaze-*.whl        # policy from the wheel's tag
  python3 scripts/check_wheel_abi.py build/libmoeblaze_capi.so  # against manylinux_2_28
  python3 scripts/check_wheel_abi.py --policy manylinux_2_31 LIB
  python3 scripts/check_wheel_abi.py --policy-json manylinux-policy.json --policy manylinux_2_34 LIB

For each ELF shared library (in a wheel: every *.so* inside) it reads, with binutils' objdump,
the NEEDED libraries (`objdump -p`) and the symbol versions needed from each (`objdump -p`'s
version references; the symbols behind them from `objdump -T`), and compares them with the
manylinux policy: only the policy's libraries, and from glibc, libstdc++ and libgcc_s no symbol
version newer than the policy allows (GLIBC_2.N, GLIBCXX_3.4.x, CXXABI_1.3.x, GCC_x.y). It
prints each offending library and symbol and exits 1 if the code needs more than the policy.

Outside every policy but allowed here, with a note: the libraries that torch's wheels carry and
load before moeblaze loads its library (moeblaze._lib imports torch first; the loader binds a
NEEDED soname to the copy already loaded): libgomp.so.1, and in a CUDA build libcudart, libcublas,
libcublasLt and libnccl. Their symbol versions are not checked (torch's copies decide).

The two policies built in (manylinux_2_28, manylinux_2_31) are auditwheel 6.8's
(manylinux-policy.json, x86_64); --policy-json reads that file itself for the others.
Python standard library only, plus objdump.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile

# The allowed libraries, the same in every manylinux_2_N policy from 2_24 on.
_LIBS = ["libatomic.so.1", "libgcc_s.so.1", "libstdc++.so.6", "libm.so.6", "libmvec.so.1",
         "libanl.so.1", "libdl.so.2", "librt.so.1", "libc.so.6", "libnsl.so.1", "libutil.so.1",
         "libpthread.so.0", "libX11.so.6", "libXext.so.6", "libXrender.so.1", "libICE.so.6",
         "libSM.so.6", "libGL.so.1", "libgobject-2.0.so.0", "libgthread-2.0.so.0",
         "libglib-2.0.so.0", "libresolv.so.2", "libexpat.so.1", "libz.so.1"]
# Per policy: the newest numbered version of each family, and the family's named versions.
# (GLIBC 2.19-2.21 do not exist on x86_64, so "<= newest" is the policy's list.)
_BUILTIN = {
    "manylinux_2_28": {"GLIBC": "2.28", "GLIBCXX": "3.4.24", "CXXABI": "1.3.11", "GCC": "7.0.0",
                       "LIBATOMIC": "1.2", "ZLIB": "1.2.9"},
    "manylinux_2_31": {"GLIBC": "2.31", "GLIBCXX": "3.4.28", "CXXABI": "1.3.12", "GCC": "7.0.0",
                       "LIBATOMIC": "1.2", "ZLIB": "1.2.9"},
}
_NAMED = {"CXXABI": {"FLOAT128", "TM_1"}}
# The dynamic loader itself: part of glibc (GLIBC_ versions, checked as such).
_LOADER = re.compile(r"ld-linux-x86-64\.so\.2$")
# Carried and loaded by torch, a declared dependency (see the docstring).
_FROM_TORCH = re.compile(r"(libgomp\.so\.1|libcudart\.so\.\d+|libcublas(Lt)?\.so\.\d+"
                         r"|libnccl\.so\.\d+)$")


def _num(v):
    return tuple(int(p) for p in v.split("."))


class Policy:
    def __init__(self, name, libs, allowed):
        self.name, self.libs, self.allowed = name, set(libs), allowed  # family -> predicate

    @staticmethod
    def builtin(name):
        if name not in _BUILTIN:
            raise SystemExit(f"check_wheel_abi: no built-in policy {name!r} (built in: "
                             f"{', '.join(_BUILTIN)}); pass auditwheel's --policy-json")
        allowed = {}
        for fam, newest in _BUILTIN[name].items():
            named = _NAMED.get(fam, set())
            allowed[fam] = (lambda v, newest=newest, named=named: v in named or
                            (re.fullmatch(r"[0-9.]+", v) is not None and _num(v) <= _num(newest)))
        return Policy(name, _LIBS, allowed)

    @staticmethod
    def from_json(path, name):
        for entry in json.load(open(path)):
            if entry["name"] == name or name in entry.get("aliases", []):
                versions = entry["symbol_versions"].get("x86_64", {})
                allowed = {fam: (lambda v, ok=frozenset(vs): v in ok)
                           for fam, vs in versions.items()}
                return Policy(name, entry["lib_whitelist"], allowed)
        raise SystemExit(f"check_wheel_abi: {path} has no policy {name!r}")


def _objdump(flag, path):
    try:
        return subprocess.run(["objdump", flag, path], check=True, capture_output=True,
                              text=True).stdout
    except FileNotFoundError:
        raise SystemExit("check_wheel_abi: objdump not found (binutils)")
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"check_wheel_abi: objdump {flag} {path} failed: {e.stderr.strip()}")


def read_elf(path):
    """(NEEDED sonames, {soname: set of versions needed from it}, {version: [symbols]})."""
    private = _objdump("-p", path)
    needed = re.findall(r"^\s*NEEDED\s+(\S+)", private, re.M)
    refs, lib = {}, None
    in_refs = False
    for line in private.splitlines():
        if line.startswith("Version References:"):
            in_refs = True
            continue
        if in_refs:
            m = re.match(r"\s*required from (\S+):", line)
            if m:
                lib = m.group(1)
                refs.setdefault(lib, set())
                continue
            m = re.match(r"\s*0x[0-9a-f]+ 0x[0-9a-f]+ \d+ (\S+)", line)
            if m and lib:
                refs[lib].add(m.group(1))
                continue
            if line.strip():
                in_refs = False
    symbols = {}
    for line in _objdump("-T", path).splitlines():
        # undefined: "0000000000000000      DF *UND*	0000000000000000 (GLIBC_2.34) dlopen"
        m = re.search(r"\*UND\*\s+\S+\s+\(?([A-Za-z_]+_[0-9A-Za-z_.]+)\)?\s+(\S+)$", line)
        if m:
            symbols.setdefault(m.group(1), []).append(m.group(2))
    return needed, refs, symbols


def _family(version):
    """GLIBCXX_3.4.21 -> (GLIBCXX, 3.4.21); CXXABI_TM_1 -> (CXXABI, TM_1)."""
    fam, _, rest = version.partition("_")
    return fam, rest


def check_elf(path, policy, shown_as):
    needed, refs, symbols = read_elf(path)
    bad = []
    print(f"{shown_as}: NEEDED {' '.join(needed) or '(none)'}")
    for lib in needed:
        if lib in policy.libs or _LOADER.match(lib):
            continue
        if _FROM_TORCH.match(lib):
            print(f"  note: {lib} is outside {policy.name}'s libraries; torch carries and loads it")
            continue
        bad.append(f"  library {lib} is not allowed by {policy.name}")
    newest = {}
    for lib, versions in sorted(refs.items()):
        if _FROM_TORCH.match(lib) or (lib not in policy.libs and not _LOADER.match(lib)):
            continue  # torch's copy decides, or already reported above
        for version in sorted(versions):
            fam, num = _family(version)
            if re.fullmatch(r"[0-9.]+", num):
                newest[fam] = max(newest.get(fam, num), num, key=_num)
            ok = policy.allowed.get(fam)
            if ok is None or not ok(num):
                syms = sorted(set(symbols.get(version, [])))
                bad.append(f"  {version} from {lib} is newer than {policy.name} allows: "
                           f"{' '.join(syms) or '(no symbol listed)'}")
    needs = ", ".join(f"{f} {v}" for f, v in sorted(newest.items()))
    print(f"  needs {needs or 'nothing versioned'}")
    for line in bad:
        print(line)
    return not bad


def _wheel_policy(wheel):
    tags = re.findall(r"(manylinux_2_\d+)_x86_64", os.path.basename(wheel))
    return tags[0] if tags else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="wheels (.whl) or shared libraries")
    ap.add_argument("--policy", help="manylinux_2_N (default: a wheel's own tag, else "
                                     "manylinux_2_28)")
    ap.add_argument("--policy-json", help="auditwheel's manylinux-policy.json to read the "
                                          "policy from")
    args = ap.parse_args(argv)
    ok = True
    for path in args.paths:
        name = args.policy or (_wheel_policy(path) if path.endswith(".whl") else None)
        if path.endswith(".whl") and name is None:
            print(f"{path}: not tagged manylinux_2_N_x86_64")
            ok = False
            continue
        name = name or "manylinux_2_28"
        policy = (Policy.from_json(args.policy_json, name) if args.policy_json
                  else Policy.builtin(name))
        print(f"{os.path.basename(path)}: checking against {policy.name}")
        if not path.endswith(".whl"):
            ok &= check_elf(path, policy, path)
            continue
        with zipfile.ZipFile(path) as whl, tempfile.TemporaryDirectory() as tmp:
            libs = [n for n in whl.namelist() if re.search(r"\.so(\.\d+)*$", n)]
            if not libs:
                print(f"{path}: no shared library inside")
            for member in libs:
                ok &= check_elf(whl.extract(member, tmp), policy, member)
    print("check_wheel_abi: " + ("OK" if ok else "FAILED: needs more than the policy allows"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
