"""Hypothesis fuzz of the local ops on CPU: shapes (T 1..40, D a multiple of 8 up to 128, hc = 4) and
per-token magnitudes from 1e-30 to 1e30 (and zero rows), against reference.py in fp64.

Defined behaviour, which the tests below check exactly:

* Finite input whose per-token mean square fits fp32 (RMS below ~1.8e19: every class here up to
  1e15): the ops match the fp64 reference (coefficients to 1e-5, bf16 outputs to 1 ulp plus
  fp32's own cancellation error). Tiny tokens (1e-30) are fine: rms_eps dominates their mean
  square in fp32 and fp64 alike.
* Finite input whose per-token mean square overflows fp32 (the 1e30 class): the fp32 RMS factor
  r = rsqrt(inf) is 0, so the token's mixing coefficients are those of a zero row (m = 0), its
  collapse is still the finite weighted sum, and the fused norm of such a y gives 0. Finite,
  never NaN, but not the fp64 answer: bf16 activations beyond ~1e19 are outside the contract.
* Non-finite input (NaN or +-Inf) in token t: every other token's outputs are bitwise what they
  are without it (no cross-token contamination). Token t's post_mix, res_mix, pre_mix are all
  NaN; its layer_input is NaN in every column with fresh weights, and non-finite at least in the
  columns where the collapsed stream is non-finite with carried-in (delayed) weights. In the
  post, new_stream[t, :, d] is non-finite exactly in the columns d where y[t, d] or any
  stream[t, i, d] is, and bitwise unchanged elsewhere; NaN mixes for token t make all of
  new_stream[t] NaN. mhc_head's output row t is all NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from conftest import assert_bf16_close, assert_mix_close
from hypothesis import given, settings
from hypothesis import strategies as st
from spkernels import reference as ref

ops = torch.ops.spkernels
bf16, f32, f64 = torch.bfloat16, torch.float32, torch.float64
HC = 4
EPS = 1e-6
FP32_MAX = torch.finfo(f32).max
# Per-token magnitudes: 0 is a padding row; 1e15 is the largest class whose mean square fits fp32,
# 1e30 the overflow regime. Classes sit far from the edge (~1.8e19), so which side a token is on
# never depends on rounding (overflows() asserts it).
MAGNITUDES = [0.0, 1e-30, 1e-3, 1.0, 1e3, 1e15, 1e30]
FUZZ = settings(max_examples=40, deadline=None)


@dataclass
class Case:
    num_tokens: int
    hidden_size: int
    stream_scale: list[float]
    y_scale: list[float]
    norm: bool
    delayed: bool
    seed: int

    def __post_init__(self) -> None:
        self.gen = torch.Generator().manual_seed(self.seed)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=f32)

    def rows(self, scale: list[float], *shape: int) -> torch.Tensor:
        """bf16 [T, *shape]: token t of magnitude scale[t], each stream/row off by up to ~e^+-2."""
        T = self.num_tokens
        s = torch.tensor(scale, dtype=f64).reshape(T, *([1] * len(shape)))
        jitter = torch.exp(0.7 * self.randn(T, *shape[:-1], 1)).to(f64)
        return (self.randn(T, *shape).to(f64) * s * jitter).to(bf16)

    def stream(self) -> torch.Tensor:
        return self.rows(self.stream_scale, HC, self.hidden_size)

    def y(self) -> torch.Tensor:
        return self.rows(self.y_scale, self.hidden_size)

    def site(self) -> tuple:
        D, m = self.hidden_size, ref.num_mix(HC)
        fn = self.randn(m, HC * D) / math.sqrt(HC * D)
        scale = 0.5 + 2 * torch.rand(3, generator=self.gen)
        base = 0.5 * self.randn(m)
        norm_weight = (1 + 0.2 * self.randn(D)).to(bf16) if self.norm else None
        pre_mix_in = torch.sigmoid(self.randn(self.num_tokens, HC)) + 1e-6 if self.delayed else None
        return fn, scale, base, norm_weight, pre_mix_in

    def head(self) -> tuple:
        D = self.hidden_size
        return (
            self.randn(HC, HC * D) / math.sqrt(HC * D),
            0.5 + 2 * torch.rand(1, generator=self.gen),
            self.randn(HC),
        )

    def mixes(self) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.num_tokens
        return 2 * torch.sigmoid(self.randn(T, HC)), torch.softmax(2 * self.randn(T, HC, HC), dim=-1)


@st.composite
def cases(draw, max_tokens: int = 40) -> Case:
    T = draw(st.integers(1, max_tokens))
    scales = st.lists(st.sampled_from(MAGNITUDES), min_size=T, max_size=T)
    return Case(
        num_tokens=T,
        hidden_size=draw(st.sampled_from(range(8, 129, 8))),
        stream_scale=draw(scales),
        y_scale=draw(scales),
        norm=draw(st.booleans()),
        delayed=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


# ----------------------------------------------------------------------------- expected values
def overflows(x: torch.Tensor, dims) -> torch.Tensor:
    """Per token: does fp32's mean of squares overflow? (x in fp64)"""
    ms = x.to(f64).square().mean(dim=dims)
    assert ((ms < 1e36) | (ms > 1e40)).all(), "a token's magnitude is too close to fp32's edge"
    return ms > FP32_MAX


