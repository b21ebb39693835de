"""Running the model on pp stages of a TP group each: plain (spawns one process per rank), under
torchrun, or in one process for tp = pp = 1; the ``--check`` comparison against a one-process run."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import resource
import statistics
import sys
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..policy import SPPolicy
from .config import ModelConfig, preset
from .engine import MICROBATCH_MIN_TOKENS, Engine
from .model import Model
from .mtp import MTPLayer
from .pipeline import make_stage
from .profile import Profiler, step_kinds
from .speculative import DRAFT_MODES, SpeculativeEngine
from .weights import load_weights, random_weights, save_weights

DEFAULT_CUDA_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_PROMPT_LEN = {"tiny": 32, "v4-flash-like": 512}


@dataclass(frozen=True)
class RunOptions:
    preset: str = "tiny"
    device: str = "cpu"
    tp: int = 1
    pp: int = 1
    arch: str = "v4"
    # Model overrides (None: the preset's): Engram layers (V4.1 default: 1 and L - 1), routed experts
    # (0: dense FFN), depth.
    engram_layers: tuple[int, ...] | None = None
    num_experts: int | None = None
    num_layers: int | None = None
    pp_direct_shards: bool = False  # SP steps send shards rank to rank between stages (pipeline.py)
    microbatches: int = 1  # forwards per step (whole requests each); stages overlap them (engine.py)
    microbatch_min_tokens: int = MICROBATCH_MIN_TOKENS  # a step of N tokens: at most N // this forwards
    sp_threshold: int | str | None = "auto"
    prompts: int = 4
    prompt_len: int | None = None  # longest synthetic prompt; the others are shorter, varied
    prompt_lens: tuple[int, ...] | None = None  # explicit lengths instead (overrides prompts, prompt_len)
    gen: int = 16
    # Speculative decoding: K tokens drafted per request per step (None: plain decoding), and what
    # proposes them (speculative.DRAFT_MODES: the MTP layer, or the oracle / wrong of tests and bounds).
    mtp: int | None = None
    mtp_draft: str = "mtp"
    seed: int = 0
    warmup: int = 0  # untimed generations before the measured one
    repeat: int = 1  # measured generations; throughput is their median (profile: the last one)
    max_tokens_per_step: int = 8192
    capture_sizes: tuple[int, ...] | None = None  # None: DEFAULT_CUDA_CAPTURE_SIZES on cuda, none on cpu
    graphs: bool | None = None  # None: on for cuda
    comm_max_tokens: int | None = None  # None: exactly what the schedule can need
    check: bool = False
    check_atol: float | None = None  # None: CHECK_RTOL * max |reference logit| (see compare)
    check_graphs: bool = False
    # Overlap each step's host work with the step before's device work where it applies (engine.py);
    # False: every step synchronous (A/B comparisons).
    overlap: bool = True
    record_logits: bool = False
    profile: bool = False  # time by category (mHC, NCCL, attention, GEMM, other) of the measured run
    load_weights: str | None = None
    save_weights: str | None = None
    verbose: bool = True


@dataclass(frozen=True)
class Plan:
    config: ModelConfig
    prompts: list[list[int]]
    policy: SPPolicy
    graphs: bool
    kv_len: int
    comm_capacity: int


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def make_prompts(opts: RunOptions, vocab_size: int) -> list[list[int]]:
    """Synthetic prompts from the seed (a CPU generator: the same prompts on every device)."""
    gen = torch.Generator().manual_seed(opts.seed + 1)
    if opts.prompt_lens is not None:
        lengths = list(opts.prompt_lens)
    else:
        longest = opts.prompt_len or DEFAULT_PROMPT_LEN.get(opts.preset, 32)
        lengths = torch.randint(1, longest + 1, (opts.prompts,), generator=gen).tolist()
        lengths[0] = longest  # always one long request among the short ones
    if not lengths or any(not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"prompt lengths must be positive ints, at least one prompt; got {lengths}")
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def plan(opts: RunOptions, config: ModelConfig | None = None) -> Plan:
    """Every check that needs no process group, so impossible configs fail before anything starts."""
    if not isinstance(opts.tp, int) or opts.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {opts.tp}")
    if not isinstance(opts.pp, int) or opts.pp < 1:
        raise ValueError(f"--pp must be >= 1, got {opts.pp}")
    if not isinstance(opts.microbatches, int) or isinstance(opts.microbatches, bool) or opts.microbatches < 1:
        raise ValueError(
            f"--microbatches must be an int >= 1 (1: each step is one forward), got {opts.microbatches!r}"
        )
    if type(opts.microbatch_min_tokens) is not int or opts.microbatch_min_tokens < 1:
        raise ValueError(
            f"--microbatch-min-tokens must be a positive int, got {opts.microbatch_min_tokens!r}"
        )
    if opts.device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {opts.device!r}")
    world = opts.tp * opts.pp
    if opts.device == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(
            f"--tp {opts.tp} --pp {opts.pp} needs {world} GPUs, {torch.cuda.device_count()} visible"
        )
    if opts.tp == 1 and opts.sp_threshold not in (None, "auto"):
        raise ValueError(
            "--sp-threshold: SP shards tokens across a TP group and needs --tp > 1 "
            "(use --sp-threshold none or auto with --tp 1)"
        )
    if not isinstance(opts.gen, int) or opts.gen < 1:
        raise ValueError(f"--gen must be >= 1 (tokens to generate per request), got {opts.gen!r}")
    for name, low in (("warmup", 0), ("repeat", 1), ("prompts", 1)):
        value = getattr(opts, name)
        if not isinstance(value, int) or value < low:
            raise ValueError(f"--{name} must be an int >= {low}, got {value!r}")
    if opts.prompt_len is not None and (not isinstance(opts.prompt_len, int) or opts.prompt_len < 1):
        raise ValueError(f"--prompt-len must be an int >= 1 (the longest prompt), got {opts.prompt_len!r}")
    if opts.check_atol is not None and not (math.isfinite(opts.check_atol) and opts.check_atol >= 0):
        raise ValueError(f"--check-atol must be a finite number >= 0, got {opts.check_atol!r}")
    if opts.load_weights and not os.path.isfile(opts.load_weights):
        raise ValueError(f"--load-weights {opts.load_weights}: no such file")
    graphs = opts.graphs
    if graphs is None:  # on by default where they can run: one forward per step, no pipeline hand-over
        graphs = opts.device == "cuda" and opts.pp == opts.microbatches == 1
    if graphs and opts.device != "cuda":
        raise ValueError("CUDA graphs need --device cuda")
    if graphs and opts.pp > 1:
        raise ValueError(
            "CUDA graphs with --pp > 1: stages hand activations over with eager send/recv; use --no-graphs"
        )
    if graphs and opts.microbatches > 1:
        raise ValueError(
            "CUDA graphs with --microbatches > 1: a graph replays a whole decode step; use --no-graphs"
        )
    if config is None:
        config = _load_config(opts)
    config.validate(opts.tp, opts.pp)
    if opts.arch != config.arch:
        raise ValueError(f"--arch {opts.arch} but the weights are for {config.arch}")
    drafts = _check_mtp(opts, config)
    prompts = make_prompts(opts, config.vocab_size)
    needed = max(len(p) for p in prompts) + opts.gen + drafts  # a verify writes K positions ahead
    if needed > config.max_seq_len:
        raise ValueError(
            f"the longest request needs {needed} positions (prompt + --gen + --mtp), above the model's "
            f"max_seq_len = {config.max_seq_len}"
        )
    capture = (
        opts.capture_sizes
        if opts.capture_sizes is not None
        else (mtp_capture_sizes(drafts) if graphs else ())
    )
    sp_threshold = None if opts.tp == 1 else opts.sp_threshold
    policy = SPPolicy(opts.tp, sp_threshold, capture, hidden_size=config.hidden_size)
    budget = opts.max_tokens_per_step
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"--max-tokens-per-step must be a positive int, got {budget!r}")
    if budget < drafts + 1:
        raise ValueError(
            f"--max-tokens-per-step {budget} cannot hold one verify of --mtp {drafts} + 1 tokens"
        )
    if drafts and graphs and policy.max_capture_size < drafts + 1:
        raise ValueError(
            f"--mtp {drafts}: a verify batch has K + 1 = {drafts + 1} tokens per request, above the "
            f"largest capture size {policy.max_capture_size} (--capture-sizes {policy.capture_sizes}); "
            f"capture a size of at least {drafts + 1} or use --no-graphs"
        )
    # The largest padded step: a full eager step, or the bucket of the largest decode (verify) batch.
    decode_tokens = min(len(prompts) * (drafts + 1), budget)
    capacity = max(policy.pad(budget, False), policy.pad(decode_tokens, True))
    if opts.comm_max_tokens is not None:
        if capacity > opts.comm_max_tokens:
            raise ValueError(
                f"a step can reach T = {capacity} padded tokens (--max-tokens-per-step {budget}, capture "
                f"sizes {policy.capture_sizes}), above the communicator capacity --comm-max-tokens "
                f"{opts.comm_max_tokens}"
            )
        capacity = opts.comm_max_tokens
    kv_len = min(_round_up(needed, 16), config.max_seq_len)
    return Plan(config, prompts, policy, graphs, kv_len, capacity)


def mtp_capture_sizes(drafts: int) -> tuple[int, ...]:
    """The default capture sizes, and with K drafts also K + 1 times each: a verify batch of B requests
    has B (K + 1) tokens, its drafts B."""
    sizes = set(DEFAULT_CUDA_CAPTURE_SIZES)
    if drafts:
        sizes |= {(drafts + 1) * s for s in DEFAULT_CUDA_CAPTURE_SIZES}
    return tuple(sorted(sizes))


def _check_mtp(opts: RunOptions, config: ModelConfig) -> int:
    """-> K, the drafted tokens per step (0 without --mtp)."""
    if opts.mtp is None:
        return 0
    if type(opts.mtp) is not int or opts.mtp < 1:
        raise ValueError(f"--mtp K drafts K >= 1 tokens per step, got {opts.mtp!r}")
    if opts.mtp_draft not in DRAFT_MODES:
        raise ValueError(f"--mtp-draft must be one of {DRAFT_MODES}, got {opts.mtp_draft!r}")
    if not config.mtp_layers:
        raise ValueError(
            f"--mtp: {opts.load_weights} has no MTP layer (its config has mtp_layers = 0); save weights "
            f"with one (--mtp with random weights adds it)"
        )
    if opts.microbatches > 1:
        raise ValueError(
            "--mtp runs each step as one forward (drafts follow the verify): use --microbatches 1"
        )
    return opts.mtp


def _load_config(opts: RunOptions) -> ModelConfig:
    if opts.load_weights:
        return load_weights(opts.load_weights)[1]
    return preset_config(opts)


def preset_config(opts: RunOptions) -> ModelConfig:
    return preset(
        opts.preset,
        arch=opts.arch,
        engram_layers=opts.engram_layers,
        num_experts=opts.num_experts,
        num_layers=opts.num_layers,
        mtp_layers=1 if opts.mtp is not None else None,
    )


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _sync_ranks() -> None:
    """Every rank's device drained, then the ranks meet (a no-op in one process)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


