"""Typed Python functions over ``torch.ops.spkernels.*``: the API model code calls.

One mixing site's weights and scalars travel as :class:`MhcParams`, the three mixes a site hands to
the next one as :class:`Mixes`, and results come back as named tuples. Collectives take the
:class:`~spkernels.Communicator` itself. Every function is one ``torch.ops`` call with its arguments
in schema order: nothing else runs in it, so it costs only argument passing in eager mode, traces
under ``torch.compile(fullgraph=True)`` to the op alone, and records into CUDA graphs like the op.

Validation belongs to the ops (the CUDA launchers in C++, the CPU kernels in ops.py): bad tensors
raise there, naming the argument, whether a caller comes through these functions or calls
``torch.ops`` directly. The functions here check only what the ops cannot see: that ``comm`` is a
Communicator (the ops receive its integer handle).

Names: ``stream`` [T, hc, D] bf16 (in SP mode this rank's token shard [T / tp, hc, D]), ``partial``
[T, D] bf16 (a row-parallel layer's per-rank output, best written into ``comm.partial_buffer(T)``),
``y`` [T, D] bf16 (a sublayer's complete output), ``layer_input`` [T, D] bf16 (the next sublayer's
input; all T rows after an SP pre), ``post_mix`` [T, hc], ``res_mix`` [T, hc, hc] (source stream i
-> destination j), ``pre_mix`` [T, hc] fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import reference as ref
from .comm import Communicator

_ops = torch.ops.spkernels
# OpOverloads, not packets: a call skips the packet's overload lookup.
_mhc_pre = _ops.mhc_pre.default
_mhc_post = _ops.mhc_post.default
_mhc_post_pre = _ops.mhc_post_pre.default
_mhc_head = _ops.mhc_head.default
_mhc_pre_ag = _ops.mhc_pre_ag.default
_mhc_post_rs = _ops.mhc_post_rs.default
_mhc_post_pre_rs_ag = _ops.mhc_post_pre_rs_ag.default
_mhc_post_ar = _ops.mhc_post_ar.default
_mhc_post_pre_ar = _ops.mhc_post_pre_ar.default
_sp_all_gather = _ops.sp_all_gather.default
_sp_shard = _ops.sp_shard.default


class MhcParams(NamedTuple):
    """One mixing site: its weights and the scalars of its math (defaults: reference.py).

    ``fn`` [(2 + hc) * hc, hc * D] fp32, ``scale`` [3] fp32, ``base`` [(2 + hc) * hc] fp32,
    ``norm_weight`` [D] bf16 or None (the sublayer's RMSNorm, fused into the pre). For
    :func:`mhc_head` the same tuple holds the head's ``fn`` [hc, hc * D], ``scale`` [1], ``base``
    [hc]; the head uses only ``rms_eps`` and ``hc_eps`` of the scalars.

    ``rms_eps``: inside the RMS factor of the stream; ``hc_eps``: added to each pre weight
    (vLLM's ``hc_pre_eps``); ``sinkhorn_eps``: added to the softmax and to every row and column
    sum of the Sinkhorn (vLLM's ``hc_sinkhorn_eps``; None = ``hc_eps``, as in DeepSeek's
    checkpoints, which have one ``hc_eps``); ``norm_eps``: the fused RMSNorm's;
    ``sinkhorn_iters``: Sinkhorn sweeps; ``post_alpha``: the post weights' multiplier (vLLM's
    ``hc_post_mult_value``).
    """

    fn: torch.Tensor
    scale: torch.Tensor
    base: torch.Tensor
    norm_weight: torch.Tensor | None = None
    rms_eps: float = ref.RMS_EPS
    hc_eps: float = ref.HC_EPS
    sinkhorn_eps: float | None = None
    norm_eps: float = ref.NORM_EPS
    sinkhorn_iters: int = ref.SINKHORN_ITERS
    post_alpha: float = ref.POST_ALPHA

    @property
    def op_scalars(self) -> tuple:
        """The five scalars in the ops' schema order (sinkhorn_eps goes last, after any comm)."""
        return self.rms_eps, self.hc_eps, self.norm_eps, self.sinkhorn_iters, self.post_alpha


class Mixes(NamedTuple):
    """What a site's pre hands to the post after its sublayer (and, in V4.1, to the next pre).

    ``post_mix`` [T, hc] and ``res_mix`` [T, hc, hc] feed the post; ``pre_mix`` [T, hc] is the
    site's own pre weights, which V4.1 (delayed pre-mix) passes as the next site's ``pre_mix_in``.
    """

    post_mix: torch.Tensor
    res_mix: torch.Tensor
    pre_mix: torch.Tensor


class PreResult(NamedTuple):
    layer_input: torch.Tensor
    mixes: Mixes


class BoundaryResult(NamedTuple):
    """A post fused with the next site's pre: the new stream, the next sublayer's input, its mixes."""

    stream: torch.Tensor
    layer_input: torch.Tensor
    mixes: Mixes


def _handle(comm: Communicator) -> int:
    if not isinstance(comm, Communicator):
        raise TypeError(f"comm must be a spkernels.Communicator, got {type(comm).__name__}")
    return comm.handle


# tuple.__new__ builds the named tuples without their keyword-parsing __new__ (~0.2 us per call).
_tuple = tuple.__new__


def _pre_result(out) -> PreResult:
    return _tuple(PreResult, (out[0], _tuple(Mixes, out[1:4])))


def _boundary_result(out) -> BoundaryResult:
    return _tuple(BoundaryResult, (out[0], out[1], _tuple(Mixes, out[2:5])))


# ----------------------------------------------------------------------------- local
def mhc_pre(stream: torch.Tensor, params: MhcParams, *, pre_mix_in: torch.Tensor | None = None) -> PreResult:
    """A site's pre: coefficients from ``stream``, collapse, fused norm.

    The collapse weighs the streams with the site's own pre weights, or with ``pre_mix_in`` [T, hc]
    when given (V4.1: the previous site's ``pre_mix``; a one-hot on stream 0 at the first site).
    """
    p = params
    out = _mhc_pre(
        stream, p.fn, p.scale, p.base, p.norm_weight, pre_mix_in,
        *p.op_scalars, p.sinkhorn_eps,
    )  # fmt: skip
    return _pre_result(out)


def mhc_post(y: torch.Tensor, stream: torch.Tensor, mixes: Mixes) -> torch.Tensor:
    """The post: ``y`` [T, D] mixed back into ``stream`` with ``mixes.post_mix`` / ``res_mix``."""
    return _mhc_post(y, stream, mixes.post_mix, mixes.res_mix)


def mhc_post_pre(
    y: torch.Tensor, stream: torch.Tensor, mixes: Mixes, params: MhcParams, *,
    pre_mix_in: torch.Tensor | None = None,
) -> BoundaryResult:  # fmt: skip
    """The post of one site fused with the pre of the next (``params``), on the stream it stores."""
    p = params
    out = _mhc_post_pre(
        y, stream, mixes.post_mix, mixes.res_mix, p.fn, p.scale, p.base, p.norm_weight, pre_mix_in,
        *p.op_scalars, p.sinkhorn_eps,
    )  # fmt: skip
    return _boundary_result(out)


def mhc_head(stream: torch.Tensor, params: MhcParams) -> torch.Tensor:
    """V4's learned collapse before the final norm: [T, hc, D] -> [T, D] bf16."""
    return _mhc_head(stream, params.fn, params.scale, params.base, params.rms_eps, params.hc_eps)


# ----------------------------------------------------------------------------- SP mode
def sp_pre(
    stream: torch.Tensor, params: MhcParams, comm: Communicator, *, pre_mix_in: torch.Tensor | None = None
) -> PreResult:
    """SP pre: the pre on this rank's shard, then an all-gather of ``layer_input`` to [T, D].

    The mixes stay per shard ([T / tp, ...]), like the stream."""
    p = params
    out = _mhc_pre_ag(
        stream, p.fn, p.scale, p.base, p.norm_weight, pre_mix_in,
        *p.op_scalars, _handle(comm), p.sinkhorn_eps,
    )  # fmt: skip
    return _pre_result(out)


def sp_post(partial: torch.Tensor, stream: torch.Tensor, mixes: Mixes, comm: Communicator) -> torch.Tensor:
    """SP post: reduce-scatter of ``partial`` [T, D] (every rank's), then the post on this shard."""
    return _mhc_post_rs(partial, stream, mixes.post_mix, mixes.res_mix, _handle(comm))


def sp_boundary(
    partial: torch.Tensor, stream: torch.Tensor, mixes: Mixes, params: MhcParams, comm: Communicator, *,
    pre_mix_in: torch.Tensor | None = None,
) -> BoundaryResult:  # fmt: skip
    """The whole SP boundary in one op: reduce-scatter, post, the next site's pre, all-gather.

    ``stream`` and the returned stream and mixes are this rank's shard; ``layer_input`` is [T, D]."""
    p = params
    out = _mhc_post_pre_rs_ag(
        partial, stream, mixes.post_mix, mixes.res_mix, p.fn, p.scale, p.base, p.norm_weight, pre_mix_in,
        *p.op_scalars, _handle(comm), p.sinkhorn_eps,
    )  # fmt: skip
    return _boundary_result(out)


def sp_all_gather(x_local: torch.Tensor, num_tokens: int, comm: Communicator) -> torch.Tensor:
    """Every rank's [T / tp, ...] rows in rank order, trimmed to ``num_tokens`` (any dtype)."""
    return _sp_all_gather(x_local, num_tokens, _handle(comm))


def sp_shard(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """This rank's rows of ``x`` [T, ...] zero-padded to a multiple of tp (any dtype)."""
    return _sp_shard(x, _handle(comm))


# ----------------------------------------------------------------------------- TP mode
def tp_post(partial: torch.Tensor, stream: torch.Tensor, mixes: Mixes, comm: Communicator) -> torch.Tensor:
    """TP post: all-reduce of ``partial`` [T, D], then the post on the replicated stream."""
    return _mhc_post_ar(partial, stream, mixes.post_mix, mixes.res_mix, _handle(comm))


def tp_boundary(
    partial: torch.Tensor, stream: torch.Tensor, mixes: Mixes, params: MhcParams, comm: Communicator, *,
    pre_mix_in: torch.Tensor | None = None,
) -> BoundaryResult:  # fmt: skip
    """The whole TP boundary in one op: all-reduce, post, the next site's pre (replicated)."""
    p = params
    out = _mhc_post_pre_ar(
        partial, stream, mixes.post_mix, mixes.res_mix, p.fn, p.scale, p.base, p.norm_weight, pre_mix_in,
        *p.op_scalars, _handle(comm), p.sinkhorn_eps,
    )  # fmt: skip
    return _boundary_result(out)


__all__ = [
    "MhcParams", "Mixes", "PreResult", "BoundaryResult",
    "mhc_pre", "mhc_post", "mhc_post_pre", "mhc_head",
    "sp_pre", "sp_post", "sp_boundary", "sp_all_gather", "sp_shard",
    "tp_post", "tp_boundary",
]  # fmt: skip
