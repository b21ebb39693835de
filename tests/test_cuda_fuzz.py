"""Hypothesis fuzz of the CUDA local ops (mhc_pre, mhc_post, mhc_post_pre, mhc_head) against
reference.py in fp64: T 1..64, D a multiple of 8 in [64, 8192], per-token magnitudes from 0 and
1e-30 to 1e30, fused norm on/off, fresh/delayed pre-mix. Skipped without CUDA.

Tolerances are test_cuda_local.py's: mixes within MIX_ATOL (split-bf16 tensor-core products and the
SFU's approximate exp/reciprocal), bf16 outputs within 1 spacing (2 after the fused norm) plus fp32's
own cancellation error (post_slack, expected_layer_input). The defined behaviour is the CPU path's
(test_fuzz_cpu.py), with one difference in where fp32 overflows: the kernel sums the 4D squares
before dividing, so a token's RMS factor is 0 (the coefficients of a zero row) when that *sum*
exceeds fp32's range. The large finite class is 1e12 here (1e15 on CPU) so that its sum over up to
4 * 8192 terms stays far below the edge at every D; 1e30 is the overflow class.

Non-finite input (NaN/Inf in token t): every other token's outputs are bitwise those of the clean
run; token t's outputs are non-finite where the CPU contract says so. Only finiteness is checked
there, not values: the kernels' approximate exp/reciprocal make NaN-vs-Inf an implementation detail.
"""

from __future__ import annotations

import pytest
import spkernels  # noqa: F401  (registers torch.ops.spkernels)
import torch
from conftest import assert_bf16_close, assert_mix_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spkernels import reference as ref
from test_cuda_local import MIX_ATOL, expected_layer_input, post_slack
from test_fuzz_cpu import (
    Case,
    assert_other_tokens_identical,
    bad_cases,
    run_poisoned_post,
    run_poisoned_stream,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ops = torch.ops.spkernels
bf16, f32, f64 = torch.bfloat16, torch.float32, torch.float64
FP32_MAX = torch.finfo(f32).max
MAGNITUDES = [0.0, 1e-30, 1e-3, 1.0, 1e3, 1e12, 1e30]
# D: the model sizes and the limit often, any multiple of 8 in [64, 8192] otherwise.
HIDDEN = st.one_of(st.sampled_from([64, 4096, 5120, 7168, 8192]), st.integers(8, 1024).map(lambda k: 8 * k))
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw, max_tokens: int = 64) -> Case:
    T = draw(st.integers(1, max_tokens))
    scales = st.lists(st.sampled_from(MAGNITUDES), min_size=T, max_size=T)
    return Case(
        num_tokens=T,
        hidden_size=draw(HIDDEN),
        stream_scale=draw(scales),
        y_scale=draw(scales),
        norm=draw(st.booleans()),
        delayed=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def cuda(*ts):
    return tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in ts)


# ----------------------------------------------------------------------------- expected values
def overflows(x: torch.Tensor, dims) -> torch.Tensor:
    """Per token: does the kernel's fp32 sum of squares overflow? (x in fp64.) The classes sit far
    from the edge (3.4e38), so rounding never decides the side; the assert makes sure."""
    s = x.to(f64).square().sum(dim=dims)
    assert ((s < 1e38) | (s > 1e39)).all(), "a token's sum of squares is too close to fp32's edge"
    return s > FP32_MAX


def expected_coefficients(stream, fn, scale, base):
    """fp64 (pre, post, res); a token whose sum of squares overflows gets r = 0: a zero row's mixes."""
    big = overflows(stream, (1, 2))
    stream = torch.where(big[:, None, None], torch.zeros_like(stream), stream)
    return ref.mhc_coefficients(stream, fn, scale, base, compute_dtype=f64)


def check_pre(out, stream, fn, scale, base, norm_weight, pre_mix_in) -> None:
    layer_input, post_mix, res_mix, pre_mix = out
    pre, post, res = expected_coefficients(stream, fn, scale, base)
    assert_mix_close(pre_mix, pre, "pre_mix", atol=MIX_ATOL)
    assert_mix_close(post_mix, post, "post_mix", atol=MIX_ATOL)
    assert_mix_close(res_mix, res, "res_mix", atol=MIX_ATOL)
    # The collapse (+ norm) with the kernel's own weights keeps the bf16 tolerance tight.
    want, slack = expected_layer_input(stream, pre_mix, pre_mix_in, norm_weight)
    if norm_weight is not None:
        # A collapsed y whose sum of squares overflows fp32 normalises to exactly 0 (r = 0).
        weights = (pre_mix if pre_mix_in is None else pre_mix_in).to(f64)
        big = overflows(ref.collapse(stream, weights, f64), -1)[:, None]
        want = torch.where(big, torch.zeros_like(want), want)
        slack = torch.where(big, torch.zeros_like(slack), slack)
    assert_bf16_close(layer_input, want, "layer_input", ulps=2, slack=slack)


