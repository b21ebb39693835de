"""``python -m spkernels.env``: what this install is and what it can run, for bug reports.

One ``key: value`` line each: versions (spkernels, torch, what the build was made against, NCCL
compiled and loaded), GPUs, and the Communicator backends available on this machine.
"""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

import torch

from . import _library
from ._library import BUILD_INFO
from .comm import env_default
from .version import __version__

# The fused (lsa) path needs the NCCL device API: symmetric-memory windows and LSA pointers.
LSA_MIN_NCCL = (2, 28)


def _run(cmd: list[str]) -> str:
    try:
        cwd = Path(__file__).resolve().parents[2]  # the checkout, for an editable install
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=cwd).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine(commit: str | None = None) -> dict:
    """What a measurement ran on, for its results file: GPU, driver, torch, CUDA, NCCL, commit, date.
    commit: given, else SPK_COMMIT, else the checkout's git HEAD (``-dirty`` with uncommitted changes
    to tracked files), else "unknown"."""
    cuda = torch.cuda.is_available()
    nccl = None
    if cuda:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) if cuda else ""
    commit = commit or os.environ.get("SPK_COMMIT")  # given: taken as is (a copied tree's .git may be stale)
    if not commit:
        commit = _run(["git", "rev-parse", "HEAD"]) or "unknown"
        if commit != "unknown" and _run(["git", "status", "--porcelain", "--untracked-files=no"]):
            commit += "-dirty"
    return {
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "driver": driver.splitlines()[0] if driver else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


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
