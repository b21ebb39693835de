"""The mHC math of docs/contract.md in plain PyTorch: the single source of truth for every test.

Everything is per token and computed in fp32 (or the dtype of ``compute_dtype``, fp64 in tests);
bf16 rounding happens exactly where the spec puts it: the collapsed ``y``, the fused-norm
output, the mixed stream, and (reference only) the reduced partial before the post.
"""

from __future__ import annotations

import torch

HC = 4
RMS_EPS = HC_EPS = NORM_EPS = 1e-6
SINKHORN_ITERS = 20
POST_ALPHA = 2.0


def num_mix(hc: int = HC) -> int:
    return (2 + hc) * hc


def mhc_coefficients(
    stream: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    rms_eps: float = RMS_EPS,
    hc_eps: float = HC_EPS,
    sinkhorn_iters: int = SINKHORN_ITERS,
    post_alpha: float = POST_ALPHA,
    compute_dtype: torch.dtype = torch.float32,
    sinkhorn_eps: float | None = None,
):
    """stream [T, hc, D] -> (pre [T, hc], post [T, hc], res [T, hc, hc]); res[t, i, j] maps i -> j.

    ``hc_eps`` is added to the pre weights; ``sinkhorn_eps`` (None: ``hc_eps``) to the softmax and
    to every row and column sum of the Sinkhorn (vLLM's ``hc_pre_eps`` and ``hc_sinkhorn_eps``)."""
    sk_eps = hc_eps if sinkhorn_eps is None else sinkhorn_eps
    T, hc, D = stream.shape
    x = stream.reshape(T, hc * D).to(compute_dtype)
    r = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + rms_eps)
    m = (x @ fn.to(compute_dtype).t()) * r  # RMS factor after the product, as specified
    scale = scale.to(compute_dtype)
    base = base.to(compute_dtype)
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = post_alpha * torch.sigmoid(m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    logits = (m[:, 2 * hc :] * scale[2] + base[2 * hc :]).reshape(T, hc, hc)
    c = torch.softmax(logits, dim=-1) + sk_eps
    c = c / (c.sum(dim=-2, keepdim=True) + sk_eps)  # column normalisation
    for _ in range(sinkhorn_iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + sk_eps)
        c = c / (c.sum(dim=-2, keepdim=True) + sk_eps)
    return pre, post, c


def collapse(stream: torch.Tensor, weights: torch.Tensor, compute_dtype=torch.float32) -> torch.Tensor:
    """sum_i w[i] * X[i] in fp32, rounded to bf16: [T, hc, D], [T, hc] -> [T, D]."""
    y = (weights.to(compute_dtype).unsqueeze(-1) * stream.to(compute_dtype)).sum(dim=1)
    return y.to(torch.bfloat16)


def rms_norm(y_b: torch.Tensor, weight: torch.Tensor, eps: float, compute_dtype=torch.float32):
    y = y_b.to(compute_dtype)
    out = y * torch.rsqrt(y.square().mean(dim=-1, keepdim=True) + eps) * weight.to(compute_dtype)
    return out.to(torch.bfloat16)


def mhc_pre(
    stream,
    fn,
    scale,
    base,
    norm_weight=None,
    pre_mix_in=None,
    rms_eps=RMS_EPS,
    hc_eps=HC_EPS,
    norm_eps=NORM_EPS,
    sinkhorn_iters=SINKHORN_ITERS,
    post_alpha=POST_ALPHA,
    compute_dtype=torch.float32,
    sinkhorn_eps=None,
):
    """-> (layer_input [T, D] bf16, post_mix [T, hc], res_mix [T, hc, hc], pre_mix [T, hc]) fp32."""
    pre, post, res = mhc_coefficients(
        stream, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, post_alpha, compute_dtype, sinkhorn_eps
    )
    weights = pre if pre_mix_in is None else pre_mix_in
    y_b = collapse(stream, weights, compute_dtype)
    layer_input = y_b if norm_weight is None else rms_norm(y_b, norm_weight, norm_eps, compute_dtype)
    f32 = torch.float32
    return layer_input, post.to(f32), res.to(f32), pre.to(f32)


def mhc_post(y, stream, post_mix, res_mix, compute_dtype=torch.float32):
    """new[t, j] = bf16(post[t, j] * y[t] + sum_i res[t, i, j] * X[t, i]).

    Written as hc broadcast products, not an einsum: that lowers to a batched matmul of [hc, hc]
    tiles, which torch.compile hands to cuBLAS at ~10x the time of the one fused elementwise
    kernel it makes of this (the bench's compiled baseline)."""
    c = compute_dtype
    x, res = stream.to(c), res_mix.to(c)
    new = post_mix.to(c).unsqueeze(-1) * y.to(c).unsqueeze(1)
    for i in range(stream.shape[1]):
        new = new + res[:, i, :, None] * x[:, i, None, :]
    return new.to(torch.bfloat16)


def mhc_post_pre(
    y, stream, post_mix, res_mix, fn, scale, base, norm_weight=None, pre_mix_in=None, *eps, **kw
):
    new_stream = mhc_post(y, stream, post_mix, res_mix, kw.get("compute_dtype", torch.float32))
    return (new_stream, *mhc_pre(new_stream, fn, scale, base, norm_weight, pre_mix_in, *eps, **kw))


def mhc_head(stream, fn, scale, base, rms_eps=RMS_EPS, hc_eps=HC_EPS, compute_dtype=torch.float32):
    T, hc, D = stream.shape
    x = stream.reshape(T, hc * D).to(compute_dtype)
    r = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + rms_eps)
    m = (x @ fn.to(compute_dtype).t()) * r
    w = torch.sigmoid(m * scale.to(compute_dtype)[0] + base.to(compute_dtype)) + hc_eps
    return collapse(stream, w, compute_dtype)


def reduce_partials(partials: list[torch.Tensor]) -> torch.Tensor:
    """The reference reduction: fp32 sum in rank order 0..tp-1, rounded to bf16."""
    acc = torch.zeros_like(partials[0], dtype=torch.float32)
    for p in partials:
        acc += p.float()
    return acc.to(torch.bfloat16)
