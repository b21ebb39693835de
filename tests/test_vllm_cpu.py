"""spkernels.integrations.vllm on CPU: each function against a restatement of vLLM's mHC math
written here from its public interface (independent of reference.py), in fp64, with vLLM's
argument order and return shapes; the TP/SP boundaries against the local functions at tp = 1 and,
over gloo, at tp = 2 (on the reduced partial: fp32 in rank order, one rounding); the Communicator
built from a group coordinator.
"""

from __future__ import annotations

import inspect

import pytest
import spkernels
import torch
import torch.distributed as dist
from distributed import run_distributed
from spkernels.integrations import vllm

f64, bf16 = torch.float64, torch.bfloat16
RMS_EPS, PRE_EPS, SINK_EPS, POST_MULT, REPEAT, NORM_EPS = 1e-6, 2e-6, 3e-3, 2.0, 20, 1e-5


# ----------------------------------------------------------------------------- vLLM's math, restated
def vllm_mixes(residual, fn, hc_scale, hc_base, rms_eps, pre_eps, sink_eps, post_mult, repeat, hc=4):
    """The three mixes of one site from the projection input (the residual [T, hc, D], or any [T, n]
    with fn [mix, n]): pre [T, hc], post [T, hc, 1], comb [T, hc, hc] (comb[i, j] carries stream i
    into stream j). fp64 throughout."""
    T = residual.shape[0]
    x = residual.reshape(T, -1).to(f64)
    inv_rms = 1.0 / torch.sqrt((x * x).mean(-1, keepdim=True) + rms_eps)
    mix = (x @ fn.to(f64).T) * inv_rms
    s, b = hc_scale.to(f64), hc_base.to(f64)
    pre = 1 / (1 + torch.exp(-(mix[:, :hc] * s[0] + b[:hc]))) + pre_eps
    post = post_mult / (1 + torch.exp(-(mix[:, hc : 2 * hc] * s[1] + b[hc : 2 * hc])))
    logits = (mix[:, 2 * hc :] * s[2] + b[2 * hc :]).view(T, hc, hc)
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    comb = e / e.sum(-1, keepdim=True) + sink_eps
    comb = comb / (comb.sum(1, keepdim=True) + sink_eps)
    for _ in range(repeat - 1):
        comb = comb / (comb.sum(2, keepdim=True) + sink_eps)
        comb = comb / (comb.sum(1, keepdim=True) + sink_eps)
    return pre, post.unsqueeze(-1), comb


def vllm_collapse(residual, weights, norm_weight=None, norm_eps=0.0):
    y = (weights.to(f64).unsqueeze(-1) * residual.to(f64)).sum(1).to(bf16)
    if norm_weight is None:
        return y
    y64 = y.to(f64)
    return (y64 / torch.sqrt((y64 * y64).mean(-1, keepdim=True) + norm_eps) * norm_weight.to(f64)).to(bf16)


def vllm_post(x, residual, post_layer_mix, comb_res_mix):
    mixed = torch.einsum("tij,tid->tjd", comb_res_mix.to(f64), residual.to(f64))
    return (mixed + post_layer_mix.to(f64) * x.to(f64).unsqueeze(1)).to(bf16)


def vllm_head(residual, hc_fn, hc_scale, hc_base, rms_eps, hc_eps):
    T, hc, D = residual.shape
    x = residual.reshape(T, hc * D).to(f64)
    mix = (x @ hc_fn.to(f64).T) / torch.sqrt((x * x).mean(-1, keepdim=True) + rms_eps)
    gate = 1 / (1 + torch.exp(-(mix * hc_scale.to(f64)[0] + hc_base.to(f64)))) + hc_eps
    return vllm_collapse(residual, gate)


# ----------------------------------------------------------------------------- inputs
def site(mhc, D, norm=True):
    p = mhc.site(D, norm=norm)
    return p["fn"], p["scale"], p["base"], p["norm_weight"]


SCALARS = (RMS_EPS, PRE_EPS, SINK_EPS, POST_MULT, REPEAT)


