#!/usr/bin/env python3
"""Per-kernel SASS manifest of the CUDA sources, so that a change in code generation is always seen.

Compiles every ``csrc/**/*.cu`` for sm_90a with the flags of the build (``nvcc_flags``, shared with
tests/test_cuda_compile.py), disassembles each object (``cuobjdump -sass``), splits it per function,
demangles the names (``c++filt``) and normalises the text (no addresses, nothing that depends on
file paths), and records for each function: the sha256 of its normalised SASS, its registers and
its spill bytes (from ``ptxas -v``), and the sources that compile a copy of it.

    python tools/sass_manifest.py --check          # compare with tests/sass_manifest.json
    python tools/sass_manifest.py --write          # record the current code generation
    python tools/sass_manifest.py --check --dump DIR   # also write each function's SASS to DIR

A refactor that should not change code generation must pass ``--check``; a change that does is
recorded with ``--write`` in its own commit, which lists the functions whose hashes changed.
cuobjdump comes from the CUDA toolkit or the pip package nvidia-cuda-cuobjdump (pinned in
requirements-dev.txt: its text format, and so the hashes, may differ between releases).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
MANIFEST = ROOT / "tests" / "sass_manifest.json"
ARCH = "90a"


def cu_files() -> list[Path]:
    return sorted(CSRC.rglob("*.cu"))


def find_tool(name: str) -> str | None:
    """`name` on PATH, else in a pip-installed CUDA component (nvidia/cu13/bin)."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for sub in ("cu13", "cuda_cuobjdump", "cuda_nvcc"):
            cand = Path(root) / sub / "bin" / name
            if cand.exists():
                return str(cand)
    return None


def nccl_include_dir() -> Path | None:
    """The headers of the pip package nvidia-nccl-cu13: the NCCL that torch loads on the GPU machine."""
    try:
        import nvidia.nccl
    except ImportError:
        return None
    for root in nvidia.nccl.__path__:
        if (Path(root) / "include" / "nccl.h").exists():
            return Path(root) / "include"
    return None


class NvccFlags:
    """The flags CMake gives nvcc for csrc/ (CMakeLists.txt, Release), plus ``ptxas -v`` for the
    registers and spills (it does not change code generation). ``common``: every unit; ``torch``:
    the units that include torch (its include paths and ABI)."""

    def __init__(self, workdir: Path, nccl_include: Path) -> None:
        import torch
        import torch.utils.cpp_extension

        # A CPU-only torch wheel ships the c10/cuda headers but not the one CMake generates for CUDA
        # builds; it only says that c10_cuda is a shared library. Supply it, never shadowing a real one.
        shim = workdir / "shim"
        torch_includes = [Path(p) for p in torch.utils.cpp_extension.include_paths()]
        if not any((p / "c10/cuda/impl/cuda_cmake_macros.h").exists() for p in torch_includes):
            (shim / "c10/cuda/impl").mkdir(parents=True, exist_ok=True)
            (shim / "c10/cuda/impl/cuda_cmake_macros.h").write_text(
                "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"
            )
        self.common = [
            find_tool("nvcc") or "nvcc", "-c", "-std=c++17", f"-gencode=arch=compute_{ARCH},code=sm_{ARCH}",
            "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-lineinfo", "-Xptxas=-warn-spills", "-Xptxas=-v",
            "-DSPK_WITH_CUDA=1", f"-I{CSRC}", f"-I{nccl_include}",
        ]  # fmt: skip
        self.torch = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
        self.torch += [f"-I{p}" for p in torch_includes] + [f"-I{shim}"]

    def unit(self, src: Path, out: Path) -> list[str]:
        return [*self.common, *self.torch, str(src), "-o", str(out)]


# ---- disassembly and normalisation

