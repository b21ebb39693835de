"""The typed functions of spkernels.api on CPU: each against reference.py (fp64), each against the
``torch.ops`` call it stands for (bitwise: it must be that call and nothing else), fullgraph
compilation through them, and the errors they add (a ``comm`` that is not a Communicator).

The comm functions run in a one-process gloo group (tp = 1); tp = 2 is in test_distributed_cpu.py.
"""

from __future__ import annotations

import math

import pytest
import spkernels
import torch
from spkernels import Communicator, MhcParams, Mixes
from spkernels import reference as ref

ops = torch.ops.spkernels
f64 = torch.float64
HC = 4


def params_of(p: dict, **scalars) -> MhcParams:
    return MhcParams(p["fn"], p["scale"], p["base"], p.get("norm_weight"), **scalars)


def op_args(p: MhcParams, pre_mix_in, comm=None) -> tuple:
    """MhcParams and pre_mix_in in the order of the ops' schemas (sinkhorn_eps last, after comm)."""
    eps = (p.rms_eps, p.hc_eps, p.norm_eps, p.sinkhorn_iters, p.post_alpha)
    return (
        p.fn,
        p.scale,
        p.base,
        p.norm_weight,
        pre_mix_in,
        *eps,
        *(() if comm is None else (comm,)),
        p.sinkhorn_eps,
    )


def mixes_of(mhc, num_tokens: int) -> Mixes:
    post_mix, res_mix = mhc.mixes(num_tokens)
    return Mixes(post_mix, res_mix, mhc.pre_mix_in(num_tokens))


def flat(x) -> list:
    """A result's tensors in order (named tuples nest: (layer_input, (post, res, pre)))."""
    return [x] if isinstance(x, torch.Tensor) else [t for e in x for t in flat(e)]


def assert_same(a, b) -> None:
    """Two results of the same op on the same inputs: bitwise equal, tensor for tensor."""
    a, b = flat(a), flat(b)
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"output {i} differs"


def check_pre(mhc, res, stream, p: MhcParams, pre_mix_in) -> None:
    want = ref.mhc_pre(
        stream, p.fn, p.scale, p.base, p.norm_weight, pre_mix_in,
        p.rms_eps, p.hc_eps, p.norm_eps, p.sinkhorn_iters, p.post_alpha, compute_dtype=f64,
        sinkhorn_eps=p.sinkhorn_eps,
    )  # fmt: skip
    assert isinstance(res, spkernels.PreResult) and isinstance(res.mixes, Mixes)
    mhc.assert_bf16_close(res.layer_input, want[0], "layer_input", ulps=1 if p.norm_weight is None else 2)
    for name, got, w in zip(Mixes._fields, res.mixes, (want[1], want[2], want[3]), strict=True):
        mhc.assert_mix_close(got, w, name)


# ----------------------------------------------------------------------------- local functions
@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "fresh"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "nonorm"])
def test_mhc_pre(mhc, delayed, norm):
    T, D = 5, 64
    stream = mhc.stream(T, D)
    p = params_of(mhc.site(D, norm=norm))
    pre_in = mhc.pre_mix_in(T) if delayed else None
    res = spkernels.mhc_pre(stream, p, pre_mix_in=pre_in)
    check_pre(mhc, res, stream, p, pre_in)
    assert_same(res, ops.mhc_pre(stream, *op_args(p, pre_in)))


def test_mhc_post(mhc):
    T, D = 5, 64
    stream, y, mixes = mhc.stream(T, D), mhc.y(T, D), mixes_of(mhc, T)
    out = spkernels.mhc_post(y, stream, mixes)
    mhc.assert_bf16_close(out, ref.mhc_post(y, stream, *mixes[:2], compute_dtype=f64), "new_stream")
    assert_same(out, ops.mhc_post(y, stream, *mixes[:2]))


@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "fresh"])
def test_mhc_post_pre(mhc, delayed):
    T, D = 5, 64
    stream, y, mixes = mhc.stream(T, D), mhc.y(T, D), mixes_of(mhc, T)
    p = params_of(mhc.site(D))
    pre_in = mixes.pre_mix if delayed else None
    res = spkernels.mhc_post_pre(y, stream, mixes, p, pre_mix_in=pre_in)
    assert isinstance(res, spkernels.BoundaryResult)
    mhc.assert_bf16_close(res.stream, ref.mhc_post(y, stream, *mixes[:2], compute_dtype=f64), "stream")
    check_pre(mhc, spkernels.PreResult(res.layer_input, res.mixes), res.stream, p, pre_in)
    assert_same(res, ops.mhc_post_pre(y, stream, *mixes[:2], *op_args(p, pre_in)))


