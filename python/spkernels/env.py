"""``python -m spkernels.env``: what this install is and what it can run, for bug reports.

One ``key: value`` line each: versions (spkernels, torch, what the build was made against, NCCL
compiled and loaded), GPUs, and the Communicator backends available on this machine.
"""

from __future__ import annotations

import os

import torch

from . import _library
from ._library import BUILD_INFO
from .comm import env_default
from .version import __version__

# The fused (lsa) path needs the NCCL device API: symmetric-memory windows and LSA pointers.
LSA_MIN_NCCL = (2, 28)


def _fmt_version(v: tuple[int, ...] | None) -> str:
    return "none" if v is None else ".".join(str(p) for p in v)


def gpus() -> list[tuple[str, str]]:
    """(name, sm_XY) per visible GPU."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        out.append((torch.cuda.get_device_name(i), f"sm_{major}{minor}"))
    return out


def _all_peers_reachable(count: int) -> bool:
    return all(torch.cuda.can_device_access_peer(i, j) for i in range(count) for j in range(count) if i != j)


def backends() -> list[str]:
    """gloo always (CPU tensors); nccl with CUDA kernels and a GPU; lsa when, in addition, the NCCL
    that torch loads has the device API, every GPU reaches every other by P2P, and SPK_FUSED != 0
    (the default of Communicator(fused=None)).
    (A Communicator still decides per group; this is what the machine allows.)"""
    found = ["gloo"]
    count = len(gpus())
    if not (_library.HAS_CUDA_KERNELS and count > 0):
        return found
    found.append("nccl")
    nccl = _library.runtime_nccl_version()
    fused = env_default("fused")
    if nccl is not None and nccl[:2] >= LSA_MIN_NCCL and fused and _all_peers_reachable(count):
        found.append("lsa")
    return found


def collect() -> dict[str, str]:
    info = {
        "spkernels": f"{__version__} ({os.path.dirname(os.path.abspath(__file__))})",
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})",
        "built against": (
            f"torch {BUILD_INFO.TORCH_VERSION}, CUDA {BUILD_INFO.CUDA_VERSION or 'none'}, "
            f"NCCL {BUILD_INFO.NCCL_VERSION or 'none'}, archs {BUILD_INFO.CUDA_ARCHS or 'none'}"
        ),
        "cuda kernels": "yes" if _library.HAS_CUDA_KERNELS else "no (CPU-only build)",
        "nccl compiled": _fmt_version(_library.COMPILED_NCCL_VERSION),
        "nccl runtime": _fmt_version(_library.runtime_nccl_version()),
    }
    found = gpus()
    if found:
        info["gpus"] = ", ".join(f"{found.count(k)} x {k[0]} ({k[1]})" for k in sorted(set(found)))
    else:
        info["gpus"] = "none"
    info["backends"] = ", ".join(backends())
    spk_vars = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("SPK_"))
    info["SPK_* set"] = " ".join(spk_vars) or "none"
    return info


def main() -> None:
    for key, value in collect().items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