def check_mixes(mhc, post, comb, want_post, want_comb):
    mhc.assert_mix_close(post, want_post, "post_mix")
    mhc.assert_mix_close(comb, want_comb, "comb_mix")


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "nonorm"])
def test_mhc_pre(mhc, norm):
    T, D = 6, 64
    residual = mhc.stream(T, D)
    fn, scale, base, nw = site(mhc, D, norm)
    post, comb, layer_input = vllm.mhc_pre(
        residual, fn, scale, base, *SCALARS, norm_weight=nw, norm_eps=NORM_EPS
    )
    assert post.shape == (T, 4, 1) and comb.shape == (T, 4, 4) and layer_input.shape == (T, D)
    pre, want_post, want_comb = vllm_mixes(residual, fn, scale, base, *SCALARS)
    check_mixes(mhc, post, comb, want_post, want_comb)
    want = vllm_collapse(residual, pre, nw, NORM_EPS)
    mhc.assert_bf16_close(layer_input, want, "layer_input", ulps=2 if norm else 1)


def test_mhc_pre_leading_dims(mhc):
    """vLLM's ops take [..., hc, D]: two leading dims come back as two leading dims."""
    D = 32
    residual = mhc.stream(6, D).view(2, 3, 4, D)
    fn, scale, base, _ = site(mhc, D)
    post, comb, layer_input = vllm.mhc_pre(residual, fn, scale, base, *SCALARS)
    assert post.shape == (2, 3, 4, 1) and comb.shape == (2, 3, 4, 4) and layer_input.shape == (2, 3, D)
    flat = vllm.mhc_pre(residual.view(6, 4, D), fn, scale, base, *SCALARS)
    assert torch.equal(layer_input.view(6, D), flat[2]) and torch.equal(comb.view(6, 4, 4), flat[1])


def test_mhc_post(mhc):
    T, D = 6, 64
    residual, x = mhc.stream(T, D), mhc.y(T, D)
    post, comb = mhc.mixes(T)
    out = vllm.mhc_post(x, residual, post.unsqueeze(-1), comb)
    assert out.shape == residual.shape
    mhc.assert_bf16_close(out, vllm_post(x, residual, post.unsqueeze(-1), comb), "residual")


def test_mhc_fused_post_pre(mhc):
    T, D = 6, 64
    residual, x = mhc.stream(T, D), mhc.y(T, D)
    post_in, comb_in = mhc.mixes(T)
    fn, scale, base, nw = site(mhc, D)
    new, post, comb, layer_input = vllm.mhc_fused_post_pre(
        x,
        residual,
        post_in.unsqueeze(-1),
        comb_in,
        fn,
        scale,
        base,
        *SCALARS,
        norm_weight=nw,
        norm_eps=NORM_EPS,
    )
    mhc.assert_bf16_close(new, vllm_post(x, residual, post_in.unsqueeze(-1), comb_in), "residual")
    # The next pre reads the stored bf16 residual (the module docstring says why): restate on `new`.
    pre, want_post, want_comb = vllm_mixes(new, fn, scale, base, *SCALARS)
    check_mixes(mhc, post, comb, want_post, want_comb)
    mhc.assert_bf16_close(layer_input, vllm_collapse(new, pre, nw, NORM_EPS), "layer_input", ulps=2)


def test_hc_head(mhc):
    T, D = 6, 64
    residual, h = mhc.stream(T, D), mhc.head(D)
    out = vllm.hc_head(residual, h["fn"], h["scale"], h["base"], 1e-5, 1e-3)
    mhc.assert_bf16_close(out, vllm_head(residual, h["fn"], h["scale"], h["base"], 1e-5, 1e-3), "out")


@pytest.mark.parametrize("carried", [True, False], ids=["carried", "first-site"])
def test_mhc_pre_delayed(mhc, carried):
    T, D = 6, 64
    residual = mhc.stream(T, D)
    fn, scale, base, nw = site(mhc, D)
    pre_mix = mhc.pre_mix_in(T) if carried else None
    post, comb, layer_input, pre = vllm.mhc_pre_delayed(residual, fn, scale, base, *SCALARS, pre_mix=pre_mix)
    want_pre, want_post, want_comb = vllm_mixes(residual, fn, scale, base, *SCALARS)
    check_mixes(mhc, post, comb, want_post, want_comb)
    mhc.assert_mix_close(pre, want_pre, "pre_mix")
    if carried:
        mhc.assert_bf16_close(layer_input, vllm_collapse(residual, pre_mix), "layer_input")
    else:  # vLLM's first site: stream 0 itself
        assert torch.equal(layer_input, residual[:, 0])


