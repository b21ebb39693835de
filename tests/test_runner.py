"""The model runner end to end on CPU (gloo): tp = 2 with and without SP, tp = 4 and chunked prefill
all give the one-process greedy tokens and logits, through the padding paths; plus the CLI, the
weights round trip, the scheduler and the errors for configs that cannot work."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
import weakref
from types import SimpleNamespace

import pytest
import torch
from distributed import run_distributed
from spkernels.policy import SPPolicy
from spkernels.runner import (
    Engine,
    Model,
    Request,
    RunOptions,
    compare,
    plan,
    random_weights,
    schedule,
    worker,
)
from spkernels.runner import engram as engram_mod
from spkernels.runner import profile as profile_mod
from spkernels.runner import weights as weights_mod
from spkernels.runner.__main__ import parse_args
from spkernels.runner.config import preset
from spkernels.runner.engine import PENDING
from torch.autograd import DeviceType
from torch.overrides import TorchFunctionMode

# Prompt lengths 1, 3 and 5 are tp - 1 and tp + 1 for tp = 2 and tp = 4 (so some ranks own only pad
# rows of a shard), 40 is the long one; five requests make every decode batch pad up to the capture
# size 8 (pad rows in TP mode, and in SP mode at tp = 4, where a whole shard is padding).
BASE = RunOptions(
    device="cpu",
    prompt_lens=(1, 3, 5, 40, 2),
    gen=5,
    capture_sizes=(2, 4, 8),
    verbose=False,
    record_logits=True,
)


def options(**changes) -> RunOptions:
    return dataclasses.replace(BASE, **changes)


def run_configs(rank: int, world_size: int, configs: list[RunOptions]) -> list:
    """Several runs in one process group: one spawn per tp size keeps the suite fast."""
    return [worker(rank, world_size, opts) for opts in configs]


def run_all(cases: dict[str, RunOptions]) -> dict[str, dict]:
    """rank 0's results per case: tp = 1 in this process, the others through run_distributed."""
    out = {}
    for tp in sorted({opts.tp for opts in cases.values()}):
        names = [name for name, opts in cases.items() if opts.tp == tp]
        configs = [cases[name] for name in names]
        if tp == 1:
            out.update({name: worker(0, 1, opts) for name, opts in zip(names, configs, strict=True)})
            continue
        backend = "nccl" if configs[0].device == "cuda" else "gloo"
        results = run_distributed(tp, run_configs, configs, backend=backend)
        assert all(r == [None] * len(configs) for r in results[1:])
        out.update(zip(names, results[0], strict=True))
    return out


@pytest.fixture(scope="module")
def reference() -> dict:
    """The one-process run every layout must reproduce."""
    return worker(0, 1, options(tp=1, sp_threshold=None))


def assert_matches(results: dict, reference: dict, min_coverage: float = 0.75) -> None:
    # The tiny preset's LM head is a permuted copy of the embedding (weights.random_weights), which
    # puts the reference's top-2 logit margins far above the bf16 noise between TP layouts: logits
    # within atol then cannot swap a greedy token, so comparing tokens is fair (launch.compare). A
    # step whose margin is not above 2 * atol ends its request's comparison; `coverage` asserts that
    # such steps are rare, so the check keeps its teeth.
    check = compare(results, reference)
    assert check["coverage"] >= min_coverage, check
    assert check["max_logit_diff"] <= check["atol"], check
    assert not check["token_mismatches"], check


def assert_policy_steps(results: dict, opts: RunOptions) -> set[tuple[bool, bool]]:
    """Every step padded and dispatched as the policy says, from the padded count alone, and every
    pure-decode step that fits a capture size replayed from a graph (when graphs are on).
    Returns the (use_sp, graph) pairs seen."""
    p = plan(opts)
    seen = set()
    for num_tokens, padded, use_sp, graph, prefill_tokens, _ in results["steps"]:
        decode = prefill_tokens == 0
        assert padded == p.policy.pad(num_tokens, uniform_decode=decode)
        assert use_sp == p.policy.use_sp(padded)
        assert graph == (p.graphs and decode and p.policy.graph_size(num_tokens, True) is not None)
        seen.add((use_sp, graph))
    return seen


# Tensor calls that hand a device value to the host: on a GPU each waits for every kernel enqueued
# before it, so the host could no longer enqueue work ahead of its GPU (a pipeline stage microbatch
# k + 1 while it runs k; the engine step n + 1 while it runs n).
HOST_READS = {"item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__"}


