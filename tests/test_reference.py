"""reference.py against the contract's math (docs/contract.md): Sinkhorn properties, shapes,
padding rows, and a tiny case recomputed independently with plain Python loops (no torch math)
in double precision."""

from __future__ import annotations

import math

import pytest
import torch
from spkernels import reference as ref

bf16, f32, f64 = torch.bfloat16, torch.float32, torch.float64
HC = 4
EPS = 1e-6


# ----------------------------------------------------------------------------- properties
@pytest.mark.parametrize("num_tokens, hidden_size", [(1, 8), (7, 64), (33, 256)])
def test_sinkhorn_doubly_stochastic(mhc, num_tokens, hidden_size):
    stream = mhc.stream(num_tokens, hidden_size)
    p = mhc.site(hidden_size)
    _, _, res = ref.mhc_coefficients(stream, p["fn"], p["scale"], p["base"], compute_dtype=f64)
    assert (res > 0).all()
    # The last step normalises columns: sum_i C[i][j] = s / (s + hc_eps) with s ~ 1 after 19
    # sweeps, so within ~hc_eps of 1.
    torch.testing.assert_close(res.sum(dim=-2), torch.ones(num_tokens, HC, dtype=f64), atol=1e-5, rtol=0)
    # Rows are only as close as 20 Sinkhorn sweeps get them from a softmax of O(1) logits
    # (measured ~1e-7); 1e-3 catches a missing row step, which leaves rows off by ~0.1-1.
    torch.testing.assert_close(res.sum(dim=-1), torch.ones(num_tokens, HC, dtype=f64), atol=1e-3, rtol=0)


def test_sinkhorn_iters_change_the_result(mhc):
    """One iteration is softmax + one column normalisation: rows are then visibly off 1."""
    stream = mhc.stream(16, 64)
    p = mhc.site(64)
    _, _, res1 = ref.mhc_coefficients(stream, p["fn"], p["scale"], p["base"], sinkhorn_iters=1)
    # A column of the softmax that sums to s becomes s / (s + hc_eps): just below 1, by up to
    # ~1e-4 when a column is nearly empty (s ~ 1e-2) as it can be before any Sinkhorn sweep.
    col = res1.sum(dim=-2)
    assert (col <= 1 + 1e-6).all() and (col > 1 - 1e-3).all()
    assert (res1.sum(dim=-1) - 1).abs().max() > 1e-2


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("delayed", [True, False])
def test_shapes_and_dtypes(mhc, norm, delayed):
    T, D = 5, 16
    stream, y = mhc.stream(T, D), mhc.y(T, D)
    post_mix, res_mix = mhc.mixes(T)
    p, h = mhc.site(D, norm=norm), mhc.head(D)
    pre_in = mhc.pre_mix_in(T) if delayed else None
    layer_input, post, res, pre = ref.mhc_pre(
        stream, p["fn"], p["scale"], p["base"], p["norm_weight"], pre_in
    )
    assert (layer_input.shape, layer_input.dtype) == ((T, D), bf16)
    assert (post.shape, post.dtype) == ((T, HC), f32)
    assert (res.shape, res.dtype) == ((T, HC, HC), f32)
    assert (pre.shape, pre.dtype) == ((T, HC), f32)
    new = ref.mhc_post(y, stream, post_mix, res_mix)
    assert (new.shape, new.dtype) == ((T, HC, D), bf16)
    out = ref.mhc_post_pre(
        y, stream, post_mix, res_mix, p["fn"], p["scale"], p["base"], p["norm_weight"], pre_in
    )
    assert [tuple(o.shape) for o in out] == [(T, HC, D), (T, D), (T, HC), (T, HC, HC), (T, HC)]
    head = ref.mhc_head(stream, h["fn"], h["scale"], h["base"])
    assert (head.shape, head.dtype) == ((T, D), bf16)