def test_mhc_fused_post_pre_delayed(mhc):
    T, D = 6, 64
    residual, x = mhc.stream(T, D), mhc.y(T, D)
    post_in, comb_in = mhc.mixes(T)
    carried = mhc.pre_mix_in(T)
    fn, scale, base, nw = site(mhc, D)
    args = (x, residual, post_in.unsqueeze(-1), comb_in, fn, scale, base, *SCALARS, carried, nw, NORM_EPS)
    new, post, comb, layer_input, pre, aux = vllm.mhc_fused_post_pre_delayed(*args)
    mhc.assert_bf16_close(new, vllm_post(x, residual, post_in.unsqueeze(-1), comb_in), "residual")
    want_pre, want_post, want_comb = vllm_mixes(new, fn, scale, base, *SCALARS)
    check_mixes(mhc, post, comb, want_post, want_comb)
    mhc.assert_mix_close(pre, want_pre, "pre_mix")
    mhc.assert_bf16_close(layer_input, vllm_collapse(new, carried, nw, NORM_EPS), "layer_input", ulps=2)
    assert aux.shape == (0, D) and aux.dtype == bf16  # vLLM's empty aux without capture_aux
    # capture_aux: the mean of the new residual's streams, bf16; every other output unchanged
    *same, aux = vllm.mhc_fused_post_pre_delayed(*args, capture_aux=True)
    for a, b in zip(same, (new, post, comb, layer_input, pre), strict=True):
        assert torch.equal(a, b)
    mhc.assert_bf16_close(aux, new.to(f64).mean(1).to(bf16), "aux")


def test_mhc_pre_broadcast(mhc):
    """V4's first layer: the embedding becomes hc copies, and the pre runs on them with the full fn
    (fn_broadcast accepted, not needed)."""
    T, D = 6, 64
    e = mhc.y(T, D)
    fn, scale, base, nw = site(mhc, D)
    fn_b = fn.view(-1, 4, D).sum(1)
    residual, *pre = vllm.mhc_pre_broadcast(
        e, fn, scale, base, *SCALARS, norm_weight=nw, norm_eps=NORM_EPS, fn_broadcast=fn_b
    )
    assert torch.equal(residual, e.unsqueeze(1).expand(T, 4, D))
    want = vllm.mhc_pre(residual, fn, scale, base, *SCALARS, norm_weight=nw, norm_eps=NORM_EPS)
    for a, b in zip(pre, want, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"\bfn\b"):
        vllm.mhc_pre_broadcast(e, fn[:, :-1], scale, base, *SCALARS)


def test_mhc_pre_delayed_broadcast_x(mhc):
    """V4.1's first layer: x the embedding, the residual its copies, fn the broadcast projection
    [mix, D]: the mixes are vLLM's products of fn with x (its mean square over D), the layer input
    stream 0 normed; the same as the full fn on the copies."""
    T, D = 6, 64
    e = mhc.y(T, D)
    residual = e.unsqueeze(1).expand(T, 4, D).contiguous()
    fn, scale, base, nw = site(mhc, D)
    fn_b = fn.view(-1, 4, D).sum(1)
    got = vllm.mhc_pre_delayed(residual, fn_b, scale, base, *SCALARS, x=e, norm_weight=nw, norm_eps=NORM_EPS)
    want_pre, want_post, want_comb = vllm_mixes(e, fn_b, scale, base, *SCALARS)
    check_mixes(mhc, got[0], got[1], want_post, want_comb)
    mhc.assert_mix_close(got[3], want_pre, "pre_mix")
    mhc.assert_bf16_close(got[2], vllm_collapse(residual, torch.eye(4)[0].expand(T, 4), nw, NORM_EPS), "li")
    full = vllm.mhc_pre_delayed(residual, fn, scale, base, *SCALARS, norm_weight=nw, norm_eps=NORM_EPS)
    mhc.assert_mix_close(got[3], full[3], "pre_mix")
    for bad, match in (({"x": e[:-1]}, r"\bx\b"), ({"fn": fn}, r"\bfn\b")):
        args = {"x": e, "fn": fn_b, **bad}
        with pytest.raises(ValueError, match=match):
            vllm.mhc_pre_delayed(residual, args["fn"], scale, base, *SCALARS, x=args["x"])


# vLLM 0.34.0's mHC kernel functions (vllm.model_executor.kernels.mhc.tilelang): parameter names in
# order, and the defaults of the trailing ones.
SITE = ("fn", "hc_scale", "hc_base", "rms_eps", "hc_pre_eps", "hc_sinkhorn_eps", "hc_post_mult_value",
        "sinkhorn_repeat")  # fmt: skip
