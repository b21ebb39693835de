"""SPPolicy (docs/contract.md, "Padding, dispatch and CUDA graphs"): the SP decision is a pure
function of the padded count, padding is CUDA-graph safe (decode batches land on capture sizes,
SP forwards on tp multiples), bad values raise."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from spkernels.policy import DEFAULT_AUTO_THRESHOLD, SPPolicy

tp_sizes = st.integers(1, 16)
thresholds = st.one_of(st.none(), st.integers(1, 600))
capture_lists = st.lists(st.integers(1, 512), max_size=12, unique=True).map(sorted)
token_counts = st.integers(1, 2048)


@st.composite
def policies(draw):
    return SPPolicy(draw(tp_sizes), draw(thresholds), draw(capture_lists))


def engages(policy, num_tokens):
    t, tp = policy.sp_threshold, policy.tp_size
    return t is not None and tp > 1 and num_tokens >= t and num_tokens >= tp


@settings(max_examples=300, deadline=None)
@given(policies(), token_counts, st.booleans())
def test_pad_properties(policy, num_tokens, uniform_decode):
    padded = policy.pad(num_tokens, uniform_decode)
    assert padded >= num_tokens
    use_sp = policy.use_sp(padded)
    assert use_sp == engages(policy, padded)  # the decision reads nothing but the padded count
    if use_sp:
        assert padded % policy.tp_size == 0
    captured = uniform_decode and num_tokens <= policy.max_capture_size
    if captured:
        # FULL_DECODE_ONLY: the smallest capture size that holds the batch, never a non-captured size
        assert padded == min(s for s in policy.capture_sizes if s >= num_tokens)
        assert policy.graph_size(num_tokens, uniform_decode) == padded
    else:
        assert policy.graph_size(num_tokens, uniform_decode) is None
        tp = policy.tp_size
        assert padded == (-(-num_tokens // tp) * tp if engages(policy, num_tokens) else num_tokens)
    assert policy.pad(padded, uniform_decode) == padded


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 16), st.integers(1, 600), capture_lists, token_counts, st.booleans())
def test_sp_padding_is_idempotent_tp_multiple(tp_size, threshold, sizes, num_tokens, uniform_decode):
    policy = SPPolicy(tp_size, threshold, sizes)
    padded = policy.pad(num_tokens, uniform_decode)
    if policy.use_sp(padded):
        assert padded % tp_size == 0 and padded >= tp_size
        assert policy.pad(padded, uniform_decode) == padded


@settings(max_examples=300, deadline=None)
@given(tp_sizes, thresholds, capture_lists)
def test_capture_sizes_rounded(tp_size, threshold, sizes):
    policy = SPPolicy(tp_size, threshold, sizes)
    out = policy.capture_sizes
    assert all(b > a for a, b in zip(out, out[1:], strict=False))
    for size in out:
        if threshold is not None and size >= threshold and tp_size > 1:
            assert size % tp_size == 0  # SP may engage inside this captured bucket
    # every original decode batch size still fits a capture size no larger than its rounded bucket
    for size in sizes:
        bucket = policy.graph_size(size, True)
        assert bucket is not None and size <= bucket < size + tp_size


def test_examples():
    policy = SPPolicy(4, 16, (1, 2, 4, 8, 15, 16, 17, 32))
    assert policy.capture_sizes == (1, 2, 4, 8, 15, 16, 20, 32)
    assert policy.pad(3, True) == 4 and not policy.use_sp(4)
    assert policy.pad(16, True) == 16 and policy.use_sp(16)
    assert policy.pad(17, True) == 20 and policy.use_sp(20)
    assert policy.pad(17, False) == 20
    assert policy.pad(13, False) == 13 and not policy.use_sp(13)
    assert policy.pad(33, True) == 36  # above the largest capture size: eager, SP-rounded
    assert policy.graph_size(33, True) is None
    # rounding never pulls a forward into SP: 15 < threshold stays 15 even though 16 would engage
    assert policy.pad(15, False) == 15
    assert not SPPolicy(1, 1, (1, 2, 3)).use_sp(3)
    assert not SPPolicy(8, None, ()).use_sp(10_000)
    assert not SPPolicy(8, 2, ()).use_sp(4)  # fewer tokens than ranks: no shard for everyone


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(tp_size=0, sp_threshold=None), "tp_size"),
        (dict(tp_size=2.0, sp_threshold=None), "tp_size"),
        (dict(tp_size=True, sp_threshold=None), "tp_size"),
        (dict(tp_size=2, sp_threshold=0), "sp_threshold"),
        (dict(tp_size=2, sp_threshold=-5), "sp_threshold"),
        (dict(tp_size=2, sp_threshold=1.5), "sp_threshold"),
        (dict(tp_size=2, sp_threshold="fast"), "sp_threshold"),
        (dict(tp_size=2, sp_threshold=8, capture_sizes=(0, 1)), "capture_sizes"),
        (dict(tp_size=2, sp_threshold=8, capture_sizes=(1, 4, 2)), "capture_sizes"),
        (dict(tp_size=2, sp_threshold=8, capture_sizes=(4, 4)), "capture_sizes"),
        (dict(tp_size=2, sp_threshold=8, capture_sizes=(1, 2.5)), "capture_sizes"),
        (dict(tp_size=2, sp_threshold="auto", hidden_size=0), "hidden_size"),
        (dict(tp_size=2, sp_threshold="auto"), "hidden_size"),
    ],
)
def test_bad_values_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SPPolicy(**kwargs)


@pytest.mark.parametrize("bad", [0, -1, 2.0, None])
def test_bad_token_counts_raise(bad):
    policy = SPPolicy(2, 4, (1, 2))
    with pytest.raises(ValueError, match="num_tokens"):
        policy.pad(bad, False)
    with pytest.raises(ValueError, match="padded_num_tokens"):
        policy.use_sp(bad)


def test_auto_threshold(tmp_path):
    table = tmp_path / "crossover.json"
    table.write_text(json.dumps({"2": {"4096": 1536}, "4": {"4096": 777}}))
    assert SPPolicy(2, "auto", hidden_size=4096, crossover_table=table).sp_threshold == 1536
    assert SPPolicy(4, "auto", hidden_size=4096, crossover_table=table).sp_threshold == 777
    assert SPPolicy(8, "auto", hidden_size=4096, crossover_table=table).sp_threshold == DEFAULT_AUTO_THRESHOLD
    assert SPPolicy(2, "auto", hidden_size=5120, crossover_table=table).sp_threshold == DEFAULT_AUTO_THRESHOLD
    assert isinstance(SPPolicy(2, "auto", hidden_size=4096).sp_threshold, int)  # the shipped table parses
    table.write_text(json.dumps({"2": {"4096": -3}}))
    with pytest.raises(ValueError, match="threshold"):
        SPPolicy(2, "auto", hidden_size=4096, crossover_table=table)
