"""V4.1 in the runner on CPU (gloo): delayed pre-mix, Engram, the expert-parallel
MoE and pipeline stages. PP2xTP2 (4 processes) and PP2xTP1, with SP on and off, give the one-process
greedy tokens and logits; Engram sits on stage 1's first layer; prompts are not tp multiples. Plus
plain-math checks of the Engram add, the MoE gate and experts, the delayed-mode forward, and the
stage boundary's trim and re-shard. Microbatched pipelines (--microbatches 2, 3) give bitwise the
tokens and logits of one forward per step, split no finer than --microbatch-min-tokens allows, and
their stages never read a device value on the host (which would stop them overlapping)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import test_runner
import torch
from distributed import run_distributed
from spkernels import reference as ref
from spkernels.comm import Communicator
from spkernels.runner import (
    Engine,
    Model,
    Request,
    RunOptions,
    compare,
    engram,
    moe,
    pipeline,
    plan,
    random_weights,
    worker,
)
from spkernels.runner.__main__ import main, report
from spkernels.runner.config import preset
from spkernels.runner.engine import split_microbatches
from spkernels.runner.launch import preset_config
from test_runner import HostReads, assert_matches, assert_policy_steps, run_configs

# Five prompts of lengths 1, 3, 5, 40, 2 (not tp multiples: shards with pad rows at tp = 2); the
# tiny preset has 2 layers, so pp = 2 puts layer 1, V4.1's default Engram layer, first on stage 1.
BASE = dataclasses.replace(test_runner.BASE, arch="v4.1")


def options(**changes) -> RunOptions:
    return dataclasses.replace(BASE, **changes)


def microbatched(opts: RunOptions, microbatches: int, min_tokens: int = 1) -> RunOptions:
    """``opts`` split into up to ``microbatches`` forwards per step, of at least ``min_tokens`` each on
    average (1: the tiny test steps split, decode steps included)."""
    return dataclasses.replace(opts, microbatches=microbatches, microbatch_min_tokens=min_tokens)


def test_engram_on_stage_first_layer():
    config = preset_config(BASE)
    assert config.engram_layers == (1,)
    assert pipeline.stage_layers(config.num_layers, 2, 1)[0] == 1


# ----------------------------------------------------------------------------- plain math
def test_engram_add_matches_per_token_formula():
    gen = torch.Generator().manual_seed(1)
    T, hc, D, E, rows = 6, 4, 32, 8, 11
    stream = torch.randn(T, hc, D, generator=gen).to(torch.bfloat16)
    tables = [torch.randn(rows + 1, E, generator=gen).to(torch.bfloat16) for _ in range(2)]
    tables = [torch.cat([t[:-1], t.new_zeros(1, E)]) for t in tables]  # the zero pad row
    w_key = (torch.randn(D, 2 * E, generator=gen) / 4).to(torch.bfloat16)
    w_value = (torch.randn(D, 2 * E, generator=gen) / 4).to(torch.bfloat16)
    ids = torch.randint(0, rows, (T, 2), generator=gen)
    ids[-1] = rows  # a pad row
    out = engram.engram_add(stream, ids, tables, w_key, w_value)
    for t in range(T):
        e = torch.cat([tables[0][ids[t, 0]], tables[1][ids[t, 1]]])
        key, value = (w_key @ e).double(), (w_value @ e).double()  # bf16 products, as in the module
        for j in range(hc):
            x = stream[t, j].double()
            d = (x / x.square().mean().add(1e-6).sqrt()) @ (key / key.square().mean().add(1e-6).sqrt())
            d = d / math.sqrt(D)
            gate = torch.sigmoid(torch.sign(d) * d.abs().clamp_min(1e-6).sqrt())
            want = (x + gate * value).to(torch.bfloat16)
            # one bf16 rounding of an fp32 vs fp64 sum: at most one bf16 spacing apart
            spacing = 2.0 ** (torch.floor(torch.log2(want.double().abs().clamp_min(2**-126))) - 7)
            assert ((out[t, j].double() - want.double()).abs() <= spacing).all(), (t, j)
    assert torch.equal(out[-1], stream[-1])  # pad memory is zero: the stream row is untouched


def test_engram_hash_depends_on_last_n_tokens_only():
    a, b = [5, 9, 1, 2, 3], [7, 7, 1, 2, 3]
    orders, size = (2, 3), 101
    assert engram.hash_ids(a, range(4, 5), orders, size) == engram.hash_ids(b, range(4, 5), orders, size)
    assert engram.hash_ids(a, range(2, 3), (3,), size) != engram.hash_ids(b, range(2, 3), (3,), size)
    ids = engram.hash_ids(a, range(5), orders, size)
    assert all(0 <= i < size for row in ids for i in row)
    assert ids[0] != engram.hash_ids([4], range(1), orders, size)[0]  # the first token hashes on its own


def test_engram_hash_windows_match_one_ngram_at_a_time():
    """hash_windows (int64 tensor arithmetic modulo 2^61 - 1) gives ngram_hash's exact rows for every
    order, from a request's first token (sentinels) and from later starts (a window of its history),
    token ids up to 2^31; its product modulo the prime is exact at the operands' extremes."""
    prime, gen = engram._PRIME, torch.Generator().manual_seed(5)
    edges = [0, 1, 2, (1 << 30) - 1, 1 << 30, (1 << 31) - 1, 1 << 31, (1 << 60) + 12345, prime - 2, prime - 1]
    a = torch.tensor(edges + torch.randint(0, prime, (4096,), generator=gen).tolist())
    for b in (engram._MULT, 0, 1, (1 << 31) - 1, 1 << 31, prime - 1):
        assert engram._mul_mod_prime(a, b).tolist() == [x * b % prime for x in a.tolist()], b
    x = torch.tensor([0, prime - 1, prime, 2 * prime, (1 << 63) - 1])
    assert engram._mod_prime(x).tolist() == [v % prime for v in x.tolist()]
    tokens = torch.randint(0, 1 << 31, (300,), generator=gen)
    for orders in ((2, 3), (1,), (4, 1, 3)):
        width = max(orders)
        for start in (0, 1, width - 1, width, 57):
            history = tokens[max(0, start - width + 1) :]
            got = engram.hash_windows(engram.windows(history, start, width), orders, 65537)
            want = engram.hash_ids(tokens.tolist(), range(start, len(tokens)), orders, 65537)
            assert got.tolist() == want, (orders, start)