# ----------------------------------------------------------------------------- finite inputs
@FUZZ
@given(cases())
def test_mhc_pre_fuzz(case):
    stream = cuda(case.stream())[0]
    site = cuda(*case.site())
    out = ops.mhc_pre(stream, *site)
    check_pre(out, stream, *site)


@FUZZ
@given(cases())
def test_mhc_post_fuzz(case):
    stream, y, post_mix, res_mix = cuda(case.stream(), case.y(), *case.mixes())
    out = ops.mhc_post(y, stream, post_mix, res_mix)
    want = ref.mhc_post(y, stream, post_mix, res_mix, compute_dtype=f64)
    assert_bf16_close(out, want, "new_stream", slack=post_slack(y, stream, post_mix, res_mix))


@FUZZ
@given(cases())
def test_mhc_post_pre_fuzz(case):
    stream, y, post_mix, res_mix = cuda(case.stream(), case.y(), *case.mixes())
    site = cuda(*case.site())
    out = ops.mhc_post_pre(y, stream, post_mix, res_mix, *site)
    want = ref.mhc_post(y, stream, post_mix, res_mix, compute_dtype=f64)
    assert_bf16_close(out[0], want, "new_stream", slack=post_slack(y, stream, post_mix, res_mix))
    # The pre is checked on the op's own new stream, so a legal bf16 flip in the post counts once.
    check_pre(out[1:], out[0], *site)


@FUZZ
@given(cases())
def test_mhc_head_fuzz(case):
    stream = cuda(case.stream())[0]
    fn, scale, base = cuda(*case.head())
    out = ops.mhc_head(stream, fn, scale, base)
    big = overflows(stream, (1, 2))
    zeroed = torch.where(big[:, None, None], torch.zeros_like(stream), stream)
    x = zeroed.reshape(case.num_tokens, -1).to(f64)
    m = (x @ fn.to(f64).t()) * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + 1e-6)
    w = torch.sigmoid(m * scale.to(f64)[0] + base.to(f64)) + 1e-6
    # As in test_cuda_local.test_mhc_head: the head's internal weights are off by ~1e-5.
    slack = 2e-5 * stream.to(f64).abs().sum(dim=1)
    assert_bf16_close(out, ref.collapse(stream, w, f64), "head", slack=slack)


# ----------------------------------------------------------------------------- non-finite inputs
def check_pre_nonfinite(got, clean, token, cols, fresh: bool, prefix: str = "") -> None:
    for i, name in enumerate(("layer_input", "post_mix", "res_mix", "pre_mix")):
        assert_other_tokens_identical(got[i], clean[i], token, prefix + name)
    for i, name in ((1, "post_mix"), (2, "res_mix"), (3, "pre_mix")):
        assert not torch.isfinite(got[i][token]).any(), f"{prefix}{name}[{token}] has finite values"
    row = got[0][token]
    if fresh:  # non-finite weights reach every column
        assert not torch.isfinite(row).any(), f"{prefix}layer_input[{token}] has finite values"
    else:  # carried-in weights: at least the columns where the stream is non-finite
        assert not torch.isfinite(row[cols]).any(), f"{prefix}layer_input[{token}, {cols}] is finite"


@FUZZ
@given(bad_cases(cases()))
def test_mhc_pre_nonfinite_input(bad):
    _, token, cols, _, _ = bad
    got, clean, site = run_poisoned_stream("mhc_pre", bad, cuda)
    check_pre_nonfinite(got, clean, token, cols, fresh=site[-1] is None)


@FUZZ
@given(bad_cases(cases()), st.sampled_from(["stream", "y", "mixes"]))
def test_mhc_post_nonfinite_input(bad, where):
    got, clean, bad_cols, _ = run_poisoned_post("mhc_post", bad, where, cuda)
    assert torch.equal(got[~bad_cols], clean[~bad_cols]), f"{where}: finite positions changed"
    assert not torch.isfinite(got[bad_cols]).any(), f"{where}: a non-finite input gave a finite output"


@FUZZ
@given(bad_cases(cases()), st.sampled_from(["stream", "y"]))
def test_mhc_post_pre_nonfinite_input(bad, where):
    _, token, cols, _, _ = bad
    got, clean, bad_cols, site = run_poisoned_post("mhc_post_pre", bad, where, cuda)
    assert torch.equal(got[0][~bad_cols], clean[0][~bad_cols]), "new_stream: finite positions changed"
    assert not torch.isfinite(got[0][bad_cols]).any(), "new_stream: a non-finite input gave a finite output"
    # The next site's pre sees a non-finite new-stream row in those columns.
    check_pre_nonfinite(got[1:], clean[1:], token, cols, fresh=site[-1] is None, prefix="next ")


@FUZZ
@given(bad_cases(cases()))
def test_mhc_head_nonfinite_input(bad):
    token = bad[1]
    got, clean, _ = run_poisoned_stream("mhc_head", bad, cuda)
    assert_other_tokens_identical(got, clean, token, "head")
    assert not torch.isfinite(got[token]).any(), f"head[{token}] has finite values"
