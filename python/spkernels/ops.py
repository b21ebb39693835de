"""Fake (meta) and CPU implementations of ``torch.ops.spkernels.*`` (schemas: csrc/torch_bindings.cpp).

CPU kernels are the reference math of reference.py with gloo collectives behind the
communicator, so CI without a GPU exercises the whole op contract.

Who validates what: each op validates its own arguments in the language of its kernel — the CPU
kernels here, the CUDA launchers in csrc/ops/checks.h (which add the CUDA-only limits: hc = 4, D a
multiple of 8 up to 8192, 16-byte alignment) — with the same messages, so a bad tensor raises the
same way whether it reaches the op through spkernels.api (which validates nothing but the
Communicator's type) or through torch.ops directly. Communicator checks (closed, capacity, hidden
size) sit where the communicator's state lives: comm.py's registry for gloo, CommState for CUDA.

Reductions follow docs/contract.md: fp32 sum in rank order 0..tp-1, rounded to bf16, then the post —
identical on every rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from . import reference as ref
from .comm import lookup

_lib = "spkernels"
bf16, f32 = torch.bfloat16, torch.float32


# ----------------------------------------------------------------------------- argument checks
def _check_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple, device=None) -> None:
    """shape: expected sizes, None where any size goes."""
    want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a {dtype} tensor {want}, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} {want}, got {t.dtype}")
    if t.dim() != len(shape) or any(e is not None and s != e for s, e in zip(t.shape, shape, strict=True)):
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {list(t.shape)}, strides {list(t.stride())})")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} like the stream, got {t.device}")


def _check_stream(stream: torch.Tensor) -> tuple[int, int, int]:
    if not isinstance(stream, torch.Tensor) or stream.dim() != 3:
        got = list(stream.shape) if isinstance(stream, torch.Tensor) else type(stream).__name__
        raise ValueError(f"stream must be bf16 [T, hc, D], got {got}")
    _check_tensor("stream", stream, bf16, (None, None, None))
    T, hc, D = stream.shape
    if hc < 1 or D < 1:
        raise ValueError(f"stream must be bf16 [T, hc, D] with hc, D >= 1, got {list(stream.shape)}")
    return T, hc, D


def _check_eps(name: str, value, positive: bool) -> None:
    """An eps: finite and > 0 where a zero row would otherwise divide by zero (the mean squares,
    the norm, the Sinkhorn's sums), else >= 0. The CUDA launchers' rule too (csrc/ops/checks.h)."""
    ok = isinstance(value, int | float) and math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        raise ValueError(f"{name} must be a finite number {'>' if positive else '>='} 0, got {value!r}")


def _check_pre_args(stream, fn, scale, base, norm_weight, pre_mix_in, eps, sinkhorn_eps) -> None:
    rms_eps, hc_eps, norm_eps, sinkhorn_iters, post_alpha = eps
    T, hc, D = stream.shape
    dev = stream.device
    _check_tensor("fn", fn, f32, (ref.num_mix(hc), hc * D), dev)
    _check_tensor("scale", scale, f32, (3,), dev)
    _check_tensor("base", base, f32, (ref.num_mix(hc),), dev)
    if norm_weight is not None:
        _check_tensor("norm_weight", norm_weight, bf16, (D,), dev)
    if pre_mix_in is not None:
        _check_tensor("pre_mix_in", pre_mix_in, f32, (T, hc), dev)
    if not 1 <= sinkhorn_iters <= 1000:  # the CUDA launchers' range too (csrc/ops/checks.h)
        raise ValueError(f"sinkhorn_iters must be in [1, 1000], got {sinkhorn_iters}")
    _check_eps("rms_eps", rms_eps, True)
    _check_eps("hc_eps", hc_eps, False)
    if norm_weight is not None:
        _check_eps("norm_eps", norm_eps, True)
    if sinkhorn_eps is None:
        _check_eps("sinkhorn_eps (None: hc_eps)", hc_eps, True)
    else:
        _check_eps("sinkhorn_eps", sinkhorn_eps, True)
    if not isinstance(post_alpha, int | float) or not math.isfinite(post_alpha):
        raise ValueError(f"post_alpha must be a finite number, got {post_alpha!r}")


def _check_post_args(stream, post_mix, res_mix) -> None:
    T, hc, _ = stream.shape
    _check_tensor("post_mix", post_mix, f32, (T, hc), stream.device)
    _check_tensor("res_mix", res_mix, f32, (T, hc, hc), stream.device)


def _comm_for(comm: int, num_tokens: int, device: torch.device):
    c = lookup(comm)
    if device.type != c.device.type:
        raise ValueError(
            f"comm {comm} is a {c.backend} communicator for {c.device.type} tensors, "
            f"got {device.type} tensors"
        )
    if num_tokens > c.max_tokens:
        raise ValueError(
            f"T = {num_tokens} tokens is above the communicator's capacity max_tokens = {c.max_tokens}"
        )
    return c


def _comm_for_stream(comm: int, stream: torch.Tensor, sp: bool):
    """The communicator of a stream op: T (tp * T_local in SP mode) within capacity, D its hidden_size."""
    c = lookup(comm)
    _comm_for(comm, stream.shape[0] * (c.tp_size if sp else 1), stream.device)
    if stream.shape[2] != c.hidden_size:
        raise ValueError(
            f"stream's hidden size {stream.shape[2]} differs from the communicator's "
            f"hidden_size {c.hidden_size}"
        )
    return c


def _check_sp_partial(partial, stream, c) -> int:
    T_local, _, D = stream.shape
    T = T_local * c.tp_size
    _check_tensor("partial", partial, bf16, (None, D), stream.device)
    if partial.shape[0] != T:
        raise ValueError(
            f"partial must be [T, D] with T = tp * T_local = {c.tp_size} * {T_local} = {T} "
            f"(pad T to a multiple of tp), got {list(partial.shape)}"
        )
    return T


# ----------------------------------------------------------------------------- gloo helpers
def _all_gather_rows(x: torch.Tensor, c) -> list[torch.Tensor]:
    """All-gather over the group as raw bytes (any dtype), returned in rank order."""
    flat = x.contiguous().view(torch.uint8).reshape(-1)
    outs = [torch.empty_like(flat) for _ in range(c.tp_size)]
    dist.all_gather(outs, flat, group=c.group)
    return [o.view(x.dtype).reshape(x.shape) for o in outs]


def _reduce_rows(partial: torch.Tensor, c, rows: slice) -> torch.Tensor:
    # Gather every rank's whole partial, then sum ``rows`` in rank order: bitwise identical on every
    # rank. (Each rank must contribute the *receiver's* rows, so it cannot send only its own.)
    return ref.reduce_partials([p[rows] for p in _all_gather_rows(partial, c)])


def _my_rows(c, T: int) -> slice:
    n = T // c.tp_size
    return slice(c.rank * n, (c.rank + 1) * n)


# ----------------------------------------------------------------------------- local ops
def _pre_out_like(stream):
    T, hc, D = stream.shape
    return (
        stream.new_empty((T, D)),
        stream.new_empty((T, hc), dtype=f32),
        stream.new_empty((T, hc, hc), dtype=f32),
        stream.new_empty((T, hc), dtype=f32),
    )


# The dispatcher leaves out trailing arguments that equal their schema defaults when it calls a
# Python kernel, so the kernels restate the defaults: reference.py's, which the schemas state too
# (tests/test_api_cpu.py checks they agree). ``eps`` = (rms_eps, hc_eps, norm_eps, sinkhorn_iters,
# post_alpha) in schema order; ``sinkhorn_eps`` None means hc_eps.
EPS_DEFAULTS = (ref.RMS_EPS, ref.HC_EPS, ref.NORM_EPS, ref.SINKHORN_ITERS, ref.POST_ALPHA)


def _split_eps(eps_sk: tuple, comm: bool = False) -> tuple:
    """(eps, comm, sinkhorn_eps) from the trailing scalars as the dispatcher passes them: the comm
    ops' five eps and comm always, sinkhorn_eps only when not None; the local ops' as far as the
    last argument that differs from its default."""
    if comm:
        return tuple(eps_sk[:5]), eps_sk[5], eps_sk[6] if len(eps_sk) > 6 else None
    full = tuple(eps_sk) + (EPS_DEFAULTS + (None,))[len(eps_sk) :]
    return full[:5], None, full[5]


@torch.library.register_fake(f"{_lib}::mhc_pre")
def _(stream, fn, scale, base, norm_weight=None, pre_mix_in=None, *eps_sk):
    return _pre_out_like(stream)


@torch.library.register_kernel(f"{_lib}::mhc_pre", "cpu")
def _(stream, fn, scale, base, norm_weight=None, pre_mix_in=None, *eps_sk):
    eps, _, sinkhorn_eps = _split_eps(eps_sk)
    _check_stream(stream)
    _check_pre_args(stream, fn, scale, base, norm_weight, pre_mix_in, eps, sinkhorn_eps)
    return ref.mhc_pre(stream, fn, scale, base, norm_weight, pre_mix_in, *eps, sinkhorn_eps=sinkhorn_eps)


@torch.library.register_fake(f"{_lib}::mhc_post")
def _(y, stream, post_mix, res_mix):
    return torch.empty_like(stream)


def _check_y(y, stream):
    T, _, D = stream.shape
    _check_tensor("y", y, bf16, (T, D), stream.device)


@torch.library.register_kernel(f"{_lib}::mhc_post", "cpu")
def _(y, stream, post_mix, res_mix):
    _check_stream(stream)
    _check_y(y, stream)
    _check_post_args(stream, post_mix, res_mix)
    return ref.mhc_post(y, stream, post_mix, res_mix)


@torch.library.register_fake(f"{_lib}::mhc_post_pre")
def _(y, stream, post_mix, res_mix, fn, scale, base, norm_weight=None, pre_mix_in=None, *eps_sk):
    return (torch.empty_like(stream), *_pre_out_like(stream))


@torch.library.register_kernel(f"{_lib}::mhc_post_pre", "cpu")
def _(y, stream, post_mix, res_mix, fn, scale, base, norm_weight=None, pre_mix_in=None, *eps_sk):
    eps, _, sinkhorn_eps = _split_eps(eps_sk)
    _check_stream(stream)
    _check_y(y, stream)
    _check_post_args(stream, post_mix, res_mix)
    _check_pre_args(stream, fn, scale, base, norm_weight, pre_mix_in, eps, sinkhorn_eps)
    site = (fn, scale, base, norm_weight, pre_mix_in, *eps)
    return ref.mhc_post_pre(y, stream, post_mix, res_mix, *site, sinkhorn_eps=sinkhorn_eps)


@torch.library.register_fake(f"{_lib}::mhc_head")
def _(stream, fn, scale, base, rms_eps=ref.RMS_EPS, hc_eps=ref.HC_EPS):
    return stream.new_empty((stream.shape[0], stream.shape[2]))


@torch.library.register_kernel(f"{_lib}::mhc_head", "cpu")
def _(stream, fn, scale, base, rms_eps=ref.RMS_EPS, hc_eps=ref.HC_EPS):
    T, hc, D = _check_stream(stream)
    _check_tensor("fn", fn, f32, (hc, hc * D), stream.device)
    _check_tensor("scale", scale, f32, (1,), stream.device)
    _check_tensor("base", base, f32, (hc,), stream.device)
    _check_eps("rms_eps", rms_eps, True)
    _check_eps("hc_eps", hc_eps, False)
    return ref.mhc_head(stream, fn, scale, base, rms_eps, hc_eps)


# ----------------------------------------------------------------------------- SP mode
@torch.library.register_fake(f"{_lib}::mhc_post_rs")
def _(partial, stream, post_mix, res_mix, comm):
    return torch.empty_like(stream)


@torch.library.register_kernel(f"{_lib}::mhc_post_rs", "cpu")
def _(partial, stream, post_mix, res_mix, comm):
    T_local, _, _ = _check_stream(stream)
    c = _comm_for_stream(comm, stream, sp=True)
    T = _check_sp_partial(partial, stream, c)
    _check_post_args(stream, post_mix, res_mix)
    y = _reduce_rows(partial, c, _my_rows(c, T))
    return ref.mhc_post(y, stream, post_mix, res_mix)


def _ag_pre_out(stream, comm):
    li, post, res, pre = _pre_out_like(stream)
    return stream.new_empty((stream.shape[0] * lookup(comm).tp_size, stream.shape[2])), post, res, pre


@torch.library.register_fake(f"{_lib}::mhc_pre_ag")
def _(stream, fn, scale, base, norm_weight, pre_mix_in, *eps_comm_sk):
    return _ag_pre_out(stream, eps_comm_sk[5])


def _pre_ag_cpu(stream, fn, scale, base, norm_weight, pre_mix_in, eps, sinkhorn_eps, c):
    _check_pre_args(stream, fn, scale, base, norm_weight, pre_mix_in, eps, sinkhorn_eps)
    layer_input, post, res, pre = ref.mhc_pre(
        stream, fn, scale, base, norm_weight, pre_mix_in, *eps, sinkhorn_eps=sinkhorn_eps
    )
    return torch.cat(_all_gather_rows(layer_input, c)), post, res, pre


@torch.library.register_kernel(f"{_lib}::mhc_pre_ag", "cpu")
def _(stream, fn, scale, base, norm_weight, pre_mix_in, *eps_comm_sk):
    eps, comm, sinkhorn_eps = _split_eps(eps_comm_sk, comm=True)
    _check_stream(stream)
    c = _comm_for_stream(comm, stream, sp=True)
    return _pre_ag_cpu(stream, fn, scale, base, norm_weight, pre_mix_in, eps, sinkhorn_eps, c)


@torch.library.register_fake(f"{_lib}::mhc_post_pre_rs_ag")
def _(partial, stream, post_mix, res_mix, fn, scale, base, norm_weight, pre_mix_in, *eps_comm_sk):
    return (torch.empty_like(stream), *_ag_pre_out(stream, eps_comm_sk[5]))


@torch.library.register_kernel(f"{_lib}::mhc_post_pre_rs_ag", "cpu")
def _(partial, stream, post_mix, res_mix, fn, scale, base, norm_weight, pre_mix_in, *eps_comm_sk):
    eps, comm, sinkhorn_eps = _split_eps(eps_comm_sk, comm=True)
    _check_stream(stream)
    c = _comm_for_stream(comm, stream, sp=True)
    T = _check_sp_partial(partial, stream, c)
    _check_post_args(stream, post_mix, res_mix)
    _check_pre_args(stream, fn, scale, base, norm_weight, pre_mix_in, eps, sinkhorn_eps)
    y = _reduce_rows(partial, c, _my_rows(c, T))
    new_stream = ref.mhc_post(y, stream, post_mix, res_mix)
    pre = _pre_ag_cpu(new_stream, fn, scale, base, norm_weight, pre_mix_in, eps, sinkhorn_eps, c)
    return (new_stream, *pre)


@torch.library.register_fake(f"{_lib}::sp_all_gather")
def _(x_local, num_tokens, comm):
    return x_local.new_empty((num_tokens, *x_local.shape[1:]))


def _check_all_gather(x_local, num_tokens, c):
    if not isinstance(x_local, torch.Tensor) or x_local.dim() < 1:
        raise ValueError("x_local must be a tensor [T_local, ...]")
    if not x_local.is_contiguous():
        raise ValueError("x_local must be contiguous")
    T = x_local.shape[0] * c.tp_size
    if not 0 <= num_tokens <= T:
        raise ValueError(f"num_tokens must be in [0, tp * T_local = {T}], got {num_tokens}")


@torch.library.register_kernel(f"{_lib}::sp_all_gather", "cpu")
def _(x_local, num_tokens, comm):
    c = lookup(comm)
    _check_all_gather(x_local, num_tokens, c)
    _comm_for(comm, x_local.shape[0] * c.tp_size, x_local.device)
    return torch.cat(_all_gather_rows(x_local, c))[:num_tokens]


def sp_shard_rows(num_tokens: int, tp_size: int, rank: int) -> tuple[int, int]:
    """Rows [start, end) of the zero-padded [ceil(T / tp) * tp, ...] tensor that ``rank`` owns."""
    per_rank = -(-num_tokens // tp_size)
    return rank * per_rank, (rank + 1) * per_rank


@torch.library.register_fake(f"{_lib}::sp_shard")
def _(x, comm):
    c = lookup(comm)
    return x.new_empty((-(-x.shape[0] // c.tp_size), *x.shape[1:]))


def sp_shard_impl(x: torch.Tensor, comm: int) -> torch.Tensor:
    """Device-generic: pad rows with zeros to a multiple of tp and copy out this rank's rows."""
    c = lookup(comm)
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("x must be a tensor [T, ...]")
    if x.device.type != c.device.type or (x.is_cuda and x.device != c.device):
        raise ValueError(f"x must be on {c.device} like comm {comm} ({c.backend}), got {x.device}")
    start, end = sp_shard_rows(x.shape[0], c.tp_size, c.rank)
    out = x.new_zeros((end - start, *x.shape[1:]))
    n = max(0, min(end, x.shape[0]) - start)
    out[:n] = x[start : start + n]
    return out


# sp_shard is pure indexing: one device-generic implementation serves CPU and CUDA.
torch.library.register_kernel(f"{_lib}::sp_shard", ("cpu", "cuda"))(sp_shard_impl)


# ----------------------------------------------------------------------------- TP mode
def _check_tp_partial(partial, stream):
    T, _, D = stream.shape
    _check_tensor("partial", partial, bf16, (T, D), stream.device)


@torch.library.register_fake(f"{_lib}::mhc_post_ar")
def _(partial, stream, post_mix, res_mix, comm):
    return torch.empty_like(stream)


@torch.library.register_kernel(f"{_lib}::mhc_post_ar", "cpu")
def _(partial, stream, post_mix, res_mix, comm):
    T, _, _ = _check_stream(stream)
    c = _comm_for_stream(comm, stream, sp=False)
    _check_tp_partial(partial, stream)
    _check_post_args(stream, post_mix, res_mix)
    return ref.mhc_post(_reduce_rows(partial, c, slice(0, T)), stream, post_mix, res_mix)


@torch.library.register_fake(f"{_lib}::mhc_post_pre_ar")
def _(partial, stream, post_mix, res_mix, fn, scale, base, norm_weight, pre_mix_in, *eps_comm_sk):
    return (torch.empty_like(stream), *_pre_out_like(stream))


@torch.library.register_kernel(f"{_lib}::mhc_post_pre_ar", "cpu")
def _(partial, stream, post_mix, res_mix, fn, scale, base, norm_weight, pre_mix_in, *eps_comm_sk):
    eps, comm, sinkhorn_eps = _split_eps(eps_comm_sk, comm=True)
    T, _, _ = _check_stream(stream)
    c = _comm_for_stream(comm, stream, sp=False)
    _check_tp_partial(partial, stream)
    _check_post_args(stream, post_mix, res_mix)
    _check_pre_args(stream, fn, scale, base, norm_weight, pre_mix_in, eps, sinkhorn_eps)
    y = _reduce_rows(partial, c, slice(0, T))
    site = (fn, scale, base, norm_weight, pre_mix_in, *eps)
    return ref.mhc_post_pre(y, stream, post_mix, res_mix, *site, sinkhorn_eps=sinkhorn_eps)


# ----------------------------------------------------------------------------- the runner's glue
# Internal ops of the model runner (runner/glue.py); CUDA kernels in csrc/ops/runner_ops.cu, which
# compute these exact operations (fp32 products, one bf16 rounding per output).
def _check_rope_args(qkv, cos, sin, kv_cache, rows, positions) -> None:
    _check_tensor("qkv", qkv, bf16, (None, 3, None, None))
    T, _, H, hd = qkv.shape
    if hd % 16:
        raise ValueError(f"qkv's head_dim must be a multiple of 16, got {hd}")
    _check_tensor("kv_cache", kv_cache, bf16, (2, None, H, None, hd))
    for name, t in (("cos", cos), ("sin", sin)):
        ok = isinstance(t, torch.Tensor) and t.dtype == f32 and t.is_contiguous() and t.numel() == T * hd // 2
        if not ok:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must be a contiguous float32 tensor of [T, head_dim / 2] = [{T}, {hd // 2}] "
                f"values, got {got}"
            )
    for name, t in (("rows", rows), ("positions", positions)):
        _check_tensor(name, t, torch.int64, (T,))
    for name, t, size in (("rows", rows, kv_cache.shape[1]), ("positions", positions, kv_cache.shape[3])):
        if T and (int(t.min()) < 0 or int(t.max()) >= size):
            raise ValueError(f"{name} must be in [0, {size}) (kv_cache's size), got {t.min()}..{t.max()}")


@torch.library.register_fake(f"{_lib}::_rope_kv_cache")
def _(qkv, cos, sin, kv_cache, rows, positions):
    return None


@torch.library.register_kernel(f"{_lib}::_rope_kv_cache", "cpu")
def _(qkv, cos, sin, kv_cache, rows, positions):
    _check_rope_args(qkv, cos, sin, kv_cache, rows, positions)
    T, _, _, hd = qkv.shape
    c, s = cos.view(T, 1, 1, hd // 2), sin.view(T, 1, 1, hd // 2)
    kv = qkv[:, 1:].clone()  # k rotated here, v as is; qkv's k and v stay as they were
    for x in (qkv[:, :1], kv[:, :1]):  # q in place, then k
        x1, x2 = x.chunk(2, dim=-1)
        a, b, x1s = x1 * c, x2 * s, x1 * s  # bf16 x fp32 -> fp32: exactly x1.float() * c
        torch.sub(a, b, out=x1)
        torch.add(x1s, x2 * c, out=x2)
    kv_cache[:, rows, :, positions] = kv  # [T, 2, H, hd] -> (row, position) of k and v


@torch.library.register_fake(f"{_lib}::_silu_mul")
def _(gate_up):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@torch.library.register_kernel(f"{_lib}::_silu_mul", "cpu")
def _(gate_up):
    _check_tensor("gate_up", gate_up, bf16, (None, None))
    if gate_up.shape[1] % 16:
        raise ValueError(f"gate_up must have shape [T, 2F] with F a multiple of 8, got {list(gate_up.shape)}")
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.mul(torch.nn.functional.silu(gate.float()), up, out=up.new_empty(up.shape))