def _generate(
    model,
    plan_: Plan,
    opts: RunOptions,
    policy: SPPolicy,
    graphs: bool,
    log,
    record: bool,
    microbatches=1,
    profile=False,
    mtp=None,
    oracle=None,
):
    """``mtp``: (the MTPLayer on the last stage, else None) for speculative decoding; None: plain."""
    kwargs = dict(
        record_logits=record,
        check_graphs=opts.check_graphs and graphs,
        log=log,
        microbatches=microbatches,
        microbatch_min_tokens=opts.microbatch_min_tokens,
        # a distributed model's steps start with its ranks met (not rank 0's lone --check reference)
        meet=_sync_ranks if model.comm is not None or model.stage is not None else None,
        overlap=opts.overlap,
    )
    if mtp is None:
        engine = Engine(model, policy, opts.max_tokens_per_step, **kwargs)
        max_batch = min(len(plan_.prompts), opts.max_tokens_per_step)
    else:
        engine = SpeculativeEngine(
            model, mtp[0], policy, opts.max_tokens_per_step, opts.mtp, opts.mtp_draft, oracle, **kwargs
        )
        max_batch = min(len(plan_.prompts), opts.max_tokens_per_step // (opts.mtp + 1))
    engine.label_steps = profile
    if graphs:
        engine.capture(max_batch)
    for _ in range(opts.warmup):  # untimed: first-call costs (cuBLAS heuristics, allocator) stay out
        engine.generate(plan_.prompts, opts.gen)
    rates = {"prefill_tokens_per_s": [], "decode_ms_per_step": []}  # per measured generation
    for rep in range(opts.repeat):
        engine.steps.clear()
        engine.forwards.clear()
        last = rep == opts.repeat - 1
        progress = ProgressBar(len(plan_.prompts) * opts.gen) if log and last else None
        profiler = Profiler(model.device, sync=_sync_ranks) if profile and last else contextlib.nullcontext()
        with profiler:
            requests = engine.generate(plan_.prompts, opts.gen, progress)
        if progress:
            progress.close()
        stats = engine.stats()
        for key, values in rates.items():
            values.append(stats[key])
    if opts.repeat > 1:  # one generation's figures move by several % run to run: report the median
        for key, values in rates.items():
            stats[key] = statistics.median(values)
            stats[key + "_range"] = (min(values), max(values))
        stats["repeat"] = opts.repeat
    kinds = profiler.by_step_kind() if profile else None
    stats["step_kinds"] = step_kinds(engine.steps, kinds, model.device.type)  # the last generation's
    if profile:
        stats["profile_ms"] = profiler.totals()
        stats["profile_top"] = profiler.top()
        if (covered := profiler.coverage()) is not None:
            stats["profile_covered_ms"] = covered
    forwards = [dataclasses.astuple(f) for f in engine.forwards]
    return requests, stats, [dataclasses.astuple(s) for s in engine.steps], forwards


class ProgressBar:
    """tqdm when installed, else a line every quarter of the way."""

    def __init__(self, total: int):
        self.total, self.last = total, 0
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="generate", unit="tok")
        except ImportError:
            self.bar = None

    def __call__(self, done: int):
        if self.bar is not None:
            self.bar.update(done - self.last)
        elif done * 4 // self.total > self.last * 4 // self.total:
            print(f"generated {done}/{self.total} tokens", flush=True)
        self.last = done

    def close(self):
        if self.bar is not None:
            self.bar.close()