@pytest.mark.parametrize("compute_dtype", [f32, f64])
def test_zero_rows_are_finite(mhc, compute_dtype):
    """Padding rows (all zero) must give finite coefficients everywhere, and zero outputs."""
    T, D = 6, 32
    pad = torch.tensor([0, 3, 5])
    stream, y = mhc.stream(T, D), mhc.y(T, D)
    stream[pad], y[pad] = 0, 0
    post_mix, res_mix = mhc.mixes(T)
    p, h = mhc.site(D), mhc.head(D)
    kw = {"compute_dtype": compute_dtype}
    for pre_in in (None, mhc.pre_mix_in(T)):
        outs = [
            *ref.mhc_pre(stream, p["fn"], p["scale"], p["base"], p["norm_weight"], pre_in, **kw),
            *ref.mhc_post_pre(
                y, stream, post_mix, res_mix, p["fn"], p["scale"], p["base"], p["norm_weight"], pre_in, **kw
            ),
            ref.mhc_post(y, stream, post_mix, res_mix, **kw),
            ref.mhc_head(stream, h["fn"], h["scale"], h["base"], **kw),
        ]
        for i, o in enumerate(outs):
            assert torch.isfinite(o).all(), f"output {i} has non-finite values"
        layer_input, _, res, pre = outs[:4]
        assert (layer_input[pad] == 0).all()
        assert (outs[4][pad] == 0).all() and (outs[-2][pad] == 0).all() and (outs[-1][pad] == 0).all()
        # m = 0 on a zero row: pre = sigmoid(base) + hc_eps exactly as the spec says.
        want_pre = torch.sigmoid(p["base"][:HC].to(compute_dtype)) + EPS
        torch.testing.assert_close(pre[pad], want_pre.float().expand(len(pad), HC))
        torch.testing.assert_close(res[pad].sum(dim=-2), torch.ones(len(pad), HC), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- plain-Python oracle
def to_bf16(v: float) -> float:
    """Round a double to the nearest bf16 (8 significant bits, ties to even), normal range only."""
    if v == 0.0:
        return 0.0
    mant, exp = math.frexp(v)  # v = mant * 2**exp, 0.5 <= |mant| < 1
    return math.ldexp(round(mant * 256.0), exp - 8)  # round() on a float is ties-to-even


def sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def py_coefficients(X, fn, scale, base, iters, rms_eps=EPS, hc_eps=EPS, sk_eps=EPS, alpha=2.0):
    """The contract's coefficient steps for one token, written out with lists. X: hc lists of D floats."""
    hc, D = len(X), len(X[0])
    x = [X[i][d] for i in range(hc) for d in range(D)]
    r = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + rms_eps)
    m = [sum(fn[k][n] * x[n] for n in range(len(x))) * r for k in range(len(fn))]
    pre = [sigmoid(m[j] * scale[0] + base[j]) + hc_eps for j in range(hc)]
    post = [alpha * sigmoid(m[hc + j] * scale[1] + base[hc + j]) for j in range(hc)]
    C = [
        [m[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j] for j in range(hc)] for i in range(hc)
    ]
    for i in range(hc):  # softmax over j of each row i, + the Sinkhorn eps
        top = max(C[i])
        e = [math.exp(v - top) for v in C[i]]
        C[i] = [v / sum(e) + sk_eps for v in e]

    def normalise_columns():
        for j in range(hc):
            s = sum(C[i][j] for i in range(hc)) + sk_eps
            for i in range(hc):
                C[i][j] /= s

    normalise_columns()
    for _ in range(iters - 1):
        for i in range(hc):
            s = sum(C[i]) + sk_eps
            C[i] = [v / s for v in C[i]]
        normalise_columns()
    return pre, post, C