_INSN = re.compile(r"^/\*[0-9a-f]+\*/\s*(.*?)\s*/\*\s*(0x[0-9a-f]+)\s*\*/$")
_ENC = re.compile(r"^/\*\s*(0x[0-9a-f]+)\s*\*/$")
_ANON = re.compile(r"\d*_GLOBAL__N_\w*?(?=\d+[A-Za-z_])")


def split_sass(text: str) -> dict[str, list[str]]:
    """cuobjdump -sass text -> {mangled name: normalised lines}. An instruction is its text and
    encoding words (the control bits included: stall counts and barriers are code generation too),
    without its address; the file headers (paths, identifiers) are dropped."""
    out: dict[str, list[str]] = {}
    cur: list[str] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("Function :"):
            cur = out.setdefault(line.split(":", 1)[1].strip(), [])
            continue
        if (
            cur is None
            or not line
            or line.startswith((".headerflags", ".target", "code for", "Fatbin", "......"))
        ):
            if line.startswith(("Fatbin", "code for")):
                cur = None
            continue
        if m := _INSN.match(line):
            cur.append(" ".join(m.group(1).split()) + " " + m.group(2))
        elif m := _ENC.match(line):
            if cur:
                cur[-1] += " " + m.group(1)
        else:
            cur.append(" ".join(line.split()))
    return out


def demangle(names: list[str]) -> dict[str, str]:
    """Itanium names -> readable ones; anonymous namespaces (nvcc names them after the file) collapsed."""
    if not names:
        return {}
    filt = shutil.which("c++filt") or find_tool("cu++filt")
    if filt is None:  # mangled, with the anonymous namespaces' file hashes cut
        return {n: _ANON.sub("(anonymous namespace)", n) for n in names}
    res = subprocess.run([filt], input="\n".join(names) + "\n", capture_output=True, text=True, check=True)
    return dict(zip(names, res.stdout.splitlines(), strict=True))


def ptxas_usage(stderr: str) -> dict[str, dict[str, int]]:
    """``ptxas -v`` output -> {mangled name: registers, spill_stores, spill_loads, stack} (registers for
    entry functions only)."""
    usage: dict[str, dict[str, int]] = {}
    entry = props = None
    for line in stderr.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            entry = m.group(1)
        elif m := re.search(r"Function properties for (\S+)", line):
            props = m.group(1)
        elif props and (
            m := re.search(
                r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
            )
        ):
            u = usage.setdefault(props, {})
            u["stack"], u["spill_stores"], u["spill_loads"] = (int(g) for g in m.groups())
            props = None
        elif entry and (m := re.search(r"Used (\d+) registers", line)):
            usage.setdefault(entry, {})["registers"] = int(m.group(1))
            entry = None
    return usage


def object_functions(obj: Path, ptxas_stderr: str, cuobjdump: str) -> dict[str, dict]:
    """One object's functions: {demangled name: {sha256, registers, spill_bytes, lines}}."""
    env = dict(os.environ)
    if "NVDISASM_PATH" not in env and (nvdisasm := find_tool("nvdisasm")):
        env["NVDISASM_PATH"] = str(Path(nvdisasm).parent)  # cuobjdump runs nvdisasm
    res = subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"cuobjdump -sass {obj} failed: {res.stderr.strip()}")
    sass = split_sass(res.stdout)
    usage = ptxas_usage(ptxas_stderr)
    names = demangle(sorted(sass))
    out = {}
    for mangled, lines in sass.items():
        u = usage.get(mangled, {})
        out[names[mangled]] = {
            "sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest(),
            "registers": u.get("registers"),
            "spill_bytes": max(u.get("spill_stores", 0), u.get("spill_loads", 0)),
            "lines": lines,
        }
    return out


