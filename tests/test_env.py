"""``python -m spkernels.env`` and the build record: the wheel knows what it was built against and
refuses, at import and before loading the library, a torch it was not built for."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import spkernels
import torch
from spkernels import _library, env
from spkernels._library import BUILD_INFO, check_torch_matches_build

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def env_lines(*args: str) -> dict[str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "spkernels.env", *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return dict(line.split(": ", 1) for line in proc.stdout.splitlines())


def test_env_prints_versions_gpus_backends():
    lines = env_lines()
    assert lines["spkernels"].split()[0] == spkernels.__version__
    assert lines["torch"] == f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"
    assert lines["built against"].startswith(f"torch {BUILD_INFO.TORCH_VERSION}, ")
    want_nccl = _library.runtime_nccl_version()
    assert lines["nccl runtime"] == ("none" if want_nccl is None else ".".join(map(str, want_nccl)))
    assert lines["nccl compiled"] == (
        "none"
        if _library.COMPILED_NCCL_VERSION is None
        else ".".join(map(str, _library.COMPILED_NCCL_VERSION))
    )
    backends = lines["backends"].split(", ")
    assert backends[0] == "gloo"
    if not torch.cuda.is_available():  # with GPUs: test_gpu_env_counts_gpus_and_backends
        assert lines["gpus"] == "none"
        assert backends == ["gloo"]


@pytest.mark.gpu
@requires_cuda
def test_gpu_env_counts_gpus_and_backends():
    lines = env_lines()
    count = sum(int(kind.split(" x ")[0]) for kind in lines["gpus"].split(", "))
    assert count == torch.cuda.device_count()
    assert _library.HAS_CUDA_KERNELS and "nccl" in lines["backends"].split(", ")


@pytest.mark.parametrize(
    "cuda_kernels, num_gpus, nccl, peers, fused, want",
    [
        (False, 2, (2, 28, 9), True, "1", ["gloo"]),
        (True, 0, None, True, "1", ["gloo"]),
        (True, 2, (2, 28, 9), True, "1", ["gloo", "nccl", "lsa"]),
        (True, 2, (2, 27, 7), True, "1", ["gloo", "nccl"]),  # no device API before 2.28
        (True, 2, (2, 28, 9), False, "1", ["gloo", "nccl"]),  # no P2P between the GPUs
        (True, 2, (2, 28, 9), True, "0", ["gloo", "nccl"]),  # SPK_FUSED=0
    ],
)
def test_backends_follow_build_gpus_nccl(monkeypatch, cuda_kernels, num_gpus, nccl, peers, fused, want):
    monkeypatch.setattr(_library, "HAS_CUDA_KERNELS", cuda_kernels)
    monkeypatch.setattr(_library, "runtime_nccl_version", lambda: nccl)
    monkeypatch.setattr(env, "gpus", lambda: [("NVIDIA H200", "sm_90")] * num_gpus)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: peers)
    monkeypatch.setenv("SPK_FUSED", fused)
    assert env.backends() == want


def test_build_record_matches_this_environment():
    """The editable build (or installed wheel) under test was made here: the record says so."""
    assert BUILD_INFO.TORCH_VERSION == str(torch.__version__)
    assert (BUILD_INFO.CUDA_VERSION is not None) == _library.HAS_CUDA_KERNELS
    if not _library.HAS_CUDA_KERNELS:  # a CUDA build: test_gpu_build_record_names_cuda_and_nccl
        assert BUILD_INFO.NCCL_VERSION is None


@pytest.mark.gpu
@requires_cuda
def test_gpu_build_record_names_cuda_and_nccl():
    assert _library.HAS_CUDA_KERNELS and BUILD_INFO.CUDA_VERSION == torch.version.cuda
    assert tuple(int(p) for p in BUILD_INFO.NCCL_VERSION.split(".")) == _library.COMPILED_NCCL_VERSION


class Build:
    def __init__(self, torch_version, cuda_version):
        self.TORCH_VERSION, self.CUDA_VERSION = torch_version, cuda_version


@pytest.mark.parametrize(
    "built, torch_version, cuda_version, error",
    [
        (("2.13.0+cpu", None), "2.13.1+cpu", None, None),  # patch releases keep the ABI
        (("2.13.0+cpu", None), "2.13.0+cu130", "13.0", None),  # CPU build, CUDA torch: CPU ops work
        (("2.13.0+cu130", "13.0"), "2.13.0+cu130", "13.0", None),
        (("2.13.0+cu130", "13.0"), "2.13.0+cu132", "13.2", None),
        (
            ("2.13.0+cpu", None),
            "2.12.0+cpu",
            None,
            "built against torch 2.13.0+cpu but this is torch 2.12.0+cpu",
        ),
        (("2.13.0", None), "3.13.0", None, "built against torch 2.13.0 but this is torch 3.13.0"),
        (("2.13.0+cu130", "13.0"), "2.13.0+cpu", None, "CUDA 13.0 but this torch 2.13.0+cpu has CUDA None"),
        (
            ("2.13.0+cu130", "13.0"),
            "2.13.0+cu128",
            "12.8",
            "CUDA 13.0 but this torch 2.13.0+cu128 has CUDA 12.8",
        ),
    ],
)
def test_torch_check_table(built, torch_version, cuda_version, error):
    if error is None:
        check_torch_matches_build(torch_version, cuda_version, Build(*built))
    else:
        with pytest.raises(ImportError, match=error.replace("+", r"\+")):
            check_torch_matches_build(torch_version, cuda_version, Build(*built))


def test_import_refuses_other_torch_before_loading_the_library():
    major, minor = (int(p) for p in str(torch.__version__).split(".")[:2])
    fake = f"{major}.{minor + 1}.0"
    proc = run_python(f"""
        import torch
        torch.__version__ = {fake!r}
        try:
            import spkernels
        except ImportError as e:
            print("refused:", e)
        print("loaded:", hasattr(torch.ops.spkernels, "mhc_pre"))
    """)
    assert proc.returncode == 0, proc.stderr
    assert (
        f"refused: spkernels was built against torch {BUILD_INFO.TORCH_VERSION} but this is torch {fake}"
        in (proc.stdout)
    )
    assert "rebuild" in proc.stdout
    assert "loaded: False" in proc.stdout


def test_import_without_build_record_says_rebuild():
    proc = run_python("""
        import sys
        sys.modules["spkernels._build_info"] = None  # as if the build never wrote it
        try:
            import spkernels
        except ImportError as e:
            print("refused:", e)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "refused: spkernels' build record (_build_info.py) is missing" in proc.stdout
