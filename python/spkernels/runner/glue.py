"""The model's glue between the mHC ops and the GEMMs, as two fused spkernels ops (internal: CUDA
kernels in csrc/ops/runner_ops.cu, the same torch math on CPU in spkernels/ops.py). Each reads its
input once and writes its output once; in eager torch the rotary embedding alone moved four fp32
copies of q and k and the KV-cache write a fifth."""

from __future__ import annotations

import torch

_ops = torch.ops.spkernels


def rope_kv_cache(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, rows: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Rotary embedding of q and k in bf16 qkv [T, 3, heads, head_dim] (products in fp32, each half
    rounded to bf16 once) with fp32 cos, sin [T, ..., head_dim / 2]: q rotated in place, k rotated
    into one layer's cache [2, rows, heads, max_seq_len, head_dim] at each token's (row, position)
    with v beside it; qkv's k and v are left as they were. -> q [T, heads, head_dim] (a view of qkv).
    Rows and positions must lie in the cache: the CPU kernel checks them, the CUDA kernel (which
    cannot without a host read) skips the cache write of a token outside it."""
    _ops._rope_kv_cache(qkv, cos, sin, kv_cache, rows, positions)
    return qkv[:, 0]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """bf16 [T, 2F] (gate | up) -> bf16(silu(gate) * up) [T, F], in fp32."""
    return _ops._silu_mul(gate_up)
