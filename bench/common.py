"""Harness shared by the benchmarks in bench/: process launch, timing and machine facts.

Timing (docs/performance.md, "How performance is measured"): warm-up (which also compiles), then repeated
chunks timed with CUDA events (eager) or graph replays (a CUDA graph holding many back-to-back
calls, time divided by the calls), variants of one shape interleaved chunk by chunk so that drift
hits all of them alike, the median chunk per rank, and the maximum of those medians across ranks
(a collective is as slow as its slowest rank). Callers rotate among input sets larger than L2.
"""

from __future__ import annotations

import datetime
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
L2_BYTES = 60 * 10**6  # H200 L2 (60 MB): rotate inputs so that the working set is at least twice this

# torch >= 2.13 deprecates {all_gather_into,reduce_scatter}_tensor for *_single; the GPU machine has 2.11.
warnings.filterwarnings("ignore", ".*(all_gather_into|reduce_scatter)_tensor.*", FutureWarning)


def import_spkernels():
    """Import spkernels from the installed package, else from python/ of this checkout."""
    try:
        import spkernels
    except ImportError:
        sys.path.insert(0, str(REPO / "python"))
        import spkernels
    return spkernels


# ---------------------------------------------------------------- processes
def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def launch(worker: Callable, nprocs: int, backend: str, args) -> None:
    """Run ``worker(args)`` on every rank of an initialised process group.

    Under torchrun this process is one rank; otherwise spawn ``nprocs`` processes that meet through a
    file in a temporary folder (no TCP port to race for).
    """
    if under_torchrun():
        _entry(int(os.environ["LOCAL_RANK"]), None, None, backend, worker, args)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            store = os.path.join(tmp, "store")
            mp.spawn(_entry, args=(nprocs, store, backend, worker, args), nprocs=nprocs, join=True)


def _entry(local_rank, nprocs, store, backend, worker, args) -> None:
    kw = {"timeout": datetime.timedelta(minutes=60)}
    if store is not None:
        os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(local_rank))
        kw.update(init_method=f"file://{store}", rank=local_rank, world_size=nprocs)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        kw["device_id"] = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(1)  # two ranks on a small CI machine: oversubscribed threads only add noise
    dist.init_process_group(backend, **kw)
    try:
        worker(args)
    finally:
        dist.destroy_process_group()
    # Done and reported: skip interpreter teardown, where a rank occasionally aborted in C++ static
    # destruction ("terminate called without an active exception") after its peer had exited.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- timing
@dataclass
class TimingConfig:
    warmup: int = 3  # eager calls per variant before anything is timed (compiles, allocates)
    repeats: int = 7  # timed chunks per variant; the median is kept
    target_us: float = 2000.0  # aim of one chunk's duration, so event resolution and syncs don't matter
    max_calls: int = 256  # most calls in one eager chunk or one graph
    max_replays: int = 64