POST = ("x", "residual", "post_layer_mix", "comb_res_mix")
VLLM_SIGNATURES = {
    "mhc_pre": (("residual", *SITE), {"n_splits": 1, "norm_weight": None, "norm_eps": 1e-6}),
    "mhc_pre_broadcast": (
        ("residual", *SITE),
        {"n_splits": 1, "norm_weight": None, "norm_eps": 1e-6, "fn_broadcast": None},
    ),
    "mhc_post": (POST, {}),
    "mhc_fused_post_pre": (
        (*POST, *SITE),
        {"n_splits": 1, "tile_n": 1, "norm_weight": None, "norm_eps": 1e-6},
    ),
    "mhc_pre_delayed": (
        ("residual", *SITE),
        {"pre_mix": None, "x": None, "norm_weight": None, "norm_eps": 1e-6},
    ),
    "mhc_fused_post_pre_delayed": (
        (*POST, *SITE),
        {"pre_mix": None, "norm_weight": None, "norm_eps": 1e-6, "capture_aux": False},
    ),
    # the names of vLLM's HCHeadOp (the TileLang function, called positionally, names them hs_flat,
    # fn, hc_scale, hc_base, rms_eps, hc_eps)
    "hc_head": (("hidden_states", "hc_fn", "hc_scale", "hc_base", "rms_norm_eps", "hc_eps"), {}),
    # V4.1's boundary entry (models/deepseek_v41/nvidia/ops/mhc.py); comm is spkernels' own
    "mhc_shifted_post_pre": (
        (*POST, *SITE),
        {
            "pre_mix": None,
            "norm_weight": None,
            "norm_eps": 1e-6,
            "capture_aux": False,
            "stream": None,
            "reduce_results": False,
            "comm": None,
        },
    ),
}


@pytest.mark.parametrize("name", list(VLLM_SIGNATURES))
def test_signatures_are_vllms(name):
    """Each local function takes vLLM's parameters in vLLM's order with its defaults, so positional
    and keyword calls written for vLLM mean the same here."""
    required, defaults = VLLM_SIGNATURES[name]
    params = list(inspect.signature(getattr(vllm, name)).parameters.values())
    assert [p.name for p in params] == [*required, *defaults]
    assert all(p.default is inspect.Parameter.empty for p in params[: len(required)])
    assert {p.name: p.default for p in params[len(required) :]} == defaults


def test_mhc_shifted_post_pre(mhc, group1):
    """V4.1's boundary entry: the fused delayed post+pre, with reduce_results the all-reduce inside
    (at tp = 1 the identity); stream accepted; no MoE output, no reduce without a communicator."""
    T, D = 5, 64
    residual, x = mhc.stream(T, D), mhc.y(T, D)
    post_in, comb_in = mhc.mixes(T)
    fn, scale, base, nw = site(mhc, D)
    args = (x, residual, post_in.unsqueeze(-1), comb_in, fn, scale, base, *SCALARS, mhc.pre_mix_in(T), nw)
    want = vllm.mhc_fused_post_pre_delayed(*args, capture_aux=True)
    with vllm.communicator_for_group(group1, max_tokens=T, hidden_size=D) as comm:
        for kw in ({}, {"stream": object()}, {"reduce_results": True, "comm": comm}):
            got = vllm.mhc_shifted_post_pre(*args, capture_aux=True, **kw)
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                assert torch.equal(a, b), f"{kw}: output {i}"
    first = vllm.mhc_shifted_post_pre(*args[:12])  # pre_mix None: stream 0, as the local function
    local = vllm.mhc_fused_post_pre_delayed(*args[:12])
    assert all(torch.equal(a, b) for a, b in zip(first, local, strict=True))
    with pytest.raises(TypeError, match=r"\bx\b"):
        vllm.mhc_shifted_post_pre(object(), *args[1:])
    with pytest.raises(ValueError, match="comm"):
        vllm.mhc_shifted_post_pre(*args, reduce_results=True)


def test_post_mix_with_or_without_its_unit_dim(mhc):
    """vLLM's fused ops take the post mix as [T, hc, 1] or [T, hc]: the same result."""
    T, D = 5, 64
    residual, x = mhc.stream(T, D), mhc.y(T, D)
    post, comb = mhc.mixes(T)
    assert torch.equal(
        vllm.mhc_post(x, residual, post, comb), vllm.mhc_post(x, residual, post.unsqueeze(-1), comb)
    )