def expected_coefficients(stream, fn, scale, base):
    """fp64 (pre, post, res); a token whose fp32 mean square overflows gets r = 0, i.e. m = 0: the
    coefficients of a zero row."""
    big = overflows(stream, (1, 2))
    stream = torch.where(big[:, None, None], torch.zeros_like(stream), stream)
    return ref.mhc_coefficients(stream, fn, scale, base, compute_dtype=f64)


def expected_layer_input(stream, weights, norm_weight):
    """(expected, slack) of the collapse (+ norm) in fp64 with the op's own fp32 weights, so the
    tolerance stays at bf16 rounding: fp32's error on y = sum_i w_i X_i is ~4 * 2^-24 * sum_i |w_i X_i|,
    more than a bf16 spacing where the terms cancel, which the slack allows (times the norm's
    r * |weight|). A y whose fp32 mean square overflows normalises to exactly 0."""
    w = weights.to(f64)
    y_b = ref.collapse(stream, w, f64)
    slack = 4 * 2.0**-24 * (w.abs().unsqueeze(-1) * stream.to(f64).abs()).sum(dim=1)
    if norm_weight is None:
        return y_b, slack
    y = y_b.to(f64)
    r = torch.rsqrt(y.square().mean(dim=-1, keepdim=True) + EPS)
    big = overflows(y, -1)[:, None]
    out = torch.where(big, 0.0, ref.rms_norm(y_b, norm_weight, EPS, f64).to(f64)).to(bf16)
    return out, torch.where(big, 0.0, slack * r * norm_weight.to(f64).abs())


def post_slack(y, stream, post_mix, res_mix):
    """fp32's own error on new = post * y + sum_i res_ij X_i (5 terms): ~5 * 2^-24 times the sum of
    the terms' magnitudes."""
    terms = post_mix.to(f64).abs().unsqueeze(-1) * y.to(f64).abs().unsqueeze(1) + torch.einsum(
        "tij,tid->tjd", res_mix.to(f64).abs(), stream.to(f64).abs()
    )
    return 5 * 2.0**-24 * terms


def check_pre(out, stream, fn, scale, base, norm_weight, pre_mix_in) -> None:
    layer_input, post_mix, res_mix, pre_mix = out
    pre, post, res = expected_coefficients(stream, fn, scale, base)
    # 1e-5: the coefficients are O(1); fp32 dot products over hc*D <= 512 terms and 20 Sinkhorn
    # sweeps stay near 1e-6 of fp64.
    assert_mix_close(pre_mix, pre, "pre_mix")
    assert_mix_close(post_mix, post, "post_mix")
    assert_mix_close(res_mix, res, "res_mix")
    weights = pre_mix if pre_mix_in is None else pre_mix_in
    want, slack = expected_layer_input(stream, weights, norm_weight)
    # A flipped y_b (1 ulp) can move the normalised value by 2 ulps.
    assert_bf16_close(layer_input, want, "layer_input", ulps=1 if norm_weight is None else 2, slack=slack)


