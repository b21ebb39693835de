"""``--profile``: where the measured generation's time goes, by category (rank 0).

On cuda: GPU kernel time (torch.profiler / CUPTI, graph replays included), by kernel name, summed
and as time covered (overlapping kernels counted once: a PDL-launched pass 2 is resident, waiting,
while its pass 1 runs, and its summed time counts that wait). On cpu: each op's self CPU time, by
op name. Profiling slows the run down: report throughput from a run without it, and read these as
shares.
"""

from __future__ import annotations

import bisect

import torch
from torch.autograd import DeviceType

# The name of the record_function range the Engine puts around each timed step when profiled, + its
# kind ("prefill": any prompt token in it; "decode"). On cuda the profiler also shows it on the GPU
# timeline (a user annotation spanning the step): like ProfilerStep, never counted as kernel time.
STEP_RANGE = "spkernels.step."
STEP_KINDS = ("prefill", "decode")


def _annotation(name: str) -> bool:
    return name.startswith(("ProfilerStep", STEP_RANGE))


# (label, lower-case name fragments); the first match wins, anything else is "other".
CATEGORIES = (
    ("mHC", ("spk::", "spkernels::")),
    ("NCCL", ("nccl", "c10d::", "gloo")),
    ("attention", ("flash", "fmha", "attention")),  # before GEMM: cutlass fmha kernels
    (
        "GEMM",
        (
            "gemm",
            "cutlass",
            "nvjet",
            "xmma",
            "aten::mm",
            "aten::matmul",
            "aten::addmm",
            "aten::bmm",
            "aten::linear",
        ),
    ),
)
LABELS = tuple(label for label, _ in CATEGORIES) + ("other",)
# spkernels' own model-glue ops and kernels (runner/glue.py) are glue: "other", not mHC.
GLUE = ("spk::glue::", "spkernels::_rope_kv_cache", "spkernels::_silu_mul")


def category(name: str) -> str:
    low = name.lower()
    if any(f in low for f in GLUE):
        return "other"
    for label, fragments in CATEGORIES:
        if any(f in low for f in fragments):
            return label
    return "other"


def _timed(events, device_type: str):
    """(name, ms, calls) of each of ``profiler.key_averages()``: kernels on cuda, ops' self time on cpu.
    Not the schedule's ProfilerStep range: on cuda it is also a GPU-timeline annotation spanning
    the whole step, which would count the step's time twice."""
    for e in events:
        if _annotation(e.key):
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
        if e.device_type == DeviceType.CUDA and not _annotation(e.name):
            spans[category(e.name)].append((e.time_range.start, e.time_range.end))
    busy = covered_ms(iv for ivs in spans.values() for iv in ivs)
    return {**{label: covered_ms(ivs) for label, ivs in spans.items()}, "GPU busy": busy}


def _op(name: str) -> bool:
    return name.startswith(("aten::", "spkernels::"))


def _outermost_op(e) -> bool:
    """A CPU op not called from inside another op (whose time already counts it)."""
    parent = e.cpu_parent
    while parent is not None:
        if _op(parent.name):
            return False
        parent = parent.cpu_parent
    return True


def _work(events, device_type: str):
    """(name, start_us, end_us) of what occupies the device: kernels on cuda; on cpu the outermost ops."""
    for e in events:
        if _annotation(e.name):
            continue
        if device_type == "cuda":
            if e.device_type == DeviceType.CUDA:
                yield e.name, e.time_range.start, e.time_range.end
        elif e.device_type == DeviceType.CPU and _op(e.name) and _outermost_op(e):
            yield e.name, e.time_range.start, e.time_range.end


IDLE_GAPS = 3  # the longest idle stretches by_step_kind reports per step kind


def by_step_kind(events, device_type: str) -> dict[str, dict]:
    """Per step kind, from the Engine's STEP_RANGE ranges in ``profiler.events()``: the steps seen,
    the milliseconds of them that any work covers ("busy": GPU kernels on cuda, outermost ops on
    cpu), what each category covers, and where the rest went: ``lead_ms``, from each range's start
    to its first work (on cuda: the host's work before the GPU gets the step's first kernel), and
    ``gaps``, the IDLE_GAPS longest idle stretches in the ranges as (ms, the work that ended the
    wait, or "the step's end": the device done before the host saw it).

    A kernel belongs to the step whose range it starts in (clipped to it). A synchronous step's
    range begins with the device drained and ends with its tokens read, so its kernels run inside
    it. An overlapped step's range runs from the previous step's completion to its own
    (Engine._complete), which is when the GPU runs its kernels: queued behind the previous step,
    they start as it ends; only where the GPU catches up with the host during an enqueue can a
    step's first kernels start before its range and count for the step before."""
    ranges = sorted(
        (e.time_range.start, e.time_range.end, e.name[len(STEP_RANGE) :])
        for e in events
        if e.device_type == DeviceType.CPU and e.name.startswith(STEP_RANGE)
    )
    starts = [start for start, _, _ in ranges]
    work = [[] for _ in ranges]  # (start, clipped end, name) per range
    for name, start, end in _work(events, device_type):
        i = bisect.bisect_right(starts, start) - 1
        if i < 0 or start >= ranges[i][1]:
            continue  # outside every timed step (the ranks' meeting, the tracer's own work)
        work[i].append((start, min(end, ranges[i][1]), name))
    spans = {kind: {label: [] for label in LABELS} for _, _, kind in ranges}
    leads, gaps = dict.fromkeys(spans, 0), {kind: [] for kind in spans}
    for (low, high, kind), items in zip(ranges, work, strict=True):
        reach = low  # how far the step's work has covered its range so far
        for start, end, name in sorted(items):
            spans[kind][category(name)].append((start, end))
            if start > reach:
                gaps[kind].append(((start - reach) / 1000, name))
            reach = max(reach, end)
        if high > reach:
            gaps[kind].append(((high - reach) / 1000, "the step's end"))
        leads[kind] += (min(items)[0] if items else high) - low
    return {
        kind: {
            "steps": sum(k == kind for _, _, k in ranges),
            "busy_ms": covered_ms(iv for ivs in by_label.values() for iv in ivs),
            "busy_by_category_ms": {label: covered_ms(ivs) for label, ivs in by_label.items()},
            "lead_ms": leads[kind] / 1000,
            "gaps": sorted(gaps[kind], key=lambda gap: -gap[0])[:IDLE_GAPS],
        }
        for kind, by_label in spans.items()
    }


