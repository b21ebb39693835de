"""Host time of the model runner's batch build (Engine.build_batch), against a baseline revision's.

The host builds each step's batch while the GPU runs the step before; what nothing in flight hides
(a generation's first step) adds to the step's wall time. Each case builds one batch of synthetic
requests: an 8192-token prompt chunk, decode rows of short and of long contexts, with and without
Engram. ``--baseline REV`` loads REV's ``runner/engine.py`` (``REV=FILE``: REV's engine.py copied to
FILE, where the checkout has no git history; with this tree's other modules) beside this tree's and
interleaves the two loop by loop, so the comparison is a same-run A/B. On cuda the batch goes
through pinned memory to the device, as in a run.

    python bench/runner_host.py --device cpu --baseline 54a3f7d
    python bench/runner_host.py --device cuda --baseline 54a3f7d --out DIR

Prints a table (median µs per batch) and writes DIR/runner_host.json (default bench/results).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
from common import REPO, host_loop_us, import_spkernels, machine_info

# name -> (Engram, requests, context length, decode, in flight): a prefill case is its requests' whole
# prompts; "in flight": each decode row's token is still PENDING, sampled by the step in flight (an
# overlapped decode's steady state: the batch gathers the ids on the device)
CASES = {
    "prefill 8192": (False, 1, 8192, False, False),
    "prefill 16 x 64": (False, 16, 64, False, False),
    "decode 16 x 64": (False, 16, 64, True, False),
    "decode 16 x 64 in flight": (False, 16, 64, True, True),
    "decode 16 x 8192": (False, 16, 8192, True, False),
    "decode 64 x 32768": (False, 64, 32768, True, False),
    "Engram prefill 8192": (True, 1, 8192, False, False),
    "Engram prefill 16 x 64": (True, 16, 64, False, False),
    "Engram decode 16 x 64": (True, 16, 64, True, False),
}
QUICK = {"prefill 8192": 256, "decode 16 x 8192": 512, "decode 64 x 32768": 1024, "Engram prefill 8192": 256}


def baseline_engine(baseline: str):
    """(REV, module): REV's runner/engine.py (``REV=FILE``: read from FILE) as a module of
    spkernels.runner: its relative imports are this tree's."""
    rev, _, file = baseline.partition("=")
    if file:
        path = Path(file)
    else:
        source = subprocess.run(
            ["git", "show", f"{rev}:python/spkernels/runner/engine.py"],
            cwd=REPO, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        path = Path(tempfile.mkdtemp()) / "engine_baseline.py"
        path.write_text(source)
    spec = importlib.util.spec_from_file_location("spkernels.runner.engine_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return rev, module


def case_batch(module, config, device, engram, num, length, decode, in_flight, seed):
    """(engine, entries, padded) of one case for ``module``'s Engine and Request."""
    model = SimpleNamespace(pad_id=config.vocab_size, trash_row=num, config=config)
    if engram:
        model.config = config.replace(engram_layers=(1,))
    engine = module.Engine.__new__(module.Engine)  # only what build_batch reads: no weights
    engine.model, engine.device, engine.inflight = model, device, []
    rng = random.Random(seed)
    prompt_len = length - 1 if decode else length
    requests = [
        module.Request(i, [rng.randrange(config.vocab_size) for _ in range(prompt_len)], 4)
        for i in range(num)
    ]
    for req in requests if decode else ():
        req.num_computed = prompt_len
        req.generated = [module.PENDING if in_flight else rng.randrange(config.vocab_size)]
    if in_flight:  # only what build_batch reads of the step in flight: its ids and their rows
        ids = torch.arange(num, dtype=torch.int64, device=device)
        engine.inflight = [SimpleNamespace(ids=ids, sample_of={i: i for i in range(num)})]
    tokens = num if decode else num * length
    return engine, module.schedule(requests, tokens), tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--baseline",
        default=None,
        metavar="REV[=FILE]",
        help="git revision whose engine.py to compare (=FILE: REV's engine.py, read from FILE)",
    )
    p.add_argument("--calls", type=int, default=20, help="batches per timed loop")
    p.add_argument("--repeats", type=int, default=9, help="timed loops per variant (median)")
    p.add_argument("--quick", action="store_true", help="shorter contexts (a smoke run)")
    p.add_argument("--out", default=str(REPO / "bench" / "results"), metavar="DIR")
    args = p.parse_args()

    import_spkernels()
    from spkernels.runner import engine as current
    from spkernels.runner.config import preset

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    config = preset("tiny").replace(vocab_size=32768)
    variants = {"current": current}
    baseline = None
    if args.baseline:
        baseline, variants["baseline"] = baseline_engine(args.baseline)
    rows = []
    for name, (engram, num, length, decode, in_flight) in CASES.items():
        length = QUICK.get(name, length) if args.quick else length
        builds = {}
        for label, module in variants.items():
            engine, entries, padded = case_batch(
                module, config, device, engram, num, length, decode, in_flight, seed=0
            )
            builds[label] = lambda e=engine, x=entries, n=padded, d=decode: e.build_batch(x, n, d)
            host_loop_us(builds[label], 2, sync)  # warm-up: pinned blocks, lazy inits
        times = {label: [] for label in builds}
        for i in range(args.repeats):  # alternate which goes first: drift hits both alike
            for label in builds if i % 2 == 0 else reversed(builds):
                times[label].append(host_loop_us(builds[label], args.calls, sync))
        row = {"case": name, "tokens": padded, "context": length}
        row.update({f"{label}_us": statistics.median(t) for label, t in times.items()})
        if "baseline_us" in row:
            row["speedup"] = row["baseline_us"] / row["current_us"]
        rows.append(row)

    head = f"{'case':<22} {'current us':>11}" + (
        f" {'baseline us':>12} {'speedup':>8}" if args.baseline else ""
    )
    print(head)
    for r in rows:
        line = f"{r['case']:<22} {r['current_us']:>11.1f}"
        if args.baseline:
            line += f" {r['baseline_us']:>12.1f} {r['speedup']:>7.2f}x"
        print(line)
    result = {
        "machine": machine_info(),
        "config": {
            "device": str(device),
            "baseline": baseline,
            "calls": args.calls,
            "repeats": args.repeats,
            "quick": args.quick,
        },  # fmt: skip
        "rows": rows,
    }
    out = Path(args.out) / "runner_host.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
