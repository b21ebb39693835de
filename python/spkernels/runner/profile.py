"""``--profile``: where the measured generation's time goes, by category (rank 0).

On cuda: GPU kernel time (torch.profiler / CUPTI, graph replays included), by kernel name, summed
and as time covered (overlapping kernels counted once: a PDL-launched pass 2 is resident, waiting,
while its pass 1 runs, and its summed time counts that wait). On cpu: each op's self CPU time, by
op name. Profiling slows the run down: report throughput from a run without it, and read these as
shares.
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


def _timed(events, device_type: str):
    """(name, ms, calls) of each of ``profiler.key_averages()``: kernels on cuda, ops' self time on cpu.
    Not the schedule's ProfilerStep range: on cuda it is also a GPU-timeline annotation spanning
    the whole step, which would count the step's time twice."""
    for e in events:
        if e.key.startswith("ProfilerStep"):
            continue
        if device_type == "cuda":
            if e.device_type == DeviceType.CUDA:
                yield e.key, e.self_device_time_total / 1000, e.count
        else:
            yield e.key, e.self_cpu_time_total / 1000, e.count


def breakdown(events, device_type: str) -> dict[str, float]:
    """Milliseconds per category from ``profiler.key_averages()``."""
    totals = dict.fromkeys(LABELS, 0.0)
    for name, ms, _ in _timed(events, device_type):
        totals[category(name)] += ms
    return totals


TOP_LABELS = ("mHC", "other")  # the categories whose largest names --profile prints


def top_names(events, device_type: str, label: str, n: int = 5) -> list[tuple[str, float, int]]:
    """The n names that take the most of one category (which mHC kernels; which glue in "other"),
    as (name, ms, calls): the time per call compares with the microbenchmarks'."""
    named = [item for item in _timed(events, device_type) if category(item[0]) == label]
    return sorted(named, key=lambda item: -item[1])[:n]


def covered_ms(intervals) -> float:
    """Milliseconds covered by (start_us, end_us) intervals, overlaps counted once."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered / 1000


def coverage(events) -> dict[str, float]:
    """Milliseconds of the GPU timeline each category's kernels cover (``profiler.events()``), and
    under "GPU busy" what any kernel covers."""
    spans = {label: [] for label in LABELS}
    for e in events:
        if e.device_type == DeviceType.CUDA and not e.name.startswith("ProfilerStep"):
            spans[category(e.name)].append((e.time_range.start, e.time_range.end))
    busy = covered_ms(iv for ivs in spans.values() for iv in ivs)
    return {**{label: covered_ms(ivs) for label, ivs in spans.items()}, "GPU busy": busy}


def format_breakdown(totals: dict[str, float], device_type: str, what: str | None = None) -> str:
    total = totals.get("GPU busy", sum(v for k, v in totals.items() if k in LABELS))
    what = what or ("GPU kernel time" if device_type == "cuda" else "self CPU time of ops")
    parts = ", ".join(f"{k} {v:.2f} ms ({v / total:.0%})" for k, v in totals.items() if k in LABELS and total)
    tail = f"GPU busy {totals['GPU busy']:.2f} ms" if "GPU busy" in totals else f"total {total:.2f} ms"
    return f"profile (rank 0, {what}): {parts}; {tail}"


def format_top(label: str, top: list[tuple[str, float, int]]) -> str:
    parts = (f"{name[:90]} {ms:.2f} ms / {calls} = {1000 * ms / calls:.1f} us" for name, ms, calls in top)
    return f"profile {label}, largest: " + "; ".join(parts)


class Profiler:
    """A context manager around the measured generation; ``totals()`` afterwards.

    Starting the tracer takes a rank a while (CUPTI's first start: up to seconds), and not every
    rank the same while: a fused kernel launched by a rank that started early waits in its barrier
    for the late peer, and that wait would count as mHC kernel time (2.7 s of a 48 ms prefill on
    2 H200s). So the tracer starts in the schedule's warm-up (traced, then dropped), the ranks
    meet in ``sync`` (a barrier of the world group, with their devices drained), and only then
    does recording begin.
    """

    def __init__(self, device: torch.device, sync=None):
        self.device_type = device.type
        self.sync = sync
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=1)
        self.prof = torch.profiler.profile(activities=activities, schedule=schedule)

    def __enter__(self):
        self.prof.__enter__()  # warm-up: the tracer runs, nothing is kept
        if self.sync is not None:
            self.sync()
        self.prof.step()  # recording from here
        return self

    def __exit__(self, *exc):
        return self.prof.__exit__(*exc)

    def totals(self) -> dict[str, float]:
        return breakdown(self.prof.key_averages(), self.device_type)

    def coverage(self) -> dict[str, float] | None:
        return coverage(self.prof.events()) if self.device_type == "cuda" else None

    def top(self) -> dict[str, list[tuple[str, float, int]]]:
        events = self.prof.key_averages()
        return {label: top_names(events, self.device_type, label) for label in TOP_LABELS}
