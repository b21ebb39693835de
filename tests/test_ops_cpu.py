"""torch.ops.spkernels.* on CPU: every op against reference.py in fp64, opcheck on every op, a
torch.compile(fullgraph=True) model, and a table of bad arguments that must raise naming the argument.

The comm ops run here in a one-process gloo group (tp = 1 is a legal Communicator); their tp > 1
behaviour is tested in test_distributed_cpu.py.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from distributed import run_distributed
from spkernels import Communicator
from spkernels import reference as ref

ops = torch.ops.spkernels
bf16, f32, f64 = torch.bfloat16, torch.float32, torch.float64
HC = 4
EPS = (1e-6, 1e-6, 1e-6, 20, 2.0)  # rms_eps, hc_eps, norm_eps, sinkhorn_iters, post_alpha
TOKENS = [1, 2, 3, 17]
HIDDEN = [8, 64]


def site_args(p: dict, pre_mix_in=None) -> tuple:
    return p["fn"], p["scale"], p["base"], p["norm_weight"], pre_mix_in


def clone_all(args) -> list:
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def assert_unchanged(before, after) -> None:
    """No op may write into its inputs (none is marked mutable in the schema)."""
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        if isinstance(b, torch.Tensor):
            assert torch.equal(b, a), f"input {i} was modified"


def check_pre_outputs(mhc, out, stream, p, pre_mix_in, eps=EPS) -> None:
    """mhc_pre-shaped outputs against the fp64 reference on the same stream."""
    want = ref.mhc_pre(stream, *site_args(p, pre_mix_in), *eps, compute_dtype=f64)
    # With the fused norm, a flipped y_b (1 ulp) can move the normalised value by 2 ulps.
    mhc.assert_bf16_close(out[0], want[0], "layer_input", ulps=1 if p["norm_weight"] is None else 2)
    for name, o, w in zip(("post_mix", "res_mix", "pre_mix"), out[1:], want[1:], strict=True):
        mhc.assert_mix_close(o, w, name)


# ----------------------------------------------------------------------------- local ops vs reference
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("hidden_size", HIDDEN)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "fresh"])
def test_mhc_pre(mhc, num_tokens, hidden_size, norm, delayed):
    stream = mhc.stream(num_tokens, hidden_size)
    p = mhc.site(hidden_size, norm=norm)
    args = (stream, *site_args(p, mhc.pre_mix_in(num_tokens) if delayed else None))
    before = clone_all(args)
    out = ops.mhc_pre(*args)
    assert_unchanged(before, args)
    check_pre_outputs(mhc, out, stream, p, args[-1])


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("hidden_size", HIDDEN)
def test_mhc_post(mhc, num_tokens, hidden_size):
    stream, y = mhc.stream(num_tokens, hidden_size), mhc.y(num_tokens, hidden_size)
    post_mix, res_mix = mhc.mixes(num_tokens)
    args = (y, stream, post_mix, res_mix)
    before = clone_all(args)
    out = ops.mhc_post(*args)
    assert_unchanged(before, args)
    mhc.assert_bf16_close(out, ref.mhc_post(*args, compute_dtype=f64), "new_stream")


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("hidden_size", HIDDEN)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "fresh"])
def test_mhc_post_pre(mhc, num_tokens, hidden_size, norm, delayed):
    stream, y = mhc.stream(num_tokens, hidden_size), mhc.y(num_tokens, hidden_size)
    post_mix, res_mix = mhc.mixes(num_tokens)
    p = mhc.site(hidden_size, norm=norm)
    args = (y, stream, post_mix, res_mix, *site_args(p, mhc.pre_mix_in(num_tokens) if delayed else None))
    before = clone_all(args)
    out = ops.mhc_post_pre(*args)
    assert_unchanged(before, args)
    mhc.assert_bf16_close(out[0], ref.mhc_post(y, stream, post_mix, res_mix, compute_dtype=f64), "new_stream")
    # The pre half is checked on the op's own new_stream: a rare 1-ulp flip there (fp32 vs fp64)
    # would otherwise move the next site's mixes by ~1e-4 and hide real errors behind a loose bound.
    check_pre_outputs(mhc, out[1:], out[0], p, args[-1])


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("hidden_size", HIDDEN)
def test_mhc_head(mhc, num_tokens, hidden_size):
    stream = mhc.stream(num_tokens, hidden_size)
    h = mhc.head(hidden_size)
    args = (stream, h["fn"], h["scale"], h["base"])
    before = clone_all(args)
    out = ops.mhc_head(*args)
    assert_unchanged(before, args)
    mhc.assert_bf16_close(out, ref.mhc_head(*args, compute_dtype=f64), "out")


def test_eps_arguments_are_used(mhc):
    """Non-default EPS values reach the math (each one changes the result, and the op follows)."""
    T, D = 5, 8
    stream, y = mhc.stream(T, D), mhc.y(T, D)
    stream[1] *= 1e-3  # a tiny token, so rms_eps and norm_eps matter
    post_mix, res_mix = mhc.mixes(T)
    p = mhc.site(D)
    eps = (1e-4, 1e-2, 1e-1, 3, 1.5)
    out = ops.mhc_pre(stream, *site_args(p), *eps)
    check_pre_outputs(mhc, out, stream, p, None, eps)
    default = ops.mhc_pre(stream, *site_args(p))
    for i in range(4):
        assert not torch.equal(out[i], default[i]), f"output {i} ignores the EPS arguments"
    out = ops.mhc_post_pre(y, stream, post_mix, res_mix, *site_args(p), *eps)
    check_pre_outputs(mhc, out[1:], out[0], p, None, eps)
    h = mhc.head(D)
    out = ops.mhc_head(stream, h["fn"], h["scale"], h["base"], 1e-2, 1e-1)
    mhc.assert_bf16_close(out, ref.mhc_head(stream, h["fn"], h["scale"], h["base"], 1e-2, 1e-1, f64), "out")


def test_zero_rows_through_the_ops(mhc):
    """Padding rows give finite values and zero layer_input / stream rows in every local op."""
    T, D = 6, 64
    pad = [0, 4]
    stream, y = mhc.stream(T, D), mhc.y(T, D)
    stream[pad], y[pad] = 0, 0
    post_mix, res_mix = mhc.mixes(T)
    p, h = mhc.site(D), mhc.head(D)
    outs = [
        *ops.mhc_pre(stream, *site_args(p)),
        *ops.mhc_post_pre(y, stream, post_mix, res_mix, *site_args(p)),
        ops.mhc_post(y, stream, post_mix, res_mix),
        ops.mhc_head(stream, h["fn"], h["scale"], h["base"]),
    ]
    assert all(torch.isfinite(o).all() for o in outs)
    for i in (0, 4, 5, 9, 10):  # layer_input, new_stream, layer_input, new_stream, head out
        assert (outs[i][pad] == 0).all(), f"output {i}: padding rows are not zero"


# ----------------------------------------------------------------------------- comm ops at tp = 1
@pytest.mark.parametrize("num_tokens", [1, 17])
@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "fresh"])
def test_comm_ops_tp1(mhc, comm1, num_tokens, delayed):
    """At tp = 1 every collective is the identity: SP and TP ops equal reference post/pre."""
    T, D, h = num_tokens, 64, comm1.handle
    stream, partial = mhc.stream(T, D), mhc.y(T, D)
    post_mix, res_mix = mhc.mixes(T)
    p = mhc.site(D)
    pre_in = mhc.pre_mix_in(T) if delayed else None
    want_new = ref.mhc_post(partial, stream, post_mix, res_mix, compute_dtype=f64)
    for op in (ops.mhc_post_rs, ops.mhc_post_ar):
        mhc.assert_bf16_close(op(partial, stream, post_mix, res_mix, h), want_new, f"{op}: new_stream")
    check_pre_outputs(mhc, ops.mhc_pre_ag(stream, *site_args(p, pre_in), *EPS, h), stream, p, pre_in)
    for op in (ops.mhc_post_pre_rs_ag, ops.mhc_post_pre_ar):
        out = op(partial, stream, post_mix, res_mix, *site_args(p, pre_in), *EPS, h)
        mhc.assert_bf16_close(out[0], want_new, f"{op}: new_stream")
        check_pre_outputs(mhc, out[1:], out[0], p, pre_in)
    assert torch.equal(ops.sp_shard(stream, h), stream)
    assert torch.equal(ops.sp_all_gather(stream, T, h), stream)
    assert torch.equal(ops.sp_all_gather(stream, T - 1, h), stream[: T - 1])


def test_partial_buffer_tp1(mhc, comm1):
    """A partial written into comm.partial_buffer (poisoned first) gives what a plain tensor gives."""
    T, D, h = 9, 64, comm1.handle
    stream, partial = mhc.stream(T, D), mhc.y(T, D)
    post_mix, res_mix = mhc.mixes(T)
    buf = comm1.partial_buffer(T)
    assert buf.shape == (T, D) and buf.dtype == bf16
    buf.fill_(float("nan"))
    buf.copy_(partial)
    for op in (ops.mhc_post_rs, ops.mhc_post_ar):
        assert torch.equal(op(buf, stream, post_mix, res_mix, h), op(partial, stream, post_mix, res_mix, h))
    # one buffer of the communicator: every call a view of its first rows, the same memory
    again = comm1.partial_buffer(comm1.max_tokens)
    assert again.data_ptr() == buf.data_ptr() and torch.equal(again[:T], partial)
    for bad in (0, comm1.max_tokens + 1):
        with pytest.raises(ValueError, match="num_tokens must be in"):
            comm1.partial_buffer(bad)


# ----------------------------------------------------------------------------- barrier timeout
# The GPU side (a peer that dies mid-run) is tests/test_cuda_hang.py.
def test_comm_check_op_registered():
    """In every build; its kernel (CUDA builds) raises a fused kernel's barrier timeout."""
    assert str(ops._comm_check.default._schema) == "spkernels::_comm_check(int comm) -> ()"


