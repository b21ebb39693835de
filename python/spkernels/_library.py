"""Loads the compiled extension after checking that this torch is the one it was built against (and,
on GPUs, that torch loads the NCCL it was built against)."""

from __future__ import annotations

import glob
import os

import torch

_here = os.path.dirname(os.path.abspath(__file__))
try:
    from . import _build_info as BUILD_INFO  # written by setup.py build_ext
except ImportError as e:
    raise ImportError(
        f"spkernels' build record (_build_info.py) is missing from {_here}: rebuild with "
        "`pip install --no-build-isolation -e .`"
    ) from e


def _major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2])


def check_torch_matches_build(torch_version: str, cuda_version: str | None, build=BUILD_INFO) -> None:
    """libtorch's C++ ABI changes between minor releases, and a CUDA build needs torch's CUDA major:
    refuse the wrong torch here with a clear message instead of an undefined symbol (or a crash)."""
    rebuild = "install the spkernels wheel built for it or rebuild: `pip install --no-build-isolation .`"
    if _major_minor(torch_version) != _major_minor(build.TORCH_VERSION):
        raise ImportError(
            f"spkernels was built against torch {build.TORCH_VERSION} but this is torch {torch_version}; "
            + rebuild
        )
    cuda_major = (cuda_version or "").split(".")[0]
    if build.CUDA_VERSION is not None and cuda_major != build.CUDA_VERSION.split(".")[0]:
        raise ImportError(
            f"spkernels was built with CUDA kernels for CUDA {build.CUDA_VERSION} but this torch "
            f"{torch_version} has CUDA {cuda_version}; " + rebuild
        )


check_torch_matches_build(str(torch.__version__), torch.version.cuda)
_candidates = sorted(glob.glob(os.path.join(_here, "_C*.so")))
if not _candidates:
    raise ImportError(
        f"spkernels' compiled library (_C*.so) is missing from {_here}: build it with "
        "`pip install --no-build-isolation -e .`"
    )
torch.ops.load_library(_candidates[0])

_nccl_code, _has_cuda = (int(v) for v in torch.ops.spkernels._build_info())
HAS_CUDA_KERNELS = bool(_has_cuda)


def _version_tuple(code: int) -> tuple[int, int, int]:
    # NCCL_VERSION_CODE = major * 10000 + minor * 100 + patch (since 2.9)
    return code // 10000, (code % 10000) // 100, code % 100


COMPILED_NCCL_VERSION = _version_tuple(_nccl_code) if _nccl_code else None


def runtime_nccl_version() -> tuple[int, int, int] | None:
    if not torch.cuda.is_available():
        return None
    v = torch.cuda.nccl.version()
    return tuple(v) if isinstance(v, tuple) else _version_tuple(int(v))


if HAS_CUDA_KERNELS and torch.cuda.is_available():
    _rt = runtime_nccl_version()
    if _rt is not None and _rt[:2] != COMPILED_NCCL_VERSION[:2]:
        raise ImportError(
            f"spkernels was built against NCCL {COMPILED_NCCL_VERSION} but torch loads NCCL {_rt}: "
            "rebuild spkernels in this environment"
        )
