"""Load test: many back-to-back fused boundaries across GPUs, checked as they run.

    python bench/load.py [--calls 100000 | --quick] [--hidden-size 4096] [--max-tokens 2048]
                         [--check-every 1000] [--graph-frac 0.5] [--buckets 16,64,256] [--fused 1]

One process per GPU (torch.multiprocessing, nccl group, one spkernels.Communicator). Every call is a
whole boundary, drawn from a schedule that every rank derives from the same seed: the SP boundary
(mhc_post_pre_rs_ag on this rank's shard) or the TP boundary (mhc_post_pre_ar on the replicated
stream); eager, at a random padded T (a multiple of tp up to --max-tokens), or the replay of a CUDA
graph captured once per (boundary, bucket); inputs taken at a random row offset of large random
tensors (so every call sees fresh data); in eager calls, half the partials written into
comm.partial_buffer first. There is no host synchronisation between calls except at checks.

Every --check-every calls (and at the first and last), the call's outputs are checked:
  * against reference.py in fp64 after the explicit reduction of all ranks' partials (fp32 sum in
    rank order, rounded to bf16), with tests/'s tolerance helpers (conftest.assert_bf16_close,
    test_cuda_local.post_slack / expected_layer_input, MIX_ATOL): new_stream to 1 bf16 spacing,
    layer_input to 2, mixes to 1e-4 (the SP check gathers new_stream and pre_mix over NCCL);
  * bitwise against an eager call on the same inputs (graph replay == eager; eager is deterministic);
  * TP outputs bitwise identical on every rank.
A failed check counts as an error and the run goes on; an exception ends the run (a collective
cannot be resumed on one rank). "Drift" is the worst relative norm error of the bf16 outputs and
the worst absolute error of the mixes over all checks: it must not grow with the number of calls.

Memory: torch.cuda.memory_allocated() after the warm-up (graphs captured, one call of every kind
checked) and after the last call, with every transient reference dropped: it must not change
(> 1 MiB is reported as a leak). Device memory outside torch's allocator (NCCL) is reported too
(mem_get_info used - memory_reserved), flagged above 64 MiB of growth.

Prints one summary line ("LOAD ... -> OK" or "-> FAIL") and exits non-zero on any error, leak,
rank failure or --timeout. With --out, writes <out>/load.json (machine facts + the summary).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
EPS = (1e-6, 1e-6, 1e-6, 20, 2.0)
MIB = 1 << 20
LEAK_BYTES = 1 * MIB
OTHER_LEAK_BYTES = 64 * MIB
# torch >= 2.13 deprecates all_gather_into_tensor (the checks' gather); the GPU machine has 2.11.
warnings.filterwarnings("ignore", ".*all_gather_into_tensor.*", FutureWarning)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=100_000, help="boundaries per rank (default 100000)")
    p.add_argument("--quick", action="store_true", help="5000 calls")
    p.add_argument("--nprocs", type=int, default=2, help="processes, one GPU each (tp)")
    p.add_argument("--hidden-size", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=2048, help="communicator capacity = largest T")
    p.add_argument("--check-every", type=int, default=1000, help="check one call every K calls")
    p.add_argument("--graph-frac", type=float, default=0.5, help="fraction of calls replayed from graphs")
    p.add_argument(
        "--buckets", default="16,64,256", help="captured T buckets (rounded up to a multiple of tp)"
    )
    p.add_argument("--fused", choices=["1", "0"], default="1", help="SPK_FUSED: 1 = lsa backend, 0 = nccl")
    p.add_argument("--warmup", type=int, default=200, help="calls before memory is first measured")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=500.0, help="seconds before the ranks are killed")
    p.add_argument("--out", default=None, help="directory for load.json")
    args = p.parse_args(argv)
    if args.quick:
        args.calls = 5000
    tp = args.nprocs
    args.buckets = sorted({-(-int(b) // tp) * tp for b in args.buckets.split(",") if b.strip()})
    if args.max_tokens < tp or any(b > args.max_tokens for b in args.buckets):
        p.error(f"--max-tokens {args.max_tokens} must be >= tp and >= every bucket {args.buckets}")
    if args.calls < 1 or args.check_every < 1 or not 0.0 <= args.graph_frac <= 1.0:
        p.error("--calls and --check-every must be >= 1, --graph-frac in [0, 1]")
    return args


class Load:
    """One rank's state: inputs (identical on every rank except whose partial is whose), graphs, stats."""

    def __init__(self, args, comm, rank: int, tp: int):
        sys.path.insert(0, str(REPO / "tests"))
        import conftest
        import spkernels.reference as ref
        import test_cuda_local

        self.ref, self.conftest, self.tcl = ref, conftest, test_cuda_local
        self.args, self.comm, self.rank, self.tp = args, comm, rank, tp
        self.ops = torch.ops.spkernels
        D, cap = args.hidden_size, args.max_tokens
        g = torch.Generator(device="cuda").manual_seed(args.seed)
        rnd = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
        # Shared inputs: each token its own magnitude, so the RMS factor matters.
        self.stream = (rnd(cap, 4, D) * torch.exp(rnd(cap, 1, 1))).to(torch.bfloat16)
        self.post_mix = 2 * torch.sigmoid(rnd(cap, 4))
        self.res_mix = torch.softmax(2 * rnd(cap, 4, 4), dim=-1)
        self.partials = rnd(tp, cap, D).to(torch.bfloat16)  # every rank's partial, for the reference
        self.site = (
            rnd(24, 4 * D) / (4 * D) ** 0.5,  # fn
            0.5 + 2 * torch.rand(3, device="cuda", generator=g),  # scale
            0.5 * rnd(24),  # base
            (1 + 0.2 * rnd(D)).to(torch.bfloat16),  # norm_weight
            None,  # pre_mix_in
        )
        self.graphs: dict[tuple[str, int], tuple] = {}
        self.stats = {"ops": 0, "sp": 0, "tp": 0, "eager": 0, "graph": 0, "zero_copy": 0, "checks": 0}
        self.errors: list[str] = []
        self.drift = {"new_stream": 0.0, "layer_input": 0.0, "mixes": 0.0}

    # ------------------------------------------------------------------ inputs and calls
    def rows(self, kind: str, T: int, offset: int) -> slice:
        """The stream rows this rank passes: all T (TP) or its shard of them (SP)."""
        if kind == "tp":
            return slice(offset, offset + T)
        n = T // self.tp
        return slice(offset + self.rank * n, offset + (self.rank + 1) * n)

    def eager(self, kind: str, T: int, offset: int, zero_copy: bool):
        partial = self.partials[self.rank, offset : offset + T]
        if zero_copy:
            buf = self.comm.partial_buffer(T)
            buf.copy_(partial)
            partial = buf
        r = self.rows(kind, T, offset)
        op = self.ops.mhc_post_pre_rs_ag if kind == "sp" else self.ops.mhc_post_pre_ar
        return op(
            partial, self.stream[r], self.post_mix[r], self.res_mix[r], *self.site, *EPS, self.comm.handle
        )

    def capture(self, kind: str, T: int) -> None:
        """A graph of one boundary on static inputs of bucket T (filled before each replay)."""
        n = T if kind == "tp" else T // self.tp
        D = self.args.hidden_size
        static = (
            torch.zeros(T, D, dtype=torch.bfloat16, device="cuda"),
            torch.zeros(n, 4, D, dtype=torch.bfloat16, device="cuda"),
            torch.zeros(n, 4, device="cuda"),
            torch.zeros(n, 4, 4, device="cuda"),
        )
        op = self.ops.mhc_post_pre_rs_ag if kind == "sp" else self.ops.mhc_post_pre_ar
        run = lambda: op(*static, *self.site, *EPS, self.comm.handle)  # noqa: E731
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        self.graphs[(kind, T)] = (graph, static, out)

    def replay(self, kind: str, T: int, offset: int):
        graph, static, out = self.graphs[(kind, T)]
        r = self.rows(kind, T, offset)
        static[0].copy_(self.partials[self.rank, offset : offset + T])
        static[1].copy_(self.stream[r])
        static[2].copy_(self.post_mix[r])
        static[3].copy_(self.res_mix[r])
        graph.replay()
        return out

    def call(self, kind: str, graph: bool, T: int, offset: int, zero_copy: bool):
        s = self.stats
        s["ops"] += 1
        s[kind] += 1
        s["graph" if graph else "eager"] += 1
        s["zero_copy"] += zero_copy
        return self.replay(kind, T, offset) if graph else self.eager(kind, T, offset, zero_copy)

    # ------------------------------------------------------------------ checks
    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """All ranks' rows of t in rank order (NCCL, independent of the ops under test)."""
        out = torch.empty((self.tp * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t.contiguous())
        return out

    def rel(self, got: torch.Tensor, want: torch.Tensor) -> float:
        a, b = got.double(), want.double()
        return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()

    def check(self, i: int, kind: str, graph: bool, T: int, offset: int, out) -> None:
        """Collective (every rank checks the same call): reference, eager-vs-call, TP replicas."""
        ref, cf, tcl, f64 = self.ref, self.conftest, self.tcl, torch.float64
        self.stats["checks"] += 1
        where = f"call {i} ({kind}, {'graph' if graph else 'eager'}, T={T}, offset={offset})"
        out = tuple(o.clone() for o in out)  # a graph's outputs are overwritten by the eager call below
        again = self.eager(kind, T, offset, zero_copy=False)
        full = slice(offset, offset + T)
        stream, post_mix, res_mix = self.stream[full], self.post_mix[full], self.res_mix[full]
        y = ref.reduce_partials([self.partials[r, full] for r in range(self.tp)])
        want_new = ref.mhc_post(y, stream, post_mix, res_mix, compute_dtype=f64)
        slack = tcl.post_slack(y, stream, post_mix, res_mix)
        fn, scale, base, norm_weight, _ = self.site
        if kind == "sp":
            n = T // self.tp
            mine = slice(self.rank * n, (self.rank + 1) * n)
            new_full, pre_full = self.gather(out[0]), self.gather(out[4])
            want_new, slack = want_new[mine], slack[mine]
        else:
            mine = slice(0, T)
            new_full, pre_full = out[0], out[4]
            for t, name in ((out[0], "new_stream"), (out[1], "layer_input")):
                peers = self.gather(t)
                if not all(torch.equal(peers[r * T : (r + 1) * T], t) for r in range(self.tp)):
                    self.errors.append(f"{where}: TP {name} differs across ranks")
        # The next site's mixes from the (gathered) new stream the op produced, so that a legal
        # bf16 flip in the post counts once; layer_input with the op's own pre_mix.
        want_pre = ref.mhc_pre(new_full, fn, scale, base, norm_weight, None, *EPS, compute_dtype=f64)
        expected, li_slack = tcl.expected_layer_input(new_full, pre_full, None, norm_weight)
        try:
            names = ("new_stream", "layer_input", "post_mix", "res_mix", "pre_mix")
            for a, b, name in zip(out, again, names, strict=True):
                assert torch.equal(a, b), f"{name} differs from an eager call on the same inputs"
            cf.assert_bf16_close(out[0], want_new, "new_stream", slack=slack)
            cf.assert_bf16_close(out[1], expected, "layer_input", ulps=2, slack=li_slack)
            for k, name in ((2, "post_mix"), (3, "res_mix"), (4, "pre_mix")):
                cf.assert_mix_close(out[k], want_pre[k - 1][mine].float(), name, atol=tcl.MIX_ATOL)
        except AssertionError as e:
            self.errors.append(f"{where}: {str(e)[:400]}")
        d = self.drift
        d["new_stream"] = max(d["new_stream"], self.rel(out[0], want_new))
        d["layer_input"] = max(d["layer_input"], self.rel(out[1], expected))
        mix_err = max((out[k].double() - want_pre[k - 1][mine]).abs().max().item() for k in (2, 3, 4))
        d["mixes"] = max(d["mixes"], mix_err)

    # ------------------------------------------------------------------ the run
    def schedule(self, rng: random.Random):
        """(kind, graph, T, offset, zero_copy): the same sequence on every rank (same seed)."""
        a, tp, cap = self.args, self.tp, self.args.max_tokens
        kind = "sp" if rng.random() < 0.5 else "tp"
        graph = rng.random() < a.graph_frac
        T = rng.choice(a.buckets) if graph else tp * rng.randint(1, cap // tp)
        offset = rng.randint(0, cap - T)
        zero_copy = not graph and rng.random() < 0.5
        return kind, graph, T, offset, zero_copy

    def memory(self) -> dict:
        torch.cuda.synchronize()
        gc.collect()
        free, total = torch.cuda.mem_get_info()
        reserved = torch.cuda.memory_reserved()
        return {
            "allocated": torch.cuda.memory_allocated(),
            "reserved": reserved,
            "other": total - free - reserved,
        }


def worker(rank: int, tp: int, store: str, args, result_path: str) -> None:
    torch.cuda.set_device(rank)
    os.environ["SPK_FUSED"] = args.fused
    dist.init_process_group(
        "nccl",
        init_method=f"file://{store}",
        rank=rank,
        world_size=tp,
        timeout=datetime.timedelta(seconds=args.timeout),
        device_id=torch.device("cuda", rank),
    )
    sys.path.insert(0, str(REPO / "python"))
    import spkernels

    with spkernels.Communicator(max_tokens=args.max_tokens, hidden_size=args.hidden_size) as comm:
        load = Load(args, comm, rank, tp)
        for kind in ("sp", "tp"):
            for T in args.buckets:
                load.capture(kind, T)
        # Warm-up: every kind of call checked once, then random calls; none of it is counted.
        rng = random.Random(args.seed)
        for i, (kind, graph) in enumerate((k, g) for k in ("sp", "tp") for g in (False, True)):
            T = args.buckets[0]
            load.check(-1 - i, kind, graph, T, 0, load.call(kind, graph, T, 0, zero_copy=False))
        for _ in range(args.warmup):
            load.call(*load.schedule(rng))
        out = None
        load.stats = dict.fromkeys(load.stats, 0)
        before = load.memory()
        start = time.perf_counter()
        for i in range(args.calls):
            step = load.schedule(rng)
            out = load.call(*step)
            if i % args.check_every == 0 or i == args.calls - 1:
                load.check(i, step[0], step[1], step[2], step[3], out)
        out = None
        after = load.memory()
        seconds = time.perf_counter() - start
        backend = comm.backend
    result = {
        "rank": rank,
        "backend": backend,
        "stats": load.stats,
        "errors": load.errors,
        "drift": load.drift,
        "memory_before": before,
        "memory_after": after,
        "seconds": seconds,
    }
    results = [None] * tp
    dist.all_gather_object(results, result)
    if rank == 0:
        Path(result_path).write_text(json.dumps(results))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as bench/common.py: no interpreter teardown after the results are out


def summarize(args, results: list[dict]) -> tuple[str, bool, dict]:
    r0 = results[0]
    errors = [e for r in results for e in r["errors"]]
    drift = {k: max(r["drift"][k] for r in results) for k in r0["drift"]}
    grow = max(r["memory_after"]["allocated"] - r["memory_before"]["allocated"] for r in results)
    other = max(r["memory_after"]["other"] - r["memory_before"]["other"] for r in results)
    leak = grow > LEAK_BYTES or other > OTHER_LEAK_BYTES
    s = r0["stats"]
    ok = not errors and not leak and all(r["stats"]["ops"] == args.calls for r in results)
    mem = [
        f"{r['memory_before']['allocated'] / MIB:.1f} -> {r['memory_after']['allocated'] / MIB:.1f}"
        for r in results
    ]
    line = (
        f"LOAD tp={args.nprocs} D={args.hidden_size} max_tokens={args.max_tokens} backend={r0['backend']}: "
        f"ops {s['ops']} per rank (sp {s['sp']}, tp {s['tp']}; eager {s['eager']} of which zero-copy "
        f"{s['zero_copy']}, graph {s['graph']}), checks {s['checks']}, errors {len(errors)}, max drift: "
        f"new_stream {drift['new_stream']:.2e} rel, layer_input {drift['layer_input']:.2e} rel, "
        f"mixes {drift['mixes']:.2e} abs; memory_allocated MiB per rank {', '.join(mem)} "
        f"({'LEAK' if grow > LEAK_BYTES else 'flat'}, max growth {grow} B), non-torch device memory "
        f"growth {other / MIB:+.1f} MiB; {max(r['seconds'] for r in results):.1f} s"
        f" -> {'OK' if ok else 'FAIL'}"
    )
    summary = {"ok": ok, "line": line, "errors": errors[:50], "drift": drift, "ranks": results}
    return line, ok, summary


def main(argv=None) -> int:
    args = parse_args(argv)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < args.nprocs:
        print(f"LOAD skipped: needs {args.nprocs} CUDA GPUs, found {have}")
        return 2
    sys.path.insert(0, str(REPO / "bench"))
    from common import machine_info

    with tempfile.TemporaryDirectory(prefix="spk_load_") as tmp:
        result_path = os.path.join(tmp, "results.json")
        ctx = mp.start_processes(
            worker,
            args=(args.nprocs, os.path.join(tmp, "store"), args, result_path),
            nprocs=args.nprocs,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + args.timeout
        failure = None
        try:
            while not ctx.join(timeout=max(0.0, deadline - time.monotonic()), grace_period=2.0):
                if time.monotonic() >= deadline:
                    failure = f"timed out after {args.timeout:.0f} s (a hang?)"
                    break
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            failure = f"rank {e.error_index} failed: {e}"
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
        if failure is None and not os.path.exists(result_path):
            failure = "ranks exited without results"
        if failure is not None:
            print(f"LOAD FAIL: {failure}")
            return 1
        results = json.loads(Path(result_path).read_text())
    line, ok, summary = summarize(args, results)
    for e in summary["errors"][:10]:
        print("  error:", e)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        config = {k: v for k, v in vars(args).items() if k != "out"}
        doc = {"machine": machine_info(), "config": config, **summary}
        (out / "load.json").write_text(json.dumps(doc, indent=1))
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