def test_check_on_gloo_is_a_noop(comm1):
    comm1.check()
    comm1.close()
    with pytest.raises(RuntimeError, match="closed"):
        comm1.check()


@pytest.mark.parametrize(
    "raw, want", [(None, 120.0), ("", 120.0), ("2", 2.0), (" 0.25 ", 0.25), ("0", 0.0), ("1e3", 1000.0)]
)
def test_barrier_timeout_env(monkeypatch, group1, raw, want):
    if raw is None:
        monkeypatch.delenv("SPK_BARRIER_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("SPK_BARRIER_TIMEOUT", raw)
    with Communicator(group1, max_tokens=8, hidden_size=8) as comm:
        monkeypatch.setenv("SPK_BARRIER_TIMEOUT", "7")  # read once, at creation
        assert comm.barrier_timeout_s == want


@pytest.mark.parametrize("raw", ["abc", "2s", "-1", "nan", "inf", "1e10"])
def test_barrier_timeout_env_bad_value_is_named(monkeypatch, group1, raw):
    monkeypatch.setenv("SPK_BARRIER_TIMEOUT", raw)
    with pytest.raises(ValueError, match=rf"SPK_BARRIER_TIMEOUT .*got {re.escape(repr(raw))}"):
        Communicator(group1, max_tokens=8, hidden_size=8)


# ----------------------------------------------------------------------------- opcheck
def opcheck_inputs(mhc, tp_size: int = 1) -> dict:
    T, D = 4, 64  # D = the comm1 fixture's hidden_size
    post_mix, res_mix = mhc.mixes(T)
    return {
        "stream": mhc.stream(T, D),
        "y": mhc.y(T, D),
        "partial": mhc.y(T * tp_size, D),
        "post_mix": post_mix,
        "res_mix": res_mix,
        "site": mhc.site(D),
        "head": mhc.head(D),
        "pre_mix_in": mhc.pre_mix_in(T),
        "ints": mhc.randn(2 * tp_size + 1, 3, dtype=torch.int32),
        "tp_size": tp_size,
    }


def opcheck_cases(x: dict, comm: int) -> dict:
    """name -> (op, args) covering every public op, on small inputs."""
    stream, y, partial, post, res = x["stream"], x["y"], x["partial"], x["post_mix"], x["res_mix"]
    p, h, pre_in, T = x["site"], x["head"], x["pre_mix_in"], stream.shape[0] * x["tp_size"]
    return {
        "mhc_pre": (ops.mhc_pre, (stream, *site_args(p))),
        "mhc_pre-delayed-eps": (ops.mhc_pre, (stream, *site_args(p, pre_in), 1e-5, 1e-5, 1e-5, 4, 1.0)),
        "mhc_pre-sinkhorn_eps": (ops.mhc_pre, (stream, *site_args(p), 1e-5, 1e-5, 1e-5, 4, 1.0, 1e-2)),
        "mhc_post": (ops.mhc_post, (y, stream, post, res)),
        "mhc_post_pre": (ops.mhc_post_pre, (y, stream, post, res, *site_args(p, pre_in))),
        "mhc_head": (ops.mhc_head, (stream, h["fn"], h["scale"], h["base"])),
        "mhc_post_rs": (ops.mhc_post_rs, (partial, stream, post, res, comm)),
        "mhc_pre_ag": (ops.mhc_pre_ag, (stream, *site_args(p, pre_in), *EPS, comm)),
        "mhc_post_pre_rs_ag": (
            ops.mhc_post_pre_rs_ag,
            (partial, stream, post, res, *site_args(p), *EPS, comm),
        ),
        "sp_all_gather-trim": (ops.sp_all_gather, (y, T - 1, comm)),
        "sp_all_gather-f32-3d": (ops.sp_all_gather, (res, T, comm)),
        "sp_shard": (ops.sp_shard, (stream, comm)),
        "sp_shard-int32-pad": (ops.sp_shard, (x["ints"], comm)),
        "mhc_post_ar": (ops.mhc_post_ar, (y, stream, post, res, comm)),
        "mhc_post_pre_ar": (ops.mhc_post_pre_ar, (y, stream, post, res, *site_args(p, pre_in), *EPS, comm)),
        "mhc_post_pre_ar-sinkhorn_eps": (
            ops.mhc_post_pre_ar,
            (y, stream, post, res, *site_args(p, pre_in), *EPS, comm, 1e-2),
        ),
    }


LOCAL_CASES = [
    "mhc_pre",
    "mhc_pre-delayed-eps",
    "mhc_pre-sinkhorn_eps",
    "mhc_post",
    "mhc_post_pre",
    "mhc_head",
]
COMM_CASES = [
    "mhc_post_rs", "mhc_pre_ag", "mhc_post_pre_rs_ag", "sp_all_gather-trim", "sp_all_gather-f32-3d",
    "sp_shard", "sp_shard-int32-pad", "mhc_post_ar", "mhc_post_pre_ar", "mhc_post_pre_ar-sinkhorn_eps",
]  # fmt: skip


def test_opcheck_covers_every_op(mhc, comm1):
    cases = opcheck_cases(opcheck_inputs(mhc), comm1.handle)
    assert list(cases) == LOCAL_CASES + COMM_CASES
    covered = {op._qualified_op_name.split("::")[1] for op, _ in cases.values()}
    registered = (
        n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("spkernels::")
    )
    public = {n for n in registered if not n.startswith("_")}
    assert public == covered, f"ops without an opcheck case: {public - covered}"


@pytest.mark.parametrize("case", LOCAL_CASES + COMM_CASES)
def test_opcheck(mhc, comm1, case):
    op, args = opcheck_cases(opcheck_inputs(mhc), comm1.handle)[case]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("case", LOCAL_CASES + COMM_CASES)
def test_backward_raises(mhc, comm1, case):
    """The ops are inference-only: a forward with grad-requiring inputs gives the no-grad outputs, and
    a backward through them raises naming the op (torch's default would return zero gradients)."""
    op, args = opcheck_cases(opcheck_inputs(mhc), comm1.handle)[case]
    with torch.no_grad():
        want = op(*args)
    args = [
        a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in args
    ]
    got = op(*args)
    outs = got if isinstance(got, tuple) else (got,)
    for g, w in zip(outs, want if isinstance(want, tuple) else (want,), strict=True):
        assert torch.equal(g, w)
    if not any(o.requires_grad for o in outs):  # an integer shard: nothing to differentiate
        assert not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        return
    name = op._qualified_op_name
    with pytest.raises(RuntimeError, match=f"derivative for {name} is not implemented"):
        sum(o.float().sum() for o in outs if o.requires_grad).backward()


def _opcheck_tp2(rank, world_size, inputs):
    with Communicator(max_tokens=64, hidden_size=64) as comm:
        cases = opcheck_cases(inputs, comm.handle)
        for name in COMM_CASES:
            torch.library.opcheck(*cases[name])


@pytest.mark.slow
def test_opcheck_comm_ops_tp2(mhc):
    """opcheck runs each op several times; every rank does the same calls in the same order."""
    run_distributed(2, _opcheck_tp2, opcheck_inputs(mhc, tp_size=2))


# ----------------------------------------------------------------------------- torch.compile
def v4_model(emb, sites, weights, head):
    """Embedding -> pre -> (sublayer -> post_pre)* -> sublayer -> post -> head, all local ops."""
    stream = emb.unsqueeze(1).expand(-1, HC, -1).contiguous()
    layer_input, post_mix, res_mix, _ = ops.mhc_pre(stream, *site_args(sites[0]))
    for site, w in zip(sites[1:], weights, strict=False):
        y = torch.relu(layer_input @ w)
        stream, layer_input, post_mix, res_mix, _ = ops.mhc_post_pre(
            y, stream, post_mix, res_mix, *site_args(site)
        )
    stream = ops.mhc_post(torch.relu(layer_input @ weights[-1]), stream, post_mix, res_mix)
    return ops.mhc_head(stream, head["fn"], head["scale"], head["base"])


def v41_model(emb, sites, weights, comm, sp):
    """V4.1 delayed pre-mix through the comm ops: SP (shard, *_rs_ag, gather) or TP (*_ar) mode."""
    num_tokens = emb.shape[0]
    stream = emb.unsqueeze(1).expand(-1, HC, -1).contiguous()
    if sp:
        stream = ops.sp_shard(stream, comm)
    one_hot = torch.zeros(stream.shape[0], HC, dtype=f32, device=emb.device)
    one_hot[:, 0] = 1  # the first site collapses to stream 0: exactly the embedding
    if sp:
        layer_input, post_mix, res_mix, pre_mix = ops.mhc_pre_ag(
            stream, *site_args(sites[0], one_hot), *EPS, comm
        )
    else:
        layer_input, post_mix, res_mix, pre_mix = ops.mhc_pre(stream, *site_args(sites[0], one_hot), *EPS)
    boundary = ops.mhc_post_pre_rs_ag if sp else ops.mhc_post_pre_ar
    for site, w in zip(sites[1:], weights, strict=False):
        partial = torch.relu(layer_input @ w)
        stream, layer_input, post_mix, res_mix, pre_mix = boundary(
            partial, stream, post_mix, res_mix, *site_args(site, pre_mix), *EPS, comm
        )
    post = ops.mhc_post_rs if sp else ops.mhc_post_ar
    stream = post(torch.relu(layer_input @ weights[-1]), stream, post_mix, res_mix, comm)
    return ops.sp_all_gather(stream, num_tokens, comm) if sp else stream


def model_params(mhc, hidden_size, num_sites=4):
    sites = [mhc.site(hidden_size) for _ in range(num_sites)]
    weights = [
        (mhc.randn(hidden_size, hidden_size) / math.sqrt(hidden_size)).to(bf16) for _ in range(num_sites)
    ]
    return sites, weights


# Compiled and eager results must be bitwise equal: the custom ops are opaque calls into the same
# kernels, and the only code the compiler generates around them (relu, copies) is exact.
def test_compile_fullgraph_v4_model(mhc):
    D = 64
    sites, weights = model_params(mhc, D)
    head = mhc.head(D)
    torch._dynamo.reset()
    compiled = torch.compile(v4_model, fullgraph=True)
    emb = mhc.y(5, D)
    assert torch.equal(compiled(emb, sites, weights, head), v4_model(emb, sites, weights, head))
    # Dynamic token counts (a serving engine's case): the fake kernels must handle symbolic T.
    torch._dynamo.reset()
    dynamic = torch.compile(v4_model, fullgraph=True, dynamic=True, backend="aot_eager")
    for T in (3, 17):
        emb = mhc.y(T, D)
        assert torch.equal(dynamic(emb, sites, weights, head), v4_model(emb, sites, weights, head))


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "tp"])
def test_compile_fullgraph_comm_model(mhc, comm1, sp):
    D = 64
    sites, weights = model_params(mhc, D)
    torch._dynamo.reset()
    compiled = torch.compile(v41_model, fullgraph=True)
    emb = mhc.y(7, D)
    eager = v41_model(emb, sites, weights, comm1.handle, sp)
    assert torch.equal(compiled(emb, sites, weights, comm1.handle, sp), eager)
    # At tp = 1 both modes are the same math: one more check that the SP ops are wired like TP's.
    assert torch.equal(eager, v41_model(emb, sites, weights, comm1.handle, not sp))