def py_pre(X, fn, scale, base, norm_weight, pre_mix_in, iters, rms_eps=EPS, hc_eps=EPS, norm_eps=EPS,
           sk_eps=EPS, alpha=2.0):  # fmt: skip
    hc, D = len(X), len(X[0])
    pre, post, C = py_coefficients(X, fn, scale, base, iters, rms_eps, hc_eps, sk_eps, alpha)
    w = pre if pre_mix_in is None else pre_mix_in
    y_b = [to_bf16(sum(w[i] * X[i][d] for i in range(hc))) for d in range(D)]
    if norm_weight is None:
        layer_input = y_b
    else:
        s = 1.0 / math.sqrt(sum(v * v for v in y_b) / D + norm_eps)
        layer_input = [to_bf16(y_b[d] * s * norm_weight[d]) for d in range(D)]
    return layer_input, post, C, pre


def py_post(y, X, post_mix, res_mix):
    """new[j] = bf16(post[j] * y + sum_i res[i][j] * X[i]): res_mix[i][j] carries source i to j."""
    hc, D = len(X), len(X[0])
    return [
        [to_bf16(post_mix[j] * y[d] + sum(res_mix[i][j] * X[i][d] for i in range(hc))) for d in range(D)]
        for j in range(hc)
    ]


def test_to_bf16_matches_torch(mhc):
    v = mhc.randn(1000, dtype=f64) * torch.exp2(mhc.randn(1000, dtype=f64) * 8)
    assert [to_bf16(x) for x in v.tolist()] == v.to(bf16).to(f64).tolist()


# (rms_eps, hc_eps, norm_eps, sinkhorn_eps, post_alpha): the defaults, and each one its own value,
# so that a swapped or dropped eps shows
EPS_SETS = {"defaults": (EPS, EPS, EPS, EPS, 2.0), "distinct": (1e-3, 2e-2, 0.25, 5e-2, 1.5)}


@pytest.mark.parametrize("iters", [1, 3, 20])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("delayed", [True, False])
@pytest.mark.parametrize("eps_set", list(EPS_SETS))
@pytest.mark.parametrize("hc", [4, 2])
def test_tiny_case_against_plain_python(mhc, iters, norm, delayed, eps_set, hc):
    """D = 8, two tokens, hc = 4 (and 2: the math and the CPU ops take any hc; only the CUDA kernels
    specialise 4): reference.py in fp64 equals the loop version of the contract's math."""
    T, D = 2, 8
    rms_eps, hc_eps, norm_eps, sk_eps, alpha = EPS_SETS[eps_set]
    stream = mhc.stream(T, D, hc)
    p = mhc.site(D, hc, norm=norm)
    pre_in = mhc.pre_mix_in(T, hc).to(f64) if delayed else None
    eps = (rms_eps, hc_eps, norm_eps, iters, alpha)
    got = ref.mhc_pre(
        stream, p["fn"], p["scale"], p["base"], p["norm_weight"], pre_in, *eps, compute_dtype=f64,
        sinkhorn_eps=sk_eps,
    )  # fmt: skip
    nw = p["norm_weight"].to(f64).tolist() if norm else None
    for t in range(T):
        X = stream[t].to(f64).tolist()
        want = py_pre(X, p["fn"].tolist(), p["scale"].tolist(), p["base"].tolist(), nw,
                      None if pre_in is None else pre_in[t].tolist(), iters, rms_eps, hc_eps, norm_eps,
                      sk_eps, alpha)  # fmt: skip
        # bf16 values: both sides round the same double-precision value at the same points;
        # only summation order differs (~1e-16), so any flip would be a real disagreement.
        assert got[0][t].to(f64).tolist() == want[0]
        # The mixes leave reference.py as fp32: compare at fp32 resolution.
        assert got[1][t].tolist() == pytest.approx(want[1], rel=1e-6, abs=1e-7)
        assert got[2][t].tolist() == [pytest.approx(row, rel=1e-6, abs=1e-7) for row in want[2]]
        assert got[3][t].tolist() == pytest.approx(want[3], rel=1e-6, abs=1e-7)


