"""spkernels behind vLLM's mHC kernel interface (DeepSeek-V4 / V4.1), without importing vLLM.

The local functions take the arguments of the mHC kernel functions that vLLM's NVIDIA DeepSeek-V4
and V4.1 models call (``vllm.model_executor.kernels.mhc.tilelang``; checked against vLLM 0.34.0),
in their order and with their defaults, and return what those return, so a model file can swap
them in call for call:

=============================  ==================================================================
``mhc_pre``                    ``(post_mix [T, hc, 1], comb_mix [T, hc, hc], layer_input [T, D])``
``mhc_pre_broadcast``          ``(residual [T, hc, D], post_mix, comb_mix, layer_input)`` from the
                               ``[T, D]`` embedding (V4's first layer)
``mhc_post``                   the new residual ``[T, hc, D]``
``mhc_fused_post_pre``         ``(residual, post_mix, comb_mix, layer_input)`` of the next site
``hc_head``                    ``[T, D]``
``mhc_pre_delayed``            ``(post_mix, comb_mix, layer_input, pre_mix [T, hc])`` (V4.1)
``mhc_fused_post_pre_delayed`` ``(residual, post_mix, comb_mix, layer_input, pre_mix, aux [T, D])``
                               (V4.1; ``aux`` has 0 rows unless ``capture_aux``)
``mhc_shifted_post_pre``       the same; ``reduce_results=True, comm=`` all-reduces ``x`` inside
                               (V4.1's boundary entry, ``models/deepseek_v41/nvidia/ops/mhc.py``)
=============================  ==================================================================

Names map as ``residual`` = spkernels' ``stream``, ``comb_mix`` / ``comb_res_mix`` = ``res_mix``,
``hc_pre_eps`` = ``hc_eps``, ``hc_sinkhorn_eps`` = ``sinkhorn_eps``, ``hc_post_mult_value`` =
``post_alpha``, ``sinkhorn_repeat`` = ``sinkhorn_iters``. ``n_splits`` and ``tile_n`` (vLLM's
kernel tuning knobs) are accepted and ignored. Leading dims before ``[hc, D]`` are flattened into
T and restored on the way out, as vLLM's ops do; a post mix may be ``[..., hc, 1]`` or ``[..., hc]``.
vLLM's ``hc_collapse_triton`` (V4.1's exit) and ``mhc_fused_post_pre_tilelang_reuse_residual`` have
no counterpart here: keep the former (one read of the stream), use ``mhc_fused_post_pre`` for the
latter (spkernels never writes its inputs).

The boundaries with communication (``tp_*``, ``sp_*``) keep the same conventions and add a
keyword ``comm``: a :class:`~spkernels.Communicator` built on vLLM's TP group with
:func:`communicator_for_group`. They replace vLLM's ``tensor_model_parallel_all_reduce`` inside
``RowParallelLinear`` (TP), or its reduce-scatter before the post and all-gather after the pre
(SP): the row-parallel layer runs with ``reduce_results=False``, writes its partial output
(ideally into ``comm.partial_buffer(T)``), and the boundary reduces it, mixes, and (in SP)
gathers the next layer input. In SP mode ``residual`` and the mixes are this rank's token shard
(``sp_shard`` of the [T, hc, D] residual; T padded to a multiple of tp), ``layer_input`` all T rows.

Numerical differences from vLLM (all of them: docs/integration.md): where vLLM has DeepGEMM its
``fn · x`` is a TF32 GEMM, spkernels' products keep fp32-grade accuracy; and for T <= 32 vLLM's
fused post+pre computes the next pre's ``fn · x`` and sum of squares from the unrounded fp32 new
residual, spkernels from the bf16 residual it stores (differences ~1e-3 in the mixes). spkernels
follows the stored stream on purpose: the next site's pre then sees exactly the residual that every
later op sees, so results do not depend on whether a post and the following pre ran fused or as two
ops, nor on T (vLLM's own unfused post and pre, and its fused path above T = 32, read the stored
residual too).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import api
from ..api import MhcParams, Mixes
from ..comm import Communicator


def _params(fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat,
            norm_weight, norm_eps) -> MhcParams:  # fmt: skip
    return MhcParams(
        fn, hc_scale, hc_base, norm_weight, rms_eps, hc_pre_eps, hc_sinkhorn_eps, norm_eps, sinkhorn_repeat,
        hc_post_mult_value,
    )  # fmt: skip


def _got(t) -> object:
    """What an argument was, for an error message: a tensor's shape, else its type's name."""
    return list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def _shape_of(residual, name: str = "residual"):
    """-> (outer dims, hc, D) of vLLM's [..., hc, D] residual."""
    if not isinstance(residual, torch.Tensor) or residual.dim() < 3:
        raise ValueError(
            f"{name} must be a tensor of shape [..., hc, D] with at least one token dim, got {_got(residual)}"
        )
    return residual.shape[:-2], residual.shape[-2], residual.shape[-1]


