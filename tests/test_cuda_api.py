"""spkernels.api and spkernels.integrations.vllm on one GPU: each function bitwise equal to the
torch.ops call it stands for, sinkhorn_eps != hc_eps honoured by the CUDA kernels (against
reference.py), the vLLM-convention functions against the restatement of vLLM's math in
test_vllm_cpu.py, and CUDA-graph capture through the functions. The tp > 1 boundaries on GPUs are
the ops' own tests (test_cuda_comm.py); the functions' reshapes around them run at tp = 2 on CPU
(test_vllm_cpu.py).
"""

from __future__ import annotations

import pytest
import spkernels
import torch
from spkernels import MhcParams
from spkernels import reference as ref
from spkernels.integrations import vllm
from test_cuda_local import MIX_ATOL, expected_layer_input
from test_vllm_cpu import POST_MULT, REPEAT, RMS_EPS, vllm_mixes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ops = torch.ops.spkernels
f64 = torch.float64


def cuda_site(mhc, D, norm=True, **scalars) -> MhcParams:
    p = mhc.site(D, norm=norm)
    nw = p["norm_weight"].cuda() if norm else None
    return MhcParams(p["fn"].cuda(), p["scale"].cuda(), p["base"].cuda(), nw, **scalars)


def op_args(p: MhcParams, pre_mix_in=None) -> tuple:
    eps = (p.rms_eps, p.hc_eps, p.norm_eps, p.sinkhorn_iters, p.post_alpha)
    return (p.fn, p.scale, p.base, p.norm_weight, pre_mix_in, *eps, p.sinkhorn_eps)


def flat(x) -> list:
    return [x] if isinstance(x, torch.Tensor) else [t for e in x for t in flat(e)]


def assert_same(a, b) -> None:
    for i, (x, y) in enumerate(zip(flat(a), flat(b), strict=True)):
        assert torch.equal(x, y), f"output {i} differs"


@pytest.mark.parametrize("T,D", [(3, 4096), (17, 7168), (300, 5120)])
def test_functions_are_the_ops(mhc, T, D):
    stream, y = mhc.stream(T, D).cuda(), mhc.y(T, D).cuda()
    post_mix, res_mix = (t.cuda() for t in mhc.mixes(T))
    mixes = spkernels.Mixes(post_mix, res_mix, mhc.pre_mix_in(T).cuda())
    p = cuda_site(mhc, D, sinkhorn_eps=1e-6)  # passed through (CPU tests pass other values)
    assert_same(spkernels.mhc_pre(stream, p), ops.mhc_pre(stream, *op_args(p)))
    assert_same(spkernels.mhc_post(y, stream, mixes), ops.mhc_post(y, stream, post_mix, res_mix))
    assert_same(
        spkernels.mhc_post_pre(y, stream, mixes, p, pre_mix_in=mixes.pre_mix),
        ops.mhc_post_pre(y, stream, post_mix, res_mix, *op_args(p, mixes.pre_mix)),
    )


@pytest.mark.parametrize("T,D", [(1, 4096), (17, 4096), (4099, 7168)])
def test_sinkhorn_eps_apart_from_hc_eps(mhc, T, D):
    """hc_eps on the pre weights, sinkhorn_eps on the Sinkhorn: the CUDA kernels against
    reference.py with the two set far apart (and swapped, which must change both)."""
    stream = mhc.stream(T, D).cuda()
    p = cuda_site(mhc, D, hc_eps=1e-2, sinkhorn_eps=2e-1)
    got = spkernels.mhc_pre(stream, p)
    want = ref.mhc_pre(
        stream, p.fn, p.scale, p.base, p.norm_weight, None, p.rms_eps, p.hc_eps, p.norm_eps,
        p.sinkhorn_iters, p.post_alpha, compute_dtype=f64, sinkhorn_eps=p.sinkhorn_eps,
    )  # fmt: skip
    for name, g, w in zip(("post_mix", "res_mix", "pre_mix"), got.mixes, want[1:], strict=True):
        mhc.assert_mix_close(g, w.float(), name, atol=MIX_ATOL)
    expected, slack = expected_layer_input(stream, got.mixes.pre_mix, None, p.norm_weight)
    mhc.assert_bf16_close(got.layer_input, expected, "layer_input", ulps=2, slack=slack)
    swapped = spkernels.mhc_pre(stream, p._replace(hc_eps=2e-1, sinkhorn_eps=1e-2))
    assert not torch.equal(swapped.mixes.res_mix, got.mixes.res_mix)
    assert not torch.equal(swapped.mixes.pre_mix, got.mixes.pre_mix)
    same = p._replace(sinkhorn_eps=None)
    assert_same(
        spkernels.mhc_pre(stream, same), spkernels.mhc_pre(stream, same._replace(sinkhorn_eps=p.hc_eps))
    )