def test_moe_gates_and_expert_parallel_split():
    gen = torch.Generator().manual_seed(2)
    T, D, F, E, k = 9, 16, 8, 4, 2
    x = torch.randn(T, D, generator=gen).to(torch.bfloat16)
    router = torch.randn(E, D, generator=gen)
    w_gate, w_up = (torch.randn(E, F, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    w_down = torch.randn(E, D, F, generator=gen).to(torch.bfloat16)
    g = moe.gates(x, router, k)
    assert ((g > 0).sum(dim=1) <= k).all()
    scores = x.float() @ router.t()
    top = scores.topk(k + 1).values
    margins = top[:, :k] - top[:, k:]
    want = margins / (margins.sum(1, keepdim=True) + moe.GATE_TAU)
    torch.testing.assert_close(g.sum(dim=1), want.sum(dim=1), atol=1e-5, rtol=0)
    assert (g.sum(dim=1) < 1).all()
    # Well conditioned where every margin is tiny: gates move by at most ~2x the score noise / GATE_TAU.
    tied = torch.zeros(1, D, dtype=torch.bfloat16)
    tied_router = torch.stack([router[0], router[0] + 1e-3, router[0] - 1e-3, router[0] + 2e-3])
    bump = torch.full((1, D), 2**-6).to(torch.bfloat16)
    noise = ((tied + bump).float() @ tied_router.t() - tied.float() @ tied_router.t()).abs().max()
    moved = (moe.gates(tied + bump, tied_router, k) - moe.gates(tied, tied_router, k)).abs().max()
    assert moved <= 4 * noise / moe.GATE_TAU + 1e-6
    torch.testing.assert_close(g.sort(dim=1, descending=True).values[:, :k], want, atol=1e-5, rtol=0)
    full = moe.routed_experts(x, g, w_gate, w_up, w_down, k)
    dense = torch.zeros(T, D)
    for t in range(T):
        for e in range(E):
            act = (torch.nn.functional.silu((w_gate[e] @ x[t]).float()) * (w_up[e] @ x[t]).float()).bfloat16()
            dense[t] += g[t, e] * (w_down[e] @ act).float()
    torch.testing.assert_close(full, dense, atol=1e-4, rtol=1e-4)
    halves = [
        moe.routed_experts(
            x, g[:, r * 2 : r * 2 + 2], *(w[r * 2 : r * 2 + 2] for w in (w_gate, w_up, w_down)), k
        )
        for r in range(2)
    ]
    torch.testing.assert_close(halves[0] + halves[1], full, atol=1e-5, rtol=1e-5)
    # A row's sum depends on its own gates only: the first rows alone, or with zero-gate pad rows
    # appended (a CUDA-graph bucket), give the same bits; pad rows give zeros.
    assert torch.equal(moe.routed_experts(x[:4], g[:4], w_gate, w_up, w_down, k), full[:4])
    padded = moe.routed_experts(torch.cat([x, x[:3]]), torch.cat([g, 0 * g[:3]]), w_gate, w_up, w_down, k)
    assert torch.equal(padded[:T], full) and not padded[T:].any()


def test_delayed_forward_matches_reference_flow():
    """One prefill through the model against the V4.1 flow spelled out with reference.py: each site
    collapses with the previous site's pre (one-hot on stream 0 first), Engram before layer 1's
    attention pre, exit collapse with the last pre_mix."""
    opts = options(prompt_lens=(7,))
    p = plan(opts)
    weights = random_weights(p.config, 0, torch.device("cpu"))
    model = Model(p.config, weights, "cpu", None, 1, p.kv_len)
    req = Request(0, p.prompts[0], 1)
    batch, _ = Engine(model, p.policy, 64).build_batch([(req, 7)], 7, decode=False)
    logits = model.forward(batch, use_sp=False)

    fresh = Model(p.config, weights, "cpu", None, 1, p.kv_len)
    cfg = p.config
    stream = fresh.embed[batch.input_ids].unsqueeze(1).expand(-1, 4, -1).contiguous()
    pre_mix = torch.zeros(7, 4)
    pre_mix[:, 0] = 1
    for i, layer in enumerate(fresh.layers):
        if i in cfg.engram_layers:
            stream = engram.engram_add(stream, batch.hash_ids, *layer["engram"])
        for site, sublayer in (
            ("attn_mix", lambda li, i=i: fresh.attention(i, li, batch)),
            ("ffn_mix", lambda li, i=i: fresh.ffn(i, li)),
        ):
            layer_input, post_mix, res_mix, pre_mix_next = ref.mhc_pre(
                stream, *layer[site][:4], pre_mix, *cfg.eps, sinkhorn_eps=cfg.sinkhorn_eps
            )
            stream = ref.mhc_post(sublayer(layer_input), stream, post_mix, res_mix)
            pre_mix = pre_mix_next
    h = ref.collapse(stream, pre_mix)[batch.sample_idx].float()
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + cfg.norm_eps) * fresh.norm_weight
    torch.testing.assert_close(logits, h @ fresh.lm_head.t(), atol=0, rtol=0)  # same ops, same order


# ----------------------------------------------------------------------------- stage boundary
def boundary_round_trip(rank: int, world_size: int) -> None:
    gen = torch.Generator().manual_seed(3)
    num_tokens, padded, hc, D = 5, 8, 4, 16
    full_stream = torch.randn(padded, hc, D, generator=gen).to(torch.bfloat16)
    full_pre = torch.rand(padded, hc, generator=gen)
    full_stream[num_tokens:], full_pre[num_tokens:] = 0, 0  # pad rows are zero
    rows = slice(rank * padded // world_size, (rank + 1) * padded // world_size)
    with Communicator(max_tokens=padded, hidden_size=D) as comm:
        for use_sp in (True, False):
            local = [full_stream[rows].clone(), full_pre[rows].clone()] if use_sp else [full_stream, full_pre]
            sent = pipeline.stage_exit(local, num_tokens, use_sp, comm)
            assert torch.equal(sent[0], full_stream[:num_tokens]) and torch.equal(
                sent[1], full_pre[:num_tokens]
            )
            back = pipeline.stage_entry(sent, padded, use_sp, comm)
            assert all(torch.equal(b, t) for b, t in zip(back, local, strict=True)), use_sp


def test_stage_boundary_trims_and_reshards_exactly():
    run_distributed(2, boundary_round_trip)


# ----------------------------------------------------------------------------- end to end
# name -> (options, the SP modes its steps must show, reference key)
CASES = {
    "pp2-tp2-sp": (options(tp=2, pp=2, sp_threshold=16), {True, False}, "dense"),
    "pp2-tp2-sp-direct": (
        options(tp=2, pp=2, sp_threshold=16, pp_direct_shards=True),
        {True, False},
        "dense",
    ),
    "pp2-tp2-nosp": (options(tp=2, pp=2, sp_threshold=None), {False}, "dense"),
    "pp2-tp2-sp-moe": (options(tp=2, pp=2, sp_threshold=8, num_experts=4), {True}, "moe"),
    "pp2-tp2-sp-v4": (options(arch="v4", tp=2, pp=2, sp_threshold=8), {True}, "v4"),
    "pp2-tp1": (options(tp=1, pp=2, sp_threshold=None), {False}, "dense"),
    "pp2-tp1-moe": (
        options(tp=1, pp=2, sp_threshold=None, num_experts=4, max_tokens_per_step=12),
        {False},
        "moe",
    ),
    "tp2-sp-moe-chunked": (options(tp=2, sp_threshold=8, num_experts=4, max_tokens_per_step=12), None, "moe"),
    # microbatched pipelines: the prefill step splits into 9 + 42 tokens (9 pads to 10 for SP at tp = 2)
    "pp2-tp2-sp-mb2": (microbatched(options(tp=2, pp=2, sp_threshold=8), 2), {True, False}, "dense"),
    "pp2-tp1-mb3": (microbatched(options(tp=1, pp=2, sp_threshold=None), 3), {False}, "dense"),
}
REFERENCES = {
    "dense": options(sp_threshold=None),
    "moe": options(sp_threshold=None, num_experts=4),
    "v4": options(arch="v4", sp_threshold=None),
}


@pytest.fixture(scope="module")
def references() -> dict:
    return {name: worker(0, 1, opts) for name, opts in REFERENCES.items()}


@pytest.fixture(scope="module")
def layouts() -> dict:
    """rank 0's results per case: one spawn per world size."""
    out = {}
    for world in sorted({o.tp * o.pp for o, _, _ in CASES.values()}):
        names = [n for n, (o, _, _) in CASES.items() if o.tp * o.pp == world]
        results = run_distributed(world, run_configs, [CASES[n][0] for n in names], timeout=180)
        assert all(r == [None] * len(names) for r in results[1:])
        out.update(zip(names, results[0], strict=True))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_matches_one_process(references, layouts, name):
    opts, modes, ref_name = CASES[name]
    results = layouts[name]
    if opts.microbatches > 1:
        seen = assert_policy_forwards(results, opts)
    else:
        seen = {use_sp for use_sp, _ in assert_policy_steps(results, opts)}
    assert seen == modes if modes is not None else True in seen
    assert_matches(results, references[ref_name])


def test_direct_shard_transfer_is_identical(layouts):
    """Rank-to-rank shards between stages (SP steps) must give bitwise the gather/re-shard results."""
    direct, gathered = layouts["pp2-tp2-sp-direct"], layouts["pp2-tp2-sp"]
    assert direct["tokens"] == gathered["tokens"]
    assert all(torch.equal(a, b) for a, b in zip(direct["logits"], gathered["logits"], strict=True))


def test_engram_and_experts_move_the_logits(references):
    """The comparisons above can see a skipped Engram (e.g. on a stage's first layer) or dropped
    experts: either moves the logits by more than the tolerance."""
    without_engram = worker(0, 1, options(sp_threshold=None, engram_layers=()))
    assert not compare(without_engram, references["dense"])["ok"]
    assert not compare(references["moe"], references["dense"])["ok"]


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(tp=2, pp=3), r"pp = 3 must be in \[1, num_layers = 2\]"),
        (dict(tp=1, sp_threshold=8), "needs --tp > 1"),
        (dict(tp=4, num_experts=6), "num_experts = 6 is not divisible by tp = 4"),
        (dict(num_experts=2), "moe_top_k = 2 must be below num_experts = 2"),
        (dict(engram_layers=(2,)), "engram_layers"),
        (dict(device="cpu", pp=2, graphs=True), "CUDA graphs"),
        (dict(pp=2, microbatches=0), "--microbatches must be an int >= 1"),
        (dict(microbatches=-2), "--microbatches must be an int >= 1"),
        (dict(microbatches=1.5), "--microbatches must be an int >= 1"),
        (dict(pp=2, microbatch_min_tokens=0), "--microbatch-min-tokens must be a positive int"),
    ],
)
def test_impossible_configs_raise(changes, match):
    with pytest.raises(ValueError, match=match):
        plan(options(**changes))


