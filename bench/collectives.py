"""spkernels microbenchmarks: each op against what a user would otherwise run, and against the machine.

    python bench/collectives.py [--quick] [--suite all|local|sp|tp] [--delayed] [--out DIR]
                                [--write-crossover]

With N GPUs it spawns one process per GPU (or runs under torchrun) and sweeps tp = N (and 2 when
N > 2); without GPUs (or with --cpu) it runs a small CPU/gloo smoke sweep on 2 processes. Ops and
variants: bench/cases.py. Timing: bench/common.py (warm-up, events or graph replays,
median, max over ranks, A/B interleaving, inputs rotated over >= 2x L2). Outputs, under --out
(default bench/results): <name>.json (machine, rows as in docs/performance.md, floors, config and crossover),
<name>.txt (every row), <name>.png (latency and speedup vs T). --delayed: V4.1 delayed mode, every
pre and its baselines collapse with a carried-in pre_mix_in (name suffix _delayed; the floors
leave out its 16 bytes per token).

Floors. At start: copy_bw = a 1 GiB device copy, bytes read + written / time; link_bw = bytes
received per rank / time of an all-gather at >= 128 MiB received per rank, the fastest of the LSA
all-gather kernel alone and its push twin (``_lsa_link_probe``, when the backend is lsa and the
build has it: SPK_BENCH_PROBES=1),
``sp_all_gather`` and NCCL's all_gather_into_tensor.
Per op, with E = 2 bytes (bf16), n = tp, hc = 4, R = D*E (one row), F = 24*4D*4 (fn, fp32), mixes
80 B read (post+res) and 96 B written (post+res+pre) per token, each input read once and each
output written once:

  op                  NVLink bytes per rank per direction   HBM bytes per rank
  mhc_pre             0                                     T*(4R + R + 96) + F
  mhc_post            0                                     T*(R + 8R + 80)
  mhc_post_pre        0                                     T*(R + 8R + R + 176) + F
  mhc_head            0                                     T*(4R + R) + 4*4D*4
  mhc_post_rs         (n-1)/n * T*R                         T*R + T/n*(8R + 80)
  mhc_pre_ag          (n-1)/n * T*R                         T/n*(4R + 96) + T*R + F
  mhc_post_pre_rs_ag  2*(n-1)/n * T*R                       2*T*R + T/n*(8R + 176) + F
  sp_all_gather       (n-1)/n * T*R                         T/n*R + T*R
  mhc_post_ar         2*(n-1)/n * T*R                       T*R + T*(8R + 80)
  mhc_post_pre_ar     2*(n-1)/n * T*R                       T*R + T*(8R + R + 176) + F

(the partial [T, D] is read once in all, part locally and part by peers; the all-reduce counts the
bandwidth-optimal reduce-scatter + all-gather, as nccl-tests' busbw does; at n = 2 a one-shot pull
moves the same bytes). floor_us = max(NVLink bytes / link_bw, HBM bytes / copy_bw);
frac_of_floor = floor_us / time_us; hbm_GBps = HBM bytes / time_us, the HBM bandwidth the op
achieved (for a local op frac_of_floor = hbm_GBps / the run's copy bandwidth); speedup =
baseline_us / time_us. Baseline rows carry the op's floor. ``wrong`` counts output elements off
the reference path (cases.count_wrong); a variant with wrong > 0 is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import cases
import torch
from common import REPO, launch

# torch.compile baselines. The default sweep has one beside every op (the four compiled references
# are shared: a fused op's baseline is NCCL + its local op's compiled reference); the quick subset
# keeps to the ops of the README table (it has to stay near 2 minutes).
QUICK_COMPILE_OPS = ("mhc_post_pre_rs_ag", "mhc_post_pre_ar", "mhc_post_pre")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="T in {8, 64, 4096, 8192} at D=4096, + (8192, 7168)")
    p.add_argument("--suite", default="all", choices=("all", "local", "sp", "tp"))
    p.add_argument(
        "--ops", default="", help="comma-separated op names to keep (default: every op of the suite)"
    )
    p.add_argument("--T", default="", help="comma-separated token counts (overrides the sweep)")
    p.add_argument("--D", default="", help="comma-separated hidden sizes (overrides the sweep)")
    p.add_argument("--tp", default="", help="comma-separated tp sizes (default: GPU count, and 2 if more)")
    p.add_argument("--modes", default="eager,graph", help="eager and/or graph (graph needs CUDA)")
    p.add_argument(
        "--delayed",
        action="store_true",
        help="V4.1 delayed mode: every pre (and its baselines) collapses with a carried-in pre_mix_in",
    )
    p.add_argument("--compile-D", default="4096", help="D values with torch.compile baselines ('' = none)")
    p.add_argument("--compile-T", default="", help="T values with torch.compile baselines (default: all)")
    p.add_argument(
        "--compile-ops",
        default=None,
        help="ops with torch.compile baselines ('all' = every op, the default; --quick: the boundaries and "
        "mhc_post_pre)",
    )
    p.add_argument("--ref-D", default="4096", help="D values with timed eager-reference baselines")
    p.add_argument("--repeats", type=int, default=None, help="timed chunks per variant (median kept)")
    p.add_argument("--cpu", action="store_true", help="CPU/gloo smoke sweep even when GPUs exist")
    p.add_argument("--nprocs", type=int, default=None, help="processes (default: GPU count; 2 on CPU)")
    p.add_argument("--out", default=str(REPO / "bench" / "results"), help="output directory")
    p.add_argument("--name", default=None, help="output file stem (default from the mode)")
    p.add_argument(
        "--commit",
        default=None,
        help="commit to record (default: SPK_COMMIT, else git HEAD, -dirty if modified)",
    )
    p.add_argument(
        "--print",
        dest="print_rows",
        default="key",
        choices=("key", "all"),
        help="key: graph rows vs the strongest baseline; all: every row",
    )
    p.add_argument(
        "--write-crossover",
        action="store_true",
        help="also write python/spkernels/sp_crossover.json ({tp: {D: T}}, read by SPPolicy)",
    )
    p.add_argument("--crossover-from", default=None, metavar="JSON",
                   help="run nothing: write sp_crossover.json from a results JSON")  # fmt: skip
    args = p.parse_args(argv)
    for flag in ("T", "D", "tp", "compile_D", "compile_T", "ref_D"):  # comma lists of positive ints
        text = getattr(args, flag)
        if any(not v.strip().isdigit() or int(v) < 1 for v in text.split(",") if text):
            p.error(f"--{flag.replace('_', '-')} must be comma-separated positive ints, got {text!r}")
    if not set(args.modes.split(",")) <= {"eager", "graph"}:
        p.error(f"--modes must be eager and/or graph, got {args.modes!r}")
    known = set(cases.LOCAL_OPS + cases.SP_OPS + cases.TP_OPS)
    if unknown := {o for o in args.ops.split(",") if o} - known:
        p.error(f"--ops: unknown ops {sorted(unknown)}; choose from {sorted(known)}")
    for flag in ("repeats", "nprocs"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.compile_ops is None:  # each compiled reference costs ~2 compilations (automatic dynamic T)
        args.compile_ops = ",".join(QUICK_COMPILE_OPS) if args.quick else "all"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.crossover_from:
        from sweep import crossover_from_results

        print(json.dumps(crossover_from_results(Path(args.crossover_from))))
        return
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    args.cuda = ngpu > 0 and not args.cpu
    if not args.cuda:
        print("no CUDA GPUs (or --cpu): running the CPU/gloo smoke sweep on 2 processes", flush=True)
    nprocs = args.nprocs or (ngpu if args.cuda else 2)
    args.name = args.name or (
        "collectives_cpu" if not args.cuda else "collectives_quick" if args.quick else "collectives"
    ) + ("_delayed" if args.delayed else "")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    launch(run_worker, nprocs, "nccl" if args.cuda else "gloo", args)


def run_worker(args) -> None:
    from sweep import worker  # imported in the worker: it loads spkernels and the CUDA context

    worker(args)


if __name__ == "__main__":
    main()