def _check_args(residual, x=None, post_layer_mix=None, comb_res_mix=None, pre_mix=None, sp=False):
    """vLLM's shapes against the residual (leading dims ..., hc, D) before anything is reshaped, so
    that a tensor of the right size but the wrong shape (a transposed mix, a partial of another
    width) is an error, not a reinterpretation: x [..., D] (an SP boundary's partial: [T, D] of
    every token), post_layer_mix [..., hc, 1] or [..., hc], comb_res_mix [..., hc, hc], pre_mix
    [..., hc]; only those given. -> (leading dims, hc, D)."""
    outer, hc, D = _shape_of(residual)
    want = {
        "post_layer_mix": (post_layer_mix, ((hc, 1), (hc,))),
        "comb_res_mix": (comb_res_mix, ((hc, hc),)),
        "pre_mix": (pre_mix, ((hc,),)),
    }
    if sp:
        _check_sp_partial(x, D)
    else:
        want["x"] = (x, ((D,),))
    for name, (t, trailings) in want.items():
        if t is None:
            continue
        shapes = [(*outer, *trailing) for trailing in trailings]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) not in shapes:
            wanted = " or ".join(str(list(shape)) for shape in shapes)
            raise ValueError(f"{name} must have shape {wanted} (the residual's leading dims), got {_got(t)}")
    return outer, hc, D