class Bench:
    """Times variants of one shape on every rank of ``group`` and agrees on the numbers."""

    def __init__(self, group, device: torch.device, cfg: TimingConfig):
        self.group, self.device, self.cfg = group, device, cfg
        self.cuda = device.type == "cuda"

    # -- agreement across ranks (every rank must take the same branches, or collectives hang)
    def reduce(self, values: list[float], op=dist.ReduceOp.MAX) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.reduce([0.0])
        if self.cuda:
            torch.cuda.synchronize()

    def _clock(self, fn: Callable[[], None]) -> float:
        """Microseconds one call of ``fn`` takes on the device (host clock on CPU)."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    def _calls_for(self, est_us: float, lo: int) -> int:
        return int(min(max(math.ceil(self.cfg.target_us / max(est_us, 1e-3)), lo), self.cfg.max_calls))

    def measure(self, variants: dict[str, Callable[[int], object]], nsets: int, graph: bool):
        """-> ({name: median us per call, max over ranks}, {name: error}) for each variant.

        ``variants[name](i)`` runs one call on input set ``i % nsets``. A variant that raises on any
        rank is dropped on every rank (the error is returned instead of a time).
        """
        if graph and not self.cuda:
            raise ValueError("CUDA-graph timing needs CUDA")
        errors: dict[str, str] = {}
        runners: dict[str, Callable[[], None]] = {}
        per_chunk: dict[str, int] = {}
        for name, fn in variants.items():
            # Each stage ends in one reduction of (failed, estimate), so all ranks drop a variant together.
            est = self._stage(errors, name, lambda fn=fn: self._warm(fn, nsets))
            if est is None:
                continue
            if not graph:
                calls = self._calls_for(est, 1)
                runners[name] = lambda fn=fn, n=calls: _loop(fn, n, nsets)
                per_chunk[name] = calls
                continue
            calls = max(self._calls_for(est, 2), min(nsets, self.cfg.max_calls))
            replay = [None]
            est = self._stage(errors, name, lambda fn=fn, c=calls, r=replay: self._graph(fn, nsets, c, r))
            if est is None:
                continue
            replays = int(min(max(math.ceil(self.cfg.target_us / max(est, 1e-3)), 1), self.cfg.max_replays))
            runners[name] = lambda r=replay[0], n=replays: _loop(lambda _: r(), n, 1)
            per_chunk[name] = calls * replays
        samples: dict[str, list[float]] = {name: [] for name in runners}
        names = list(runners)
        for rep in range(self.cfg.repeats):
            for k in range(len(names)):  # rotate the order every round: A B C, B C A, ...
                name = names[(k + rep) % len(names)]
                self.sync()
                samples[name].append(self._clock(runners[name]) / per_chunk[name])
        medians = self.reduce([statistics.median(samples[n]) for n in names]) if names else []
        return dict(zip(names, medians, strict=True)), errors

    def _stage(self, errors: dict, name: str, work: Callable[[], float]) -> float | None:
        try:
            value, err = work(), ""
        except Exception as e:  # noqa: BLE001 - reported in the results, not fatal to the sweep
            value, err = 0.0, f"{type(e).__name__}: {e}"[:300]
        failed, value = self.reduce([float(bool(err)), value])
        if failed:
            errors[name] = err or "failed on another rank"
            return None
        return value

    def _warm(self, fn, nsets: int) -> float:
        _loop(fn, self.cfg.warmup, nsets)
        return self._clock(lambda: _loop(fn, 3, nsets)) / 3

    def _graph(self, fn, nsets: int, calls: int, out: list) -> float:
        out[0] = self._capture(fn, nsets, calls)
        out[0]()  # the first replay uploads the graph
        return self._clock(out[0])

    def _capture(self, fn, nsets: int, calls: int):
        # Warm up on a side stream first (what torch.cuda.graph expects), then capture ``calls``
        # back-to-back calls over rotating input sets in one graph.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _loop(fn, 2, nsets)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            _loop(fn, calls, nsets)
        torch.cuda.synchronize()
        return g.replay


def _loop(fn, calls: int, nsets: int) -> None:
    for i in range(calls):
        fn(i % nsets)


def sets_for(set_bytes: int, max_sets: int = 64) -> int:
    """How many input sets to rotate so that they span at least 2x L2."""
    return int(min(max(math.ceil(2 * L2_BYTES / max(set_bytes, 1)), 1), max_sets))


# ---------------------------------------------------------------- bandwidth
def copy_bandwidth(bench: Bench, nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth in GB/s, counting bytes read + written (the slowest rank's)."""
    if not bench.cuda:
        nbytes = min(nbytes, 64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=bench.device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        bench.sync()
        times.append(bench._clock(lambda: dst.copy_(src)))
    t = bench.reduce([statistics.median(times)])[0]
    return 2 * nbytes / t / 1e3


# ---------------------------------------------------------------- machine facts
def host_loop_us(fn: Callable, calls: int, sync: Callable) -> float:
    """Microseconds per call of ``calls`` back-to-back host calls of ``fn``, the device drained by
    ``sync`` before and after: what the host spends, where the host is the bottleneck."""
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def machine_info(commit: str | None = None) -> dict:
    """GPU, driver, torch, CUDA, NCCL, commit and date of a run (spkernels.env.machine)."""
    from spkernels.env import machine

    return machine(commit)


class Progress:
    """tqdm when it is installed and this is rank 0; otherwise one short line per step on rank 0."""

    def __init__(self, total: int, enabled: bool):
        self.enabled, self.total, self.n, self.t0 = enabled, total, 0, time.time()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=sys.stdout, mininterval=2.0, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, label: str) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
        elif self.enabled:
            print(f"[{self.n}/{self.total} {time.time() - self.t0:6.1f}s] {label}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
