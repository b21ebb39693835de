"""run_distributed: the one way tests start a process group (every distributed test uses it).

Spawns ``world_size`` processes that meet through a file in a fresh temporary directory (no port to
race for), initialises ``torch.distributed`` in each (gloo on CPU, nccl with one GPU per rank), runs
``fn(rank, world_size, *args)`` and returns what each rank returned (tensors come back on the CPU).
Any failure in a child fails the calling test with that child's traceback; a run that outlives
``timeout`` is killed and fails, so a deadlocked collective can never hang the suite.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 120.0


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _worker(rank, world_size, backend, timeout_s, result_dir, fn, args):
    # Two cores on CI: ranks that each spin up all intra-op threads only fight each other.
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method="file://" + os.path.join(result_dir, "store"),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
    except (Exception, KeyboardInterrupt):
        raise  # no teardown: peers may be stuck in a collective; the parent kills them
    except BaseException as e:
        # pytest.fail/skip/exit raise BaseExceptions that spawn's wrapper would not report: turn them
        # into an Exception so that the parent sees the message and the traceback.
        raise RuntimeError(f"rank {rank}: {type(e).__name__}: {e}") from e
    torch.save(_to_cpu(result), os.path.join(result_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
    # Skip interpreter teardown: gloo worker threads still referenced through the ops' group
    # handles can abort ("terminate called without an active exception") while Python shuts down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _child_errors(ctx) -> str:
    """Every failed rank's traceback, oldest first: the first is usually the cause, later ones
    (a peer's "Connection closed by peer") the consequence."""
    found = []
    for rank, path in enumerate(ctx.error_files):
        if os.access(path, os.R_OK) and os.path.getsize(path) > 0:
            with open(path, "rb") as fh:
                found.append((os.path.getmtime(path), rank, pickle.load(fh)))
    return "".join(f"\n--- rank {rank} ---\n{trace}" for _, rank, trace in sorted(found))


def run_distributed(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). With ``backend="nccl"``
    rank r runs on ``cuda:r``; the test is skipped when fewer than ``world_size`` GPUs exist.
    """
    if backend == "nccl":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < world_size:
            pytest.skip(f"needs {world_size} CUDA GPUs for backend=nccl, found {have}")
    elif backend != "gloo":
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")

    with tempfile.TemporaryDirectory(prefix="spk_dist_") as result_dir:
        ctx = mp.start_processes(
            _worker,
            args=(world_size, backend, timeout, result_dir, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        failure = None
        try:
            # join() returns False while ranks are still running and raises as soon as one fails
            # (after killing the others, which may be stuck in a collective with the dead rank).
            while not ctx.join(timeout=max(0.0, deadline - time.monotonic()), grace_period=2.0):
                if time.monotonic() >= deadline:
                    alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                    failure = f"timed out after {timeout:.0f} s; ranks still running: {alive}"
                    break
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            failure = f"rank {e.error_index} failed first"
            if isinstance(e, mp.ProcessExitedException):  # no traceback: killed by a signal, or exit()
                failure += f" ({e})"
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
        if failure is not None:
            where = f"run_distributed({fn.__name__}, world_size={world_size}, backend={backend})"
            pytest.fail(f"{where}: {failure}{_child_errors(ctx)}", pytrace=False)
        results = []
        for r in range(world_size):
            path = os.path.join(result_dir, f"rank{r}.pt")
            if not os.path.exists(path):
                pytest.fail(
                    f"rank {r} of {world_size} exited 0 without finishing {fn.__name__}", pytrace=False
                )
            results.append(torch.load(path, map_location="cpu", weights_only=False))
        return results
