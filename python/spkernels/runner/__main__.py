"""python -m spkernels.runner: greedy generation with TP, SP dispatch and full decode graphs.

python -m spkernels.runner --device cpu --tp 2 --sp-threshold 8 --prompts 4 --gen 8 --check
python -m spkernels.runner --device cpu --arch v4.1 --tp 2 --pp 2 --num-experts 4 --sp-threshold 8 --check
python -m spkernels.runner --device cpu --arch v4.1 --pp 2 --microbatches 3 --microbatch-min-tokens 8 --check
python -m spkernels.runner --device cpu --tp 2 --sp-threshold 8 --mtp 2 --check
torchrun --nproc-per-node 2 -m spkernels.runner --device cuda --tp 2 --preset v4-flash-like
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from .. import env
from .config import PRESETS
from .engine import MICROBATCH_MIN_TOKENS
from .launch import RunOptions, exit_without_teardown, launch
from .profile import STEP_KINDS, format_breakdown, format_idle, format_step_kind, format_top
from .speculative import DRAFT_MODES


def _threshold(text: str):
    if text in ("none", "auto"):
        return None if text == "none" else "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, 'auto' or 'none', got {text!r}") from None


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def parse_args(argv=None) -> RunOptions:
    p = argparse.ArgumentParser(prog="python -m spkernels.runner", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (processes)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (world = tp * pp processes)")
    p.add_argument(
        "--pp-direct-shards",
        action="store_true",
        help="SP steps send each shard rank to rank between stages (no gather / re-shard; same results)",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=1,
        metavar="M",
        help="split each step's requests into up to M forwards (whole requests each) so pipeline stages "
        "overlap, but a step of N tokens into at most N // --microbatch-min-tokens (so small steps, "
        "decode steps in particular, stay one forward; 1: one forward per step)",
    )
    p.add_argument(
        "--microbatch-min-tokens",
        type=int,
        default=MICROBATCH_MIN_TOKENS,
        metavar="N",
        help="smallest average microbatch: a step of N tokens splits into at most N // this forwards; below "
        "it a microbatch's GPU time does not cover the host's enqueue of the next (default %(default)s)",
    )
    p.add_argument("--arch", choices=("v4", "v4.1"), default="v4")
    p.add_argument(
        "--engram-layers",
        type=_int_list,
        default=None,
        metavar="N,N,...",
        help="layers with Engram memory (default: none for v4, 1 and L-1 for v4.1; '' for none)",
    )
    p.add_argument("--num-experts", type=int, default=None, help="routed MoE experts (0: dense FFN)")
    p.add_argument("--num-layers", type=int, default=None, help="override the preset's depth")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument(
        "--sp-threshold",
        type=_threshold,
        default="auto",
        metavar="N|auto|none",
        help="SP engages on forwards of at least N padded tokens (auto: measured crossover)",
    )
    p.add_argument("--prompts", type=int, default=4, help="number of synthetic prompts")
    p.add_argument("--prompt-len", type=int, default=None, help="longest synthetic prompt")
    p.add_argument(
        "--prompt-lens",
        type=_int_list,
        default=None,
        metavar="N,N,...",
        help="explicit prompt lengths (instead of --prompts/--prompt-len)",
    )
    p.add_argument("--gen", type=int, default=16, help="tokens to generate per request")
    p.add_argument(
        "--mtp",
        type=int,
        default=None,
        metavar="K",
        help="greedy speculative decoding: draft K tokens per request per step with the MTP layer and "
        "verify them in one forward of K + 1 tokens per request (same tokens as plain decoding)",
    )
    p.add_argument(
        "--mtp-draft",
        choices=DRAFT_MODES,
        default="mtp",
        help="what proposes the drafts: the MTP layer, the plain run's tokens (oracle: every draft "
        "accepted) or never them (wrong); the MTP layer runs in every mode (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0, help="untimed generations before the measured one")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measured generations; prefill and decode rates are their medians (--profile: the last one)",
    )
    p.add_argument(
        "--max-tokens-per-step",
        type=int,
        default=8192,
        help="token budget of a step (longer prompts are prefilled in chunks; default 8192)",
    )
    p.add_argument(
        "--capture-sizes",
        type=_int_list,
        default=None,
        metavar="N,N,...",
        help="decode batch sizes to capture (default 1,2,4,...,64 on cuda)",
    )
    p.add_argument(
        "--no-graphs", dest="graphs", action="store_false", default=None, help="run decode steps eagerly"
    )
    p.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="run every step synchronously (build, forward, read the tokens) instead of enqueuing step "
        "n + 1 while the GPU runs step n (on by default; never with --mtp or --pp > 1)",
    )
    p.add_argument(
        "--comm-max-tokens",
        type=int,
        default=None,
        help="communicator capacity (default: what the schedule needs)",
    )
    p.add_argument("--check", action="store_true", help="compare tokens and logits with a one-process run")
    p.add_argument(
        "--check-atol",
        type=float,
        default=None,
        help="logit tolerance of --check (default: 2^-7 of the largest reference logit)",
    )
    p.add_argument(
        "--check-graphs",
        action="store_true",
        help="also run each replayed step eagerly and report the largest logit difference",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="print the measured run's time by category (mHC, NCCL, attention, GEMM, other; GPU kernel "
        "time on cuda); profiling slows the run, so take throughput from a run without it",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="write the results (machine, command, options, stats with wall_ms / gpu_busy_ms per step "
        "kind, steps, tokens) to DIR/runner.json",
    )
    p.add_argument("--load-weights", default=None, metavar="PATH")
    p.add_argument("--save-weights", default=None, metavar="PATH")
    p.add_argument("--quiet", action="store_true", help="no per-step lines or progress")
    fields = vars(p.parse_args(argv))
    del fields["out"]  # where main writes the results, not a run option (out_dir)
    return RunOptions(verbose=not fields.pop("quiet"), **fields)  # every other flag is a RunOptions field


def out_dir(argv) -> str | None:
    """--out of a command line parse_args accepted."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--out", default=None)
    return p.parse_known_args(argv)[0].out