# Each logit is a dot product with a bf16 hidden state (relative rounding 2^-9), and every TP layout
# rounds its partial sums to bf16 at different points (2^-9 each, a few per layer, correlated through
# the stream): on the tiny preset tp = 2 and 4 differ from one process by ~2^-8.5 of the largest logit.
# Twice that is expected noise, not a bug; a
# wrong row, shard or mix moves logits by O(1) of their size instead.
CHECK_RTOL = 2**-7


def compare(results: dict, reference: dict, atol: float | None = None) -> dict:
    """Greedy tokens must match and logits agree within atol wherever the comparison is decidable.

    A step whose reference top-2 logit margin exceeds 2 * atol is decided: logits within atol cannot
    swap its argmax, so the tokens must be identical. At a request's first undecided step the two
    runs may legitimately pick different tokens; its logits are still compared (they come from the
    same prefix), the rest of that request is not (the continuations may differ). `coverage` is the
    fraction of steps compared; callers that need a meaningful check assert it is high."""
    if atol is None:
        atol = CHECK_RTOL * max(t.abs().max().item() for t in reference["logits"] if t.numel())
    token_mismatches, max_diff, min_margin, compared, total = [], 0.0, float("inf"), 0, 0
    for i, (got_tokens, want_tokens, got, want) in enumerate(
        zip(results["tokens"], reference["tokens"], results["logits"], reference["logits"], strict=True)
    ):
        n = min(len(got), len(want))
        total += max(len(got_tokens), len(want_tokens))
        if not n:
            token_mismatches += [i] if got_tokens != want_tokens else []
            continue
        top2 = want[:n].topk(2, dim=-1).values
        margins = top2[:, 0] - top2[:, 1]
        min_margin = min(min_margin, margins.min().item())
        undecided = (margins <= 2 * atol).nonzero()
        k = undecided[0].item() if len(undecided) else n  # steps [0, k) are decided
        rows = min(k + 1, n)
        max_diff = max(max_diff, (got[:rows] - want[:rows]).abs().max().item())
        if k == n and len(got_tokens) != len(want_tokens) or got_tokens[:k] != want_tokens[:k]:
            token_mismatches.append(i)
        compared += rows
    return {
        "ok": not token_mismatches and max_diff <= atol,
        "token_mismatches": token_mismatches,
        "max_logit_diff": max_diff,
        "min_ref_margin": min_margin,
        "fair": min_margin > 2 * atol,  # every step decided: the whole token sequences are compared
        "coverage": compared / max(total, 1),
        "atol": atol,
    }


