"""Loads the compiled extension and checks the NCCL it was built against against the one torch loads."""

from __future__ import annotations

import glob
import os

import torch

_here = os.path.dirname(os.path.abspath(__file__))
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