# ----------------------------------------------------------------------------- bad arguments
BAD_T, BAD_D, BAD_CAPACITY = 4, 8, 6
LOCAL_OPS = ["mhc_pre", "mhc_post", "mhc_post_pre", "mhc_head"]
COMM_OPS = ["mhc_post_rs", "mhc_pre_ag", "mhc_post_pre_rs_ag", "sp_all_gather", "sp_shard"]
COMM_OPS += ["mhc_post_ar", "mhc_post_pre_ar"]


def schema_args(op_name: str) -> list:
    return list(getattr(ops, op_name).default._schema.arguments)


def valid_args(mhc, op_name: str, comm: int, num_tokens: int = BAD_T) -> dict:
    """Arguments (in schema order) of a call that succeeds; tensors are fresh random values."""
    T, D = num_tokens, BAD_D
    post_mix, res_mix = mhc.mixes(T)
    site = mhc.head(D) if op_name == "mhc_head" else mhc.site(D)
    pool = {
        "stream": mhc.stream(T, D),
        "y": mhc.y(T, D),
        "partial": mhc.y(T, D),  # tp = 1: the padded total is the local count
        "post_mix": post_mix,
        "res_mix": res_mix,
        **site,
        "pre_mix_in": mhc.pre_mix_in(T),
        "x_local": mhc.y(T, D),
        "x": mhc.stream(T, D),
        "num_tokens": T,
        "comm": comm,
        **dict(zip(("rms_eps", "hc_eps", "norm_eps", "sinkhorn_iters", "post_alpha"), EPS, strict=True)),
    }
    return {a.name: pool.get(a.name, a.default_value) for a in schema_args(op_name)}


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    out = wide[..., ::2]
    out.copy_(t)
    return out


