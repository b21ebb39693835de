"""Decode throughput of greedy speculative decoding (runner --mtp K) against plain decoding.

    python bench/runner_mtp.py --out DIR [--preset v4-flash-like] [--tp 1] [--mtp 1,2] [--gen 64]
                               [--prompts 8] [--prompt-len 512] [--repeat 3] [-- extra runner args]

Runs ``python -m spkernels.runner`` (graphs on, FULL_DECODE_ONLY) once plain and, for each K, with the
oracle draft (the plain run's tokens: every draft accepted, the upper bound the machinery allows at
the MTP layer's cost) and with the MTP layer (random weights: acceptance near zero, the lower bound).
Every speculative run must generate the plain run's tokens (``same``; the exit status says so too).
With --tp > 1 the runner spawns its ranks itself (SP engages by --sp-threshold, default auto).
Writes DIR/runner_mtp.json (machine, commit, each run's decode tokens/s, ms per step, acceptance rate,
tokens per step) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine_info


def run(args: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "runner.json")
        cmd = [sys.executable, "-m", "spkernels.runner", "--quiet", "--out", tmp, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out = {"args": " ".join(args), "rc": proc.returncode}
        if proc.returncode or not os.path.exists(path):
            out["error"] = (proc.stderr or proc.stdout)[-2000:]
            return out
        with open(path) as f:
            out.update(json.load(f))
        return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--preset", default="v4-flash-like")
    p.add_argument("--arch", default="v4")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--mtp", default="1,2", help="comma-separated K values")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("extra", nargs="*", help="more runner arguments (after --)")
    opts = p.parse_args(argv)
    base = [
        "--device", "cuda", "--tp", str(opts.tp), "--preset", opts.preset, "--arch", opts.arch,
        "--prompts", str(opts.prompts), "--prompt-len", str(opts.prompt_len), "--gen", str(opts.gen),
        "--warmup", str(opts.warmup), "--repeat", str(opts.repeat), *opts.extra,
    ]  # fmt: skip
    configs = [("plain", [])]
    for k in (int(v) for v in opts.mtp.split(",") if v):
        configs += [(f"mtp{k}-oracle", ["--mtp", str(k), "--mtp-draft", "oracle"])]
        configs += [(f"mtp{k}-mtp", ["--mtp", str(k), "--mtp-draft", "mtp"])]
    runs = {}
    for name, args in configs:
        print(f"=== {name}: {' '.join(base + args)}", flush=True)
        runs[name] = run(base + args, opts.timeout)
        if runs[name]["rc"]:
            print(runs[name]["error"], flush=True)
    plain_tokens = runs["plain"].get("tokens")
    rows = []
    for name, r in runs.items():
        s = r.get("stats", {})
        same = r.get("tokens") == plain_tokens if plain_tokens is not None else None
        r["same_tokens_as_plain"] = same
        rows.append(
            (
                name,
                r["rc"],
                s.get("decode_tokens_per_s", 0.0),
                s.get("decode_ms_per_step", 0.0),
                s.get("acceptance_rate"),
                s.get("tokens_per_step"),
                s.get("graph_steps", 0),
                same,
            )
        )
    opts.out.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": machine_info(),
        "command": " ".join(["python3", "-m", "spkernels.runner", "--quiet", *base]),
        "runs": runs,
    }
    (opts.out / "runner_mtp.json").write_text(json.dumps(result, indent=1, default=str))
    plain_rate = rows[0][2] or float("nan")
    print(f"{'run':<14}{'rc':>4}{'tok/s':>10}{'x plain':>9}{'ms/step':>10}{'accept':>8}{'tok/step':>10}"
          f"{'graphs':>8}{'same':>6}")  # fmt: skip
    for name, rc, rate, ms, acc, tps, graphs, same in rows:
        acc_s = f"{acc:.3f}" if acc is not None else "-"
        tps_s = f"{tps:.2f}" if tps is not None else "-"
        print(
            f"{name:<14}{rc:>4}{rate:>10.1f}{rate / plain_rate:>9.2f}{ms:>10.3f}{acc_s:>8}{tps_s:>10}"
            f"{graphs:>8}{str(same):>6}"
        )
    return 0 if all(r[1] == 0 and r[7] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