def _check_sp_partial(x, D: int) -> None:
    """An SP boundary's x: the row-parallel partial of all T tokens, [T, D] (its rows: the op checks)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != D:
        raise ValueError(f"x must be this rank's partial [T, D = {D}] of every token, got {_got(x)}")


def _flat(residual: torch.Tensor) -> torch.Tensor:
    """[..., hc, D] -> [T, hc, D] (a view for the contiguous residuals the ops take); the caller has
    checked the shape (_shape_of, _check_args)."""
    return (
        residual
        if residual.dim() == 3
        else residual.reshape(residual.shape[:-2].numel(), *residual.shape[-2:])
    )


def _mixes(post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor, hc: int) -> Mixes:
    """vLLM's [..., hc, 1] (or [..., hc]) post mix and [..., hc, hc] comb mix as spkernels' [T, hc],
    [T, hc, hc] (a post reads no pre_mix)."""
    T = post_layer_mix.numel() // hc
    return Mixes(post_layer_mix.reshape(T, hc), comb_res_mix.reshape(T, hc, hc), None)


def _out_pre(res: api.PreResult, outer, hc: int, delayed: bool):
    post, comb, pre = res.mixes
    D = res.layer_input.shape[-1]
    out = (post.view(*outer, hc, 1), comb.view(*outer, hc, hc), res.layer_input.view(*outer, D))
    return (*out, pre.view(*outer, hc)) if delayed else out


def _out_boundary(res: api.BoundaryResult, outer, hc: int, delayed: bool):
    post, comb, pre = res.mixes
    D = res.layer_input.shape[-1]
    out = (res.stream.view(*outer, hc, D), post.view(*outer, hc, 1), comb.view(*outer, hc, hc),
           res.layer_input.view(*outer, D))  # fmt: skip
    return (*out, pre.view(*outer, hc)) if delayed else out


def _one_hot(stream: torch.Tensor) -> torch.Tensor:
    """vLLM's delayed pre without a carried pre_mix collapses to stream 0: a one-hot on stream 0
    (bf16(1 * X[0] + 0 * ...) is X[0] exactly)."""
    w = torch.zeros(stream.shape[0], stream.shape[1], dtype=torch.float32, device=stream.device)
    w[:, 0] = 1.0
    return w


# ----------------------------------------------------------------------------- local (vLLM's ops)
def mhc_pre(
    residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
    sinkhorn_repeat, n_splits=1, norm_weight=None, norm_eps=1e-6,
):  # fmt: skip
    """vLLM ``mhc_pre``: -> (post_mix [..., hc, 1], comb_mix [..., hc, hc], layer_input [..., D])."""
    outer, hc, _ = _shape_of(residual)
    p = _params(fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                sinkhorn_repeat, norm_weight, norm_eps)  # fmt: skip
    return _out_pre(api.mhc_pre(_flat(residual), p), outer, hc, False)


def mhc_post(x, residual, post_layer_mix, comb_res_mix):
    """vLLM ``mhc_post``: out[j] = post_layer_mix[j] * x + sum_i comb_res_mix[i, j] * residual[i]."""
    _, hc, D = _check_args(residual, x, post_layer_mix, comb_res_mix)
    stream = _flat(residual)
    new = api.mhc_post(x.reshape(stream.shape[0], D), stream, _mixes(post_layer_mix, comb_res_mix, hc))
    return new.view(residual.shape)


def mhc_fused_post_pre(
    x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
    hc_post_mult_value, sinkhorn_repeat, n_splits=1, tile_n=1, norm_weight=None, norm_eps=1e-6,
):  # fmt: skip
    """vLLM ``mhc_fused_post_pre``: the post, then the next site's pre on the stored residual.

    -> (residual, post_mix [..., hc, 1], comb_mix [..., hc, hc], layer_input [..., D])."""
    outer, hc, D = _check_args(residual, x, post_layer_mix, comb_res_mix)
    stream = _flat(residual)
    p = _params(fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                sinkhorn_repeat, norm_weight, norm_eps)  # fmt: skip
    res = api.mhc_post_pre(x.reshape(stream.shape[0], D), stream, _mixes(post_layer_mix, comb_res_mix, hc), p)
    return _out_boundary(res, outer, hc, False)


def hc_head(hidden_states, hc_fn, hc_scale, hc_base, rms_norm_eps, hc_eps):
    """vLLM ``hc_head``: the V4 head's learned collapse, [..., hc, D] -> [..., D] bf16. The names are
    vLLM's ``HCHeadOp``'s; its TileLang function (``hc_head_fused_kernel_tilelang``, which the V4
    model calls positionally) takes the same arguments in the same order."""
    outer, _, D = _shape_of(hidden_states, "hidden_states")
    stream = _flat(hidden_states)
    out = api.mhc_head(stream, MhcParams(hc_fn, hc_scale, hc_base, None, rms_norm_eps, hc_eps))
    return out.view(*outer, D)


def mhc_pre_broadcast(
    residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
    sinkhorn_repeat, n_splits=1, norm_weight=None, norm_eps=1e-6, fn_broadcast=None,
):  # fmt: skip
    """vLLM ``mhc_pre_broadcast`` (V4's first layer): ``residual`` is the [..., D] embedding; the
    residual becomes its hc copies (hc = fn's width / D) and the pre runs on them with the full
    ``fn``. ``fn_broadcast`` (vLLM's shortcut to the same products) is accepted and not needed.

    -> (residual [..., hc, D], post_mix [..., hc, 1], comb_mix [..., hc, hc], layer_input [..., D])."""
    if not isinstance(residual, torch.Tensor) or residual.dim() < 2:
        raise ValueError(f"residual must be the [..., D] embedding, got {_got(residual)}")
    D = residual.shape[-1]
    if not isinstance(fn, torch.Tensor) or fn.dim() != 2 or D == 0 or fn.shape[1] % D:
        raise ValueError(f"fn must have shape [mix, hc * D] with D = {D}, got {_got(fn)}")
    hc = fn.shape[1] // D
    stream = residual.unsqueeze(-2).expand(*residual.shape[:-1], hc, D).contiguous()
    out = mhc_pre(stream, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                  sinkhorn_repeat, norm_weight=norm_weight, norm_eps=norm_eps)  # fmt: skip
    return (stream, *out)


def _widened(fn, x, stream: torch.Tensor) -> torch.Tensor:
    """``mhc_pre_delayed``'s broadcast case: ``x`` [T, D] the embedding the residual holds hc copies
    of, ``fn`` [mix, D] the sum of the full projection's hc blocks. -> fn followed by zeros, [mix, hc *
    D]: on the copies it gives fn · x exactly, and the copies' mean square is x's."""
    T, hc, D = stream.shape
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != (T, D):
        raise ValueError(f"x must be the embedding [T, D] = {[T, D]} that the residual copies, got {_got(x)}")
    if not isinstance(fn, torch.Tensor) or fn.dim() != 2 or fn.shape[1] != D:
        raise ValueError(f"fn must be the broadcast projection [mix, D = {D}] with x given, got {_got(fn)}")
    return torch.cat([fn, fn.new_zeros(fn.shape[0], (hc - 1) * D)], dim=1)


def mhc_pre_delayed(
    residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
    sinkhorn_repeat, pre_mix=None, x=None, norm_weight=None, norm_eps=1e-6,
):  # fmt: skip
    """V4.1's pre: collapse with the carried ``pre_mix`` [..., hc] of the previous site (None: stream
    0, the model's first site), return this site's own pre weights for the next one. ``x`` (vLLM's
    first layer): the [T, D] embedding that ``residual`` holds hc copies of, with ``fn`` the
    broadcast projection [mix, D] (the sum of the full projection's hc blocks); the residual must
    be those copies, as at vLLM's call.

    -> (post_mix [..., hc, 1], comb_mix [..., hc, hc], layer_input [..., D], pre_mix [..., hc])."""
    outer, hc, _ = _check_args(residual, pre_mix=pre_mix)
    stream = _flat(residual)
    if x is not None:
        fn = _widened(fn, x, stream)
    weights = _one_hot(stream) if pre_mix is None else pre_mix.reshape(stream.shape[0], hc)
    p = _params(fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                sinkhorn_repeat, norm_weight, norm_eps)  # fmt: skip
    return _out_pre(api.mhc_pre(stream, p, pre_mix_in=weights), outer, hc, True)


def mhc_fused_post_pre_delayed(
    x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
    hc_post_mult_value, sinkhorn_repeat, pre_mix=None, norm_weight=None, norm_eps=1e-6, capture_aux=False,
):  # fmt: skip
    """V4.1's fused post+pre: the next site collapses with ``pre_mix`` (the previous site's; None:
    stream 0, as ``mhc_pre_delayed``). ``capture_aux``: also the mean of the new residual's streams,
    bf16 [..., D] (vLLM's draft models read it; here one more read of the residual, not fused).

    -> (residual, post_mix, comb_mix, layer_input, pre_mix of this site, aux: [0, D] unless
    ``capture_aux``)."""
    p = _params(fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                sinkhorn_repeat, norm_weight, norm_eps)  # fmt: skip
    return _delayed_boundary(x, residual, post_layer_mix, comb_res_mix, p, pre_mix, capture_aux, None)


def mhc_shifted_post_pre(
    x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
    hc_post_mult_value, sinkhorn_repeat, pre_mix=None, norm_weight=None, norm_eps=1e-6, capture_aux=False, *,
    stream=None, reduce_results=False, comm: Communicator | None = None,
):  # fmt: skip
    """vLLM V4.1's boundary entry (its NVIDIA model's ``mhc_shifted_post_pre``):
    ``mhc_fused_post_pre_delayed``, or with ``reduce_results`` the TP all-reduce of ``x`` (this
    rank's partial) fused into it, which needs ``comm`` (the TP group's Communicator); the residual
    comes out bitwise identical on every rank. ``stream`` (vLLM's side stream for the next mixes)
    is accepted and unused: spkernels runs on the current stream. An unfinalized MoE output as
    ``x`` is not supported.

    -> (residual, post_mix, comb_mix, layer_input, pre_mix, aux), as ``mhc_fused_post_pre_delayed``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor (an unfinalized MoE output is not supported), got {_got(x)}")
    if reduce_results and comm is None:
        raise ValueError("reduce_results=True needs comm=, the Communicator of the TP group")
    p = _params(fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                sinkhorn_repeat, norm_weight, norm_eps)  # fmt: skip
    return _delayed_boundary(
        x, residual, post_layer_mix, comb_res_mix, p, pre_mix, capture_aux, comm if reduce_results else None
    )


def _delayed_boundary(
    x, residual, post_layer_mix, comb_res_mix, p: MhcParams, pre_mix, capture_aux: bool, comm
):
    """The V4.1 boundary: local (comm None) or all-reducing ``x`` first (TP)."""
    outer, hc, D = _check_args(residual, x, post_layer_mix, comb_res_mix, pre_mix)
    stream = _flat(residual)
    weights = _one_hot(stream) if pre_mix is None else pre_mix.reshape(stream.shape[0], hc)
    mixes = _mixes(post_layer_mix, comb_res_mix, hc)
    y = x.reshape(stream.shape[0], D)
    if comm is None:
        res = api.mhc_post_pre(y, stream, mixes, p, pre_mix_in=weights)
    else:
        res = api.tp_boundary(y, stream, mixes, p, comm, pre_mix_in=weights)
    if capture_aux:
        aux = res.stream.float().mean(dim=1).to(torch.bfloat16).view(*outer, D)
    else:
        aux = res.stream.new_empty(0, D)
    return (*_out_boundary(res, outer, hc, True), aux)


# ----------------------------------------------------------------------------- TP / SP boundaries
def communicator_for_group(
    group, *, max_tokens: int, hidden_size: int, hc: int = 4, **settings
) -> Communicator:
    """A Communicator on vLLM's TP group: a ``torch.distributed`` ProcessGroup, or a group
    coordinator that holds one as ``device_group`` (vLLM's ``get_tp_group()``). ``max_tokens``:
    the engine's ``max_num_batched_tokens`` (after SP padding); ``settings``: Communicator's
    ``fused`` / ``tp_push`` / ``barrier_timeout``. Collective: every rank of the group calls it."""
    pg = getattr(group, "device_group", group)
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(
            "group must be a torch.distributed ProcessGroup or have one as .device_group, "
            f"got {type(group).__name__}"
        )
    return Communicator(pg, max_tokens=max_tokens, hidden_size=hidden_size, hc=hc, **settings)


def tp_mhc_post(x, residual, post_layer_mix, comb_res_mix, *, comm: Communicator):
    """``mhc_post`` whose ``x`` is this rank's partial [T, D] of a row-parallel layer (not yet
    all-reduced): the all-reduce and the post in one op."""
    _, hc, _ = _check_args(residual, x, post_layer_mix, comb_res_mix)
    stream = _flat(residual)
    new = api.tp_post(x, stream, _mixes(post_layer_mix, comb_res_mix, hc), comm)
    return new.view(residual.shape)


def tp_mhc_fused_post_pre(
    x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
    hc_post_mult_value, sinkhorn_repeat, n_splits=1, tile_n=1, norm_weight=None, norm_eps=1e-6, *,
    comm: Communicator, pre_mix=None,
):  # fmt: skip
    """``mhc_fused_post_pre`` on a partial ``x``: all-reduce, post and the next pre in one op (the
    residual replicated on every rank, bitwise identical). With ``pre_mix`` (V4.1) the next site
    collapses with it and the result gains this site's pre_mix, as ``mhc_fused_post_pre_delayed``."""
    outer, hc, _ = _check_args(residual, x, post_layer_mix, comb_res_mix, pre_mix)
    stream = _flat(residual)
    p = _params(fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                sinkhorn_repeat, norm_weight, norm_eps)  # fmt: skip
    mixes = _mixes(post_layer_mix, comb_res_mix, hc)
    pre_in = None if pre_mix is None else pre_mix.reshape(stream.shape[0], hc)
    res = api.tp_boundary(x, stream, mixes, p, comm, pre_mix_in=pre_in)
    return _out_boundary(res, outer, hc, pre_mix is not None)


def sp_mhc_pre(
    residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
    sinkhorn_repeat, n_splits=1, norm_weight=None, norm_eps=1e-6, *, comm: Communicator, pre_mix=None,
):  # fmt: skip
    """``mhc_pre`` on this rank's shard [T / tp, hc, D], then vLLM's all-gather of the layer input:
    -> (post_mix, comb_mix of the shard, layer_input [T, D]); with ``pre_mix`` (V4.1) the collapse
    uses it and this site's pre_mix is appended."""
    _, hc, _ = _check_args(residual, pre_mix=pre_mix)
    stream = _flat(residual)
    p = _params(fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                sinkhorn_repeat, norm_weight, norm_eps)  # fmt: skip
    pre_in = None if pre_mix is None else pre_mix.reshape(stream.shape[0], hc)
    res = api.sp_pre(stream, p, comm, pre_mix_in=pre_in)
    post, comb, pre = res.mixes
    out = (post.unsqueeze(-1), comb, res.layer_input)
    return (*out, pre) if pre_mix is not None else out


def sp_mhc_post(x, residual, post_layer_mix, comb_res_mix, *, comm: Communicator):
    """vLLM's reduce-scatter of a row-parallel partial ``x`` [T, D], then ``mhc_post`` on this
    rank's residual shard [T / tp, hc, D], in one op."""
    _, hc, _ = _check_args(residual, x, post_layer_mix, comb_res_mix, sp=True)
    return api.sp_post(x, _flat(residual), _mixes(post_layer_mix, comb_res_mix, hc), comm)


def sp_mhc_fused_post_pre(
    x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
    hc_post_mult_value, sinkhorn_repeat, n_splits=1, tile_n=1, norm_weight=None, norm_eps=1e-6, *,
    comm: Communicator, pre_mix=None,
):  # fmt: skip
    """The whole SP boundary in one op: reduce-scatter of ``x`` [T, D], post on the residual shard,
    the next pre, all-gather of its layer input. -> (residual shard, post_mix, comb_mix of the
    shard, layer_input [T, D]) (+ this site's pre_mix with ``pre_mix``, V4.1)."""
    _, hc, _ = _check_args(residual, x, post_layer_mix, comb_res_mix, pre_mix, sp=True)
    stream = _flat(residual)
    p = _params(fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                sinkhorn_repeat, norm_weight, norm_eps)  # fmt: skip
    mixes = _mixes(post_layer_mix, comb_res_mix, hc)
    pre_in = None if pre_mix is None else pre_mix.reshape(stream.shape[0], hc)
    res = api.sp_boundary(x, stream, mixes, p, comm, pre_mix_in=pre_in)
    post, comb, pre = res.mixes
    out = (res.stream, post.unsqueeze(-1), comb, res.layer_input)
    return (*out, pre) if pre_mix is not None else out


def sp_shard(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """This rank's token rows of ``x`` [T, ...] (zero-padded to a multiple of tp): the residual or
    the embedding on entering SP."""
    return api.sp_shard(x, comm)


def sp_all_gather(x_local: torch.Tensor, num_tokens: int, comm: Communicator) -> torch.Tensor:
    """Every rank's rows, trimmed to ``num_tokens``: the residual (or the head's output) on leaving SP."""
    return api.sp_all_gather(x_local, num_tokens, comm)


__all__ = [
    "mhc_pre", "mhc_pre_broadcast", "mhc_post", "mhc_fused_post_pre", "hc_head", "mhc_pre_delayed",
    "mhc_fused_post_pre_delayed", "mhc_shifted_post_pre",
    "communicator_for_group", "tp_mhc_post", "tp_mhc_fused_post_pre", "sp_mhc_pre", "sp_mhc_post",
    "sp_mhc_fused_post_pre", "sp_shard", "sp_all_gather",
]  # fmt: skip