def test_sinkhorn_eps_and_pre_eps_go_where_vllm_puts_them(mhc):
    """Swapping hc_pre_eps and hc_sinkhorn_eps changes both the pre weights and the comb mix."""
    T, D = 4, 32
    residual = mhc.stream(T, D)
    fn, scale, base, _ = site(mhc, D)
    a = vllm.mhc_pre_delayed(residual, fn, scale, base, RMS_EPS, 1e-2, 2e-1, POST_MULT, REPEAT)
    b = vllm.mhc_pre_delayed(residual, fn, scale, base, RMS_EPS, 2e-1, 1e-2, POST_MULT, REPEAT)
    want_a = vllm_mixes(residual, fn, scale, base, RMS_EPS, 1e-2, 2e-1, POST_MULT, REPEAT)
    mhc.assert_mix_close(a[3], want_a[0], "pre_mix")
    mhc.assert_mix_close(a[1], want_a[2], "comb_mix")
    assert not torch.equal(a[1], b[1]) and not torch.equal(a[3], b[3])


# ----------------------------------------------------------------------------- boundaries at tp = 1
class GroupCoordinator:
    """The shape of vLLM's group coordinator that communicator_for_group relies on."""

    def __init__(self, device_group):
        self.device_group = device_group


@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "fresh"])
def test_boundaries_tp1(mhc, group1, delayed):
    T, D = 5, 64
    residual, x = mhc.stream(T, D), mhc.y(T, D)
    post_in, comb_in = mhc.mixes(T)
    fn, scale, base, nw = site(mhc, D)
    carried = mhc.pre_mix_in(T) if delayed else None
    args = (x, residual, post_in.unsqueeze(-1), comb_in, fn, scale, base, *SCALARS)
    kw = {"norm_weight": nw, "norm_eps": NORM_EPS}
    if delayed:  # the boundaries have no aux output
        local = vllm.mhc_fused_post_pre_delayed(*args, carried, **kw)[:5]
    else:
        local = vllm.mhc_fused_post_pre(*args, **kw)
    with vllm.communicator_for_group(GroupCoordinator(group1), max_tokens=T, hidden_size=D) as comm:
        for boundary in (vllm.tp_mhc_fused_post_pre, vllm.sp_mhc_fused_post_pre):
            out = boundary(*args, **kw, comm=comm, pre_mix=carried)
            assert len(out) == len(local)
            for i, (a, b) in enumerate(zip(out, local, strict=True)):
                assert torch.equal(a, b), f"{boundary.__name__}: output {i}"
        post = vllm.mhc_post(x, residual, post_in.unsqueeze(-1), comb_in)
        for fn_post in (vllm.tp_mhc_post, vllm.sp_mhc_post):
            assert torch.equal(fn_post(x, residual, post_in.unsqueeze(-1), comb_in, comm=comm), post)
        pre_local = (
            vllm.mhc_pre_delayed(residual, fn, scale, base, *SCALARS, pre_mix=carried, **kw)
            if delayed
            else vllm.mhc_pre(residual, fn, scale, base, *SCALARS, **kw)
        )
        pre_sp = vllm.sp_mhc_pre(residual, fn, scale, base, *SCALARS, **kw, comm=comm, pre_mix=carried)
        for i, (a, b) in enumerate(zip(pre_sp, pre_local, strict=True)):
            assert torch.equal(a, b), f"sp_mhc_pre: output {i}"
        assert torch.equal(vllm.sp_all_gather(vllm.sp_shard(residual, comm), T, comm), residual)