# ----------------------------------------------------------------------------- finite inputs
@FUZZ
@given(cases())
def test_mhc_pre_fuzz(case):
    stream = case.stream()
    fn, scale, base, norm_weight, pre_mix_in = case.site()
    out = ops.mhc_pre(stream, fn, scale, base, norm_weight, pre_mix_in)
    check_pre(out, stream, fn, scale, base, norm_weight, pre_mix_in)


@FUZZ
@given(cases())
def test_mhc_post_fuzz(case):
    stream, y = case.stream(), case.y()
    post_mix, res_mix = case.mixes()
    out = ops.mhc_post(y, stream, post_mix, res_mix)
    want = ref.mhc_post(y, stream, post_mix, res_mix, compute_dtype=f64)
    assert_bf16_close(out, want, "new_stream", slack=post_slack(y, stream, post_mix, res_mix))


@FUZZ
@given(cases())
def test_mhc_post_pre_fuzz(case):
    stream, y = case.stream(), case.y()
    post_mix, res_mix = case.mixes()
    site = case.site()
    out = ops.mhc_post_pre(y, stream, post_mix, res_mix, *site)
    want = ref.mhc_post(y, stream, post_mix, res_mix, compute_dtype=f64)
    assert_bf16_close(out[0], want, "new_stream", slack=post_slack(y, stream, post_mix, res_mix))
    # The pre is checked on the op's own new stream, so a legal bf16 flip in the post counts once.
    check_pre(out[1:], out[0], *site)


@FUZZ
@given(cases())
def test_mhc_head_fuzz(case):
    stream = case.stream()
    fn, scale, base = case.head()
    out = ops.mhc_head(stream, fn, scale, base)
    # The head's weights are internal, so the fp64 reference's weights are used; their fp32 error
    # (~1e-6: sigmoid of an fp32 dot product) moves a cancelling collapse by ~1e-6 * sum_i |X_i|.
    big = overflows(stream, (1, 2))
    zeroed = torch.where(big[:, None, None], torch.zeros_like(stream), stream)
    x = zeroed.reshape(case.num_tokens, -1).to(f64)
    m = (x @ fn.to(f64).t()) * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + EPS)
    w = torch.sigmoid(m * scale.to(f64)[0] + base.to(f64)) + EPS
    slack = 2e-5 * stream.to(f64).abs().sum(dim=1)
    assert_bf16_close(out, ref.collapse(stream, w, f64), "head", slack=slack)


# ----------------------------------------------------------------------------- non-finite inputs
@st.composite
def bad_cases(draw, base=None):
    """A finite case (magnitudes that fit fp32) plus a token, some columns and a non-finite value.
    ``base``: the strategy of finite cases (default: this file's ``cases()``)."""
    case = draw(base if base is not None else cases())
    case.stream_scale = [min(s, 1e3) for s in case.stream_scale]
    case.y_scale = [min(s, 1e3) for s in case.y_scale]
    token = draw(st.integers(0, case.num_tokens - 1))
    cols = draw(st.lists(st.integers(0, case.hidden_size - 1), min_size=1, max_size=3, unique=True))
    streams = draw(st.lists(st.integers(0, HC - 1), min_size=len(cols), max_size=len(cols)))
    value = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    return case, token, cols, streams, value


def assert_other_tokens_identical(got, clean, token: int, name: str) -> None:
    keep = torch.ones(got.shape[0], dtype=torch.bool, device=got.device)
    keep[token] = False
    assert torch.equal(got[keep], clean[keep]), f"{name}: a non-finite token changed other tokens"


def check_pre_nonfinite(got, clean, token, cols, fresh: bool, prefix: str = "") -> None:
    for i, name in enumerate(("layer_input", "post_mix", "res_mix", "pre_mix")):
        assert_other_tokens_identical(got[i], clean[i], token, prefix + name)
    for i, name in ((1, "post_mix"), (2, "res_mix"), (3, "pre_mix")):
        assert got[i][token].isnan().all(), f"{prefix}{name}[{token}] is not all NaN: {got[i][token]}"
    row = got[0][token]
    if fresh:
        assert row.isnan().all(), f"{prefix}layer_input[{token}] is not all NaN with NaN weights"
    else:
        assert not torch.isfinite(row[cols]).any(), f"{prefix}layer_input[{token}, {cols}] is finite"