def report(results: dict) -> bool:
    stats = results["stats"]
    print(f"steps: {stats['steps']} ({stats['sp_steps']} SP, {stats['graph_steps']} graph replays)")
    print(
        f"microbatches: {stats['microbatches']} forwards in {stats['steps']} steps "
        f"(--microbatches {stats['max_microbatches']}; a step never splits a request)"
    )
    generated = sum(len(t) for t in results["tokens"])
    if stats["seconds"]:
        print(f"throughput: {generated / stats['seconds']:.1f} generated tokens/s ({stats['seconds']:.3f} s)")
    spread = {}
    if "repeat" in stats:  # medians of several generations, with their range
        for key, fmt in (("prefill_tokens_per_s", ".1f"), ("decode_ms_per_step", ".3f")):
            low, high = stats[key + "_range"]
            spread[key] = f", median of {stats['repeat']}: {low:{fmt}} .. {high:{fmt}}"
    print(
        f"prefill: {stats['prefill_tokens']} tokens, {stats['prefill_tokens_per_s']:.1f} tokens/s"
        f"{spread.get('prefill_tokens_per_s', '')}"
    )
    if "mtp" in stats:
        print(
            f"decode: {stats['decode_ms_per_step']:.3f} ms/step ({stats['decode_steps']} steps, "
            f"{stats['decode_tokens_per_s']:.1f} tokens/s{spread.get('decode_ms_per_step', '')})"
        )
        print(
            f"speculative: --mtp {stats['mtp']} ({stats['mtp_draft']} draft): acceptance rate "
            f"{stats['acceptance_rate']:.3f} ({stats['accepted']}/{stats['drafted']} drafts), "
            f"{stats['tokens_per_step']:.2f} tokens per request per step"
        )
    else:
        print(
            f"decode: {stats['decode_ms_per_step']:.3f} ms/step ({stats['decode_steps']} steps, "
            f"one token per request per step{spread.get('decode_ms_per_step', '')})"
        )
    if stats["graph_steps"] and stats.get("graph_max_diff") is not None:
        print(f"graph vs eager: max logit diff {stats['graph_max_diff']:.3g}")
    for rank, peak in enumerate(results["peak_memory"]):
        print(f"rank {rank}: peak memory {peak / 2**20:.1f} MiB")
    print(f"peak stream per rank: {stats['peak_stream_bytes'] / 2**20:.2f} MiB")
    if "profile_ms" in stats:
        print(format_breakdown(stats["profile_ms"], results["device"]))
        if "profile_covered_ms" in stats:
            what = "GPU time covered, overlapping kernels once"
            print(format_breakdown(stats["profile_covered_ms"], results["device"], what))
        for label, top in stats["profile_top"].items():
            print(format_top(label, top))
        for kind in STEP_KINDS:
            entry = stats["step_kinds"][kind]
            if entry["steps"]:
                print(format_step_kind(kind, entry))
                print(format_idle(kind, entry))
    for i, tokens in enumerate(results["tokens"]):
        print(f"tokens {i}: {' '.join(map(str, tokens))}")
    check = results.get("check")
    if check is None:
        return True
    verdict = "PASS" if check["ok"] else "FAIL"
    partial = "" if check["fair"] else f"; {check['coverage']:.0%} of steps compared (below 2 * atol after)"
    print(
        f"check vs one process: {verdict}: max logit diff {check['max_logit_diff']:.4g} "
        f"(atol {check['atol']:.3g}), token mismatches in requests {check['token_mismatches']}, "
        f"min reference top-2 margin {check['min_ref_margin']:.3g}{partial}"
    )
    return check["ok"]


def write_results(out_dir: str, results: dict, opts: RunOptions, argv: list[str]) -> str:
    """DIR/runner.json (main made DIR before the run): the results without the logits (tensors;
    --record-logits keeps them in memory)."""
    path = os.path.join(out_dir, "runner.json")
    doc = {
        "machine": env.machine(),
        "command": "python -m spkernels.runner " + " ".join(argv),
        "options": dataclasses.asdict(opts),
        **{k: v for k, v in results.items() if k != "logits"},
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    opts, out = parse_args(argv), out_dir(argv)
    if out is not None:  # checked before the run, not after it: a bad folder would lose the results
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as e:
            print(f"error: --out {out}: {e.strerror or e}", file=sys.stderr)
            return 2
        if not os.access(out, os.W_OK):
            print(f"error: --out {out}: not a writable folder", file=sys.stderr)
            return 2
    try:
        results = launch(opts)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not results:  # a non-zero torchrun rank: rank 0 reports
        return 0
    ok = report(results)
    if out is not None:
        print(f"results: {write_results(out, results, opts, argv)}")
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    if "WORLD_SIZE" in os.environ:  # a torchrun rank: teardown after a process group may abort
        exit_without_teardown(code)
    sys.exit(code)