def mutate(t: torch.Tensor, kind: str, mhc) -> torch.Tensor:
    if kind == "dtype":
        return t.to(f32 if t.dtype == bf16 else bf16)
    if kind == "shape":  # one more column: stays consistent in T, wrong in the trailing size
        return mhc.randn(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype)
    if kind == "rows":  # one more token than the stream has
        return mhc.randn(t.shape[0] + 1, *t.shape[1:], dtype=t.dtype)
    if kind == "ndim":
        return t[0]
    if kind == "noncontiguous":
        return noncontiguous(t)
    raise AssertionError(kind)


def tensor_kinds(op_name: str, arg: str) -> list[str]:
    """The bad kinds that apply to a tensor argument. The stream sets T, hc and D for the call, so
    its trailing sizes cannot be 'wrong' by themselves; sp_shard/sp_all_gather take any dtype and
    trailing dims. Size-1 tensors (head scale) cannot be made non-contiguous."""
    if op_name == "sp_shard":
        return ["ndim0"]
    if op_name == "sp_all_gather":
        return ["ndim0", "noncontiguous"]
    if arg == "stream":
        return ["dtype", "ndim", "noncontiguous"]
    kinds = ["dtype", "shape", "noncontiguous"]
    if arg in ("y", "post_mix", "res_mix", "pre_mix_in") or (arg == "partial" and op_name.endswith("_ar")):
        kinds.append("rows")
    if op_name == "mhc_head" and arg == "scale":
        kinds.remove("noncontiguous")
    return kinds


