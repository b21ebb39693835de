"""CUDA local kernels (mhc_pre, mhc_post, mhc_post_pre, mhc_head) against reference.py in fp64.

Runs on the GPU machine; skipped without CUDA. Tolerances: bf16 outputs through
conftest.assert_bf16_close (at most 1 bf16 spacing per element, 2 after the fused norm, <= 1%
of elements flipped); mixes within 1e-4 absolute: the kernel's fn · x runs on bf16 tensor cores
with fn split into hi + lo (|fn - hi - lo| <= 2^-17 |fn|), an error ~1e-5 on m, the rest fp32.
"""

from __future__ import annotations

import pytest
import spkernels  # noqa: F401
import torch
from spkernels import reference as ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ops = torch.ops.spkernels
f64 = torch.float64
MIX_ATOL = 1e-4
SIZES = [(T, D) for D in (64, 4096, 5120, 7168) for T in (1, 2, 3, 17, 256, 4099)]


def poison_allocator() -> None:
    """Fill the caching allocator's free blocks with NaN so that outputs the op allocates start as
    NaN: any element the kernel fails to write fails the finite check."""
    free = torch.cuda.mem_get_info()[0]
    block = torch.empty(min(free // 4, 4 << 30) // 4, dtype=torch.float32, device="cuda")
    block.fill_(float("nan"))
    del block


def to_cuda(d):
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


def inputs(mhc, T, D, pad_rows=0):
    stream = mhc.stream(T, D)
    if pad_rows:
        stream[T - pad_rows :] = 0  # padding tokens: zero rows must give finite coefficients
    site = mhc.site(D, norm=bool(T % 2))  # odd T: fused norm; even T: none
    pre_mix_in = mhc.pre_mix_in(T) if T % 3 == 0 else None
    return stream.cuda(), to_cuda(site), (pre_mix_in.cuda() if pre_mix_in is not None else None)


def expected_layer_input(stream, pre_mix, pre_mix_in, norm_weight):
    """(expected, slack): the collapse (+ norm) in fp64 with the kernel's own coefficients.

    Checking the mixes and the collapse separately keeps each tolerance tight: a 1e-5 coefficient
    error moves a cancelling y = sum_i w_i X_i by ~1e-5 * sum_i |X_i|, far more than one bf16
    spacing of a tiny |y|. Even with exact coefficients, fp32's 4-term sum is off by up to
    ~4 * 2^-24 * sum_i |w_i X_i|, which the slack allows (scaled by the norm's r * |weight|).
    """
    w = (pre_mix if pre_mix_in is None else pre_mix_in).to(torch.float64)
    y_b = ref.collapse(stream, w, torch.float64)
    slack = 4 * 2.0**-24 * (w.abs().unsqueeze(-1) * stream.to(torch.float64).abs()).sum(dim=1)
    if norm_weight is None:
        return y_b, slack
    y = y_b.to(torch.float64)
    r = torch.rsqrt(y.square().mean(dim=-1, keepdim=True) + 1e-6)
    return ref.rms_norm(y_b, norm_weight, 1e-6, torch.float64), slack * r * norm_weight.to(
        torch.float64
    ).abs()


def post_slack(y, stream, post_mix, res_mix):
    """fp32's own error on new = post * y + sum_i res_ij X_i (5 terms): up to ~5 * 2^-24 times the
    sum of the terms' magnitudes, which exceeds a bf16 spacing where the terms cancel."""
    c = torch.float64
    terms = (post_mix.to(c).abs().unsqueeze(-1) * y.to(c).abs().unsqueeze(1)) + torch.einsum(
        "tij,tid->tjd", res_mix.to(c).abs(), stream.to(c).abs()
    )
    return 5 * 2.0**-24 * terms


def check_pre_outputs(mhc, got, want, stream, pre_mix_in, norm_weight):
    for g, w, n in zip(got[1:], want[1:], ("post_mix", "res_mix", "pre_mix"), strict=True):
        mhc.assert_mix_close(g, w.float(), n, atol=MIX_ATOL)
    expected, slack = expected_layer_input(stream, got[3], pre_mix_in, norm_weight)
    mhc.assert_bf16_close(got[0], expected, "layer_input", ulps=2, slack=slack)


@pytest.mark.parametrize("T,D", SIZES)
def test_mhc_pre(mhc, T, D):
    stream, site, pmi = inputs(mhc, T, D, pad_rows=min(2, T - 1))
    poison_allocator()
    got = ops.mhc_pre(stream, site["fn"], site["scale"], site["base"], site["norm_weight"], pmi)
    torch.cuda.synchronize()
    want = ref.mhc_pre(
        stream, site["fn"], site["scale"], site["base"], site["norm_weight"], pmi, compute_dtype=f64
    )
    check_pre_outputs(mhc, got, want, stream, pmi, site["norm_weight"])


@pytest.mark.parametrize("T,D", SIZES + [(65536, 64)])  # 65536: above the row kernel's grid, the tile kernel
def test_mhc_post(mhc, T, D):
    stream = mhc.stream(T, D).cuda()
    y = mhc.y(T, D).cuda()
    post_mix, res_mix = (t.cuda() for t in mhc.mixes(T))
    poison_allocator()
    got = ops.mhc_post(y, stream, post_mix, res_mix)
    want = ref.mhc_post(y, stream, post_mix, res_mix, compute_dtype=f64)
    mhc.assert_bf16_close(got, want, "new_stream", slack=post_slack(y, stream, post_mix, res_mix))


@pytest.mark.parametrize("T,D", SIZES)
def test_mhc_post_pre(mhc, T, D):
    stream, site, pmi = inputs(mhc, T, D)
    y = mhc.y(T, D).cuda()
    post_mix, res_mix = (t.cuda() for t in mhc.mixes(T))
    args = (y, stream, post_mix, res_mix, site["fn"], site["scale"], site["base"], site["norm_weight"], pmi)
    poison_allocator()
    got = ops.mhc_post_pre(*args)
    want = ref.mhc_post_pre(*args, compute_dtype=f64)
    mhc.assert_bf16_close(got[0], want[0], "new_stream", slack=post_slack(y, stream, post_mix, res_mix))
    # The pre runs on the kernel's own new stream: compare it with the reference pre of that
    # stream so a (rare, legal) bf16 flip in the post does not count twice.
    want_pre = ref.mhc_pre(
        got[0], site["fn"], site["scale"], site["base"], site["norm_weight"], pmi, compute_dtype=f64
    )
    check_pre_outputs(mhc, got[1:], want_pre, got[0], pmi, site["norm_weight"])


@pytest.mark.parametrize("T,D", SIZES)
def test_mhc_head(mhc, T, D):
    stream = mhc.stream(T, D).cuda()
    head = to_cuda(mhc.head(D))
    poison_allocator()
    got = ops.mhc_head(stream, head["fn"], head["scale"], head["base"])
    want = ref.mhc_head(stream, head["fn"], head["scale"], head["base"], compute_dtype=f64)
    # The head's weights are not an output: allow their ~1e-5 error (split-bf16 products, as for
    # the mixes) times sum_i |X_i|, which dominates where the weighted sum cancels.
    slack = 2e-5 * stream.to(f64).abs().sum(dim=1)
    mhc.assert_bf16_close(got, want, "head", slack=slack)


def assert_replays_match_eager(mhc, T, D, static, run, what):
    """Capture run() in a CUDA graph, then replay it three times on fresh inputs copied into
    `static` (y, stream, post_mix, res_mix): every output bitwise equal to eager."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # warm-up outside capture (attributes, occupancy cache)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(3):
        fresh = [mhc.y(T, D), mhc.stream(T, D), *mhc.mixes(T)]
        for dst, src in zip(static, fresh, strict=True):
            dst.copy_(src)
        graph.replay()
        for g, e in zip(out, run(), strict=True):
            assert torch.equal(g, e), f"{what}: graph replay differs from eager"


def test_cuda_graph_replay_matches_eager(mhc):
    T, D = 24, 4096
    stream, site, _ = inputs(mhc, T, D)
    static = [mhc.y(T, D).cuda(), stream, *(t.cuda() for t in mhc.mixes(T))]
    pre_args = (site["fn"], site["scale"], site["base"], site["norm_weight"], None)
    assert_replays_match_eager(
        mhc, T, D, static, lambda: ops.mhc_post_pre(*static, *pre_args), "mhc_post_pre"
    )


@pytest.mark.parametrize("T", [5, 600])
def test_chained_ops_in_a_graph(mhc, T):
    """Every op's first kernel waits on whatever kernel precedes it (a programmatic dependent
    launch): a chain of ops, each reading what the one before it wrote, right after the copies
    that bring in the inputs, replays bitwise equal to eager. T = 5: the decode kernels (the post
    row kernel, pass 1 split over the fn rows, a CTA per row); T = 600: fn staged, pass 2's
    looping row CTAs."""
    D = 4096
    stream, site, _ = inputs(mhc, T, D)
    head = to_cuda(mhc.head(D))
    pre_args = (site["fn"], site["scale"], site["base"], site["norm_weight"], None)
    static = [mhc.y(T, D).cuda(), stream, *(t.cuda() for t in mhc.mixes(T))]
    work = [torch.empty_like(t) for t in static]

    def run():
        for dst, src in zip(work, static, strict=True):
            dst.copy_(src)
        y, x, post_mix, res_mix = work
        x = ops.mhc_post(y, x, post_mix, res_mix)
        x = ops.mhc_post(y, x, post_mix, res_mix)
        y, post_mix, res_mix, _ = ops.mhc_pre(x, *pre_args)
        x, y, post_mix, res_mix, _ = ops.mhc_post_pre(y, x, post_mix, res_mix, *pre_args)
        x = ops.mhc_post(y, x, post_mix, res_mix)
        return x, ops.mhc_head(x, head["fn"], head["scale"], head["base"])

    assert_replays_match_eager(mhc, T, D, static, run, "chained ops")


def test_deterministic_across_calls(mhc):
    T, D = 300, 5120
    stream, site, _ = inputs(mhc, T, D)
    a = ops.mhc_pre(stream, site["fn"], site["scale"], site["base"], site["norm_weight"], None)
    b = ops.mhc_pre(stream, site["fn"], site["scale"], site["base"], site["norm_weight"], None)
    for x, z in zip(a, b, strict=True):
        assert torch.equal(x, z)


@pytest.mark.parametrize("D", [4096, 7168])
def test_rows_do_not_depend_on_T(mhc, D):
    """A row's outputs are bitwise the same whether it comes in a decode batch (pass 1 split over
    the fn rows, pass 2 a CTA per row while the rows fit on the GPU in two waves, a post alone a
    thread per vector) or in a large one (several tiles per CTA; pass 2 CTAs looping over rows): SP and TP
    agree, and so do padded and unpadded batches."""
    T = 4099
    stream, site, _ = inputs(mhc, T, D)
    head = to_cuda(mhc.head(D))
    y = mhc.y(T, D).cuda()
    post_mix, res_mix = (t.cuda() for t in mhc.mixes(T))
    pre_args = (site["fn"], site["scale"], site["base"], site["norm_weight"], None)
    head_args = (head["fn"], head["scale"], head["base"])
    full_pre = ops.mhc_pre(stream, *pre_args)
    full_post_pre = ops.mhc_post_pre(y, stream, post_mix, res_mix, *pre_args)
    full_head = ops.mhc_head(stream, *head_args)
    full_post = ops.mhc_post(y, stream, post_mix, res_mix)
    assert torch.equal(full_post, full_post_pre[0]), "mhc_post vs mhc_post_pre's new stream"

    def misaligned(x):  # contiguous, one float past a 16-byte boundary (the mixes may be such views)
        return torch.empty(x.numel() + 4, device=x.device)[1 : 1 + x.numel()].view(x.shape).copy_(x)

    # pass 1 split while tiles x slices x 3 <= 132 SMs (H200): T <= 32 at D = 4096, T <= 16 at 7168;
    # 264: 2 row-kernel CTAs x 132 SMs, 528: two waves of them; 1009: a pre's ring filled by row copies
    for t in (1, 8, 16, 17, 32, 33, 64, 128, 129, 264, 265, 400, 528, 529, 1000, 1008, 1009):
        got = ops.mhc_post(y[:t], stream[:t], post_mix[:t], res_mix[:t])
        assert torch.equal(got, full_post[:t]), f"mhc_post T={t}"
        got = ops.mhc_post(y[:t], stream[:t], misaligned(post_mix[:t]), misaligned(res_mix[:t]))
        assert torch.equal(got, full_post[:t]), f"mhc_post T={t}, misaligned mixes"
        for got, full in zip(ops.mhc_pre(stream[:t], *pre_args), full_pre, strict=True):
            assert torch.equal(got, full[:t]), f"mhc_pre T={t}"
        small = ops.mhc_post_pre(y[:t], stream[:t], post_mix[:t], res_mix[:t], *pre_args)
        for got, full in zip(small, full_post_pre, strict=True):
            assert torch.equal(got, full[:t]), f"mhc_post_pre T={t}"
        assert torch.equal(ops.mhc_head(stream[:t], *head_args), full_head[:t]), f"mhc_head T={t}"


@pytest.mark.parametrize("D", [5120, 7168])
def test_pre_split_over_every_sm(mhc, D):
    """From 512 tiles (T > 8176) a pre's pass 1 runs on every SM where the column slices leave
    enough of them idle (even_split; on an H200 at D = 5120 and 7168): the CTAs left over take the
    slices' last tiles in runs (mhc_rows_fnreg_kernel). Every row, the runs' rows too, is bitwise
    the row of two smaller calls (the strided split, checked against the reference above); T odd,
    so the last tile is partial."""
    T = 8195
    stream, site, pmi = inputs(mhc, T, D)
    pre_args = (site["fn"], site["scale"], site["base"], site["norm_weight"])
    full = ops.mhc_pre(stream, *pre_args, pmi)
    for lo, hi in ((0, 4099), (4099, T)):
        part = ops.mhc_pre(stream[lo:hi], *pre_args, None if pmi is None else pmi[lo:hi])
        for got, want in zip(part, full, strict=True):
            assert torch.equal(got, want[lo:hi]), f"mhc_pre rows {lo}..{hi}"


@pytest.mark.parametrize("D", [64, 5120])
@pytest.mark.parametrize("variant", ["norm", "plain", "pre_mix_in"])
def test_loop_collapse_matches_row_kernel(mhc, D, variant):
    """Above two waves of row CTAs pass 2 loops over the rows (mhc_collapse_loop_kernel: the
    coefficient warp one row ahead of the collapse threads through a two-deep ring, the Sinkhorn
    of 8 rows at once); 128 rows run a CTA per row. The outputs are bitwise the same, with and
    without the fused norm, with a carried-in pre_mix_in, with padding rows, and where a CTA's
    rows are not a multiple of 8 (T = 3001: 7-8 rows on each of 396 CTAs at D = 64, 11-12 on
    each of 264 at D = 5120 on an H200)."""
    T = 3001
    stream = mhc.stream(T, D)
    stream[T - 5 :] = 0
    stream = stream.cuda()
    site = to_cuda(mhc.site(D, norm=variant == "norm"))
    pre_mix_in = mhc.pre_mix_in(T).cuda() if variant == "pre_mix_in" else None
    head = to_cuda(mhc.head(D))
    y = mhc.y(T, D).cuda()
    post_mix, res_mix = (t.cuda() for t in mhc.mixes(T))
    pre_args = (site["fn"], site["scale"], site["base"], site["norm_weight"])
    head_args = (head["fn"], head["scale"], head["base"])
    full_pre = ops.mhc_pre(stream, *pre_args, pre_mix_in)
    full_post_pre = ops.mhc_post_pre(y, stream, post_mix, res_mix, *pre_args, pre_mix_in)
    full_head = ops.mhc_head(stream, *head_args)
    for r0 in range(0, T, 128):
        rows = slice(r0, min(T, r0 + 128))
        pmi = pre_mix_in[rows] if pre_mix_in is not None else None
        for got, full in zip(ops.mhc_pre(stream[rows], *pre_args, pmi), full_pre, strict=True):
            assert torch.equal(got, full[rows]), f"mhc_pre rows {r0}+"
        small = ops.mhc_post_pre(y[rows], stream[rows], post_mix[rows], res_mix[rows], *pre_args, pmi)
        for got, full in zip(small, full_post_pre, strict=True):
            assert torch.equal(got, full[rows]), f"mhc_post_pre rows {r0}+"
        assert torch.equal(ops.mhc_head(stream[rows], *head_args), full_head[rows]), f"mhc_head rows {r0}+"
    assert torch.isfinite(full_pre[0].float()).all() and torch.isfinite(full_head.float()).all()


BAD = [
    ("stream", lambda s: s.float(), "stream"),
    ("stream", lambda s: s[:, :3].contiguous(), "hc = 4"),
    ("stream", lambda s: s[:, :, :60].contiguous(), "multiple of 8"),
    ("stream", lambda s: s.transpose(0, 1).contiguous().transpose(0, 1), "contiguous"),
    ("fn", lambda f: f[:, :-8].contiguous(), "fn"),
    ("fn", lambda f: f.double(), "fn"),
    ("fn", lambda f: f.cpu(), "fn"),
    ("scale", lambda x: x[:2].contiguous(), "scale"),
    ("norm_weight", lambda x: x.float(), "norm_weight"),
]


@pytest.mark.parametrize("arg,mutate,needle", BAD)
def test_bad_inputs_raise(mhc, arg, mutate, needle):
    T, D = 8, 64
    stream = mhc.stream(T, D).cuda()
    site = to_cuda(mhc.site(D))
    kw = {"stream": stream, **site}
    kw[arg] = mutate(kw[arg])
    with pytest.raises((RuntimeError, ValueError), match=needle):
        ops.mhc_pre(kw["stream"], kw["fn"], kw["scale"], kw["base"], kw["norm_weight"], None)
    ops.mhc_pre(stream, site["fn"], site["scale"], site["base"], site["norm_weight"], None)  # still usable
