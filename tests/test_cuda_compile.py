"""nvcc compiles every CUDA source for sm_90a, so CUDA code that does not compile fails CI even on a
machine without a GPU (and with a CPU-only torch). One case per file:

- every ``csrc/**/*.cu`` against torch's headers and the NCCL headers of the pip package
  nvidia-nccl-cu13 (the NCCL torch loads on the GPU machine), as CMake builds it;
- ``csrc/torch_bindings.cpp`` with ``SPK_WITH_CUDA=1`` (its CUDA-only registrations);
- every header under ``csrc/kernels/`` on its own with no torch include path: the kernel layer must
  stay torch-free.

The files compile in parallel (one nvcc per core) as soon as the first case asks for them. The
same objects then give the per-kernel SASS manifest (tools/sass_manifest.py), checked against
tests/sass_manifest.json, and the spill check.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from repo_scripts import import_script

pytestmark = pytest.mark.slow  # nvcc: ~25 s per file on 2 cores

ROOT = Path(__file__).resolve().parents[1]
(sass_manifest,) = import_script("tools", "sass_manifest")

CSRC = ROOT / "csrc"
NVCC = shutil.which("nvcc")
COMPILE_TIMEOUT_S = 1200  # ~25 s per file on 2 cores today; leave room for a slow CI machine

CU_FILES = sorted(CSRC.rglob("*.cu"))
KERNEL_HEADERS = sorted(p for p in (CSRC / "kernels").rglob("*") if p.suffix in (".cuh", ".h"))
BINDINGS = CSRC / "torch_bindings.cpp"


def cases() -> list:
    if not CU_FILES:
        return [pytest.param(None, "torch", marks=pytest.mark.skip(reason="no csrc/**/*.cu sources yet"))]
    out = [pytest.param(f, "torch", id=str(f.relative_to(ROOT))) for f in CU_FILES]
    out.append(pytest.param(BINDINGS, "torch", id=f"{BINDINGS.relative_to(ROOT)}-with-cuda"))
    out += [pytest.param(h, "torch-free", id=f"{h.relative_to(ROOT)}-torch-free") for h in KERNEL_HEADERS]
    return out


class Compiler:
    def __init__(self, workdir: Path, nccl_include: Path) -> None:
        self.workdir = workdir
        flags = sass_manifest.NvccFlags(workdir, nccl_include)  # the build's flags
        self.common, self.torch_flags = flags.common, flags.torch
        self.pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
        self.jobs: dict[tuple[Path, str], Future] = {}

    def submit_all(self, params: list) -> None:
        for p in params:
            src, kind = p.values
            if src is not None:
                self.jobs[(src, kind)] = self.pool.submit(self._compile, src, kind)

    def _compile(self, src: Path, kind: str) -> tuple[list[str], subprocess.CompletedProcess | None]:
        name = f"{src.relative_to(ROOT)}-{kind}".replace("/", "_")
        if kind == "torch-free":
            unit = self.workdir / f"{name}.cu"
            unit.write_text(f'#include "{src.relative_to(CSRC)}"\n')
            cmd = [*self.common, str(unit)]
        else:
            cmd = [*self.common, *self.torch_flags, str(src)]
        cmd += ["-o", str(self.workdir / f"{name}.o")]
        try:
            return cmd, subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return cmd, None

    def result(self, src: Path, kind: str):
        return self.jobs[(src, kind)].result()


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc is not on PATH: the CUDA compile check needs the CUDA toolkit")
    nccl_include = sass_manifest.nccl_include_dir()
    if nccl_include is None:
        pytest.skip("no NCCL headers: `pip install nvidia-nccl-cu13` (the NCCL that torch loads) to compile")
    c = Compiler(tmp_path_factory.mktemp("nvcc"), nccl_include)
    c.submit_all(cases())
    yield c
    c.pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("src, kind", cases())
def test_nvcc_compiles(compiler, src, kind):
    cmd, proc = compiler.result(src, kind)
    assert proc is not None, f"nvcc ran over {COMPILE_TIMEOUT_S} s on {src}:\n{' '.join(cmd)}"
    errors = "\n".join(line for line in proc.stderr.splitlines() if "error" in line)
    assert proc.returncode == 0, (
        f"nvcc failed on {src.relative_to(ROOT)} ({kind}):\n{' '.join(cmd)}\n"
        f"--- errors ---\n{errors}\n--- last output ---\n{proc.stderr[-6000:]}"
    )


def test_objects_link_without_duplicate_symbols(compiler):
    """The extension's objects (every .cu and the bindings) define no strong symbol twice: a
    non-inline kernel in a shared header compiles everywhere and only fails at the link."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils) to list the objects' symbols")
    objects = []
    for src in [*CU_FILES, BINDINGS]:
        cmd, proc = compiler.result(src, "torch")
        if proc is None or proc.returncode != 0:
            pytest.skip(f"{src.relative_to(ROOT)} did not compile (test_nvcc_compiles reports it)")
        objects.append(cmd[-1])
    owners: dict[str, list[str]] = {}
    for obj in objects:
        out = subprocess.run([nm, "--defined-only", obj], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in "TDBR":  # strong (global) text / data / bss / rodata
                owners.setdefault(parts[2], []).append(Path(obj).name)
    dupes = {sym: objs for sym, objs in owners.items() if len(objs) > 1}
    assert not dupes, f"strong symbols defined in several objects: {dupes}"


# Kernels that spill today, each with its spill bytes: the test fails on any other spill,
# and on one of these that no longer spills as listed (then shrink the list).
KNOWN_SPILLS: dict[str, int] = {
    "void spk::mhc_rows_kernel<(spk::YSrc)2, true, true, false, (spk::FnSrc)0>(spk::TileArgs)": 4,
    "void spk::mhc_rows_kernel<(spk::YSrc)3, true, false, false, (spk::FnSrc)0>(spk::TileArgs)": 8,
}


@pytest.fixture(scope="module")
def manifest(compiler):
    """The per-kernel SASS manifest of the objects test_nvcc_compiles built (tools/sass_manifest.py)."""
    cuobjdump = sass_manifest.find_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip(
            "no cuobjdump: `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm` for the SASS manifest"
        )
    units = {}
    for src in CU_FILES:
        cmd, proc = compiler.result(src, "torch")
        if proc is None or proc.returncode != 0:
            pytest.skip(f"{src.relative_to(ROOT)} did not compile (test_nvcc_compiles reports it)")
        units[str(src.relative_to(ROOT))] = (Path(cmd[-1]), proc.stderr)
    return sass_manifest.build_manifest(units, cuobjdump)[0]


def test_sass_manifest(manifest):
    """Every kernel's SASS, registers and spills as recorded in tests/sass_manifest.json: a change
    in code generation is deliberate, recorded with `python tools/sass_manifest.py --write`."""
    fails, _ = sass_manifest.compare(json.loads(sass_manifest.MANIFEST.read_text()), manifest)
    assert not fails, "code generation differs from tests/sass_manifest.json:\n" + "\n".join(fails)


def test_each_kernel_in_one_unit(manifest):
    """Every kernel is compiled in one translation unit (csrc/kernels/mhc_kernels.cu for the mHC
    kernels): a static kernel in a shared header, or a template instantiated by two launchers,
    would be compiled (and shipped) once per unit."""
    copies = {name: f["units"] for name, f in manifest.items() if len(f["units"]) > 1}
    assert not copies, f"kernels compiled in several units: {copies}"


def test_no_spills(manifest):
    spills = {name: f["spill_bytes"] for name, f in manifest.items() if f["spill_bytes"]}
    assert spills == KNOWN_SPILLS, f"spills {spills}, known {KNOWN_SPILLS}"
