"""``--profile``: where the measured generation's time goes, by category (rank 0).

On cuda: GPU kernel time (torch.profiler / CUPTI, graph replays included), by kernel name. On cpu:
each op's self CPU time, by op name. Profiling slows the run down: report throughput from a run
without it, and read these as shares.
"""

from __future__ import annotations

import torch
from torch.autograd import DeviceType

# (label, lower-case name fragments); the first match wins, anything else is "other".
CATEGORIES = (
    ("mHC", ("spk::", "spkernels::")),
    ("NCCL", ("nccl", "c10d::", "gloo")),
    ("attention", ("flash", "fmha", "attention")),  # before GEMM: cutlass fmha kernels
    ("GEMM", ("gemm", "cutlass", "nvjet", "xmma", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear")),
)
LABELS = tuple(label for label, _ in CATEGORIES) + ("other",)


def category(name: str) -> str:
    low = name.lower()
    for label, fragments in CATEGORIES:
        if any(f in low for f in fragments):
            return label
    return "other"


def breakdown(events, device_type: str) -> dict[str, float]:
    """Milliseconds per category from ``profiler.key_averages()``."""
    totals = dict.fromkeys(LABELS, 0.0)
    for e in events:
        if device_type == "cuda":
            if e.device_type != DeviceType.CUDA:
                continue
            us = e.self_device_time_total
        else:
            us = e.self_cpu_time_total
        totals[category(e.key)] += us / 1000
    return totals


def format_breakdown(totals: dict[str, float], device_type: str) -> str:
    total = sum(totals.values())
    what = "GPU kernel time" if device_type == "cuda" else "self CPU time of ops"
    parts = ", ".join(f"{k} {v:.2f} ms ({v / total:.0%})" for k, v in totals.items() if total)
    return f"profile (rank 0, {what}): {parts}; total {total:.2f} ms"


class Profiler:
    """A context manager around the measured generation; ``totals()`` afterwards."""

    def __init__(self, device: torch.device):
        self.device_type = device.type
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities)

    def __enter__(self):
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        return self.prof.__exit__(*exc)

    def totals(self) -> dict[str, float]:
        return breakdown(self.prof.key_averages(), self.device_type)
