"""Calls every spkernels CUDA kernel at small sizes: the workload that tools/sanitize.sh runs under
compute-sanitizer (memcheck, racecheck, synccheck).

    python tools/sanitize_ops.py --mode local   # mhc_pre, mhc_post, mhc_post_pre, mhc_head on cuda:0
    python tools/sanitize_ops.py --mode comm    # every comm op, 2 processes (torch.multiprocessing)

Sizes cover every instantiation of the two passes (pre / post / post+pre / head; local, peer and
gathering variants; narrow and full column slices) and both fn paths of pass 1: T below one tile,
one tile per CTA (fn fragments straight from global memory), and more tiles than CTAs per slice
(the persistent loop over fn staged in shared memory, where a missing barrier would be a race).
The comm ops run on both backends (lsa: the fused kernels
and the LSA all-gather; nccl: NCCL collectives + local kernels), with a partial passed as a plain
tensor and through comm.partial_buffer. Ends with "SANITIZE_OPS DONE" only if every call returned.
Children exit through the normal interpreter teardown, so the sanitizer sees every process end.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

bf16, f32 = torch.bfloat16, torch.float32
EPS = (1e-6, 1e-6, 1e-6, 20, 2.0)
# (T, D): T = 1 (one partial tile), 37 (three tiles), 600 and 4099 (more tiles than CTAs per slice);
# D from one column group per warp to the 8192 limit.
LOCAL_SIZES = [(1, 64), (37, 64), (4099, 64), (3, 1032), (37, 4096), (600, 4096), (5, 7168), (33, 8192)]
# (T_local, D) per rank, tp = 2.
COMM_SIZES = [(1, 64), (40, 64), (600, 64), (3, 4096), (100, 4096)]


def inputs(T: int, D: int, device, seed: int, norm: bool, delayed: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    m = 24
    t = {
        "stream": rnd(T, 4, D).to(bf16),
        "y": rnd(T, D).to(bf16),
        "post_mix": 2 * torch.sigmoid(rnd(T, 4)),
        "res_mix": torch.softmax(rnd(T, 4, 4), dim=-1),
        "fn": rnd(m, 4 * D) / math.sqrt(4 * D),
        "scale": torch.rand(3, generator=g) + 0.5,
        "base": 0.5 * rnd(m),
        "norm_weight": (1 + 0.2 * rnd(D)).to(bf16) if norm else None,
        "pre_mix_in": torch.sigmoid(rnd(T, 4)) if delayed else None,
        "head_fn": rnd(4, 4 * D) / math.sqrt(4 * D),
        "head_scale": torch.rand(1, generator=g) + 0.5,
        "head_base": rnd(4),
    }
    return {k: (v.to(device) if v is not None else None) for k, v in t.items()}


def site(t: dict) -> tuple:
    return t["fn"], t["scale"], t["base"], t["norm_weight"], t["pre_mix_in"]


def run_local() -> int:
    ops = torch.ops.spkernels
    device = torch.device("cuda", 0)
    calls = 0
    for i, (T, D) in enumerate(LOCAL_SIZES):
        t = inputs(T, D, device, seed=i, norm=i % 2 == 0, delayed=i % 3 == 0)
        ops.mhc_pre(t["stream"], *site(t), *EPS)
        ops.mhc_post(t["y"], t["stream"], t["post_mix"], t["res_mix"])
        ops.mhc_post_pre(t["y"], t["stream"], t["post_mix"], t["res_mix"], *site(t), *EPS)
        ops.mhc_head(t["stream"], t["head_fn"], t["head_scale"], t["head_base"])
        calls += 4
    torch.cuda.synchronize()
    return calls


def staged(comm, partial: torch.Tensor, zero_copy: bool) -> torch.Tensor:
    """The partial as a plain tensor (the op stages it) or written into the symmetric window first."""
    if not zero_copy:
        return partial
    buf = comm.partial_buffer(partial.shape[0])
    buf.copy_(partial)
    return buf


def comm_calls(comm, T_local: int, D: int, seed: int) -> int:
    """Every comm op once at this size (same calls in the same order on every rank)."""
    ops = torch.ops.spkernels
    rank, tp = comm.rank, comm.tp_size
    device = torch.device("cuda", torch.cuda.current_device())
    T = T_local * tp
    full = inputs(T, D, device, seed=seed, norm=seed % 2 == 0, delayed=seed % 3 == 0)
    mine = slice(rank * T_local, (rank + 1) * T_local)
    per_token = ("stream", "y", "post_mix", "res_mix", "pre_mix_in")
    shard = {k: (v[mine].contiguous() if k in per_token and v is not None else v) for k, v in full.items()}
    partial = torch.randn(T, D, device=device).to(bf16)
    h = comm.handle
    sp_post = (shard["stream"], shard["post_mix"], shard["res_mix"])
    tp_post = (full["stream"], full["post_mix"], full["res_mix"])
    for zero_copy in (False, True):
        ops.mhc_post_rs(staged(comm, partial, zero_copy), *sp_post, h)
        ops.mhc_post_pre_rs_ag(staged(comm, partial, zero_copy), *sp_post, *site(shard), *EPS, h)
        ops.mhc_post_ar(staged(comm, partial, zero_copy), *tp_post, h)
        ops.mhc_post_pre_ar(staged(comm, partial, zero_copy), *tp_post, *site(full), *EPS, h)
    ops.mhc_pre_ag(shard["stream"], *site(shard), *EPS, h)
    ops.sp_all_gather(shard["y"], T, h)  # fits the symmetric gather region: the LSA gather kernel
    ops.sp_all_gather(shard["post_mix"], T - 1, h)  # fp32, trimmed
    ops.sp_all_gather(shard["stream"], T, h)  # 4x larger: NCCL's all-gather once above the region
    ops.sp_shard(full["stream"], h)
    torch.cuda.synchronize()
    return 13


def comm_worker(rank: int, world_size: int, store: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=600),
        device_id=torch.device("cuda", rank),
    )
    import spkernels

    calls = 0
    for fused in ("1", "0"):
        os.environ["SPK_FUSED"] = fused
        for D in sorted({d for _, d in COMM_SIZES}):
            max_tokens = world_size * max(t for t, d in COMM_SIZES if d == D)
            with spkernels.Communicator(max_tokens=max_tokens, hidden_size=D) as comm:
                for i, (T_local, d) in enumerate(COMM_SIZES):
                    if d == D:
                        calls += comm_calls(comm, T_local, D, seed=i)
                print(f"rank {rank}: backend {comm.backend} D={D} done", flush=True)
    dist.destroy_process_group()
    print(f"rank {rank}: {calls} comm calls", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["local", "comm"], required=True)
    p.add_argument("--nprocs", type=int, default=2, help="comm mode: processes, one GPU each")
    args = p.parse_args()
    if args.mode == "local":
        import spkernels  # noqa: F401

        calls = run_local()
        print(f"SANITIZE_OPS DONE mode=local calls={calls}", flush=True)
        return
    if torch.cuda.device_count() < args.nprocs:
        sys.exit(f"comm mode needs {args.nprocs} GPUs, found {torch.cuda.device_count()}")
    # join=True raises if a rank fails, so DONE is printed only when every rank finished.
    with tempfile.TemporaryDirectory() as tmp:  # the ranks meet through a file: no TCP port to race for
        store = os.path.join(tmp, "store")
        mp.start_processes(comm_worker, args=(args.nprocs, store), nprocs=args.nprocs, start_method="spawn")
    print(f"SANITIZE_OPS DONE mode=comm nprocs={args.nprocs}", flush=True)


if __name__ == "__main__":
    main()
