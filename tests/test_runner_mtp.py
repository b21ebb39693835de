"""Greedy speculative decoding with the MTP draft layer (runner/mtp.py, runner/speculative.py) on CPU
(gloo): the tokens of plain greedy decoding with an always-right (oracle), an always-wrong and the real
MTP draft, at tp = 1 and tp = 2 with SP on the verify forward, on the drafts too, and off; the draft
under SP against the draft without it; the MTP weights round trip; the errors for bad configs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distributed import run_distributed
from spkernels.runner import Model, RunOptions, compare, plan, preset, random_weights, worker
from spkernels.runner.engine import schedule
from spkernels.runner.model import Batch
from spkernels.runner.mtp import MTPLayer
from spkernels.runner.pipeline import Stage
from spkernels.runner.speculative import accept
from spkernels.runner.weights import load_weights, save_weights

# Four requests, K = 2: a verify batch of 12 tokens pads to the capture size 16 (pad rows), its drafts
# (4 rows) to 4; the first prompt is a single token, so its first verify is its second step.
BASE = RunOptions(
    device="cpu",
    prompt_lens=(1, 3, 6, 17),
    gen=6,
    capture_sizes=(2, 4, 8, 16),
    verbose=False,
    record_logits=True,
    mtp=2,
)


def options(**changes) -> RunOptions:
    return dataclasses.replace(BASE, **changes)


def run_configs(rank: int, world_size: int, configs: list[RunOptions]) -> list:
    return [worker(rank, world_size, opts) for opts in configs]


@pytest.fixture(scope="module")
def references() -> dict:
    """Plain greedy decoding in one process, per arch: what every speculative run must reproduce."""
    return {arch: worker(0, 1, options(mtp=None, arch=arch)) for arch in ("v4", "v4.1")}


def assert_same_tokens(results: dict, reference: dict) -> None:
    assert results["tokens"] == reference["tokens"]
    # Each generated token's logits come from the verify row that produced it: the plain run's, up to
    # the bf16 noise of a different batch shape and TP layout (launch.compare's tolerance).
    check = compare(results, reference)
    assert check["ok"] and check["fair"], check


# (options, expected acceptance rate: None when it depends on the random MTP weights)
TP1 = {
    "mtp": (options(), None),
    "oracle": (options(mtp_draft="oracle"), 1.0),
    "wrong": (options(mtp_draft="wrong"), 0.0),
    "v4.1-mtp-k3": (options(arch="v4.1", mtp=3), None),
    "oracle-k1": (options(mtp=1, mtp_draft="oracle"), 1.0),
}
# sp_threshold 8: the verify forwards (16 padded) run SP, the drafts (4) TP; 2: both SP
TP2 = {
    "sp-verify-mtp": (options(tp=2, sp_threshold=8), None),
    "sp-all-oracle": (options(tp=2, sp_threshold=2, mtp_draft="oracle"), 1.0),
    "sp-all-mtp-v4.1": (options(tp=2, sp_threshold=2, arch="v4.1"), None),
    "no-sp-wrong": (options(tp=2, sp_threshold=None, mtp_draft="wrong"), 0.0),
}


@pytest.fixture(scope="module")
def tp2_results() -> dict:
    names = list(TP2)
    results = run_distributed(2, run_configs, [TP2[n][0] for n in names], timeout=300)
    return dict(zip(names, results[0], strict=True))


def _check(results, opts, rate, references):
    assert_same_tokens(results, references[opts.arch])
    stats = results["stats"]
    assert stats["mtp"] == opts.mtp and stats["mtp_draft"] == opts.mtp_draft
    assert stats["drafted"] > 0
    if rate is not None:
        assert stats["acceptance_rate"] == rate
    if rate == 1.0:  # every verify but a request's last gains K + 1 tokens
        assert stats["tokens_per_step"] > 1.5
    if rate == 0.0:
        assert stats["tokens_per_step"] == 1.0
    assert stats["decode_tokens_per_s"] > 0


@pytest.mark.parametrize("name", list(TP1))
def test_one_process_matches_plain_greedy(references, name):
    opts, rate = TP1[name]
    _check(worker(0, 1, opts), opts, rate, references)


@pytest.mark.parametrize("name", list(TP2))
def test_tp2_matches_plain_greedy(references, tp2_results, name):
    opts, rate = TP2[name]
    results = tp2_results[name]
    _check(results, opts, rate, references)
    verify_sp = [f[3] for f in results["forwards"] if f[5]]  # decode forwards' use_sp
    assert verify_sp and all(verify_sp) == (opts.sp_threshold is not None)


@pytest.mark.slow
@pytest.mark.parametrize(
    "changes",
    [dict(pp=2, arch="v4.1"), dict(tp=2, pp=2, sp_threshold=2, pp_direct_shards=True, mtp_draft="oracle")],
)
def test_pipeline_matches_plain_greedy(references, changes):
    opts = options(**changes)
    world = opts.tp * opts.pp
    results = run_distributed(world, run_configs, [opts], timeout=300)[0][0]
    _check(results, opts, 1.0 if opts.mtp_draft == "oracle" else None, references)


# ----------------------------------------------------------------------------- the draft under SP
def _prefill(tokens_per_request, next_tokens=None):
    """A prefill Batch of whole prompts, one per KV row; with ``next_tokens`` each row's token is the
    one after it (the first draft forward's input)."""
    ids, positions, rows, seq_lens, segments = [], [], [], [], []
    for row, tokens in enumerate(tokens_per_request):
        segments.append((row, len(ids), 0, len(tokens)))
        ids += tokens[1:] + [next_tokens[row]] if next_tokens else tokens
        positions += range(len(tokens))
        rows += [row] * len(tokens)
        seq_lens += range(1, len(tokens) + 1)
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return Batch(t(ids), t(positions), t(rows), t(seq_lens), len(ids), segments, None)


def draft_with_and_without_sp(rank: int, world_size: int, arch: str) -> dict:
    from spkernels.comm import Communicator

    torch.manual_seed(0)
    config = preset("tiny", arch=arch, mtp_layers=1, engram_layers=())  # no Engram: no hash_ids
    weights = random_weights(config, 0, torch.device("cpu"))
    comm = Communicator(None, max_tokens=32, hidden_size=config.hidden_size)
    try:
        model = Model(config, weights, "cpu", comm, 2, 64)
        model.stash_residual = True
        mtp = MTPLayer(config, weights, "cpu", comm, 2, 64, model)
        prompts = [torch.randint(0, config.vocab_size, (n,)).tolist() for n in (5, 3)]
        out = {}
        for use_sp in (False, True):
            logits = model.forward(_prefill(prompts), use_sp)  # sample_idx None: every row
            residual = model.residual[:8].clone()
            next_tokens = [int(logits[4].argmax()), int(logits[7].argmax())]
            draft_logits, stream = mtp.draft(_prefill(prompts, next_tokens), residual, use_sp)
            last = [4, 7]
            first = draft_logits[last].argmax(-1)
            # the second draft: one row per request at the next position, fed the first draft's stream
            t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
            step = Batch(t(first.tolist()), t([5, 3]), t([0, 1]), t([6, 4]), 2, None, None)
            second_logits, second_stream = mtp.draft(step, stream[last].clone(), use_sp)
            out[use_sp] = {
                "residual": residual,
                "stream": stream[:8].clone(),
                "tokens": [first.tolist(), second_logits[:2].argmax(-1).tolist()],
                "second_stream": second_stream[:2].clone(),
            }
    finally:
        comm.close()
    return out


@pytest.mark.parametrize("arch", ["v4", "v4.1"])
def test_draft_under_sp_matches_tp(arch):
    out = run_distributed(2, draft_with_and_without_sp, arch, timeout=120)[0]
    tp, sp = out[False], out[True]
    assert sp["tokens"] == tp["tokens"]
    for name in ("residual", "stream", "second_stream"):
        want, got = tp[name].float(), sp[name].float()
        assert got.shape == want.shape
        # SP reduce-scatters where TP all-reduces: the same bf16 partial sums added in another order,
        # each boundary then rounding the stream to bf16 (2^-8 relative). A handful of boundaries
        # (the target's four and the draft's two) stay within 2^-5 of the largest entry; a wrong row
        # or shard moves entries by O(1) of it. (Two gloo ranks on CPU agree bitwise.)
        assert (got - want).abs().max() <= 2**-5 * want.abs().max(), name


def test_drafts_match_an_mtp_run_from_scratch():
    """After steps with rejected drafts, each request's drafts equal those of a fresh MTP layer run
    over its whole accepted sequence in one prefill: the rejected positions of both KV caches were
    rewritten before anything read them."""
    from spkernels.policy import SPPolicy
    from spkernels.runner.speculative import SpecRequest, SpeculativeEngine

    gen = torch.Generator().manual_seed(1)
    config = preset("tiny", mtp_layers=1)
    weights = random_weights(config, 0, torch.device("cpu"))

    def models():
        model = Model(config, weights, "cpu", None, 3, 64)
        return model, MTPLayer(config, weights, "cpu", None, 3, 64, model)

    engine = SpeculativeEngine(*models(), SPPolicy(1, None, ()), 64, num_draft=2)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (4, 9, 1)]
    requests = [SpecRequest(i, prompt, 20) for i, prompt in enumerate(prompts)]
    for _ in range(5):
        engine.step(requests)
    assert sum(s.drafted - s.accepted for s in engine.steps) > 0  # some drafts were rejected
    model, mtp = models()
    model.stash_residual = True
    for req in requests:
        tokens = req.prompt + req.generated
        n = len(tokens) - 1
        model.forward(_prefill([tokens[:-1]]), False)
        logits, stream = mtp.draft(_prefill([tokens[:-1]], [tokens[-1]]), model.residual[:n].clone(), False)
        first = int(logits[n - 1].argmax())
        t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        step = Batch(t([first]), t([n]), t([0]), t([n + 1]), 1, None, None)
        second = int(mtp.draft(step, stream[n - 1 : n].clone(), False)[0][0].argmax())
        assert req.draft == [first, second], req.index