def build_manifest(units: dict[str, tuple[Path, str]], cuobjdump: str) -> tuple[dict, dict[str, list[str]]]:
    """units: {source (relative path): (object, ptxas stderr)} -> (manifest, {name: SASS lines}).
    A function compiled by several units (a static or inline kernel in a shared header) is one
    entry listing them all; its copies must agree, else each copy is its own entry."""
    manifest: dict[str, dict] = {}
    sass: dict[str, list[str]] = {}
    for src, (obj, stderr) in sorted(units.items()):
        for name, f in object_functions(obj, stderr, cuobjdump).items():
            key = name
            if key in manifest and manifest[key]["sha256"] != f["sha256"]:
                key = f"{name} [{src}]"
            entry = manifest.setdefault(
                key,
                {
                    "sha256": f["sha256"],
                    "registers": f["registers"],
                    "spill_bytes": f["spill_bytes"],
                    "units": [],
                },
            )
            entry["units"].append(src)
            sass[key] = f["lines"]
    return dict(sorted(manifest.items())), sass


def compare(recorded: dict, current: dict) -> tuple[list[str], list[str]]:
    """(differences that fail the check, notes). A function whose SASS, registers or spills changed,
    or that appeared, fails; one that disappeared fails too unless another entry of the same name
    remains (a duplicate copy removed). A change in which units compile it is a note."""
    fails, notes = [], []
    base = {k.split(" [")[0] for k in current}
    for name in sorted(set(recorded) | set(current)):
        r, c = recorded.get(name), current.get(name)
        if r is None:
            fails.append(f"added:   {name}")
        elif c is None:
            (notes if name.split(" [")[0] in base else fails).append(f"removed: {name}")
        else:
            diffs = [k for k in ("sha256", "registers", "spill_bytes") if r.get(k) != c.get(k)]
            if diffs:
                what = ", ".join(f"{k} {r.get(k)} -> {c.get(k)}" if k != "sha256" else "SASS" for k in diffs)
                fails.append(f"changed: {name}: {what}")
            elif r.get("units") != c.get("units"):
                notes.append(f"units:   {name}: {r.get('units')} -> {c.get('units')}")
    return fails, notes


def compile_units(workdir: Path, jobs: int) -> dict[str, tuple[Path, str]]:
    nccl = nccl_include_dir()
    if nccl is None:
        sys.exit("no NCCL headers: pip install nvidia-nccl-cu13")
    flags = NvccFlags(workdir, nccl)

    def one(src: Path) -> tuple[str, tuple[Path, str]]:
        rel = str(src.relative_to(ROOT))
        obj = workdir / (rel.replace("/", "_") + ".o")
        proc = subprocess.run(flags.unit(src, obj), capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"nvcc failed on {rel}:\n{proc.stderr[-6000:]}")
        return rel, (obj, proc.stderr)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return dict(pool.map(one, cu_files()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="record the manifest")
    mode.add_argument("--check", action="store_true", help="compare with the recorded manifest")
    p.add_argument("--manifest", type=Path, default=MANIFEST)
    p.add_argument("--dump", type=Path, help="write each function's normalised SASS here (<name hash>.sass)")
    p.add_argument("--objdir", type=Path, help="keep the objects here (default: a temporary folder)")
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    cuobjdump = find_tool("cuobjdump")
    if cuobjdump is None:
        sys.exit("no cuobjdump: install the CUDA toolkit's or `pip install nvidia-cuda-cuobjdump`")
    with tempfile.TemporaryDirectory() as tmp:
        objdir = args.objdir or Path(tmp)
        objdir.mkdir(parents=True, exist_ok=True)
        current, sass = build_manifest(compile_units(objdir, args.jobs), cuobjdump)
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        index = {}
        for name, lines in sass.items():
            fname = hashlib.sha256(name.encode()).hexdigest()[:16] + ".sass"
            (args.dump / fname).write_text(f"// {name}\n" + "\n".join(lines) + "\n")
            index[name] = fname
        (args.dump / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    if args.write:
        args.manifest.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(current)} functions to {args.manifest}")
        return 0
    fails, notes = compare(json.loads(args.manifest.read_text()), current)
    for line in notes + fails:
        print(line)
    print(f"{len(current)} functions, {len(fails)} differences from {args.manifest.relative_to(ROOT)}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
