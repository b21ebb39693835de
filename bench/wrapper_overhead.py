"""Eager host cost per call of spkernels' typed functions against the torch.ops call they make.

Each case calls one function and its op on the same inputs, ``--calls`` times in a loop, ``--repeats``
times each (interleaved, so drift hits both alike), and reports the median loop time per call and
the difference: what the function adds on the host (target <= 2 us). Inputs are small (T = 1) so
the kernels finish long before the host issues the next call: the host is the bottleneck being
measured, not the GPU. ``--comm`` adds the TP/SP boundaries on a one-rank NCCL group.

    python bench/wrapper_overhead.py                  # one GPU
    python bench/wrapper_overhead.py --device cpu     # a smoke run without a GPU (CPU kernels)

Prints a table and writes bench/results/wrapper_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch
import torch.distributed as dist
from common import REPO, host_loop_us, import_spkernels, machine_info


def measure(cases: dict, calls: int, repeats: int, sync) -> list[dict]:
    rows = []
    for name, (wrapper, direct) in cases.items():
        for f in (wrapper, direct):  # warm-up
            host_loop_us(f, max(calls // 10, 10), sync)
        w_us, d_us = [], []
        for i in range(repeats):  # alternate which goes first, so neither always follows the other
            order = ((wrapper, w_us), (direct, d_us)) if i % 2 == 0 else ((direct, d_us), (wrapper, w_us))
            for f, times in order:
                times.append(host_loop_us(f, calls, sync))
        # the median of the paired differences: drift between repeats cancels within each pair
        overhead = statistics.median(w - d for w, d in zip(w_us, d_us, strict=True))
        w, d = statistics.median(w_us), statistics.median(d_us)
        rows.append({"case": name, "wrapper_us": w, "torch_ops_us": d, "overhead_us": overhead})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--hidden-size", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--comm", action="store_true", help="also the TP/SP boundaries (one-rank group)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "wrapper_overhead.json"))
    args = p.parse_args()

    spk = import_spkernels()
    ops = torch.ops.spkernels
    dev, T, D = torch.device(args.device), args.tokens, args.hidden_size
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype).to(dev)

    stream, y = randn(T, 4, D, dtype=torch.bfloat16), randn(T, D, dtype=torch.bfloat16)
    post_mix, res_mix, pre_mix = randn(T, 4).sigmoid(), randn(T, 4, 4).softmax(-1), randn(T, 4).sigmoid()
    site = spk.MhcParams(
        randn(24, 4 * D) / (4 * D) ** 0.5, randn(3), randn(24), randn(D, dtype=torch.bfloat16)
    )
    mixes = spk.Mixes(post_mix, res_mix, pre_mix)
    eps = (site.rms_eps, site.hc_eps, site.norm_eps, site.sinkhorn_iters, site.post_alpha)
    pre_args = (site.fn, site.scale, site.base, site.norm_weight, pre_mix, *eps)
    cases = {
        "mhc_pre": (
            lambda: spk.mhc_pre(stream, site, pre_mix_in=pre_mix),
            lambda: ops.mhc_pre(stream, *pre_args),
        ),
        "mhc_post": (
            lambda: spk.mhc_post(y, stream, mixes),
            lambda: ops.mhc_post(y, stream, post_mix, res_mix),
        ),
        "mhc_post_pre": (
            lambda: spk.mhc_post_pre(y, stream, mixes, site, pre_mix_in=pre_mix),
            lambda: ops.mhc_post_pre(y, stream, post_mix, res_mix, *pre_args),
        ),
    }
    comm = None
    if args.comm:
        store = tempfile.NamedTemporaryFile(delete=False).name
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"file://{store}",
                                rank=0, world_size=1)  # fmt: skip
        comm = spk.Communicator(max_tokens=max(T, 8), hidden_size=D)
        h = comm.handle
        cases["tp_boundary"] = (
            lambda: spk.tp_boundary(y, stream, mixes, site, comm, pre_mix_in=pre_mix),
            lambda: ops.mhc_post_pre_ar(y, stream, post_mix, res_mix, *pre_args, h),
        )
        cases["sp_boundary"] = (
            lambda: spk.sp_boundary(y, stream, mixes, site, comm, pre_mix_in=pre_mix),
            lambda: ops.mhc_post_pre_rs_ag(y, stream, post_mix, res_mix, *pre_args, h),
        )
    rows = measure(cases, args.calls, args.repeats, sync)
    if comm is not None:
        comm.close()
        dist.destroy_process_group()

    print(f"{'case':<14} {'function us':>12} {'torch.ops us':>13} {'overhead us':>12}")
    for r in rows:
        print(
            f"{r['case']:<14} {r['wrapper_us']:>12.2f} {r['torch_ops_us']:>13.2f} {r['overhead_us']:>12.2f}"
        )
    result = {
        "machine": machine_info(),
        "config": {"device": str(dev), "T": T, "D": D, "calls": args.calls, "repeats": args.repeats},
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