# Ops that launch no work of their own: views, allocations, dtype and layout no-ops.
VIEW_OPS = frozenset(
    "aten::" + name
    for name in (
        "view", "as_strided", "select", "slice", "unsqueeze", "squeeze", "transpose", "t", "expand",
        "chunk", "split", "unbind", "permute", "_unsafe_view", "alias", "detach", "detach_", "empty",
        "empty_strided", "empty_like", "new_empty", "resize_", "lift_fresh", "narrow", "_reshape_alias",
        "resolve_conj", "resolve_neg", "result_type", "to", "_to_copy", "reshape", "contiguous", "flatten",
    )
)  # fmt: skip


def op_counts(events) -> dict[str, int]:
    """Ops that launch work, by name, from ``profiler.events()`` of a CPU profile: the outermost op
    of each call tree, looking through VIEW_OPS (``.to`` counts the copy it makes, if any) and
    counting a composite op once (its own kernels are its business: an mHC op, a GEMM, SDPA). On
    cuda each launches one or a few kernels: a proxy for the kernels a forward launches."""
    counts: dict[str, int] = {}

    def visit(e):
        if e.name in VIEW_OPS or not _op(e.name):
            for child in e.cpu_children:
                visit(child)
        else:
            counts[e.name] = counts.get(e.name, 0) + 1

    for e in events:
        if e.device_type == DeviceType.CPU and e.cpu_parent is None:
            visit(e)
    return counts


def step_kinds(steps, profiled: dict | None, device_type: str) -> dict[str, dict]:
    """The results' per-step-kind figures: steps, ``wall_ms`` (the steps' clock, Engine.step) and,
    from a profile on cuda, ``gpu_busy_ms`` (GPU time any kernel covers), ``wall_per_gpu_busy`` and
    ``gpu_ms`` by category; None where not measured (no profile, or cpu: no GPU). A profile on cpu
    gives ``cpu_ops_busy_ms`` and ``cpu_ops_ms`` instead (outermost ops). A profile's ``lead_ms`` and
    ``gaps`` (by_step_kind) say where a kind's wall time without work went."""
    out = {}
    for kind in STEP_KINDS:
        mine = [s for s in steps if bool(s.prefill_tokens) == (kind == "prefill")]
        wall = 1e3 * sum(s.seconds for s in mine)
        entry = {
            "steps": len(mine),
            "wall_ms": wall,
            "gpu_busy_ms": None,
            "wall_per_gpu_busy": None,
            "gpu_ms": None,
        }
        seen = (profiled or {}).get(kind)
        if seen is not None and device_type == "cuda":
            busy = seen["busy_ms"]
            entry.update(gpu_busy_ms=busy, gpu_ms=seen["busy_by_category_ms"])
            entry["wall_per_gpu_busy"] = wall / busy if busy else None
        elif seen is not None:
            entry.update(cpu_ops_busy_ms=seen["busy_ms"], cpu_ops_ms=seen["busy_by_category_ms"])
        if seen is not None:
            entry.update(lead_ms=seen["lead_ms"], gaps=seen["gaps"])
        out[kind] = entry
    return out


def format_step_kind(kind: str, entry: dict) -> str:
    """One --profile line per step kind: wall, GPU busy, their ratio, GPU time by category."""
    head = f"profile {kind} steps (rank 0): {entry['steps']} steps, wall {entry['wall_ms']:.2f} ms"
    if entry["gpu_busy_ms"] is not None:
        ratio = entry["wall_per_gpu_busy"]
        parts = ", ".join(f"{k} {v:.2f} ms" for k, v in entry["gpu_ms"].items())
        ratio_text = f"{ratio:.3f}" if ratio is not None else "n/a"
        return f"{head}, GPU busy {entry['gpu_busy_ms']:.2f} ms, wall / GPU busy {ratio_text}; GPU {parts}"
    if "cpu_ops_busy_ms" in entry:
        parts = ", ".join(f"{k} {v:.2f} ms" for k, v in entry["cpu_ops_ms"].items())
        return f"{head}, GPU busy n/a; ops busy {entry['cpu_ops_busy_ms']:.2f} ms: {parts}"
    return f"{head}, GPU busy n/a"


def format_idle(kind: str, entry: dict) -> str:
    """The --profile line of where a step kind's idle time is: before each step's first work, and
    the longest idle stretches, each named by the work that ended it."""
    gaps = "; ".join(f"{ms:.3f} ms before {name[:70]}" for ms, name in entry["gaps"]) or "none"
    lead = f"{entry['lead_ms']:.3f} ms before the steps' first work"
    return f"profile {kind} idle (rank 0): {lead}; longest: {gaps}"


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

    def by_step_kind(self) -> dict[str, dict]:
        return by_step_kind(self.prof.events(), self.device_type)

    def top(self) -> dict[str, list[tuple[str, float, int]]]:
        events = self.prof.key_averages()
        return {label: top_names(events, self.device_type, label) for label in TOP_LABELS}