# ----------------------------------------------------------------------------- pieces and errors
def test_accept_takes_the_longest_matching_prefix():
    assert accept([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accept([5, 6], [4, 6, 1]) == 0
    assert accept([5, 6], [5, 6, 8]) == 2


def test_spec_schedule_verifies_whole_drafts_within_budget():
    from spkernels.runner.speculative import SpecRequest

    requests = [SpecRequest(i, [1, 2, 3], 8) for i in range(3)]
    for req in requests[:2]:
        req.num_computed, req.generated, req.draft = 3, [4], [5, 6]
    assert [(r.index, n) for r, n in schedule(requests, budget=7)] == [(0, 3), (1, 3), (2, 1)]
    # a verify never splits: the second request waits, the prompt takes what is left
    assert [(r.index, n) for r, n in schedule(requests, budget=5)] == [(0, 3), (2, 2)]


def test_mtp_weights_round_trip(tmp_path):
    config = preset("tiny", mtp_layers=1)
    weights = random_weights(config, 0, torch.device("cpu"))
    plain = random_weights(config.replace(mtp_layers=0), 0, torch.device("cpu"))
    assert all(torch.equal(weights[k], v) for k, v in plain.items())  # same target with or without MTP
    assert {k for k in weights if k not in plain} >= {"mtp.e_proj.weight", "mtp.layer.attn.wq"}
    save_weights(tmp_path / "w.safetensors", weights, config)
    loaded, loaded_config = load_weights(tmp_path / "w.safetensors")
    assert loaded_config == config and all(torch.equal(loaded[k], v) for k, v in weights.items())


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(mtp=0), "K >= 1"),
        (dict(mtp=-2), "K >= 1"),
        (dict(mtp_draft="best"), "--mtp-draft"),
        (dict(microbatches=2), "--microbatches 1"),
        (dict(max_tokens_per_step=2), "cannot hold one verify"),
        (dict(prompt_lens=(120,), gen=6, mtp=3), r"prompt \+ --gen \+ --mtp"),
    ],
)
def test_bad_mtp_configs_raise(changes, match):
    with pytest.raises(ValueError, match=match):
        plan(options(**changes))