@pytest.mark.parametrize("T", [2, 16, 17, 600])
def test_vllm_functions_against_vllm_math(mhc, T):
    D = 4096
    residual = mhc.stream(T, D).cuda()
    p = cuda_site(mhc, D)
    scalars = (RMS_EPS, 2e-6, 3e-3, POST_MULT, REPEAT)
    post, comb, layer_input = vllm.mhc_pre(residual, p.fn, p.scale, p.base, *scalars)
    assert post.shape == (T, 4, 1) and comb.shape == (T, 4, 4) and layer_input.shape == (T, D)
    pre, want_post, want_comb = vllm_mixes(residual, p.fn, p.scale, p.base, *scalars)
    mhc.assert_mix_close(post, want_post.float(), "post_mix", atol=MIX_ATOL)
    mhc.assert_mix_close(comb, want_comb.float(), "comb_mix", atol=MIX_ATOL)
    x = mhc.y(T, D).cuda()
    new, post2, comb2, li2 = vllm.mhc_fused_post_pre(x, residual, post, comb, p.fn, p.scale, p.base, *scalars)
    assert torch.equal(new, vllm.mhc_post(x, residual, post, comb))
    # The fused pre reads the stored bf16 residual: exactly what the unfused pre on `new` gives.
    unfused = vllm.mhc_pre(new, p.fn, p.scale, p.base, *scalars)
    for a, b in zip((post2, comb2, li2), unfused, strict=True):
        assert torch.equal(a, b)


def test_vllm_first_layer_and_aux_on_cuda(mhc):
    """The first-layer forms (the embedding's copies; V4.1's broadcast fn with x) and the fused
    delayed pre's aux on the CUDA kernels, D = 4096."""
    T, D = 17, 4096
    e = mhc.y(T, D).cuda()
    p = cuda_site(mhc, D)
    scalars = (RMS_EPS, 2e-6, 3e-3, POST_MULT, REPEAT)
    residual, *pre = vllm.mhc_pre_broadcast(e, p.fn, p.scale, p.base, *scalars, norm_weight=p.norm_weight)
    assert torch.equal(residual, e.unsqueeze(1).expand(T, 4, D))
    assert_same(pre, vllm.mhc_pre(residual, p.fn, p.scale, p.base, *scalars, norm_weight=p.norm_weight))
    fn_b = p.fn.view(-1, 4, D).sum(1)
    got = vllm.mhc_pre_delayed(residual, fn_b, p.scale, p.base, *scalars, x=e, norm_weight=p.norm_weight)
    full = vllm.mhc_pre_delayed(residual, p.fn, p.scale, p.base, *scalars, norm_weight=p.norm_weight)
    for i, name in ((0, "post_mix"), (1, "comb_mix"), (3, "pre_mix")):
        mhc.assert_mix_close(got[i], full[i], name, atol=MIX_ATOL)
    assert torch.equal(got[2], full[2])  # stream 0 normed: the mixes do not enter it
    x, carried = mhc.y(T, D).cuda(), mhc.pre_mix_in(T).cuda()
    args = (x, residual, got[0], got[1], p.fn, p.scale, p.base, *scalars, carried, p.norm_weight)
    *out, aux = vllm.mhc_fused_post_pre_delayed(*args, capture_aux=True)
    assert_same(out, vllm.mhc_fused_post_pre_delayed(*args)[:5])
    mhc.assert_bf16_close(aux, out[0].double().mean(1).to(torch.bfloat16), "aux")


def test_cuda_graph_capture_through_the_functions(mhc):
    """A post_pre -> post chain captured through the functions replays to the eager results."""
    T, D = 8, 4096
    stream, y = mhc.stream(T, D).cuda(), mhc.y(T, D).cuda()
    post_mix, res_mix = (t.cuda() for t in mhc.mixes(T))
    mixes = spkernels.Mixes(post_mix, res_mix, mhc.pre_mix_in(T).cuda())
    p = cuda_site(mhc, D)

    def chain():
        s, li, m = spkernels.mhc_post_pre(y, stream, mixes, p, pre_mix_in=mixes.pre_mix)
        return spkernels.mhc_post(li, s, m)

    eager = chain()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
