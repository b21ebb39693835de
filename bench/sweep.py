"""The sweep every rank of bench/collectives.py runs, and the report rank 0 writes at the end."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import (
    REPO,
    Bench,
    Progress,
    TimingConfig,
    copy_bandwidth,
    import_spkernels,
    machine_info,
    sets_for,
)

ALL_T = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ALL_D = (4096, 5120, 7168)
QUICK_SHAPES = [(T, 4096) for T in (8, 64, 4096, 8192)] + [(8192, 7168)]
CPU_SHAPES = [(2, 256), (8, 256)]
PROBE_BYTES = 128 << 20  # received per rank by the link probe: large enough for peak bandwidth
CROSSOVER_TABLE = REPO / "python" / "spkernels" / "sp_crossover.json"


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v.strip()]


def plan(args, world: int):
    """-> (shapes [(T, D)], tp sizes, modes [graph: bool], {suite: ops})."""
    import cases

    if args.T or args.D:
        shapes = [(T, D) for D in (_ints(args.D) or ALL_D) for T in (_ints(args.T) or ALL_T)]
    elif not args.cuda:
        shapes = CPU_SHAPES
    elif args.quick:
        shapes = QUICK_SHAPES
    else:
        shapes = [(T, D) for D in ALL_D for T in ALL_T]
    tps = [tp for tp in (_ints(args.tp) or [world] + ([2] if world > 2 else [])) if 1 < tp <= world]
    modes = [
        m == "graph" for m in args.modes.split(",") if m in ("eager", "graph") and (args.cuda or m == "eager")
    ]
    keep = {o for o in args.ops.split(",") if o}
    suites = ("local", "sp", "tp") if args.suite == "all" else (args.suite,)
    ops = {s: [o for o in cases.SUITE_OPS[s] if not keep or o in keep] for s in suites}
    return shapes, tps, modes, {s: o for s, o in ops.items() if o}


def worker(args) -> None:
    import cases

    spk = import_spkernels()
    t_start = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.cuda else torch.device("cpu")
    if args.cuda:  # the baselines may use TF32 for fn.x, as docs/contract.md allows the kernels
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, 64)
    cfg = TimingConfig() if args.cuda else TimingConfig(warmup=1, repeats=3, target_us=500.0, max_calls=4)
    if args.repeats:
        cfg.repeats = args.repeats
    shapes, tps, modes, suite_ops = plan(args, world)
    world_bench = Bench(None, device, cfg)
    floors = {"copy_GBps": copy_bandwidth(world_bench), "link_GBps": {}, "link_probe": {}}
    records: list[dict] = []
    n_shard = sum(1 for s in ("sp", "tp") if s in suite_ops)
    if rank == 0 and n_shard and not tps:
        print(f"sp/tp suites skipped: they need tp >= 2 ranks, this run has {world}", flush=True)
    progress = Progress(len(shapes) * (("local" in suite_ops) + n_shard * len(tps)), rank == 0)
    params = {}

    def run(suite, T, D, tp, bench, group=None, comm=None):
        if D not in params:
            params[D] = cases.make_params(D, device)
        _run_shape(args, suite, suite_ops[suite], T, D, tp, bench, group, comm, params[D], modes, records)
        progress.step(f"{suite} T={T} D={D} tp={tp}")
        if rank == 0:  # keep what is measured if the run is cut short
            _save(args, records, floors, time.time() - t_start)

    if args.cuda:  # compile each reference once per D, before anything is timed
        for D in sorted({D for _, D in shapes} & set(_ints(args.compile_D))):
            params[D] = cases.make_params(D, device)
            for op in sorted({o for ops in suite_ops.values() for o in ops} - {"sp_all_gather"}):
                if "all" in args.compile_ops.split(",") or op in args.compile_ops.split(","):
                    cases.prime_compiled(op, D, params[D], device, args.delayed)
        world_bench.sync()
    for T, D in shapes if "local" in suite_ops else ():
        run("local", T, D, 1, world_bench)
    for tp in tps if n_shard else ():
        group = None if tp == world else dist.new_group(list(range(tp)))  # every rank joins new_group
        if rank < tp:
            bench = Bench(group, device, cfg)
            for k, D in enumerate(sorted({D for _, D in shapes}, reverse=True)):
                Ts = sorted(T for T, d in shapes if d == D)
                probe_T = _probe_tokens(tp, D) if k == 0 and args.cuda else 0
                comm = spk.Communicator(group, max_tokens=max(Ts + [probe_T, tp]), hidden_size=D)
                try:
                    if k == 0:
                        _probe_link(bench, comm, tp, D, probe_T or max(Ts + [tp]), device, floors)
                    for T in Ts:
                        for suite in ("sp", "tp"):
                            if suite not in suite_ops:
                                continue
                            if suite == "sp" and T % tp:
                                progress.step(f"sp T={T} skipped (not a multiple of tp={tp})")
                                continue
                            run(suite, T, D, tp, bench, group, comm)
                finally:
                    comm.close()
        world_bench.sync()
    progress.close()
    if rank == 0:
        _finish(args, records, floors, time.time() - t_start)
    world_bench.sync()  # leave together: a rank tearing down early can abort one still reporting


def _probe_tokens(tp: int, D: int) -> int:
    T = math.ceil(PROBE_BYTES * tp / ((tp - 1) * D * 2))
    return -(-T // tp) * tp


def _probe_link(bench: Bench, comm, tp: int, D: int, T: int, device, floors: dict) -> None:
    """Peak link bandwidth: bytes received per rank / time of an all-gather of [T, D] bf16, by the LSA
    all-gather kernel alone (pull) and its push twin (``_lsa_link_probe``, when the backend is lsa
    and the build has it: SPK_BENCH_PROBES=1),
    by ``sp_all_gather`` (that kernel after two local staging copies) and by torch.distributed's
    all-gather."""
    x_local = torch.randn((T // tp, D), device=device).to(torch.bfloat16)
    variants = {}
    if comm.backend == "lsa":
        # The probe is built only with SPK_BENCH_PROBES=1 (tools/gpu_check.sh sets it).
        if hasattr(torch.ops.spkernels, "_lsa_link_probe"):
            probe, block = torch.ops.spkernels._lsa_link_probe, T // tp * D * 2
            variants["lsa_pull"] = lambda i: probe(comm.handle, block, False)
            variants["lsa_push"] = lambda i: probe(comm.handle, block, True)
        variants["sp_all_gather(lsa)"] = lambda i: torch.ops.spkernels.sp_all_gather(x_local, T, comm.handle)
    full = x_local.new_empty((T, D))
    name = f"all_gather_into_tensor({dist.get_backend(comm.group)})"
    variants[name] = lambda i: dist.all_gather_into_tensor(full, x_local, group=comm.group)
    times, errors = bench.measure(variants, 1, graph=False)
    received = (tp - 1) / tp * T * D * 2
    bws = {k: received / t / 1e3 for k, t in times.items()}
    # Peak = the fastest probe (a plain push beats a pull on the H200 pair): a floor must never be
    # set by the slower of two ways to move bytes.
    pick = max(bws, key=bws.get, default=None)
    floors["link_GBps"][str(tp)] = bws.get(pick)
    floors["link_probe"][str(tp)] = {"used": pick, "T": T, "D": D, "GBps": bws, "errors": errors}


def _run_shape(args, suite, ops, T, D, tp, bench, group, comm, params, modes, records) -> None:
    import cases

    nsets = sets_for(cases.set_bytes(suite, T, D, tp))
    rank = dist.get_rank(group)
    inputs = cases.make_inputs(suite, T, D, tp, rank, nsets, params, bench.device, args.delayed)
    ctx = cases.Ctx(suite, T, D, tp, inputs, params, group, comm)
    compile_T, compile_ops = _ints(args.compile_T), args.compile_ops.split(",")
    for op in ops:
        ctx.with_compile = (
            args.cuda
            and D in _ints(args.compile_D)
            and (not compile_T or T in compile_T)
            and ("all" in compile_ops or op in compile_ops)
        )
        ctx.with_eager_ref = not args.cuda or D in _ints(args.ref_D)
        wrong, errors = _check(op, ctx, bench)
        timed = {k: v for k, v in cases.variants(op, ctx).items() if k not in wrong and k not in errors}
        for graph in modes:
            if comm is not None:
                cases.prepare(op, ctx)
            times, timing_errors = bench.measure(timed, nsets, graph)
            for name in cases.variants(op, ctx):
                err = errors.get(name) or timing_errors.get(name)
                if name in wrong:
                    err = f"{wrong[name]} elements off the reference path: not timed"
                records.append(
                    {
                        "op": op,
                        "variant": name,
                        "T": T,
                        "D": D,
                        "tp": tp,
                        "graph": graph,
                        "time_us": times.get(name),
                        "wrong": wrong.get(name, 0),
                        "error": err,
                    }
                )
    del ctx, inputs
    if bench.cuda:
        torch.cuda.empty_cache()


def _check(op, ctx, bench: Bench):
    """Run every variant once on set 0 against the eager reference path; agree across ranks.
    -> ({variant: #wrong > 0}, {variant: error})."""
    import cases

    guard = cases.variants(op, ctx, guard=True)
    ref_name = cases.reference_variant(op, ctx.suite)
    names = [n for n in guard if n != ref_name]
    counts, failed, msgs = [], [], {}
    try:
        if ctx.comm is not None:
            cases.prepare(op, ctx)
        expected = guard[ref_name](0)
    except Exception as e:  # noqa: BLE001 - the reference itself failed: nothing can be checked
        expected, msgs[ref_name] = None, f"{type(e).__name__}: {e}"[:300]
    for n in names:
        try:
            if expected is None:
                raise RuntimeError("the reference path failed")
            counts.append(float(cases.count_wrong(guard[n](0), expected)))
            failed.append(0.0)
        except Exception as e:  # noqa: BLE001 - recorded in the row, the variant is not timed
            counts.append(0.0)
            failed.append(1.0)
            msgs[n] = f"{type(e).__name__}: {e}"[:300]
    counts = bench.reduce(counts, op=dist.ReduceOp.SUM) if names else []
    failed = bench.reduce(failed) if names else []
    wrong = {n: int(c) for n, c in zip(names, counts, strict=True) if c > 0}
    errors = {n: msgs.get(n, "failed on another rank") for n, f in zip(names, failed, strict=True) if f}
    return wrong, errors


def _save(args, records: list[dict], floors: dict, elapsed: float, done: bool = False):
    """Write <name>.json from the records so far; -> (rows, crossover)."""
    import report

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = report.make_rows(records, floors)
    cross = report.crossover(rows)
    scalar = str | int | float | bool | type(None)
    # The run's options, less the output folder (a path on the machine that ran it).
    config = {k: v for k, v in vars(args).items() if k != "out" and isinstance(v, scalar)}
    config.update(elapsed_s=round(elapsed, 1), complete=done)
    if not hasattr(args, "machine"):
        args.machine = machine_info(args.commit)
    report.write_json(out / f"{args.name}.json", args.machine, floors, config, rows, cross)
    return rows, cross


def _finish(args, records: list[dict], floors: dict, elapsed: float) -> None:
    import report

    out = Path(args.out)
    rows, cross = _save(args, records, floors, elapsed, done=True)
    # The table with its machine line: a results file names what it ran on, the .txt included.
    (out / f"{args.name}.txt").write_text(
        f"# {report.machine_line(args.machine)}\n{report.format_table(rows)}\n"
    )
    if args.write_crossover:
        _write_crossover_table(cross)
    plotted = report.plot(out / f"{args.name}.png", rows)
    shown = rows if args.print_rows == "all" else report.key_rows(rows)
    links = ", ".join(
        f"tp={tp}: {bw:.0f} GB/s" if bw else f"tp={tp}: -" for tp, bw in floors["link_GBps"].items()
    )
    print(
        f"\ncopy {floors['copy_GBps']:.0f} GB/s (read+write); link {links or '-'}; {elapsed:.0f} s; "
        f"{len(rows)} rows -> {out}/{args.name}.json{'' if plotted else ' (no matplotlib: no plot)'}"
    )
    print(f"crossover (SP boundary beats TP from T): {json.dumps(cross)}\n")
    print(report.format_table(shown))
    print("\nTargets (worst value over the shapes each covers):")
    print(report.format_targets(report.targets(rows)), flush=True)


def crossover_from_results(path: Path) -> dict:
    """Recompute the crossover from a results JSON's rows and merge it into the SPPolicy table."""
    import report

    cross = report.crossover(json.loads(path.read_text())["rows"])
    _write_crossover_table(cross)
    return cross


def _write_crossover_table(cross: dict) -> None:
    """Merge into the table SPPolicy(sp_threshold="auto") reads; a (tp, D) where SP never won in the
    sweep is removed, so the policy falls back to its default there."""
    table = json.loads(CROSSOVER_TABLE.read_text()) if CROSSOVER_TABLE.exists() else {}
    for tp, per_d in cross.items():
        for D, T in per_d.items():
            if T is None:
                table.get(tp, {}).pop(D, None)
            else:
                table.setdefault(tp, {})[D] = T
    table = {tp: dict(sorted(v.items(), key=lambda kv: int(kv[0]))) for tp, v in sorted(table.items()) if v}
    CROSSOVER_TABLE.write_text(json.dumps(table, indent=1) + "\n")