def test_verify_must_fit_the_capture_sizes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"K \+ 1 = 3 tokens per request, above the largest capture"):
        plan(options(device="cuda", graphs=True, capture_sizes=(1, 2)))
    # the default sizes, and K + 1 = 3 times each: verify batches pad no further than plain decode's
    sizes = plan(options(device="cuda", graphs=True, capture_sizes=None)).policy.capture_sizes
    assert sizes[:5] == (1, 2, 3, 4, 6) and 192 in sizes


def test_mtp_needs_its_weights_and_the_last_stage(tmp_path):
    config = preset("tiny")
    weights = random_weights(config, 0, torch.device("cpu"))
    save_weights(tmp_path / "plain.safetensors", weights, config)
    with pytest.raises(ValueError, match="has no MTP layer"):
        plan(options(load_weights=str(tmp_path / "plain.safetensors")))
    with pytest.raises(ValueError, match="no MTP layer"):
        MTPLayer(config, weights, "cpu")
    config = config.replace(mtp_layers=1)
    weights = random_weights(config, 0, torch.device("cpu"))
    first = Model(config, weights, "cpu", stage=Stage(0, 2, 1, 0, range(0, 1)))
    with pytest.raises(ValueError, match="runs on the last pipeline stage"):
        MTPLayer(config, weights, "cpu", target=first)


# ----------------------------------------------------------------------------- GPU (skipped without)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPU_CASES = {  # FULL_DECODE_ONLY graphs; every replay also run eagerly (check_graphs)
    "graphs-oracle": options(device="cuda", check_graphs=True, mtp_draft="oracle"),
    "graphs-wrong": options(device="cuda", check_graphs=True, mtp_draft="wrong"),
    "graphs-mtp-v4.1": options(device="cuda", check_graphs=True, arch="v4.1"),
    "graphs-mtp-k3": options(device="cuda", check_graphs=True, mtp=3, capture_sizes=None),
}


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_graphs_match_plain_greedy(name):
    opts = GPU_CASES[name]
    reference = worker(0, 1, dataclasses.replace(opts, mtp=None, graphs=False, check_graphs=False))
    results = worker(0, 1, opts)
    assert results["stats"]["graph_steps"] > 0  # pure verify steps replayed (drafts too)
    # replay against an eager forward of the same shapes: within a bf16 ulp of the largest logit
    largest = max(lg.abs().max().item() for lg in reference["logits"])
    assert results["stats"]["graph_max_diff"] <= largest * 2**-8
    rate = {"oracle": 1.0, "wrong": 0.0}.get(opts.mtp_draft)
    _check(results, opts, rate, {opts.arch: reference})