def test_post_index_order_against_plain_python(mhc):
    """res_mix[i][j] takes source stream i to destination j. With a non-symmetric res_mix the
    transposed formula gives a clearly different stream, and the reference must match the right one."""
    T, D = 3, 8
    stream, y = mhc.stream(T, D), mhc.y(T, D)
    post_mix, res_mix = mhc.mixes(T)
    got = ref.mhc_post(y, stream, post_mix, res_mix, compute_dtype=f64).to(f64)
    for t in range(T):
        X, yt = stream[t].to(f64).tolist(), y[t].to(f64).tolist()
        post, res = post_mix[t].tolist(), res_mix[t].tolist()
        want = py_post(yt, X, post, res)
        transposed = py_post(yt, X, post, [list(col) for col in zip(*res, strict=True)])
        assert got[t].tolist() == want
        gap = max(
            abs(a - b) for ra, rb in zip(want, transposed, strict=True) for a, b in zip(ra, rb, strict=True)
        )
        assert gap > 0.1, "test input too symmetric to tell res_mix from its transpose"


def test_post_pre_is_post_then_pre(mhc):
    T, D = 4, 16
    stream, y = mhc.stream(T, D), mhc.y(T, D)
    post_mix, res_mix = mhc.mixes(T)
    p = mhc.site(D)
    out = ref.mhc_post_pre(
        y, stream, post_mix, res_mix, p["fn"], p["scale"], p["base"], p["norm_weight"], compute_dtype=f64
    )
    nw = p["norm_weight"].to(f64).tolist()
    for t in range(T):  # against the plain-Python post, then pre, not reference.py's own two functions
        yt, Xt = y[t].to(f64).tolist(), stream[t].to(f64).tolist()
        X = py_post(yt, Xt, post_mix[t].tolist(), res_mix[t].tolist())
        assert out[0][t].to(f64).tolist() == X
        want = py_pre(X, p["fn"].tolist(), p["scale"].tolist(), p["base"].tolist(), nw, None, 20)
        assert out[1][t].to(f64).tolist() == want[0]
        assert out[2][t].tolist() == pytest.approx(want[1], rel=1e-6, abs=1e-7)
        assert out[3][t].tolist() == [pytest.approx(row, rel=1e-6, abs=1e-7) for row in want[2]]


def test_head_against_plain_python(mhc):
    T, D = 2, 8
    stream = mhc.stream(T, D)
    h = mhc.head(D)
    got = ref.mhc_head(stream, h["fn"], h["scale"], h["base"], compute_dtype=f64).to(f64)
    for t in range(T):
        X = stream[t].to(f64).tolist()
        x = [v for row in X for v in row]
        r = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + EPS)
        m = [sum(f * v for f, v in zip(fr, x, strict=True)) * r for fr in h["fn"].tolist()]
        w = [sigmoid(m[j] * h["scale"].item() + h["base"][j].item()) + EPS for j in range(HC)]
        assert got[t].tolist() == [to_bf16(sum(w[i] * X[i][d] for i in range(HC))) for d in range(D)]


def test_reduce_partials_rounds_once_in_rank_order():
    """The reduction semantics: fp32 sum in rank order 0..tp-1, then a single bf16 rounding."""
    one, tiny, tinier = (torch.tensor([v], dtype=bf16) for v in (1.0, 2.0**-8, 2.0**-9))
    # fp32: 1 + 2^-8 + 2^-9 = 1 + 0.75 * 2^-7 rounds up to bf16 1 + 2^-7. Rounding after every
    # step would give 1.0: 1 + 2^-8 is a tie that goes to even 1.0, and 2^-9 is then lost too.
    out = ref.reduce_partials([one, tiny, tinier])
    assert out.dtype == bf16 and out.item() == 1 + 2.0**-7
    # fp32 absorbs 1 into 2^24, so the order is visible: rank order gives 0, another order 1.
    big, unit, neg = (torch.tensor([v], dtype=bf16) for v in (2.0**24, 1.0, -(2.0**24)))
    assert ref.reduce_partials([big, unit, neg]).item() == 0.0
    assert ref.reduce_partials([neg, big, unit]).item() == 1.0
