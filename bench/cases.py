"""What bench/collectives.py times: each op, its baselines on the same inputs, and its byte counts.

Variant names. Local ops: ``spkernels`` (the op), ``compile_ref`` (torch.compile of reference.py),
``eager_ref``. SP/TP ops: ``fused`` (the op, partial in ``comm.partial_buffer(T)``), ``fused:plain``
(the op given an ordinary tensor, which it copies into the window), ``nccl+spkernels``
(torch.distributed NCCL collectives around spkernels' local kernel), ``nccl+compile_ref``,
``nccl+eager_ref`` (the same collectives around the reference math).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from common import import_spkernels

spk = import_spkernels()
ref = spk.reference
ops = torch.ops.spkernels
EPS = (ref.RMS_EPS, ref.HC_EPS, ref.NORM_EPS, ref.SINKHORN_ITERS, ref.POST_ALPHA)
HC = 4
E = 2  # bytes per bf16 element

LOCAL_OPS = ("mhc_pre", "mhc_post", "mhc_post_pre", "mhc_head")
SP_OPS = ("mhc_post_rs", "mhc_pre_ag", "mhc_post_pre_rs_ag", "sp_all_gather")
TP_OPS = ("mhc_post_ar", "mhc_post_pre_ar")
PARTIAL_OPS = ("mhc_post_rs", "mhc_post_pre_rs_ag", "mhc_post_ar", "mhc_post_pre_ar")
OP_VARIANTS = ("spkernels", "fused", "fused:plain")  # variants that are spkernels' own ops
SUITE_OPS = {"local": LOCAL_OPS, "sp": SP_OPS, "tp": TP_OPS}


# ---------------------------------------------------------------- bytes (formulas: collectives.py)
def traffic(op: str, T: int, D: int, tp: int) -> tuple[float, float]:
    """-> (NVLink bytes per rank per direction, HBM bytes per rank) for one call."""
    op = op.split(":")[0]
    row = D * E  # one [D] bf16 row
    shard = T / tp
    link_rs = (tp - 1) / tp * T * row  # a reduce-scatter or an all-gather of a [T, D] bf16 tensor
    fn_bytes = (2 + HC) * HC * HC * D * 4  # fn [24, 4D] fp32, read once per call
    mix_in, mix_out = 20 * 4, 24 * 4  # post+res read, post+res+pre written, fp32 per token
    stream_rw = 2 * HC * row  # read + write one token's [4, D] stream
    local = {
        "mhc_pre": (0.0, T * (HC * row + row + mix_out) + fn_bytes),
        "mhc_post": (0.0, T * (row + stream_rw + mix_in)),
        "mhc_post_pre": (0.0, T * (row + stream_rw + row + mix_in + mix_out) + fn_bytes),
        "mhc_head": (0.0, T * (HC * row + row) + HC * HC * D * 4),
    }
    if op in local:
        return local[op]
    table = {
        "mhc_post_rs": (link_rs, T * row + shard * (stream_rw + mix_in)),
        "mhc_pre_ag": (link_rs, shard * (HC * row + mix_out) + T * row + fn_bytes),
        "mhc_post_pre_rs_ag": (2 * link_rs, 2 * T * row + shard * (stream_rw + mix_in + mix_out) + fn_bytes),
        "sp_all_gather": (link_rs, shard * row + T * row),
        "mhc_post_ar": (2 * link_rs, T * row + T * (stream_rw + mix_in)),
        "mhc_post_pre_ar": (2 * link_rs, T * row + T * (stream_rw + row + mix_in + mix_out) + fn_bytes),
    }
    return table[op]


# ---------------------------------------------------------------- reference baselines
def ref_pre(stream, fn, scale, base, norm_weight, pre_mix_in):
    return ref.mhc_pre(stream, fn, scale, base, norm_weight, pre_mix_in)


def ref_post(y, stream, post_mix, res_mix):
    return ref.mhc_post(y, stream, post_mix, res_mix)


def ref_post_pre(y, stream, post_mix, res_mix, fn, scale, base, norm_weight, pre_mix_in):
    return ref.mhc_post_pre(y, stream, post_mix, res_mix, fn, scale, base, norm_weight, pre_mix_in)


def ref_head(stream, fn, scale, base):
    return ref.mhc_head(stream, fn, scale, base)


_compiled: dict[Callable, Callable] = {}


def compiled(fn: Callable) -> Callable:
    # One torch.compile wrapper per function, primed per D with a symbolic T (prime_compiled), so a
    # sweep costs ~2 compilations per function and D (T = 1 specialises), not one per T. dynamic=False
    # turns automatic dynamic shapes off for these calls only (torch applies it around each call, so
    # the process's dynamo config is left as it was): with it on, the second D made D symbolic in one
    # graph that then served every D (dynamo's cache belongs to the function's code, whatever the
    # wrapper), and that graph's mhc_post was 4-5x slower. Each D gets its own graph with D static;
    # T stays symbolic because prime_compiled marks it dynamic.
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, fullgraph=True, dynamic=False)
    return _compiled[fn]


def spk_pre(stream, fn, scale, base, norm_weight, pre_mix_in):
    return ops.mhc_pre(stream, fn, scale, base, norm_weight, pre_mix_in, *EPS)


def spk_post_pre(y, stream, post_mix, res_mix, fn, scale, base, norm_weight, pre_mix_in):
    return ops.mhc_post_pre(y, stream, post_mix, res_mix, fn, scale, base, norm_weight, pre_mix_in, *EPS)


def spk_head(stream, fn, scale, base):
    return ops.mhc_head(stream, fn, scale, base, ref.RMS_EPS, ref.HC_EPS)


LOCAL_FNS = {  # op -> (spkernels local kernel, reference function): also what the sp/tp baselines use
    "mhc_pre": (spk_pre, ref_pre),
    "mhc_post": (ops.mhc_post, ref_post),
    "mhc_post_pre": (spk_post_pre, ref_post_pre),
    "mhc_head": (spk_head, ref_head),
}
LOCAL_OF = {"mhc_post_rs": "mhc_post", "mhc_post_ar": "mhc_post", "mhc_pre_ag": "mhc_pre",
            "mhc_post_pre_rs_ag": "mhc_post_pre", "mhc_post_pre_ar": "mhc_post_pre"}  # fmt: skip


# The token count the compiled references are first called with (per D). Inductor autotunes a
# pointwise kernel's launch configs at its first call (triton.autotune_pointwise) and keeps the
# pick for every later T of the symbolic graph: primed at T = 2 the configs' timings are noise.
# Primed at a prefill size, the pick is made where the targets are judged.
PRIME_TOKENS = 4096


def prime_compiled(op: str, D: int, params: Params, device, delayed: bool = False) -> None:
    """Compile ``op``'s reference once with a symbolic token count (PRIME_TOKENS marked dynamic), so
    every T >= 2 of the sweep reuses one graph, autotuned at that size, instead of recompiling
    (T = 1 still specialises)."""
    spk_fn, ref_fn = LOCAL_FNS[LOCAL_OF.get(op, op)]
    T = PRIME_TOKENS
    stream = torch.randn((T, HC, D), device=device).to(torch.bfloat16)
    y = torch.randn((T, D), device=device).to(torch.bfloat16)
    post_mix, res_mix = make_mixes(T, D, params, None, device)
    pmi = make_pre_mix_in(T, None, device) if delayed else None
    for t in (stream, y, post_mix, res_mix, pmi):
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    args = {
        ref_pre: (stream, *params.pre, pmi),
        ref_post: (y, stream, post_mix, res_mix),
        ref_post_pre: (y, stream, post_mix, res_mix, *params.pre, pmi),
        ref_head: (stream, *params.head),
    }[ref_fn]
    compiled(ref_fn)(*args)


# ---------------------------------------------------------------- inputs
@dataclass
class Params:
    fn: torch.Tensor
    scale: torch.Tensor
    base: torch.Tensor
    norm_weight: torch.Tensor
    fn_head: torch.Tensor
    scale_head: torch.Tensor
    base_head: torch.Tensor

    @property
    def pre(self):
        return (self.fn, self.scale, self.base, self.norm_weight)

    @property
    def head(self):
        return (self.fn_head, self.scale_head, self.base_head)


def _randn(shape, gen, device, dtype=torch.float32, std=1.0):
    return (torch.randn(shape, generator=gen, device=device) * std).to(dtype)


def make_params(D: int, device: torch.device, seed: int = 1234) -> Params:
    """Identical on every rank (same seed): fn ~ N(0, 1/(4D)) makes the mixing logits O(1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    M, K = (2 + HC) * HC, HC * D
    return Params(
        fn=_randn((M, K), g, device, std=1 / math.sqrt(K)),
        scale=1 + _randn((3,), g, device, std=0.1),
        base=_randn((M,), g, device, std=0.1),
        norm_weight=(1 + _randn((D,), g, device, std=0.1)).to(torch.bfloat16),
        fn_head=_randn((HC, K), g, device, std=1 / math.sqrt(K)),
        scale_head=1 + _randn((1,), g, device, std=0.1),
        base_head=_randn((HC,), g, device, std=0.1),
    )


def make_mixes(T: int, D: int, params: Params, gen, device, chunk: int = 4096):
    """post_mix [T, 4], res_mix [T, 4, 4] of a random stream: valid (Sinkhorn) coefficients."""
    post, res = [], []
    for t0 in range(0, T, chunk):
        stream = _randn((min(chunk, T - t0), HC, D), gen, device, torch.bfloat16)
        _, p, r = ref.mhc_coefficients(stream, params.fn, params.scale, params.base)
        post.append(p)
        res.append(r)
    return torch.cat(post).contiguous(), torch.cat(res).contiguous()


def make_pre_mix_in(T: int, gen, device) -> torch.Tensor:
    """V4.1 delayed mode's carried-in collapse weights [T, 4]: a previous site's pre (> 0)."""
    return torch.sigmoid(_randn((T, HC), gen, device)) + ref.HC_EPS


@dataclass
class Inputs:
    """``nsets`` input sets for one (suite, T, D, tp), rotated by the timing loop."""

    streams: list[torch.Tensor]  # [T_stream, 4, D]: the full stream (local, tp) or this rank's shard (sp)
    partials: list[torch.Tensor]  # [T, D]: the sublayer output (local: y) or this rank's partial
    post_mix: torch.Tensor
    res_mix: torch.Tensor
    pre_mix_in: torch.Tensor | None = None  # [T_stream, 4] in delayed mode: every pre collapses with it

    @property
    def nsets(self) -> int:
        return len(self.streams)


def make_inputs(
    suite: str, T: int, D: int, tp: int, rank: int, nsets: int, params, device, delayed: bool = False
) -> Inputs:
    # The replicated TP stream and the local suite's inputs are the same on every rank; an SP
    # shard and every partial differ per rank, as they do in a model.
    t_stream = T // tp if suite == "sp" else T
    g_stream = torch.Generator(device=device).manual_seed(100 + (rank if suite == "sp" else 0))
    g_part = torch.Generator(device=device).manual_seed(200 + rank)
    streams = [_randn((t_stream, HC, D), g_stream, device, torch.bfloat16) for _ in range(nsets)]
    partials = [_randn((T, D), g_part, device, torch.bfloat16) for _ in range(nsets)]
    post, res = make_mixes(t_stream, D, params, g_stream, device)
    pre_mix_in = make_pre_mix_in(t_stream, g_stream, device) if delayed else None
    return Inputs(streams, partials, post, res, pre_mix_in)


def set_bytes(suite: str, T: int, D: int, tp: int) -> int:
    t_stream = T // tp if suite == "sp" else T
    return t_stream * HC * D * E + T * D * E


# ---------------------------------------------------------------- variants
@dataclass
class Ctx:
    suite: str
    T: int
    D: int
    tp: int
    inputs: Inputs
    params: Params
    group: object = None
    comm: object = None  # spkernels.Communicator for sp/tp
    with_compile: bool = False
    with_eager_ref: bool = True


def variants(op: str, c: Ctx, guard: bool = False) -> dict[str, Callable[[int], object]]:
    """The timed callables of ``op`` on ``c``'s inputs. ``guard``: the correctness-check forms
    (every reference path present; TP all-reduces SUM into a copy instead of AVG in place)."""
    x, p = c.inputs, c.params
    if c.suite == "local":
        kernel, reference = LOCAL_FNS[op]

        def local(fn):
            if op == "mhc_head":
                return lambda i: fn(x.streams[i], *p.head)
            if op == "mhc_pre":
                return lambda i: fn(x.streams[i], *p.pre, x.pre_mix_in)
            if op == "mhc_post":
                return lambda i: fn(x.partials[i], x.streams[i], x.post_mix, x.res_mix)
            return lambda i: fn(x.partials[i], x.streams[i], x.post_mix, x.res_mix, *p.pre, x.pre_mix_in)

        out = {"spkernels": local(kernel)}
        if c.with_compile and not guard:
            out["compile_ref"] = local(compiled(reference))
        if c.with_eager_ref or guard:
            out["eager_ref"] = local(reference)
        return out
    out = {"fused": _fused(op, c)}
    if op in PARTIAL_OPS:
        out["fused:plain"] = _fused(op, c, plain=True)
    if op == "sp_all_gather":
        out["nccl"] = lambda i: _all_gather(x.partials[i][: c.T // c.tp], c)
        return out
    local_fn, reference = LOCAL_FNS[LOCAL_OF[op]]
    out["nccl+spkernels"] = _unfused(op, c, local_fn, guard)
    if c.with_compile and not guard:
        out["nccl+compile_ref"] = _unfused(op, c, compiled(reference), guard)
    if c.with_eager_ref or guard:
        out["nccl+eager_ref"] = _unfused(op, c, reference, guard)
    return out


def reference_variant(op: str, suite: str) -> str:
    """The variant every other one is checked against: the reference math around NCCL."""
    if op == "sp_all_gather":
        return "nccl"
    return "eager_ref" if suite == "local" else "nccl+eager_ref"


def prepare(op: str, c: Ctx) -> None:
    """Fill the zero-copy partial buffer, as the sublayer's GEMM would, before the op runs."""
    if op in PARTIAL_OPS:
        c.comm.partial_buffer(c.T).copy_(c.inputs.partials[0])


def _fused(op: str, c: Ctx, plain: bool = False):
    x, h = c.inputs, c.comm.handle
    pre = (*c.params.pre, x.pre_mix_in, *EPS, h)
    buf = c.comm.partial_buffer(c.T) if op in PARTIAL_OPS else None

    def partial(i):
        return x.partials[i] if plain else buf

    if op == "sp_all_gather":
        return lambda i: ops.sp_all_gather(x.partials[i][: c.T // c.tp], c.T, h)
    if op == "mhc_pre_ag":
        return lambda i: ops.mhc_pre_ag(x.streams[i], *pre)
    if op in ("mhc_post_rs", "mhc_post_ar"):
        fn = ops.mhc_post_rs if op == "mhc_post_rs" else ops.mhc_post_ar
        return lambda i: fn(partial(i), x.streams[i], x.post_mix, x.res_mix, h)
    fn = ops.mhc_post_pre_rs_ag if op == "mhc_post_pre_rs_ag" else ops.mhc_post_pre_ar
    return lambda i: fn(partial(i), x.streams[i], x.post_mix, x.res_mix, *pre)


def _all_gather(x_local: torch.Tensor, c: Ctx) -> torch.Tensor:
    full = x_local.new_empty((x_local.shape[0] * c.tp, *x_local.shape[1:]))
    dist.all_gather_into_tensor(full, x_local, group=c.group)
    return full


def _reduce_scatter(partial: torch.Tensor, c: Ctx) -> torch.Tensor:
    out = partial.new_empty((partial.shape[0] // c.tp, *partial.shape[1:]))
    dist.reduce_scatter_tensor(out, partial, group=c.group)
    return out


def _all_reduce(partial: torch.Tensor, c: Ctx, guard: bool) -> torch.Tensor:
    # Timed: in place, as an engine does on its GEMM output. AVG, not SUM, so that hundreds of
    # in-place reductions of one input set stay finite (NCCL runs AVG as a pre-scaled sum: same
    # traffic, same kernels). The guard sums a copy, which is the op's semantics.
    if guard:
        partial = partial.clone()
    dist.all_reduce(partial, op=dist.ReduceOp.SUM if guard else dist.ReduceOp.AVG, group=c.group)
    return partial


def _unfused(op: str, c: Ctx, local_fn, guard: bool):
    x, p = c.inputs, c.params
    if op == "mhc_pre_ag":

        def pre_ag(i):
            layer_input, *mixes = local_fn(x.streams[i], *p.pre, x.pre_mix_in)
            return (_all_gather(layer_input, c), *mixes)

        return pre_ag
    if op == "mhc_post_rs":
        return lambda i: local_fn(_reduce_scatter(x.partials[i], c), x.streams[i], x.post_mix, x.res_mix)
    if op == "mhc_post_ar":
        return lambda i: local_fn(_all_reduce(x.partials[i], c, guard), x.streams[i], x.post_mix, x.res_mix)
    if op == "mhc_post_pre_ar":
        return lambda i: local_fn(
            _all_reduce(x.partials[i], c, guard), x.streams[i], x.post_mix, x.res_mix, *p.pre, x.pre_mix_in
        )

    def boundary(i):  # mhc_post_pre_rs_ag: RS -> post+pre on the shard -> AG of layer_input
        y = _reduce_scatter(x.partials[i], c)
        pre = (*p.pre, x.pre_mix_in)
        new_stream, layer_input, *mixes = local_fn(y, x.streams[i], x.post_mix, x.res_mix, *pre)
        return (new_stream, _all_gather(layer_input, c), *mixes)

    return boundary


# ---------------------------------------------------------------- correctness guard
def count_wrong(out, expected) -> int:
    """Elements outside a loose tolerance, plus every non-finite one (nccl-tests' #wrong).

    bf16 outputs: |a - b| <= 5e-2 + 5e-2 |b|. The fused ops may keep the reduced partial in fp32
    into the post and use TF32 for fn.x, so they differ from the reference by a few bf16 ulps
    (2^-8 relative) and ~1e-3 on the mixes; a real bug (transposed res_mix, a missed peer, a
    stale row) is off by O(1). fp32 mixes: 1e-2 absolute + relative.
    """
    outs = out if isinstance(out, tuple | list) else (out,)
    exps = expected if isinstance(expected, tuple | list) else (expected,)
    if len(outs) != len(exps):
        return sum(e.numel() for e in exps)
    wrong = 0
    for a, b in zip(outs, exps, strict=True):
        if a.shape != b.shape:
            wrong += b.numel()
            continue
        tol = 5e-2 if b.dtype == torch.bfloat16 else 1e-2
        a, b = a.float(), b.float()  # exact for bf16; half the memory of fp64 at T = 16384, D = 7168
        bad = ~torch.isfinite(a) | ((a - b).abs() > tol + tol * b.abs())
        wrong += int(bad.sum())
    return wrong