class HostReads(TorchFunctionMode):
    """Records the HOST_READS among the torch calls made inside it (``with``) or inside the methods
    it ``watch``es. CPU tensors take the same calls as CUDA ones, so a CPU run shows what would
    synchronise on a GPU."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in HOST_READS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))

    def watch(self, method):
        def watched(*args, **kwargs):
            with self:
                return method(*args, **kwargs)

        return watched


def test_reference_shape(reference):
    assert [len(t) for t in reference["tokens"]] == [BASE.gen] * len(BASE.prompt_lens)
    assert all(lg.shape == (BASE.gen, 512) for lg in reference["logits"])
    assert len({tuple(t) for t in reference["tokens"]}) == len(BASE.prompt_lens)  # not a constant model


# name -> (options, the SP modes its steps must show; None: any, with SP among them)
CPU_CASES = {
    "tp2-sp": (options(tp=2, sp_threshold=16), {True, False}),  # prefill (T=52) SP, decode (bucket 8) TP
    "tp2-nosp": (options(tp=2, sp_threshold=None), {False}),
    "tp2-sp-chunked": (options(tp=2, sp_threshold=8, max_tokens_per_step=12), None),  # mixed steps
    "tp4-sp": (options(tp=4, sp_threshold=8), {True}),  # decode bucket 8 in SP: rank 3's shard is padding
}


@pytest.fixture(scope="module")
def cpu_layouts() -> dict[str, dict]:
    return run_all({name: opts for name, (opts, _) in CPU_CASES.items()})


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_matches_one_process(reference, cpu_layouts, name):
    opts, modes = CPU_CASES[name]
    results = cpu_layouts[name]
    seen = {use_sp for use_sp, _ in assert_policy_steps(results, opts)}
    if modes is not None:
        assert seen == modes
    else:
        assert True in seen
    assert_matches(results, reference)


def test_chunked_prefill_one_process(reference):
    results = worker(0, 1, options(tp=1, sp_threshold=None, max_tokens_per_step=7))
    assert max(n for n, *_ in results["steps"]) <= 7
    assert len(results["steps"]) > len(reference["steps"])
    assert_matches(results, reference)


def test_weights_round_trip(tmp_path, monkeypatch, reference):
    config = plan(BASE).config
    weights = weights_mod.random_weights(config, BASE.seed, torch.device("cpu"))
    for fmt in ("safetensors", "torch"):
        if fmt == "torch":  # the fallback when safetensors is not installed
            monkeypatch.setattr(weights_mod, "_safetensors", None)
        elif weights_mod._safetensors is None:
            continue
        path = tmp_path / f"model.{fmt}"
        assert weights_mod.save_weights(path, weights, config) == fmt
        loaded, loaded_config = weights_mod.load_weights(path)
        assert loaded_config == config
        assert all(torch.equal(loaded[k], v) for k, v in weights.items())
    results = worker(0, 1, options(tp=1, sp_threshold=None, load_weights=str(path)))
    assert results["tokens"] == reference["tokens"]
    del loaded["norm.weight"]
    with pytest.raises(ValueError, match="norm.weight"):
        weights_mod.check_weights(loaded, config, "x")


def test_cli_check(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "spkernels.runner",
        "--device",
        "cpu",
        "--tp",
        "2",
        "--sp-threshold",
        "8",
        "--prompt-lens",
        "1,3,17",
        "--gen",
        "3",
        "--check",
        "--save-weights",
        str(tmp_path / "w"),
        "--profile",
        "--repeat",
        "2",
        "--out",
        str(tmp_path / "out"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=os.environ.copy())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(ln.startswith("prefill: ") and ", median of 2: " in ln for ln in lines), proc.stdout
    assert len([ln for ln in lines if ln.startswith("tokens ")]) == 3
    assert any(ln.startswith("check vs one process: PASS") for ln in lines), proc.stdout
    assert any(" SP " in ln for ln in lines if ln.startswith("step ")), proc.stdout
    assert (tmp_path / "w").exists()
    profile = [ln for ln in lines if ln.startswith("profile (rank 0, self CPU time of ops): mHC ")]
    assert len(profile) == 1, proc.stdout
    assert not profile[0].startswith("profile (rank 0, self CPU time of ops): mHC 0.00 ms"), profile[0]
    assert any(ln.startswith("profile other, largest: ") for ln in lines), proc.stdout
    top_mhc = [ln for ln in lines if ln.startswith("profile mHC, largest: ")]
    assert len(top_mhc) == 1 and "spkernels::" in top_mhc[0], proc.stdout
    for kind in ("prefill", "decode"):  # per step kind: wall, GPU busy (n/a on cpu), by category
        line = [ln for ln in lines if ln.startswith(f"profile {kind} steps (rank 0): ")]
        assert len(line) == 1 and ", GPU busy n/a; ops busy " in line[0], proc.stdout
        idle = [ln for ln in lines if ln.startswith(f"profile {kind} idle (rank 0): ")]
        assert len(idle) == 1 and " ms before the steps' first work; longest: " in idle[0], proc.stdout
    doc = json.loads((tmp_path / "out" / "runner.json").read_text())
    assert doc["command"].startswith("python -m spkernels.runner --device cpu --tp 2 "), doc["command"]
    assert doc["options"]["tp"] == 2 and doc["check"]["ok"] and doc["machine"]["gpu"] == "cpu"
    assert {"driver", "torch", "nccl", "commit"} <= set(doc["machine"])
    assert [len(t) for t in doc["tokens"]] == [3, 3, 3]
    kinds = doc["stats"]["step_kinds"]
    assert kinds["prefill"]["steps"] == 1 and kinds["decode"]["steps"] == 2, kinds
    for entry in kinds.values():
        assert entry["wall_ms"] > 0 and entry["gpu_busy_ms"] is None and entry["gpu_ms"] is None, entry
        assert 0 < entry["cpu_ops_busy_ms"] <= entry["wall_ms"], entry
        assert entry["cpu_ops_ms"]["mHC"] > 0 and entry["cpu_ops_ms"]["GEMM"] > 0, entry


def test_step_kinds_without_profile():
    """The results always carry wall_ms and gpu_busy_ms per step kind (None: not measured)."""
    stats = worker(0, 1, options(prompt_lens=(3, 5), gen=3, sp_threshold=None))["stats"]
    kinds = stats["step_kinds"]
    assert (kinds["prefill"]["steps"], kinds["decode"]["steps"]) == (1, 2), kinds
    assert all(k["wall_ms"] > 0 and k["gpu_busy_ms"] is None for k in kinds.values()), kinds
    assert 1e3 * stats["seconds"] == pytest.approx(sum(k["wall_ms"] for k in kinds.values()))


def test_profile_by_step_kind_attributes_kernels_to_their_step():
    """A kernel counts for the step whose range it starts in, clipped to it; kernels outside every
    step (the ranks' meeting) and the ranges' own GPU annotations count nowhere. The idle time is
    found: before each step's first kernel, and the longest stretches, named by the kernel after."""

    def event(name, start, end, device=DeviceType.CUDA):
        return SimpleNamespace(
            name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end)
        )

    step = profile_mod.STEP_RANGE
    events = [
        event(step + "prefill", 0, 5000, DeviceType.CPU),
        event(step + "prefill", 0, 5000),  # the range's annotation on the GPU timeline
        event(step + "decode", 6000, 7000, DeviceType.CPU),
        event(step + "decode", 8000, 9000, DeviceType.CPU),
        event("nvjet_tst_128x256", 100, 2100),
        event("void spk::mhc_rows_kernel<2, true, true, false>", 2000, 3000),
        event("void at::native::index_elementwise_kernel<128, 4>", 4500, 5500),  # clipped at 5000
        event("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 5200, 5800),  # between steps: nowhere
        event("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", 6100, 6400),
        event("nvjet_tst_64x8", 8100, 8300),
        event("aten::mm", 100, 200, DeviceType.CPU),
    ]
    kinds = profile_mod.by_step_kind(events, "cuda")
    assert kinds["prefill"]["steps"] == 1 and kinds["decode"]["steps"] == 2, kinds
    assert kinds["prefill"]["busy_ms"] == 3.4, kinds  # 0.1 .. 3.0 and 4.5 .. 5.0
    assert kinds["prefill"]["busy_by_category_ms"] == {
        "mHC": 1.0, "NCCL": 0.0, "attention": 0.0, "GEMM": 2.0, "other": 0.5
    }  # fmt: skip
    assert kinds["decode"]["busy_ms"] == 0.5 and kinds["decode"]["busy_by_category_ms"]["attention"] == 0.3
    # idle: prefill 0 .. 0.1 (lead), 3.0 .. 4.5; decode 6.0 .. 6.1 and 8.0 .. 8.1 (leads), 6.4 .. 7.0 and
    # 8.3 .. 9.0 (ends)
    assert kinds["prefill"]["lead_ms"] == 0.1 and kinds["decode"]["lead_ms"] == 0.2, kinds
    index_kernel = "void at::native::index_elementwise_kernel<128, 4>"
    assert kinds["prefill"]["gaps"] == [(1.5, index_kernel), (0.1, "nvjet_tst_128x256")], kinds
    end, fmha = "the step's end", "fmha_cutlassF_bf16_aligned_64x128_rf_sm80"
    assert kinds["decode"]["gaps"] == [(0.7, end), (0.6, end), (0.1, fmha)], kinds
    steps = [
        SimpleNamespace(prefill_tokens=64, seconds=0.0051),
        SimpleNamespace(prefill_tokens=0, seconds=0.001),
    ]
    entry = profile_mod.step_kinds(steps, kinds, "cuda")["prefill"]
    assert entry["gpu_busy_ms"] == 3.4 and entry["wall_per_gpu_busy"] == pytest.approx(5.1 / 3.4), entry
    assert (
        "profile prefill steps (rank 0): 1 steps, wall 5.10 ms, GPU busy 3.40 ms, wall / GPU busy 1.500"
        in (profile_mod.format_step_kind("prefill", entry))
    )
    assert profile_mod.format_idle("prefill", entry) == (
        "profile prefill idle (rank 0): 0.100 ms before the steps' first work; longest: "
        "1.500 ms before void at::native::index_elementwise_kernel<128, 4>; 0.100 ms before nvjet_tst_128x256"
    )


def step_op_counts(prompt_lens) -> list[dict[str, int]]:
    """Ops launched by a prefill step and a decode step of the tiny preset (2 layers), one process."""
    p = plan(options(prompt_lens=prompt_lens, gen=2, sp_threshold=None))
    model = Model(
        p.config, random_weights(p.config, 0, torch.device("cpu")), "cpu", None, len(p.prompts), p.kv_len
    )
    # Synchronous steps: each step() call is then exactly its own forward's ops (overlapped, a decode
    # step also gathers its inputs from the previous step's ids: the engine's two ops, not the model's).
    engine = Engine(model, p.policy, 64, overlap=False)
    requests = [Request(i, list(prompt), 2) for i, prompt in enumerate(p.prompts)]
    counts = []
    for _ in range(2):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.step(requests)
        counts.append(profile_mod.op_counts(prof.events()))
    return counts


def test_model_glue_op_count():
    """The model's glue (ops outside GEMM, attention and mHC) per step stays small: rotary tables
    once per forward, q and k roped together in place, K and V in one indexed write, equal fresh
    prompts in one attention call, short ones too (padded). Before: 81 glue ops in a prefill step,
    84 in a decode step; short prompts of different lengths took an attention call each."""
    # (prompt lengths, glue bound of the prefill step, attention calls per layer)
    for prompt_lens, glue_bound, calls in (((40,), 36, 1), ((6, 6), 36, 1), ((7, 5, 3), 44, 1)):
        prefill, decode = step_op_counts(prompt_lens)
        for kind, counts, bound in (("prefill", prefill, glue_bound), ("decode", decode, 43)):
            glue = {n: c for n, c in counts.items() if profile_mod.category(n) == "other"}
            assert sum(glue.values()) <= bound, (prompt_lens, kind, glue)
            assert "aten::cat" not in glue and glue.get("aten::cos") == 1, glue
        assert prefill["aten::scaled_dot_product_attention"] == 2 * calls, prefill


def test_prefill_attention_groups_match_one_call_per_request():
    """Fresh prompts of up to PAD_GROUP_MAX tokens on consecutive cache rows share one causal call,
    each padded to that length; longer ones share a call only with prompts of their own length; a
    later chunk and a decode token get a call each. The output equals one masked call per request
    over its own keys, whatever the cache holds beyond them (stale keys and values here), and pad
    rows are zero."""
    from spkernels.runner import model as model_mod

    config = preset("tiny")
    model = Model(config, random_weights(config, 0, torch.device("cpu")), "cpu", None, 9, 600)
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(model.kv_cache[0, i].shape, generator=gen).bfloat16() for i in range(2))
    # (cache row, start, count): 4 fresh of 3 lengths, a chunk, a decode token, 2 equal fresh, pads
    requests = [(0, 0, 5), (1, 0, 9), (2, 0, 9), (3, 0, 3), (4, 6, 4), (5, 10, 1), (6, 0, 4), (7, 0, 4)]
    segments, rows, positions, first = [], [], [], 0
    for row, start, count in requests:
        segments.append((row, first, start, count))
        rows += [row] * count
        positions += range(start, start + count)
        first += count
    T = first + 3
    rows += [model.trash_row] * 3
    positions += [0] * 3
    as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    batch = model_mod.Batch(as_t([0] * T), as_t(positions), as_t(rows), as_t([1] * T), first, segments, None)
    groups = model._prefill_groups(batch)
    short = model_mod.PAD_GROUP_MAX
    assert [(g[0], g[4], g[5], g[6] is None) for g in groups] == [
        (0, 4, short, False), (4, 1, 4, True), (5, 1, 1, True), (6, 2, short, False)
    ]  # fmt: skip
    q = torch.randn((T, model.local_heads, config.head_dim), generator=gen).bfloat16()
    out = model._prefill_attention(q, k_cache, v_cache, batch, groups)
    for row, first, start, count in segments:
        end = start + count
        mask = torch.arange(end) <= torch.arange(start, end)[:, None]
        want = torch.nn.functional.scaled_dot_product_attention(
            q[first : first + count].float().transpose(0, 1), k_cache[row, :, :end].float(),
            v_cache[row, :, :end].float(), attn_mask=mask,
        ).transpose(0, 1)  # fmt: skip
        torch.testing.assert_close(out[first : first + count].float(), want, atol=2e-2, rtol=2e-2)
    assert out[batch.num_tokens :].eq(0).all()
    # different lengths past PAD_GROUP_MAX stay apart; equal ones of any length go together
    long = short + 1
    for lengths, calls in (((long, long - 1), 2), ((long, long), 1), ((long - 1, 3), 1)):
        segs = [(i, sum(lengths[:i]), 0, n) for i, n in enumerate(lengths)]
        batch = model_mod.Batch(*(as_t([0] * sum(lengths)),) * 4, sum(lengths), segs, None)
        assert len(model._prefill_groups(batch)) == calls, lengths