def test_mhc_head(mhc):
    T, D = 5, 64
    stream, h = mhc.stream(T, D), mhc.head(D)
    p = params_of(h, rms_eps=1e-3, hc_eps=1e-2)
    out = spkernels.mhc_head(stream, p)
    want = ref.mhc_head(stream, h["fn"], h["scale"], h["base"], 1e-3, 1e-2, compute_dtype=f64)
    mhc.assert_bf16_close(out, want, "out")


def test_params_scalars_reach_the_op(mhc):
    """Every scalar of MhcParams changes the result, and the result follows the reference."""
    T, D = 5, 8
    stream = mhc.stream(T, D)
    stream[1] *= 1e-3  # a tiny token, so rms_eps and norm_eps matter
    site = mhc.site(D)
    default = spkernels.mhc_pre(stream, params_of(site))
    changes = {
        "rms_eps": 1e-2, "hc_eps": 1e-2, "sinkhorn_eps": 1e-1, "norm_eps": 1e-1, "sinkhorn_iters": 3,
        "post_alpha": 1.5,
    }  # fmt: skip
    for name, value in changes.items():
        p = params_of(site, **{name: value})
        res = spkernels.mhc_pre(stream, p)
        check_pre(mhc, res, stream, p, None)
        assert any(not torch.equal(a, b) for a, b in zip(res.mixes, default.mixes, strict=True)) or not (
            torch.equal(res.layer_input, default.layer_input)
        ), f"{name} does not reach the op"


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "tp"])
def test_sinkhorn_eps_apart_from_hc_eps(mhc, comm1, sp):
    """sinkhorn_eps != hc_eps: the pre weights follow hc_eps, the Sinkhorn sinkhorn_eps, through
    every op that runs a pre (and None is exactly hc_eps)."""
    T, D = 4, 64
    stream, partial, mixes = mhc.stream(T, D), mhc.y(T, D), mixes_of(mhc, T)
    site = mhc.site(D)
    p = params_of(site, hc_eps=1e-2, sinkhorn_eps=3e-1)
    res = spkernels.mhc_pre(stream, p)
    check_pre(mhc, res, stream, p, None)
    swapped = spkernels.mhc_pre(stream, params_of(site, hc_eps=3e-1, sinkhorn_eps=1e-2))
    assert not torch.equal(res.mixes.pre_mix, swapped.mixes.pre_mix)
    assert not torch.equal(res.mixes.res_mix, swapped.mixes.res_mix)
    same = params_of(site, hc_eps=1e-2)
    assert_same(spkernels.mhc_pre(stream, same), spkernels.mhc_pre(stream, same._replace(sinkhorn_eps=1e-2)))
    assert_same(spkernels.sp_pre(stream, p, comm1), res)
    boundary = spkernels.sp_boundary if sp else spkernels.tp_boundary
    local = spkernels.mhc_post_pre(partial, stream, mixes, p)
    check_pre(mhc, spkernels.PreResult(local.layer_input, local.mixes), local.stream, p, None)
    assert_same(boundary(partial, stream, mixes, p, comm1), local)


def test_params_defaults_are_the_schemas():
    """The scalars' defaults live in reference.py; the op schemas state the same numbers."""
    schema = {a.name: a.default_value for a in ops.mhc_pre.default._schema.arguments}
    for name in ("rms_eps", "hc_eps", "norm_eps", "sinkhorn_iters", "post_alpha", "sinkhorn_eps"):
        assert MhcParams._field_defaults[name] == schema[name], name
    head = {a.name: a.default_value for a in ops.mhc_head.default._schema.arguments}
    assert (head["rms_eps"], head["hc_eps"]) == (ref.RMS_EPS, ref.HC_EPS)


# ----------------------------------------------------------------------------- comm functions, tp = 1
@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "fresh"])
def test_comm_functions_tp1(mhc, comm1, delayed):
    """At tp = 1 the collectives are identities: each function equals its local counterpart and
    the torch.ops call it stands for."""
    T, D, h = 7, 64, comm1.handle
    stream, partial, mixes = mhc.stream(T, D), mhc.y(T, D), mixes_of(mhc, T)
    p = params_of(mhc.site(D))
    pre_in = mixes.pre_mix if delayed else None
    post = spkernels.mhc_post(partial, stream, mixes)
    for fn, op in ((spkernels.sp_post, ops.mhc_post_rs), (spkernels.tp_post, ops.mhc_post_ar)):
        out = fn(partial, stream, mixes, comm1)
        assert_same(out, post)
        assert_same(out, op(partial, stream, *mixes[:2], h))
    res = spkernels.sp_pre(stream, p, comm1, pre_mix_in=pre_in)
    assert_same(res, spkernels.mhc_pre(stream, p, pre_mix_in=pre_in))
    assert_same(res, ops.mhc_pre_ag(stream, *op_args(p, pre_in, h)))
    local = spkernels.mhc_post_pre(partial, stream, mixes, p, pre_mix_in=pre_in)
    pairs = ((spkernels.sp_boundary, ops.mhc_post_pre_rs_ag), (spkernels.tp_boundary, ops.mhc_post_pre_ar))
    for fn, op in pairs:
        res = fn(partial, stream, mixes, p, comm1, pre_mix_in=pre_in)
        assert_same(res, local)
        assert_same(res, op(partial, stream, *mixes[:2], *op_args(p, pre_in, h)))
    assert_same(spkernels.sp_shard(stream, comm1), stream)
    assert_same(spkernels.sp_all_gather(stream, T - 1, comm1), stream[: T - 1])