def run_poisoned_stream(op_name: str, bad, dev=lambda *ts: ts) -> tuple:
    """mhc_pre or mhc_head on the case's stream, clean and with token `token` poisoned, on the
    tensors `dev` places (test_cuda_fuzz.py passes its cuda()). -> (got, clean, site or head args)."""
    case, token, cols, streams, value = bad
    clean_in = dev(case.stream())[0]
    stream = clean_in.clone()
    stream[token, streams, cols] = value
    args = dev(*(case.head() if op_name == "mhc_head" else case.site()))
    op = getattr(ops, op_name)
    return op(stream, *args), op(clean_in, *args), args


def run_poisoned_post(op_name: str, bad, where: str, dev=lambda *ts: ts) -> tuple:
    """mhc_post or mhc_post_pre, clean and with token `token` poisoned in `where` ("stream", "y" or
    "mixes"), on the tensors `dev` places. -> (got, clean, bad_cols, site): bad_cols marks the
    new-stream positions that must turn non-finite; site is () for mhc_post."""
    case, token, cols, streams, value = bad
    stream, y, post_mix, res_mix = dev(case.stream(), case.y(), *case.mixes())
    site = dev(*case.site()) if op_name == "mhc_post_pre" else ()
    op = getattr(ops, op_name)
    clean = op(y, stream, post_mix, res_mix, *site)
    bad_cols = torch.zeros_like(clean if op_name == "mhc_post" else clean[0], dtype=torch.bool)
    if where == "stream":
        stream[token, streams, cols] = value
        bad_cols[token, :, cols] = True
    elif where == "y":
        y[token, cols] = value
        bad_cols[token, :, cols] = True
    else:
        post_mix[token], res_mix[token] = float("nan"), float("nan")
        bad_cols[token] = True
    return op(y, stream, post_mix, res_mix, *site), clean, bad_cols, site


@FUZZ
@given(bad_cases())
def test_mhc_pre_nonfinite_input(bad):
    _, token, cols, _, _ = bad
    got, clean, site = run_poisoned_stream("mhc_pre", bad)
    check_pre_nonfinite(got, clean, token, cols, fresh=site[-1] is None)


@FUZZ
@given(bad_cases(), st.sampled_from(["stream", "y", "mixes"]))
def test_mhc_post_nonfinite_input(bad, where):
    token = bad[1]
    got, clean, bad_cols, _ = run_poisoned_post("mhc_post", bad, where)
    assert torch.equal(got[~bad_cols], clean[~bad_cols]), f"{where}: finite positions changed"
    assert not torch.isfinite(got[bad_cols]).any(), f"{where}: a non-finite input gave a finite output"
    if where == "mixes":
        assert got[token].isnan().all()


@FUZZ
@given(bad_cases(), st.sampled_from(["stream", "y"]))
def test_mhc_post_pre_nonfinite_input(bad, where):
    _, token, cols, _, _ = bad
    got, clean, bad_cols, site = run_poisoned_post("mhc_post_pre", bad, where)
    assert torch.equal(got[0][~bad_cols], clean[0][~bad_cols]), "new_stream: finite positions changed"
    assert not torch.isfinite(got[0][bad_cols]).any(), "new_stream: a non-finite input gave a finite output"
    # The next site's pre sees a non-finite new-stream row in those columns.
    check_pre_nonfinite(got[1:], clean[1:], token, cols, fresh=site[-1] is None, prefix="next ")


@FUZZ
@given(bad_cases())
def test_mhc_head_nonfinite_input(bad):
    token = bad[1]
    got, clean, _ = run_poisoned_stream("mhc_head", bad)
    assert_other_tokens_identical(got, clean, token, "head")
    assert got[token].isnan().all(), f"head[{token}] is not all NaN"