@pytest.mark.parametrize(
    "name,label",
    [
        ("void spk::mhc_rows_kernel<(spk::YSrc)2, true, true, false>(spk::TileArgs)", "mHC"),
        ("spkernels::mhc_post_pre_rs_ag", "mHC"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "NCCL"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", "attention"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "GEMM"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "GEMM"),
        ("aten::mm", "GEMM"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
    ],
)
def test_profile_categories(name, label):
    assert profile_mod.category(name) == label


def test_profile_keeps_only_what_runs_after_the_sync():
    """The tracer's start and the ranks' meeting (sync) are not recorded: a wait there must not
    count as the model's time; what runs inside the context is."""
    a = torch.randn(64, 64)
    with profile_mod.Profiler(torch.device("cpu"), sync=lambda: torch.mm(a, a)) as prof:
        torch.add(a, a)
    totals = prof.totals()
    assert totals["GEMM"] == 0.0, totals
    assert totals["other"] > 0.0, totals
    assert [(name, calls) for name, _, calls in prof.top()["other"]] == [("aten::add", 1)], prof.top()


def test_profile_coverage_counts_overlaps_once():
    """A PDL pass 2 resident while its pass 1 runs: summed, the pair counts the overlap twice;
    covered, once. Gaps between kernels are not covered."""
    assert profile_mod.covered_ms([(0, 1000), (400, 1500), (2000, 2500), (2100, 2200)]) == 2.0
    assert profile_mod.covered_ms([]) == 0.0

    def kernel(name, start, end):
        return SimpleNamespace(
            name=name, device_type=DeviceType.CUDA, time_range=SimpleNamespace(start=start, end=end)
        )

    events = [
        kernel("void spk::mhc_rows_kernel<2, true, true, false>", 0, 1000),
        kernel("void spk::mhc_collapse_loop_kernel<false, true, 3>", 200, 1600),
        kernel("nvjet_tst_128x256", 1600, 2600),
        kernel("ProfilerStep#1", 0, 5000),
        SimpleNamespace(name="aten::mm", device_type=DeviceType.CPU, time_range=None),
    ]
    covered = profile_mod.coverage(events)
    assert covered["mHC"] == 1.6 and covered["GEMM"] == 1.0 and covered["GPU busy"] == 2.6, covered
    line = profile_mod.format_breakdown(covered, "cuda", "covered")
    assert line.startswith("profile (rank 0, covered): mHC 1.60 ms (62%)") and line.endswith(
        "GPU busy 2.60 ms"
    ), line


@pytest.mark.parametrize("overlap", [False, True])
def test_step_clock_starts_after_the_ranks_meet(overlap):
    """Synchronous steps call meet once each, before their clock starts; overlapped steps meet once
    per generation, before the first step's clock starts (a meeting per step would drain the device
    and undo the overlap). A rank's wait for lagging peers is never counted as a step's time, and
    overlapped, the steps' times add up to the generation's (each from the previous one's end)."""
    p = plan(options(prompt_lens=(3, 5), gen=3))
    model = Model(p.config, random_weights(p.config, 0, torch.device("cpu")), "cpu", None, 2, p.kv_len)
    calls, pause = [], [0.0]
    meet = lambda: (calls.append(1), time.sleep(pause[0]))  # noqa: E731
    engine = Engine(model, p.policy, 64, meet=meet, overlap=overlap)
    engine.generate(p.prompts, 3)  # first-call costs (a CPU prefill's first step took 0.8 s)
    calls.clear()
    engine.steps.clear()
    pause[0] = 0.5
    begin = time.perf_counter()
    engine.generate(p.prompts, 3)
    seconds = time.perf_counter() - begin
    assert len(engine.steps) == 3 and len(calls) == (1 if overlap else 3)
    assert all(0 < step.seconds < 0.5 for step in engine.steps), engine.steps
    if overlap:
        assert seconds - 0.5 >= sum(step.seconds for step in engine.steps) > 0.5 * (seconds - 0.5)


# name -> options: each runs overlapped and synchronous. Chunked: prompt chunks next to decode rows
# whose tokens are still on the device; microbatched: several forwards take the previous step's ids.
OVERLAP_CASES = {
    "tp1": options(tp=1, sp_threshold=None),
    "tp1-chunked-mb": options(tp=1, sp_threshold=None, max_tokens_per_step=12, microbatches=2,
                              microbatch_min_tokens=4),
    "tp2-sp": options(tp=2, sp_threshold=16),
    "tp2-nosp": options(tp=2, sp_threshold=None),
    "tp2-sp-chunked": options(tp=2, sp_threshold=8, max_tokens_per_step=12),
    # V4.1 with Engram: a PENDING token's n-grams completed on the device, its hashes sharded under SP
    "tp1-engram-chunked": options(tp=1, arch="v4.1", sp_threshold=None, max_tokens_per_step=12),
    "tp2-sp-engram": options(tp=2, arch="v4.1", sp_threshold=4, max_tokens_per_step=12),
}  # fmt: skip


def assert_same_run(got: dict, want: dict) -> None:
    """Tokens, logits and steps (all but their times) bitwise equal."""
    assert got["tokens"] == want["tokens"]
    assert len(got["logits"]) == len(want["logits"])
    for a, b in zip(got["logits"], want["logits"], strict=True):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    assert [s[:-1] for s in got["steps"]] == [s[:-1] for s in want["steps"]]
    assert got["forwards"] == want["forwards"]


def test_overlap_matches_synchronous_steps():
    """Overlapped steps (the next one enqueued before the last one's tokens reach the host) give the
    synchronous steps' tokens, logits and schedule bitwise, at tp = 1 and 2, with and without SP,
    with Engram."""
    cases = {}
    for name, opts in OVERLAP_CASES.items():
        cases[name] = opts
        cases[name + "-sync"] = dataclasses.replace(opts, overlap=False)
    results = run_all(cases)
    for name in OVERLAP_CASES:
        got, want = results[name], results[name + "-sync"]
        assert got["stats"]["overlap"] and not want["stats"]["overlap"], name
        assert_same_run(got, want)
    mb = results["tp1-chunked-mb"]
    assert len(mb["forwards"]) > len(mb["steps"])  # some steps ran several forwards
    assert {s[2] for s in results["tp2-sp"]["steps"]} == {True, False}  # SP prefill, TP decode
    assert any(s[2] for s in results["tp2-sp-engram"]["steps"])  # Engram hashes sharded under SP


HOST_COLLECTIVES = (
    "barrier", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "send",
    "recv", "isend", "irecv",
)  # fmt: skip


def count_host_collectives(rank: int, world_size: int, configs: list[RunOptions]) -> list[dict]:
    """Each run's calls of torch.distributed's host-level collectives (object collectives, barriers,
    point-to-point), the runner's own and the Communicator's: spkernels' ops are not counted (on CPU
    they reduce through gloo's tensor collectives)."""
    import torch.distributed as dist

    saved = {name: getattr(dist, name) for name in HOST_COLLECTIVES}
    calls = dict.fromkeys(HOST_COLLECTIVES, 0)

    def counting(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    counts = []
    try:
        for name, fn in saved.items():
            setattr(dist, name, counting(name, fn))
        for opts in configs:
            calls.update(dict.fromkeys(HOST_COLLECTIVES, 0))
            worker(rank, world_size, opts)
            counts.append(dict(calls))
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return counts


def test_tp2_ranks_exchange_nothing_per_step():
    """At tp = 2 the ranks schedule, sample and build batches alike, each on its own: the runner's
    host-level collectives (object collectives, barriers) do not grow with the number of steps,
    with SP or without, with Engram (the tokens come through the model's own device-side ops)."""
    layouts = ((16, "v4"), (None, "v4.1"))
    cases = [options(tp=2, sp_threshold=s, arch=a, gen=g) for s, a in layouts for g in (2, 6)]
    results = run_distributed(2, count_host_collectives, cases)
    once = {**dict.fromkeys(HOST_COLLECTIVES, 0), "barrier": 1, "all_gather_object": 1}
    for counts in results:  # the generation's one meeting, the results' gather to rank 0
        assert counts == [once] * len(cases), counts


def test_overlapped_steps_read_tokens_only_after_the_next_step():
    """An overlapped step reads no device value on the host (on a GPU each read would wait for every
    kernel enqueued before it): the only reads are of a step's tokens once the next step is enqueued
    (the last step's in finish). Until then its tokens are PENDING, and the next step's decode rows
    take them on the device."""
    p = plan(options(prompt_lens=(3, 40, 5), gen=4, sp_threshold=None))
    model = Model(p.config, random_weights(p.config, 0, torch.device("cpu")), "cpu", None, 3, p.kv_len)
    engine = Engine(model, p.policy, 16)  # the 40-token prompt in chunks, next to decode rows
    reads, resolved, takes = HostReads(), [], []
    resolve, build = engine._resolve, engine.build_batch

    def watched_resolve(step):
        first = len(reads.calls)
        resolved.append((next(i for i, s in enumerate(engine.steps) if s is step.info), len(engine.steps)))
        resolve(step)
        del reads.calls[first:]  # the reads it is there for

    def watched_build(entries, padded, decode):
        takes.append(
            sum(
                req.token_span(req.num_computed + n - 1, req.num_computed + n) == [PENDING]
                for req, n in entries
            )
        )
        return build(entries, padded, decode)

    engine._resolve, engine.build_batch = watched_resolve, watched_build
    with reads:
        requests = engine.generate(p.prompts, 4)
    assert reads.calls == [], reads.calls
    steps = len(engine.steps)
    assert resolved == [(i, i + 2) for i in range(steps - 1)] + [(steps - 1, steps)], resolved
    assert takes[0] == 0 and all(n > 0 for n in takes[1:]), takes
    assert all(PENDING not in req.generated and len(req.generated) == 4 for req in requests)
    sync = Engine(model, p.policy, 16, overlap=False)
    assert [r.generated for r in sync.generate(p.prompts, 4)] == [r.generated for r in requests]


def test_overlap_applies_where_the_schedule_ignores_tokens():
    """Overlap is on by default, Engram included (a PENDING token's hashes are completed on the
    device); off with overlap=False, pipeline stages and speculative decoding (its schedule depends
    on acceptance)."""
    p = plan(options(prompt_lens=(3, 5), gen=2, sp_threshold=None))
    weights = random_weights(p.config, 0, torch.device("cpu"))
    model = Model(p.config, weights, "cpu", None, 2, p.kv_len)
    assert Engine(model, p.policy, 64).overlap and not Engine(model, p.policy, 64, overlap=False).overlap
    config = p.config.replace(engram_layers=(1,))
    engram = Model(config, random_weights(config, 0, torch.device("cpu")), "cpu", None, 2, p.kv_len)
    assert Engine(engram, p.policy, 64).overlap
    assert parse_args(["--no-overlap"]).overlap is False and parse_args([]).overlap is True


def test_schedule_decode_first_within_budget():
    requests = [Request(0, [5] * 4, 2), Request(1, [6] * 10, 2), Request(2, [7] * 3, 2)]
    requests[0].num_computed, requests[0].generated = 4, [9]  # decoding
    entries = schedule(requests, budget=8)
    assert [(r.index, n) for r, n in entries] == [(0, 1), (1, 7)]
    requests[1].num_computed = 7
    assert [(r.index, n) for r, n in schedule(requests, budget=8)] == [(0, 1), (1, 3), (2, 3)]
    requests[0].generated = [9, 9]  # done: nothing more for it
    assert [(r.index, n) for r, n in schedule(requests, budget=2)] == [(1, 2)]


def test_token_span_slices_the_history_without_building_it():
    """Request.token_span(start, end) is the history's [start:end] for every span, across the prompt,
    the generated tokens and (speculating) the drafts, past the end included."""
    from spkernels.runner.speculative import SpecRequest

    plain = Request(0, [1, 2, 3], 4, generated=[4, 5])
    spec = SpecRequest(0, [1, 2, 3], 4, generated=[4], draft=[5, 6])
    for req, tokens in ((plain, [1, 2, 3, 4, 5]), (spec, [1, 2, 3, 4, 5, 6])):
        for start in range(len(tokens) + 2):
            for end in range(start, len(tokens) + 3):
                assert req.token_span(start, end) == tokens[start:end], (start, end)


@pytest.mark.parametrize("engram", [False, True])
def test_build_batch_matches_token_by_token_inputs(engram):
    """A step's inputs, prompt chunks written as ranges and the other tokens one by one, equal what
    each token gives alone: its id, position, cache row and context length, pad rows after them, the
    rows to sample (a prompt's last token, a decode row) and the Engram hashes, whatever the order of
    chunks and decode rows in the step."""
    p = plan(options(prompt_lens=(3,), gen=2, sp_threshold=None))
    config = p.config.replace(engram_layers=(1,)) if engram else p.config
    model = Model(config, random_weights(config, 0, torch.device("cpu")), "cpu", None, 4, p.kv_len)
    engine = Engine(model, p.policy, 64, overlap=False)
    requests = [
        Request(i, torch.randint(0, config.vocab_size, (n,)).tolist(), 4) for i, n in enumerate((9, 5, 7, 6))
    ]
    requests[1].num_computed, requests[1].generated = 5, [11]  # decoding
    requests[2].num_computed, requests[2].generated = 8, [12, 13]
    requests[3].num_computed = 2  # its second chunk
    entries = [(requests[0], 4), (requests[1], 1), (requests[2], 1), (requests[3], 4)]
    batch, samples = engine.build_batch(entries, 13, decode=False)
    want, rows_to_sample, hashes = [], [], []
    for req, count in entries:
        tokens = req.prompt + req.generated
        for position in range(req.num_computed, req.num_computed + count):
            want.append((tokens[position], position, req.index, position + 1))
            if engram:
                hashes += engram_mod.hash_ids(
                    tokens, [position], config.engram_orders, config.engram_table_size
                )
        if req.num_computed + count == len(tokens):
            rows_to_sample.append((req.index, len(want) - 1))
    want += [(model.pad_id, 0, model.trash_row, 1)] * (13 - len(want))
    got = torch.stack((batch.input_ids, batch.positions, batch.rows, batch.seq_lens), 1).tolist()
    assert got == [list(t) for t in want]
    assert batch.num_tokens == 10 and [(r.index, row) for r, row in samples] == rows_to_sample
    assert batch.sample_idx.tolist() == [row for _, row in rows_to_sample]
    assert batch.segments == [(0, 0, 0, 4), (1, 4, 5, 1), (2, 5, 8, 1), (3, 6, 2, 4)]
    if engram:
        pad = [[config.engram_table_size] * len(config.engram_orders)] * 3
        assert batch.hash_ids.tolist() == hashes + pad
    else:
        assert batch.hash_ids is None
    decode, _ = engine.build_batch(entries[1:3], 4, decode=True)
    assert decode.segments is None and decode.sample_idx is None
    assert decode.input_ids.tolist() == [11, 13, model.pad_id, model.pad_id]
    assert decode.positions.tolist() == [5, 8, 0, 0] and decode.seq_lens.tolist() == [6, 9, 1, 1]
    # decode rows only outside a graph (no prompt chunk: the block built from lists): the rows to sample
    eager, _ = engine.build_batch(entries[1:3], 4, decode=False)
    assert eager.input_ids.tolist() == decode.input_ids.tolist() and eager.sample_idx.tolist() == [0, 1]
    if engram:
        assert eager.hash_ids.tolist() == hashes[4:6] + pad[:2]


@pytest.mark.parametrize("engram", [False, True])
def test_build_batch_completes_pending_tokens_on_the_device(engram):
    """A decode row whose token is still PENDING takes it from the in-flight step's ids, and with
    Engram its n-grams, hashed on the host up to that token, are completed on the device: the batch
    equals the one built with the token known, next to a known decode row, a chunk and pad rows."""
    p = plan(options(prompt_lens=(3,), gen=2, sp_threshold=None))
    config = p.config.replace(engram_layers=(1,)) if engram else p.config
    model = Model(config, random_weights(config, 0, torch.device("cpu")), "cpu", None, 4, p.kv_len)
    engine = Engine(model, p.policy, 64)
    ids = torch.randint(0, config.vocab_size, (12,)).tolist()
    engine.inflight = [SimpleNamespace(ids=torch.tensor([ids[0], ids[1]]), sample_of={0: 1, 2: 0})]
    batches = []
    for pending in (True, False):
        requests = [Request(i, ids[2 + 2 * i : 4 + 2 * i] * (i + 1), 4) for i in range(4)]
        for req, generated in zip(requests[:3], ([ids[10], ids[1]], [ids[11]], [ids[0]]), strict=True):
            req.generated = generated  # decoding its last token
            req.num_computed = len(req.prompt) + len(generated) - 1
            if pending and req.index != 1:  # sampled by the step in flight
                generated[-1] = PENDING
        entries = [(requests[0], 1), (requests[1], 1), (requests[2], 1), (requests[3], 5)]
        batches.append(engine.build_batch(entries, 12, decode=False)[0])
    got, want = batches
    for name in ("input_ids", "positions", "rows", "seq_lens", "sample_idx", "hash_ids"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert got.input_ids[:3].tolist() == [ids[1], ids[11], ids[0]]


@pytest.mark.parametrize(
    "changes, error, match",
    [
        (dict(tp=1, sp_threshold=8), ValueError, "needs --tp > 1"),
        (dict(tp=3), ValueError, "num_heads = 8 is not divisible by tp = 3"),
        (dict(tp=2, sp_threshold=4, max_tokens_per_step=64, comm_max_tokens=32), ValueError, "capacity"),
        (dict(tp=2, capture_sizes=(4, 2)), ValueError, "capture_sizes must be strictly increasing"),
        (dict(tp=2, pp=3), ValueError, r"pp = 3 must be in \[1, num_layers = 2\]"),
        (dict(prompt_lens=(200,)), ValueError, "max_seq_len"),
        (dict(tp=2, sp_threshold=0), ValueError, "sp_threshold"),
        (dict(prompt_lens=(3, 0)), ValueError, "prompt lengths"),
        (dict(device="cpu", graphs=True), ValueError, "CUDA graphs"),
        (dict(gen=0), ValueError, "--gen"),
        (dict(repeat=0), ValueError, "--repeat must be an int >= 1"),
        (dict(warmup=-1), ValueError, "--warmup must be an int >= 0"),
        (dict(prompt_lens=None, prompts=0), ValueError, "--prompts must be an int >= 1"),
        (dict(prompt_lens=None, prompt_len=0), ValueError, "--prompt-len must be an int >= 1"),
        (dict(check=True, check_atol=-1.0), ValueError, "--check-atol must be a finite number"),
        (dict(load_weights="/nonexistent/weights.safetensors"), ValueError, "no such file"),
    ],
)
def test_impossible_configs_raise(changes, error, match):
    with pytest.raises(error, match=match):
        plan(options(**changes))


def test_cli_rejects_an_unusable_out_folder_before_running(tmp_path, capsys):
    from spkernels.runner.__main__ import main

    taken = tmp_path / "a_file"
    taken.write_text("")
    assert main(["--device", "cpu", "--out", str(taken)]) == 2
    assert "--out" in capsys.readouterr().err


def test_capacity_covers_every_step():
    opts = options(tp=2, sp_threshold=4, max_tokens_per_step=9, capture_sizes=(2, 4, 8, 16))
    p = plan(opts)
    policy = SPPolicy(2, 4, (2, 4, 8, 16))
    assert p.comm_capacity == max(policy.pad(9, False), policy.pad(5, True)) == 10


# ----------------------------------------------------------------------------- GPU (skipped without)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def cuda_reference() -> dict:
    return worker(0, 1, options(device="cuda", tp=1, sp_threshold=None, graphs=False))


def gpu_options(**changes) -> RunOptions:
    return options(device="cuda", check_graphs=True, **changes)


# name -> (options, the (use_sp, graph) pairs its steps must show; None: not pinned)
GPU_CASES = {
    "tp1-graphs": (gpu_options(tp=1, sp_threshold=None), {(False, False), (False, True)}),
    "tp2-nosp-graphs": (gpu_options(tp=2, sp_threshold=None), {(False, False), (False, True)}),
    # prefill eager in SP; the decode bucket 8 >= threshold engages SP inside the captured graph
    "tp2-sp-in-graph": (gpu_options(tp=2, sp_threshold=8), {(True, False), (True, True)}),
    "tp2-sp-chunked-graphs": (gpu_options(tp=2, sp_threshold=8, max_tokens_per_step=12), None),
}


class GpuLayouts:
    """The GPU_CASES' runs, one run_all per tp size on first use: where tp = 2 has no two GPUs its
    cases skip, and the tp = 1 case still runs."""

    def __init__(self) -> None:
        self.by_tp: dict[int, dict] = {}

    def __getitem__(self, name: str) -> dict:
        tp = GPU_CASES[name][0].tp
        if tp not in self.by_tp:
            self.by_tp[tp] = run_all({n: opts for n, (opts, _) in GPU_CASES.items() if opts.tp == tp})
        return self.by_tp[tp][name]


@pytest.fixture(scope="module")
def gpu_layouts() -> GpuLayouts:
    return GpuLayouts()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_graphs_match_one_process(cuda_reference, gpu_layouts, name):
    opts, expect = GPU_CASES[name]
    results = gpu_layouts[name]
    seen = assert_policy_steps(results, opts)
    if expect is not None:
        assert seen == expect
    assert results["stats"]["graph_steps"] > 0
    # Replay against an eager forward of the same step (same shapes, same kernels): any difference
    # beyond a bf16 ulp of the logits means a static buffer was not refreshed or an op is not
    # capture-safe.
    largest = max(lg.abs().max().item() for lg in cuda_reference["logits"])
    assert results["stats"]["graph_max_diff"] <= largest * 2**-8
    assert_matches(results, cuda_reference)


@pytest.mark.gpu
@requires_cuda
def test_gpu_moe_graphs_match_eager(cuda_reference):
    """MoE at tp = 1 (the routed experts as grouped GEMMs over static pair slots, no host read):
    decode steps replay CUDA graphs, which match an eager forward of the same step, and the run
    matches an eager MoE run."""
    moe = dict(tp=1, sp_threshold=None, num_experts=4)
    results = run_all({"eager": options(device="cuda", graphs=False, **moe), "graphs": gpu_options(**moe)})
    got, want = results["graphs"], results["eager"]
    assert got["stats"]["graph_steps"] > 0
    largest = max(lg.abs().max().item() for lg in want["logits"])
    assert got["stats"]["graph_max_diff"] <= largest * 2**-8
    assert_matches(got, want)
    assert not torch.equal(want["logits"][0], cuda_reference["logits"][0])  # the experts did add


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_experts", [None, 4], ids=["dense", "moe"])
def test_gpu_forward_without_host_sync(num_experts):
    """No host synchronisation inside a forward: every step's forward (a prefill of two requests, a
    chunked continuation with a decode row, eager decode and graph replays) and its LM head run under
    torch.cuda.set_sync_debug_mode("error"); only reading the tokens afterwards synchronises."""
    p = plan(
        options(
            device="cuda",
            prompt_lens=(5, 40),
            gen=4,
            sp_threshold=None,
            capture_sizes=(2,),
            num_experts=num_experts,
        )
    )
    model = Model(p.config, random_weights(p.config, 0, torch.device("cuda")), "cuda", None, 2, p.kv_len)
    engine = Engine(model, p.policy, 16)  # the 40-token prompt in chunks
    engine.capture(2)
    requests = [Request(i, list(prompt), 4) for i, prompt in enumerate(p.prompts)]
    kinds = set()
    while not all(req.done for req in requests):
        entries = schedule(requests, 16)
        decode = all(req.decoding for req, _ in entries)
        padded = p.policy.pad(sum(n for _, n in entries), decode)
        graph = decode and padded in engine.graphs
        batch, samples = engine.build_batch(entries, padded, decode)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = engine._forward(batch, False, graph, None)
            if not graph:
                model.head(out[: len(samples)])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        kinds.add((decode, graph))
        engine.step(requests)  # the real step (same K/V rewritten); its tokens are read a step later
    engine.finish()
    assert kinds == {(False, False), (True, True)}, kinds  # prefill (mixed with decode rows), replays


@pytest.mark.gpu
@requires_cuda
def test_gpu_overlap_matches_synchronous_steps():
    """On CUDA with decode graphs, overlapped steps (each replay fed the previous step's ids on the
    device, tokens and logits through pinned copies read a step late) give the synchronous steps'
    tokens and logits bitwise, in pure decode replays and in chunked steps that mix prompt chunks with
    decode rows, with Engram (hashes completed on the device, then copied into the graph's inputs).
    Profiled, every step kind has wall and GPU busy time."""
    base = {
        "graphs": options(device="cuda", sp_threshold=None),
        "graphs-chunked": options(device="cuda", sp_threshold=None, max_tokens_per_step=12),
        "graphs-engram": options(device="cuda", arch="v4.1", sp_threshold=None, max_tokens_per_step=12),
    }
    cases = {"profiled": dataclasses.replace(base["graphs"], profile=True)}
    for name, opts in base.items():
        cases[name] = opts
        cases[name + "-sync"] = dataclasses.replace(opts, overlap=False)
    results = run_all(cases)
    for name in (*base, "profiled"):
        got, want = results[name], results[name.replace("profiled", "graphs") + "-sync"]
        assert got["stats"]["overlap"] and got["stats"]["graph_steps"] > 0, got["stats"]
        assert_same_run(got, want)
    for kind, entry in results["profiled"]["stats"]["step_kinds"].items():
        assert entry["steps"] and entry["gpu_busy_ms"] > 0 and entry["wall_ms"] > 0, (kind, entry)


@pytest.mark.gpu
@requires_cuda
def test_gpu_capture_collects_first_and_pauses_the_collector():
    """Python's garbage collector runs before each decode graph's capture and not during it. Since
    torch.cuda.graph stopped collecting first, a collection inside a capture could free an earlier
    engine's graphs (a reference cycle's): destroying a graph mid-capture invalidates the capture
    (the overlap test failed so after the MoE graphs test)."""
    p = plan(options(device="cuda", sp_threshold=None, capture_sizes=(2,)))
    model = Model(p.config, random_weights(p.config, 0, torch.device("cuda")), "cuda", None, 2, p.kv_len)

    class Cycle:
        pass

    garbage, x = Cycle(), torch.zeros(8, device="cuda")
    garbage.self, garbage.graph = garbage, torch.cuda.CUDAGraph()
    with torch.cuda.graph(garbage.graph):
        x.add_(1)
    collected = weakref.ref(garbage)
    del garbage
    seen, forward = [], model.forward

    def watched(*args):
        if torch.cuda.is_current_stream_capturing():
            seen.append({"collector on": gc.isenabled(), "cycle alive": collected() is not None})
        return forward(*args)

    model.forward = watched
    Engine(model, p.policy, 16).capture(2)
    assert seen == [{"collector on": False, "cycle alive": False}]
    assert gc.isenabled()


@pytest.mark.gpu
@requires_cuda
def test_gpu_overlapped_generation_syncs_only_to_read_tokens():
    """A whole overlapped generation (prefill, chunks next to decode rows, graph replays) runs under
    torch.cuda.set_sync_debug_mode("error") except where the engine reads a finished step's tokens
    (Engine._resolve), and gives the synchronous steps' tokens."""
    p = plan(options(device="cuda", prompt_lens=(5, 40), gen=4, sp_threshold=None, capture_sizes=(2,)))
    model = Model(p.config, random_weights(p.config, 0, torch.device("cuda")), "cuda", None, 2, p.kv_len)
    engine = Engine(model, p.policy, 16)  # the 40-token prompt in chunks
    engine.capture(2)
    resolve, resolved = engine._resolve, []

    def resolve_allowed(step):
        torch.cuda.set_sync_debug_mode("default")
        try:
            resolve(step)
            resolved.append(step)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    engine.overlap = False  # the same graphs, synchronous steps: the tokens to get
    want = [r.generated for r in engine.generate(p.prompts, 4)]
    engine.overlap, engine._resolve, engine.meet = True, resolve_allowed, lambda: None
    engine.steps.clear()
    torch.cuda.synchronize()  # the meeting's drain
    torch.cuda.set_sync_debug_mode("error")
    try:
        requests = engine.generate(p.prompts, 4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(resolved) == len(engine.steps) and engine.stats()["graph_steps"] > 0
    assert [r.generated for r in requests] == want


@pytest.mark.parametrize(
    "overrides,tp,match",
    [
        (dict(hc=3), 1, "config.hc must be 4"),
        (dict(arch="v5"), 1, "config.arch"),
        (dict(head_dim=24), 1, "head_dim must be a multiple of 16"),
        (dict(ffn_size=136), 2, "ffn_size = 136 is not a multiple of 8 \\* tp = 16"),
        (dict(num_heads=6), 4, "num_heads = 6 is not divisible by tp = 4"),
    ],
)  # fmt: skip
def test_config_rejects_shapes_the_kernels_cannot_run(overrides, tp, match):
    """The model's shapes are checked up front, not mid-forward by a glue kernel."""
    config = preset("tiny", **overrides)
    with pytest.raises(ValueError, match=match):
        config.validate(tp)
    preset("tiny").validate(tp)  # the preset itself is fine


def test_generation_after_a_failed_one_starts_clean():
    """A step that raises abandons its generation's steps in flight: the engine's next generation
    gives the tokens a fresh engine gives, not ones gathered from the failed generation's ids."""
    p = plan(options(prompt_lens=(5, 7), gen=4))
    weights = random_weights(p.config, 0, torch.device("cpu"))

    def engine():
        return Engine(Model(p.config, weights, "cpu", None, 2, p.kv_len), p.policy, 16)

    want = [r.generated for r in engine().generate(p.prompts, 4)]
    failing, forward, calls = engine(), None, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return forward(*args, **kwargs)

    forward, failing._forward = failing._forward, flaky
    with pytest.raises(RuntimeError, match="injected"):
        failing.generate(p.prompts, 4)
    assert not failing.inflight
    failing._forward = forward
    assert [r.generated for r in failing.generate(p.prompts, 4)] == want
