"""Where a fused boundary's time goes: each of its kernels' duration and the gaps between them, per
rank (torch.profiler / CUPTI; eager calls, back to back, the partial written in place beforehand).

On the GPU machine (one process per GPU, spawned here):
  python3 tools/profile_sp.py --T 8,8192 --ops mhc_post_pre_rs_ag,mhc_post_pre_ar
Without GPUs it runs the CPU ops on gloo and times the op calls instead (a smoke run).
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
from statistics import median

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.autograd import DeviceType

OPS = ("mhc_post_pre_rs_ag", "mhc_post_pre_ar")
EPS = (1e-6, 1e-6, 1e-6, 20, 2.0)


def timeline(events, device: str) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of the kernels (cuda) or spkernels op calls (cpu), by start."""
    if device == "cuda":
        picked = [e for e in events if e.device_type == DeviceType.CUDA]
    else:
        picked = [e for e in events if e.name.startswith("spkernels::")]
    return sorted(((e.name, e.time_range.start, e.time_range.end) for e in picked), key=lambda span: span[1])


def summarize(spans: list[tuple[str, float, float]], calls: int) -> list[str]:
    """Per kernel position within a call: median duration and the gap before the next; per call:
    the median span from the first kernel's start to the last one's end."""
    if not spans or len(spans) % calls:
        return [f"  {len(spans)} events for {calls} calls: cannot split them into calls"]
    k = len(spans) // calls
    per_call = [spans[i * k : (i + 1) * k] for i in range(calls)]
    lines = []
    for j in range(k):
        name = per_call[0][j][0]
        dur = median(c[j][2] - c[j][1] for c in per_call)
        gap = median(c[j + 1][1] - c[j][2] for c in per_call) if j + 1 < k else None
        short = name.split("(")[0].replace("void ", "")[:90]
        lines.append(f"  {dur:9.1f} us  {short}" + (f"   (then {gap:.1f} us gap)" if gap is not None else ""))
    span = median(c[-1][2] - c[0][1] for c in per_call)
    lines.append(f"  {span:9.1f} us  span of a call ({k} kernels)")
    return lines


def worker(rank: int, world: int, store: str, args) -> None:
    import spkernels
    from spkernels.runner.launch import exit_without_teardown

    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world
    )
    ops = torch.ops.spkernels
    Ts = [int(t) for t in args.T.split(",")]
    D = args.D
    comm = spkernels.Communicator(max_tokens=max(Ts), hidden_size=D)
    try:
        gen = torch.Generator().manual_seed(1234)
        fn = (torch.randn(24, 4 * D, generator=gen) / (2 * D) ** 0.5).to(device)
        scale, base = (
            torch.tensor([1.0, 1.0, 2.0]).to(device),
            (0.5 * torch.randn(24, generator=gen)).to(device),
        )
        norm_weight = torch.ones(D, dtype=torch.bfloat16, device=device)
        for op in args.ops.split(","):
            if op not in OPS:
                raise SystemExit(f"--ops: {op!r} is not one of {OPS}")
            for T in Ts:
                sp = op == "mhc_post_pre_rs_ag"
                if sp and T % world:
                    continue  # SP batches are padded to a multiple of tp first
                rows = T // world if sp else T
                stream = torch.randn(rows, 4, D, generator=gen).to(torch.bfloat16).to(device)
                post, res = (
                    torch.rand(rows, 4, generator=gen).to(device),
                    torch.rand(rows, 4, 4, generator=gen).to(device),
                )
                partial = comm.partial_buffer(T)
                partial.copy_(torch.randn(T, D, generator=gen).to(torch.bfloat16))
                args_ = (partial, stream, post, res, fn, scale, base, norm_weight, None, *EPS, comm.handle)
                call = functools.partial(getattr(ops, op), *args_)
                for _ in range(3):
                    call()
                if cuda:
                    torch.cuda.synchronize()
                dist.barrier()
                activities = [torch.profiler.ProfilerActivity.CPU]
                if cuda:
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                with torch.profiler.profile(activities=activities) as prof:
                    for _ in range(args.calls):
                        call()
                    if cuda:
                        torch.cuda.synchronize()
                lines = summarize(timeline(prof.events(), device.type), args.calls)
                text = "\n".join([f"rank {rank}: {op} T={T} D={D} tp={world}", *lines])
                every = [None] * world
                dist.all_gather_object(every, text)
                if rank == 0:
                    print("\n".join(every), flush=True)
    finally:
        comm.close()
        dist.destroy_process_group()
    exit_without_teardown(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", default="8,8192", help="comma-separated token counts (the whole batch)")
    p.add_argument("--D", type=int, default=4096)
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--calls", type=int, default=10, help="profiled calls per shape")
    p.add_argument("--cpu", action="store_true", help="gloo and the CPU ops even when GPUs exist")
    args = p.parse_args()
    world = 2 if args.cpu or not torch.cuda.is_available() else torch.cuda.device_count()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:  # the ranks meet through a file: no TCP port to race for
        mp.spawn(worker, args=(world, os.path.join(tmp, "store"), args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