def worker(rank: int, world_size: int, opts: RunOptions) -> dict | None:
    """One rank's whole run (process group already initialised when world_size > 1; the signature of
    tests/distributed.py's run_distributed); rank 0 returns the results, other ranks None.
    World rank s * tp + r is TP rank r of pipeline stage s (pipeline.make_stage)."""
    if world_size != opts.tp * opts.pp:
        raise ValueError(f"--tp {opts.tp} --pp {opts.pp} needs {opts.tp * opts.pp} ranks, got {world_size}")
    # Every launcher (spawn, torchrun, run_distributed) has set this rank's GPU already.
    device = (
        torch.device("cuda", torch.cuda.current_device()) if opts.device == "cuda" else torch.device("cpu")
    )
    log = print if rank == 0 and opts.verbose else None
    if opts.load_weights:
        weights, config = load_weights(opts.load_weights)
    else:
        config = preset_config(opts)
        weights = random_weights(config, opts.seed, device)
    if opts.save_weights and rank == 0:
        fmt = save_weights(opts.save_weights, weights, config)
        if log:
            log(f"saved weights to {opts.save_weights} ({fmt})")
    plan_ = plan(opts, config)
    keep_weights = opts.check and rank == 0  # for the one-process reference run
    comm, stage, group = None, None, None
    if opts.pp > 1:
        stage, group = make_stage(rank, opts.tp, opts.pp, config.num_layers, opts.pp_direct_shards)
    if opts.tp > 1:
        from ..comm import Communicator

        comm = Communicator(group, max_tokens=plan_.comm_capacity, hidden_size=config.hidden_size)
    try:
        model = Model(config, weights, device, comm, len(plan_.prompts), plan_.kv_len, stage)
        mtp = None
        if opts.mtp is not None:  # (the draft layer on the last stage, else None)
            layer = None
            if model.last_stage:
                layer = MTPLayer(config, weights, device, comm, len(plan_.prompts), plan_.kv_len, model)
            mtp = (layer,)
        if not keep_weights:
            del weights  # the full model, generated on every rank: keep only the shard
        if device.type == "cuda":  # peak memory of the run, not of generating the full weights
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        if log:
            log(
                f"{config.arch}: {config.num_layers} layers, D={config.hidden_size}, tp={opts.tp}, "
                f"pp={opts.pp}, microbatches<={opts.microbatches} (>={opts.microbatch_min_tokens} tokens "
                f"each on average), engram at {config.engram_layers}, experts={config.num_experts}, "
                f"{plan_.policy}, "
                f"backend={comm.backend if comm else 'local'}, device={device}"
            )
        record = opts.check or opts.record_logits
        oracle = None
        if mtp is not None and opts.mtp_draft != "mtp":  # the plain run's tokens, untimed and eager
            plain = Engine(model, plan_.policy, opts.max_tokens_per_step, meet=_sync_ranks)
            oracle = [r.generated for r in plain.generate(plan_.prompts, opts.gen)]
        requests, stats, steps, forwards = _generate(
            model,
            plan_,
            opts,
            plan_.policy,
            plan_.graphs,
            log,
            record,
            opts.microbatches,
            opts.profile,
            mtp=mtp,
            oracle=oracle,
        )
        del model
        tokens = [r.generated for r in requests]
        memory = [_peak_memory(device)]
        if world_size > 1:
            every = [None] * world_size
            dist.all_gather_object(every, (tokens, memory[0]))
            if any(t != tokens for t, _ in every):
                raise RuntimeError("ranks generated different tokens: replicated outputs drifted")
            memory = [m for _, m in every]
    finally:
        if comm is not None:  # collective: before rank 0 goes off alone for the reference run
            comm.close()
    if rank != 0:
        return None
    results = {
        "device": device.type,
        "tokens": tokens,
        "stats": stats,
        "peak_memory": memory,
        "steps": steps,
        "forwards": forwards,  # (step, num_tokens, padded, use_sp, graph, decode) per microbatch forward
        "logits": [torch.stack(r.logits) if r.logits else torch.empty(0) for r in requests],
    }
    if opts.check:
        ref_model = Model(config, weights, device, None, len(plan_.prompts), plan_.kv_len)
        ref_requests, *_ = _generate(ref_model, plan_, opts, SPPolicy(1, None, ()), False, None, True)
        reference = {
            "tokens": [r.generated for r in ref_requests],
            "logits": [torch.stack(r.logits) for r in ref_requests],
        }
        results["check"] = compare(results, reference, opts.check_atol)
    return results