# Scalars that would divide a zero row by zero (> 0 needed) or are not numbers at all.
BAD_EPS = {
    "rms_eps": ("eps_zero", "eps_nan"),
    "hc_eps": ("eps_negative",),
    "norm_eps": ("eps_zero",),
    "sinkhorn_eps": ("eps_zero",),
    "post_alpha": ("eps_nan",),
}
BAD_EPS_VALUE = {"eps_zero": 0.0, "eps_nan": float("nan"), "eps_negative": -1e-3}


def bad_cases():
    for op_name in LOCAL_OPS + COMM_OPS:
        for a in schema_args(op_name):
            if str(a.type) in ("Tensor", "Optional[Tensor]"):
                for kind in tensor_kinds(op_name, a.name):
                    yield pytest.param(op_name, a.name, kind, id=f"{op_name}-{a.name}-{kind}")
            elif a.name == "sinkhorn_iters":
                for kind in ("zero", "huge"):
                    yield pytest.param(op_name, a.name, kind, id=f"{op_name}-{a.name}-{kind}")
            elif a.name in BAD_EPS:
                for kind in BAD_EPS[a.name]:
                    yield pytest.param(op_name, a.name, kind, id=f"{op_name}-{a.name}-{kind}")
        if op_name in COMM_OPS:
            # sp_shard is pure indexing that never touches the communicator's buffers: no capacity;
            # the gathers take rows of any width: no hidden size.
            kinds = ("closed", "unknown") + (() if op_name == "sp_shard" else ("capacity",))
            kinds += () if op_name.startswith("sp_") else ("hidden",)
            for kind in kinds:
                yield pytest.param(op_name, "comm", kind, id=f"{op_name}-comm-{kind}")
    for kind in ("negative", "too_many"):
        yield pytest.param("sp_all_gather", "num_tokens", kind, id=f"sp_all_gather-num_tokens-{kind}")
    for op_name in ("mhc_post_rs", "mhc_post_pre_rs_ag"):
        yield pytest.param(op_name, "partial", "rows", id=f"{op_name}-partial-rows")