def test_moe_width_must_fill_16_byte_rows():
    with pytest.raises(ValueError, match="moe_ffn_size must be a multiple of 8"):
        preset("tiny", num_experts=4, moe_ffn_size=12).validate(1)


# ----------------------------------------------------------------------------- microbatches
def assert_policy_forwards(results: dict, opts: RunOptions) -> set[bool]:
    """Every microbatch forward padded and dispatched by the policy from its own count, at most
    ``opts.microbatches`` per step and no more than the step's tokens // ``opts.microbatch_min_tokens``
    (at least one), adding up to the step's tokens; -> the SP modes seen."""
    p = plan(opts)
    per_step = [0] * len(results["steps"])
    tokens = [0] * len(results["steps"])
    for step, num_tokens, padded, use_sp, graph, decode in results["forwards"]:
        assert padded == p.policy.pad(num_tokens, uniform_decode=decode)
        assert use_sp == p.policy.use_sp(padded) and not graph
        assert decode == (results["steps"][step][4] == 0)  # every forward takes its step's path
        per_step[step] += 1
        tokens[step] += num_tokens
    assert tokens == [s[0] for s in results["steps"]]
    allowed = [max(1, min(opts.microbatches, n // opts.microbatch_min_tokens)) for n in tokens]
    assert all(1 <= n <= most for n, most in zip(per_step, allowed, strict=True))
    assert max(per_step) == max(allowed) > 1
    assert results["stats"]["microbatches"] == len(results["forwards"])
    return {f[3] for f in results["forwards"]}


def test_split_microbatches_keeps_requests_whole():
    reqs = [Request(i, [1] * 50, 1) for i in range(5)]
    entries = list(zip(reqs, [1, 3, 5, 40, 2], strict=True))
    assert [[r.index for r, _ in g] for g in split_microbatches(entries, 2)] == [[0, 1, 2], [3, 4]]
    assert [[r.index for r, _ in g] for g in split_microbatches(entries, 3)] == [[0, 1, 2], [3], [4]]
    assert split_microbatches(entries, 1) == [entries]
    for m in range(1, 8):  # contiguous, in order, whole entries, never more groups than asked or entries
        groups = split_microbatches(entries, m)
        assert [e for g in groups for e in g] == entries and 1 <= len(groups) <= min(m, len(entries))
    decode = [(r, 1) for r in reqs]
    assert [len(g) for g in split_microbatches(decode, 2)] == [2, 3]
    # at most total // min_tokens groups: 51 tokens of at least 20 each -> 2 groups; 5 decode tokens -> 1
    assert [[r.index for r, _ in g] for g in split_microbatches(entries, 3, 20)] == [[0, 1, 2], [3, 4]]
    assert [len(g) for g in split_microbatches(decode, 3, 2)] == [2, 3]
    assert split_microbatches(decode, 3, 8) == [decode]


_matmul = torch.Tensor.__matmul__


def _row_invariant_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # CPU fp32 GEMM (one thread, as in run_distributed) rounds a row differently when the product has
    # at most 3 rows than when it has 8 (measured): the same token's fp32 mixing projection
    # (reference.py) then differs by an ulp between a forward of 2 rows and one of 8, and bf16
    # roundings downstream can flip. Padding small fp32 products to 16 rows takes that kernel choice
    # out, so the bitwise checks see only what microbatching itself changes.
    if a.dim() == 2 and a.dtype == torch.float32 and 0 < a.shape[0] < 16:
        rows = a.shape[0]
        return _matmul(torch.cat([a, a.new_zeros(16 - rows, a.shape[1])]), b)[:rows]
    return _matmul(a, b)


def run_row_invariant(rank: int, world_size: int, configs: list[RunOptions]) -> list:
    torch.Tensor.__matmul__ = _row_invariant_matmul  # a spawned rank: gone with the process
    return run_configs(rank, world_size, configs)


# name -> options; each *-mb<M>... run must equal bitwise the run named without the suffix. No
# minimum microbatch size except in *-min<N>, so the tiny steps split (decode steps included).
BITWISE = {
    "pp2-tp1": options(tp=1, pp=2, sp_threshold=None),
    "pp2-tp1-mb2": microbatched(options(tp=1, pp=2, sp_threshold=None), 2),
    "pp2-tp1-mb3": microbatched(options(tp=1, pp=2, sp_threshold=None), 3),
    # at least 20 tokens each: the 51-token prefill step splits in 2, decode steps of 5 not at all
    "pp2-tp1-mb3-min20": microbatched(options(tp=1, pp=2, sp_threshold=None), 3, 20),
    # SP at 8: one forward of 51 tokens (SP) becomes 9 (padded to 10, SP) + 42 (SP); decode 5 -> 2 + 3
    "pp2-tp2-sp": options(tp=2, pp=2, sp_threshold=8),
    "pp2-tp2-sp-mb2": microbatched(options(tp=2, pp=2, sp_threshold=8), 2),
    "pp2-tp2-sp-mb3": microbatched(options(tp=2, pp=2, sp_threshold=8), 3),
    # SP at 16 with rank-to-rank shards: 9 tokens go TP, 40 SP, 2 TP: the stages switch mode mid-step
    "pp2-tp2-direct": options(tp=2, pp=2, sp_threshold=16, pp_direct_shards=True),
    "pp2-tp2-direct-mb3": microbatched(options(tp=2, pp=2, sp_threshold=16, pp_direct_shards=True), 3),
}


@pytest.fixture(scope="module")
def bitwise_layouts() -> dict:
    out = {}
    for world in (2, 4):
        names = [n for n, o in BITWISE.items() if o.tp * o.pp == world]
        results = run_distributed(world, run_row_invariant, [BITWISE[n] for n in names], timeout=180)
        out.update(zip(names, results[0], strict=True))
    return out


@pytest.mark.parametrize("name", [n for n in BITWISE if "-mb" in n])
def test_microbatches_bitwise_match_one_forward(references, bitwise_layouts, name):
    opts = BITWISE[name]
    got, one = bitwise_layouts[name], bitwise_layouts[name.split("-mb")[0]]
    modes = assert_policy_forwards(got, opts)
    assert modes == ({True, False} if opts.tp > 1 else {False})
    if opts.sp_threshold == 8:  # an SP forward whose requests' tokens are not a multiple of tp
        assert any(f[3] and f[1] % opts.tp for f in got["forwards"])
    assert got["tokens"] == one["tokens"]
    assert all(torch.equal(a, b) for a, b in zip(got["logits"], one["logits"], strict=True))
    assert_matches(got, references["dense"])


def test_microbatch_count_is_reported(bitwise_layouts, capsys):
    assert report(bitwise_layouts["pp2-tp1-mb3"])
    out = capsys.readouterr().out
    n = len(bitwise_layouts["pp2-tp1-mb3"]["forwards"])
    assert f"microbatches: {n} forwards in " in out and "(--microbatches 3;" in out


def test_cli_rejects_bad_microbatches(capsys):
    assert main(["--device", "cpu", "--pp", "2", "--microbatches", "0"]) == 2
    assert "--microbatches must be an int >= 1" in capsys.readouterr().err


def run_watching_host_reads(rank: int, world_size: int, configs: list[RunOptions]) -> list[list[str]]:
    """-> per config, the host reads of the Model calls an engine step makes before its sampling."""
    mode = HostReads()
    for name in ("post_recv", "forward", "wait_sends", "head"):  # a spawned rank: gone with the process
        setattr(Model, name, mode.watch(getattr(Model, name)))
    out = []
    for opts in configs:
        mode.calls.clear()
        worker(rank, world_size, opts)
        out.append(list(mode.calls))
    return out


def test_stages_never_read_device_values():
    """Both stages of a microbatched pipeline enqueue their work without reading a device value, so
    each can run ahead of its GPU, with dense and with MoE FFNs (the routed experts size nothing from
    the routing)."""
    dense = microbatched(options(tp=1, pp=2, sp_threshold=None), 3)
    configs = [dense, dataclasses.replace(dense, num_experts=4)]
    for dense_reads, moe_reads in run_distributed(2, run_watching_host_reads, configs, timeout=120):
        assert dense_reads == moe_reads == []


# ----------------------------------------------------------------------------- GPU (skipped without)
requires_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
GPU_CASES = {
    # NCCL send/recv between stages; graphs are off with pp > 1 (eager hand-over)
    "gpu-pp2-tp1": (options(device="cuda", tp=1, pp=2, sp_threshold=None), "dense"),
    "gpu-pp2-tp1-moe": (options(device="cuda", tp=1, pp=2, sp_threshold=None, num_experts=4), "moe"),
    "gpu-pp2-tp1-mb3": (microbatched(options(device="cuda", tp=1, pp=2, sp_threshold=None), 3), "dense"),
    # SP engages inside the captured decode graphs (bucket 8 >= threshold); Engram ids are a static input
    "gpu-tp2-sp-graphs": (options(device="cuda", tp=2, sp_threshold=8, check_graphs=True), "dense"),
    "gpu-tp2-sp-moe-graphs": (
        options(device="cuda", tp=2, sp_threshold=8, num_experts=4, check_graphs=True),
        "moe",
    ),
}


@pytest.mark.gpu
@requires_two_gpus
def test_gpu_matches_one_process():
    refs = {
        k: worker(0, 1, dataclasses.replace(o, device="cuda", graphs=False)) for k, o in REFERENCES.items()
    }
    names = list(GPU_CASES)
    results = run_distributed(2, run_configs, [GPU_CASES[n][0] for n in names], backend="nccl", timeout=300)
    for name, got in zip(names, results[0], strict=True):
        opts, ref_name = GPU_CASES[name]
        if opts.microbatches > 1:
            assert_policy_forwards(got, opts)
        else:
            assert_policy_steps(got, opts)
        if opts.check_graphs:
            assert got["stats"]["graph_steps"] > 0, name
            largest = max(lg.abs().max().item() for lg in refs[ref_name]["logits"])
            assert got["stats"]["graph_max_diff"] <= largest * 2**-8, name
        assert_matches(got, refs[ref_name])