def test_partial_buffer_through_the_functions(mhc, comm1):
    T, D = 9, 64
    stream, partial, mixes = mhc.stream(T, D), mhc.y(T, D), mixes_of(mhc, T)
    buf = comm1.partial_buffer(T)
    buf.copy_(partial)
    assert_same(
        spkernels.tp_post(buf, stream, mixes, comm1), spkernels.tp_post(partial, stream, mixes, comm1)
    )


@pytest.mark.parametrize("bad", [None, 1, "comm"], ids=["none", "int-handle", "str"])
def test_comm_must_be_a_communicator(mhc, comm1, bad):
    T, D = 2, 64
    stream, partial, mixes = mhc.stream(T, D), mhc.y(T, D), mixes_of(mhc, T)
    p = params_of(mhc.site(D))
    calls = [
        lambda c: spkernels.sp_pre(stream, p, c),
        lambda c: spkernels.sp_post(partial, stream, mixes, c),
        lambda c: spkernels.sp_boundary(partial, stream, mixes, p, c),
        lambda c: spkernels.tp_post(partial, stream, mixes, c),
        lambda c: spkernels.tp_boundary(partial, stream, mixes, p, c),
        lambda c: spkernels.sp_shard(stream, c),
        lambda c: spkernels.sp_all_gather(stream, T, c),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=r"comm must be a spkernels\.Communicator"):
            call(bad)


def test_bad_tensor_is_named_through_the_functions(mhc):
    """The ops' own checks reach the caller of a function unchanged."""
    T, D = 3, 64
    stream = mhc.stream(T, D)
    p = params_of(mhc.site(D))
    with pytest.raises((ValueError, RuntimeError), match=r"\bfn\b"):
        spkernels.mhc_pre(stream, p._replace(fn=p.fn[:, :-1].contiguous()))
    with pytest.raises((ValueError, RuntimeError), match=r"\bnorm_weight\b"):
        spkernels.mhc_pre(stream, p._replace(norm_weight=p.norm_weight.float()))
    with pytest.raises((ValueError, RuntimeError), match=r"\bres_mix\b"):
        mixes = mixes_of(mhc, T)
        spkernels.mhc_post(mhc.y(T, D), stream, mixes._replace(res_mix=mixes.res_mix[:, 0]))


# ----------------------------------------------------------------------------- torch.compile
def v41_model(emb, sites, weights, comm, sp):
    """V4.1 through the functions: shard, pre(+gather), boundaries, post, gather (or TP mode)."""
    num_tokens = emb.shape[0]
    stream = emb.unsqueeze(1).expand(-1, HC, -1).contiguous()
    if sp:
        stream = spkernels.sp_shard(stream, comm)
    one_hot = torch.zeros(stream.shape[0], HC, dtype=torch.float32, device=emb.device)
    one_hot[:, 0] = 1
    if sp:
        layer_input, mixes = spkernels.sp_pre(stream, sites[0], comm, pre_mix_in=one_hot)
    else:
        layer_input, mixes = spkernels.mhc_pre(stream, sites[0], pre_mix_in=one_hot)
    boundary = spkernels.sp_boundary if sp else spkernels.tp_boundary
    for site, w in zip(sites[1:], weights, strict=False):
        partial = torch.relu(layer_input @ w)
        stream, layer_input, mixes = boundary(partial, stream, mixes, site, comm, pre_mix_in=mixes.pre_mix)
    post = spkernels.sp_post if sp else spkernels.tp_post
    stream = post(torch.relu(layer_input @ weights[-1]), stream, mixes, comm)
    return spkernels.sp_all_gather(stream, num_tokens, comm) if sp else stream


def v4_model(emb, sites, weights, head):
    stream = emb.unsqueeze(1).expand(-1, HC, -1).contiguous()
    layer_input, mixes = spkernels.mhc_pre(stream, sites[0])
    for site, w in zip(sites[1:], weights, strict=False):
        stream, layer_input, mixes = spkernels.mhc_post_pre(torch.relu(layer_input @ w), stream, mixes, site)
    stream = spkernels.mhc_post(torch.relu(layer_input @ weights[-1]), stream, mixes)
    return spkernels.mhc_head(stream, head)