@pytest.fixture
def small_comm(group1):
    with Communicator(group1, max_tokens=BAD_CAPACITY, hidden_size=BAD_D) as comm:
        yield comm


@pytest.mark.parametrize("op_name", LOCAL_OPS + COMM_OPS)
def test_valid_args_succeed(mhc, small_comm, op_name):
    """The baseline of the bad-argument table: unmodified, every call works."""
    getattr(ops, op_name)(*valid_args(mhc, op_name, small_comm.handle).values())


@pytest.mark.parametrize("op_name, arg, kind", list(bad_cases()))
def test_bad_argument_is_named(request, mhc, small_comm, op_name, arg, kind):
    args = valid_args(mhc, op_name, small_comm.handle)
    if kind == "ndim0":
        args[arg] = mhc.randn(())
    elif kind == "zero":
        args[arg] = 0
    elif kind == "huge":
        args[arg] = 1001
    elif kind in BAD_EPS_VALUE:
        args[arg] = BAD_EPS_VALUE[kind]
    elif kind == "hidden":  # a communicator of another hidden size
        other = Communicator(small_comm.group, max_tokens=BAD_CAPACITY, hidden_size=BAD_D + 8)
        request.addfinalizer(other.close)
        args[arg] = other.handle
    elif kind == "closed":
        closed = Communicator(small_comm.group, max_tokens=BAD_CAPACITY, hidden_size=BAD_D)
        closed.close()
        args[arg] = closed.handle
    elif kind == "unknown":
        args[arg] = 1 << 40
    elif kind == "capacity":  # a consistent call with one token more than the communicator holds
        args = valid_args(mhc, op_name, small_comm.handle, num_tokens=BAD_CAPACITY + 1)
    elif kind == "negative":
        args[arg] = -1
    elif kind == "too_many":
        args[arg] = BAD_T + 1
    else:
        args[arg] = mutate(args[arg], kind, mhc)
    named = {"capacity": "max_tokens", "hidden": "hidden_size"}.get(kind, arg)
    with pytest.raises((ValueError, RuntimeError), match=rf"\b{re.escape(named)}\b") as err:
        getattr(ops, op_name)(*args.values())
    # The dispatcher's own type errors quote the whole schema, which names every argument.
    assert "Declaration:" not in str(err.value)