# ----------------------------------------------------------------------------- boundaries at tp = 2
def _boundaries_tp2(rank: int, tp: int, case: dict) -> dict:
    """Every TP / SP function of the integration on this rank's partial; SP results gathered."""
    T, D, x = case["T"], case["D"], case["partials"][rank]
    residual, post_in, comb_in, carried = case["residual"], case["post"], case["comb"], case["carried"]
    fn, scale, base, nw = case["site"]
    kw = {"norm_weight": nw, "norm_eps": NORM_EPS}
    out = {}
    coordinator = GroupCoordinator(dist.group.WORLD)
    with vllm.communicator_for_group(coordinator, max_tokens=T, hidden_size=D) as comm:

        def shard(t):
            return None if t is None else vllm.sp_shard(t, comm)

        def gather(ts):  # the shards' rows gathered; the layer input is whole already
            return [vllm.sp_all_gather(t, T, comm) if t.shape[0] * tp == T else t for t in ts]

        site_args = (fn, scale, base, *SCALARS)
        out["tp_post"] = vllm.tp_mhc_post(x, residual, post_in, comb_in, comm=comm)
        out["tp_boundary"] = vllm.tp_mhc_fused_post_pre(
            x, residual, post_in, comb_in, *site_args, **kw, comm=comm, pre_mix=carried
        )
        out["tp_shifted"] = vllm.mhc_shifted_post_pre(
            x, residual, post_in, comb_in, *site_args, carried, **kw, reduce_results=True, comm=comm
        )
        r_sh, p_sh, c_sh = shard(residual), shard(post_in), shard(comb_in)
        out["sp_post"] = gather([vllm.sp_mhc_post(x, r_sh, p_sh, c_sh, comm=comm)])[0]
        out["sp_boundary"] = gather(vllm.sp_mhc_fused_post_pre(
            x, r_sh, p_sh, c_sh, *site_args, **kw, comm=comm, pre_mix=shard(carried)
        ))  # fmt: skip
        out["sp_pre"] = gather(vllm.sp_mhc_pre(r_sh, *site_args, **kw, comm=comm, pre_mix=shard(carried)))
    return out


@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "fresh"])
def test_boundaries_tp2(mhc, delayed):
    """At tp = 2 the TP and SP functions (SP on residual shards, gathered) equal the local ones on
    the reduced partial: bitwise where the result is a post, to a bf16 step / the mixes' tolerance
    where it comes from a pre; the TP results are bitwise identical on both ranks."""
    tp, T, D = 2, 6, 64
    post_in, comb_in = mhc.mixes(T)
    case = {
        "T": T, "D": D, "residual": mhc.stream(T, D), "post": post_in.unsqueeze(-1), "comb": comb_in,
        "partials": [mhc.y(T, D) for _ in range(tp)], "site": site(mhc, D),
        "carried": mhc.pre_mix_in(T) if delayed else None,
    }  # fmt: skip
    results = run_distributed(tp, _boundaries_tp2, case)
    for name in ("tp_post", "tp_boundary", "tp_shifted"):  # bitwise identical on every rank
        for a, b in zip(results[0][name], results[1][name], strict=True):
            assert torch.equal(a, b), name
    got = results[0]
    y = sum(p.float() for p in case["partials"]).to(torch.bfloat16)  # the reference reduction
    fn, scale, base, nw = case["site"]
    kw = {"norm_weight": nw, "norm_eps": NORM_EPS}
    residual, post, comb, carried = case["residual"], case["post"], case["comb"], case["carried"]
    args = (y, residual, post, comb, fn, scale, base, *SCALARS)
    if delayed:
        boundary = vllm.mhc_fused_post_pre_delayed(*args, carried, **kw)[:5]
        pre = vllm.mhc_pre_delayed(residual, fn, scale, base, *SCALARS, pre_mix=carried, **kw)
    else:
        boundary = vllm.mhc_fused_post_pre(*args, **kw)
        pre = vllm.mhc_pre(residual, fn, scale, base, *SCALARS, **kw)
    post_out = vllm.mhc_post(y, residual, post, comb)
    assert torch.equal(got["tp_post"], post_out)
    assert torch.equal(got["sp_post"], post_out.view(T, -1, D))
    for name in ("tp_boundary", "sp_boundary"):  # the new residual: a post
        assert torch.equal(got[name][0].view(boundary[0].shape), boundary[0]), name
    # The shifted entry is V4.1's boundary whatever pre_mix is (None: stream 0); its aux is empty.
    shifted = vllm.mhc_fused_post_pre_delayed(*args, carried, **kw)
    assert torch.equal(got["tp_shifted"][0], shifted[0]) and got["tp_shifted"][5].shape == (0, D)
    # The pre's outputs: its fp32 products ran in other processes (other CPU thread counts), in SP
    # over a shard's rows: equal up to the last bit.
    pres = (("tp_boundary", got["tp_boundary"][1:], boundary[1:]), ("sp_boundary", got["sp_boundary"][1:],
            boundary[1:]), ("sp_pre", got["sp_pre"], pre),
            ("tp_shifted", got["tp_shifted"][1:5], shifted[1:5]))  # fmt: skip
    for name, outs, want in pres:
        assert len(outs) == len(want), name
        for i, (a, b) in enumerate(zip(outs, want, strict=True)):
            a = a.view(b.shape)
            if b.dtype == torch.bfloat16:  # the layer input
                torch.testing.assert_close(a.double(), b.double(), rtol=2**-7, atol=0, msg=f"{name} {i}")
            else:
                mhc.assert_mix_close(a, b, f"{name} {i}")