def model_params(mhc, D, num_sites=3):
    sites = [params_of(mhc.site(D)) for _ in range(num_sites)]
    weights = [(mhc.randn(D, D) / math.sqrt(D)).to(torch.bfloat16) for _ in range(num_sites)]
    return sites, weights


def test_compile_fullgraph_local(mhc):
    D = 64
    sites, weights = model_params(mhc, D)
    head = params_of(mhc.head(D))
    emb = mhc.y(5, D)
    torch._dynamo.reset()
    compiled = torch.compile(v4_model, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(emb, sites, weights, head), v4_model(emb, sites, weights, head))


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "tp"])
def test_compile_fullgraph_comm(mhc, comm1, sp):
    D = 64
    sites, weights = model_params(mhc, D)
    emb = mhc.y(7, D)
    torch._dynamo.reset()
    compiled = torch.compile(v41_model, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(emb, sites, weights, comm1, sp), v41_model(emb, sites, weights, comm1, sp))


def test_compiled_graph_is_the_ops_alone(mhc):
    """The functions leave nothing of their own in the graph: only the op calls (and getitems)."""
    D = 64
    stream, y, mixes = mhc.stream(3, D), mhc.y(3, D), mixes_of(mhc, 3)
    p = params_of(mhc.site(D))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(lambda: spkernels.mhc_post_pre(y, stream, mixes, p), fullgraph=True, backend=backend)()
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function"]
    targets = {str(n.target) for n in calls}
    assert "spkernels.mhc_post_pre.default" in targets
    assert all(t == "spkernels.mhc_post_pre.default" or "getitem" in t for t in targets), targets


# ----------------------------------------------------------------------------- Communicator settings
def test_communicator_settings_default_to_the_environment(monkeypatch, group1):
    for name in ("SPK_FUSED", "SPK_TP_PUSH", "SPK_BARRIER_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    with Communicator(group1, max_tokens=8, hidden_size=8) as comm:
        assert (comm.fused, comm.tp_push, comm.barrier_timeout_s) == (True, True, 120.0)
    monkeypatch.setenv("SPK_FUSED", "0")
    monkeypatch.setenv("SPK_TP_PUSH", "0")
    monkeypatch.setenv("SPK_BARRIER_TIMEOUT", "3")
    with Communicator(group1, max_tokens=8, hidden_size=8) as comm:
        assert (comm.fused, comm.tp_push, comm.barrier_timeout_s) == (False, False, 3.0)


def test_communicator_arguments_override_the_environment(monkeypatch, group1):
    monkeypatch.setenv("SPK_FUSED", "0")
    monkeypatch.setenv("SPK_TP_PUSH", "0")
    monkeypatch.setenv("SPK_BARRIER_TIMEOUT", "not a number")  # never read: the argument wins
    with Communicator(group1, max_tokens=8, hidden_size=8, fused=True, tp_push=True, barrier_timeout=0) as c:
        assert (c.fused, c.tp_push, c.barrier_timeout_s) == (True, True, 0.0)
    monkeypatch.delenv("SPK_FUSED")
    monkeypatch.delenv("SPK_TP_PUSH")
    monkeypatch.delenv("SPK_BARRIER_TIMEOUT")
    with Communicator(
        group1, max_tokens=8, hidden_size=8, fused=False, tp_push=False, barrier_timeout=2.5
    ) as c:
        assert (c.fused, c.tp_push, c.barrier_timeout_s) == (False, False, 2.5)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"fused": 1}, "fused"),
        ({"tp_push": "no"}, "tp_push"),
        ({"barrier_timeout": -1}, "barrier_timeout"),
        ({"barrier_timeout": float("inf")}, "barrier_timeout"),
        ({"barrier_timeout": "2"}, "barrier_timeout"),
        ({"barrier_timeout": True}, "barrier_timeout"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 8.0}, "max_tokens"),
        ({"hidden_size": -8}, "hidden_size"),
        ({"hidden_size": True}, "hidden_size"),
        ({"hc": 0}, "hc"),
        ({"device": "meta"}, "device"),
    ],
)
def test_communicator_bad_setting_is_named(group1, kwargs, named):
    with pytest.raises(ValueError, match=rf"\b{named}\b"):
        Communicator(group1, **{"max_tokens": 8, "hidden_size": 8, **kwargs})


def test_communicator_needs_a_process_group(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="torch.distributed to be initialised"):
        Communicator(max_tokens=8, hidden_size=8)