def _spawned(rank: int, opts: RunOptions, store: str, out_path: str):
    backend = "nccl" if opts.device == "cuda" else "gloo"
    if opts.device == "cuda":
        torch.cuda.set_device(rank)
    else:  # share the cores instead of oversubscribing them tp times
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (opts.tp * opts.pp)))
    world = opts.tp * opts.pp
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        results = worker(rank, world, opts)
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()
    exit_without_teardown(0)


def exit_without_teardown(code: int) -> None:
    """Exit a process that ran a process group, skipping interpreter teardown: with gloo, C++
    destructors at teardown sporadically abort ("terminate called without an active exception")
    after all work finished and results were written. Only called on success; errors propagate."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch(opts: RunOptions) -> dict:
    """Run on ``opts.tp * opts.pp`` ranks: under torchrun (this process is one rank; non-zero ranks
    return {}), in this process for tp = pp = 1, else by spawning the ranks. Returns rank 0's results."""
    world = int(os.environ.get("WORLD_SIZE", "0"))
    plan(opts)  # fail fast, before any process starts
    if world:
        if world != opts.tp * opts.pp:
            raise ValueError(f"--tp {opts.tp} --pp {opts.pp} but torchrun started {world} processes")
        rank = int(os.environ["RANK"])
        if world == 1:
            return worker(0, 1, opts)
        if opts.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl" if opts.device == "cuda" else "gloo")
        try:
            return worker(rank, world, opts) or {}
        finally:
            dist.destroy_process_group()
    if opts.tp * opts.pp == 1:
        return worker(0, 1, opts)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "results.pt")
        store = os.path.join(tmp, "store")  # the ranks meet through a file: no TCP port to race for
        mp.spawn(_spawned, args=(opts, store, out_path), nprocs=opts.tp * opts.pp, join=True)
        return torch.load(out_path, weights_only=False)