# ----------------------------------------------------------------------------- vLLM's EP layout at tp = 2
def _ffn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A per-token FFN stand-in (an MoE's combined output, row by row)."""
    return torch.relu(x.float() @ w).to(torch.bfloat16)


def _ep_sp_forward(rank: int, tp: int, case: dict) -> torch.Tensor:
    """Two V4 layers in vLLM's sequence-parallel layout under expert parallelism, as integration.md
    maps it: attention (a row-parallel stand-in) on all T tokens, after the pre's all-gather and
    before the post's reduce-scatter; the FFN on this rank's shard. -> the final residual, gathered."""
    T, D, sites, w_attn, w_ffn = case["T"], case["D"], case["sites"], case["w_attn"], case["w_ffn"]
    kw = {"norm_weight": case["norm_weight"], "norm_eps": NORM_EPS}
    capacity = -(-T // tp) * tp
    with vllm.communicator_for_group(dist.group.WORLD, max_tokens=capacity, hidden_size=D) as comm:
        residual = vllm.sp_shard(case["residual"], comm)
        post, comb, x = vllm.sp_mhc_pre(residual, *sites[0], **kw, comm=comm)  # all T (padded) rows
        for layer in range(2):
            partial = (x.float() @ w_attn[layer][rank]).to(torch.bfloat16)  # this rank's share
            residual = vllm.sp_mhc_post(partial, residual, post, comb, comm=comm)  # reduce-scatter + post
            post, comb, x = vllm.mhc_pre(residual, *sites[2 * layer + 1], **kw)  # the FFN's, on the shard
            residual = vllm.mhc_post(_ffn(x, w_ffn[layer]), residual, post, comb)
            if layer == 0:  # the next attention's pre, then the all-gather of its input
                post, comb, x = vllm.sp_mhc_pre(residual, *sites[2], **kw, comm=comm)
        return vllm.sp_all_gather(residual, T, comm)


def _ep_sp_reference(case: dict) -> torch.Tensor:
    """The same two layers unsharded: the attention's partials summed (fp32, rank order), fused posts
    and pres."""
    sites, w_attn, w_ffn = case["sites"], case["w_attn"], case["w_ffn"]
    kw = {"norm_weight": case["norm_weight"], "norm_eps": NORM_EPS}
    residual = case["residual"]
    post, comb, x = vllm.mhc_pre(residual, *sites[0], **kw)
    for layer in range(2):
        y = sum((x.float() @ w).to(torch.bfloat16).float() for w in w_attn[layer]).to(torch.bfloat16)
        residual, post, comb, x = vllm.mhc_fused_post_pre(
            y, residual, post, comb, *sites[2 * layer + 1], **kw
        )
        y = _ffn(x, w_ffn[layer])
        if layer == 1:
            return vllm.mhc_post(y, residual, post, comb)
        residual, post, comb, x = vllm.mhc_fused_post_pre(y, residual, post, comb, *sites[2], **kw)


@pytest.mark.parametrize("T", [5, 8])
def test_vllm_ep_sequence_parallel_layout(mhc, T):
    """integration.md's recipe for vLLM's SP under expert parallelism (attention on all tokens, FFN on
    the shard) at tp = 2 gives the unsharded layers' residual (T = 5: a padded shard)."""
    tp, D = 2, 64
    sites = [site(mhc, D, norm=False)[:3] + SCALARS for _ in range(4)]
    case = {
        "T": T, "D": D, "sites": sites, "norm_weight": mhc.site(D)["norm_weight"],
        "residual": mhc.stream(T, D),
        "w_attn": [[mhc.randn(D, D) / (tp * D**0.5) for _ in range(tp)] for _ in range(2)],
        "w_ffn": [mhc.randn(D, D) / D**0.5 for _ in range(2)],
    }  # fmt: skip
    got = run_distributed(tp, _ep_sp_forward, case)
    assert torch.equal(got[0], got[1])
    want = _ep_sp_reference(case)
    # Bitwise here; the pres ran on shards in other processes (fp32 sums in an order the thread count
    # may change): a bf16 step allowed.
    torch.testing.assert_close(got[0].double(), want.double(), rtol=2**-7, atol=2**-7)


def test_communicator_for_group(group1):
    with vllm.communicator_for_group(group1, max_tokens=4, hidden_size=8, tp_push=False) as comm:
        assert isinstance(comm, spkernels.Communicator) and comm.tp_size == 1 and comm.tp_push is False
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup"):
        vllm.communicator_for_group(object(), max_tokens=4, hidden_size=8)


def test_compile_fullgraph(mhc):
    """A V4 layer pair in vLLM's calling convention traces whole."""
    T, D = 5, 32
    residual, x = mhc.stream(T, D), mhc.y(T, D)
    fn, scale, base, nw = site(mhc, D)

    def layer(residual, x):
        post, comb, li = vllm.mhc_pre(residual, fn, scale, base, *SCALARS, norm_weight=nw, norm_eps=NORM_EPS)
        residual, post, comb, li = vllm.mhc_fused_post_pre(
            li + x, residual, post, comb, fn, scale, base, *SCALARS
        )
        return vllm.mhc_post(li, residual, post, comb)

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(residual, x), layer(residual, x))


# ----------------------------------------------------------------------------- bad input, empty input
def local_call_args(mhc, T: int, D: int = 64):
    residual, x = mhc.stream(T, D), mhc.y(T, D)
    post_in, comb_in = mhc.mixes(T)
    fn, scale, base, nw = site(mhc, D)
    return residual, x, post_in.unsqueeze(-1), comb_in, (fn, scale, base, *SCALARS), nw, mhc.pre_mix_in(T)


@pytest.mark.parametrize(
    "name, change, match",
    [
        ("transposed post mix", {"post": lambda t: t.transpose(0, 1).contiguous()}, "post_layer_mix"),
        ("x of another width", {"x": lambda t: t.reshape(16, 32)}, r"\bx\b"),
        ("x of fewer rows", {"x": lambda t: t[:7]}, r"\bx\b"),
        ("transposed comb mix rows", {"comb": lambda t: t.reshape(4, 8, 4)}, "comb_res_mix"),
        ("pre_mix transposed", {"pre_mix": lambda t: t.t().contiguous()}, "pre_mix"),
        ("2-D residual", {"residual": lambda t: t.reshape(8, 256)}, "residual"),
        ("residual a list", {"residual": lambda t: t.tolist()}, "residual"),
    ],
)  # fmt: skip
def test_vllm_shapes_checked_before_reshaping(mhc, name, change, match):
    """A tensor of the right size but the wrong shape is an error naming it, not a reinterpretation."""
    residual, x, post, comb, site_args, nw, pre_mix = local_call_args(mhc, 8)
    a = {"residual": residual, "x": x, "post": post, "comb": comb, "pre_mix": pre_mix}
    a.update({k: f(a[k]) for k, f in change.items()})
    calls = [
        lambda: vllm.mhc_fused_post_pre_delayed(
            a["x"], a["residual"], a["post"], a["comb"], *site_args, a["pre_mix"]
        )
    ]
    if "pre_mix" not in change:
        calls.append(lambda: vllm.mhc_post(a["x"], a["residual"], a["post"], a["comb"]))
    if set(change) <= {"residual", "pre_mix"}:
        calls.append(lambda: vllm.mhc_pre_delayed(a["residual"], *site_args, pre_mix=a["pre_mix"]))
    for call in calls:
        with pytest.raises(ValueError, match=match):
            call()


def test_vllm_functions_take_no_tokens(mhc):
    """T = 0 (an empty batch, or a rank's empty shard) runs and returns empty results, as the ops do."""
    residual, x, post, comb, site_args, nw, pre_mix = local_call_args(mhc, 0)
    kw = {"norm_weight": nw, "norm_eps": NORM_EPS}
    assert vllm.mhc_post(x, residual, post, comb).shape == (0, 4, 64)
    assert [t.shape for t in vllm.mhc_pre(residual, *site_args, **kw)] == [(0, 4, 1), (0, 4, 4), (0, 64)]
    out = vllm.mhc_fused_post_pre_delayed(x, residual, post, comb, *site_args, pre_mix, **kw)
    assert [t.shape for t in out] == [(0, 4, 64), (0, 4, 1), (0, 4, 4), (0, 64), (0, 4), (0, 64)]
    fn, scale, base = mhc.head(64).values()
    assert vllm.hc_head(residual, fn, scale, base, RMS_EPS, PRE_EPS).shape == (0, 64)
