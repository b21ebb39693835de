"""Engram (n-gram memory, docs/contract.md): hashed n-gram embeddings added to the stream through a
per-stream gate.

For each token and each n-gram order n, the ids of the last n tokens of its request (prompt and
generated tokens; positions before the start use a sentinel) hash to a row of that order's table.
The rows, concatenated, are the token's memory ``e``; ``key = W_key e`` and ``value = W_value e``.
Stream j gets ``gate_j * value`` with ``gate_j = sigmoid(sign(d_j) * sqrt(max(|d_j|, 1e-6)))`` and
``d_j = <rms(X_j), rms(key)> / sqrt(D)``, the normalised dot product of the stream and the key.

Hashes need neighbouring tokens, so they are computed on the host over the whole request history
before any sharding; everything after the lookup is per token, so a token-sharded (SP) stream just
takes its rows of the hash ids. Each table has one extra zero row, the pad id: a pad row's memory,
key and value are zero, so its stream row is left unchanged (zero rows stay zero).
"""

from __future__ import annotations

import math

import torch

# Arithmetic modulo a Mersenne prime: a cheap, well-mixing hash, the same on every rank and device.
_PRIME = (1 << 61) - 1
_MULT = 0x9E3779B97F4A7C15 % _PRIME
_SENTINEL = -1  # the "token" before the first one
GATE_EPS = 1e-6
RMS_EPS = 1e-6


def ngram_hash(window: list[int], table_size: int) -> int:
    """Row of the table for the n-gram ``window`` (oldest token first)."""
    h = len(window)
    for token in window:
        h = (h * _MULT + token + 2) % _PRIME
    return h % table_size


def hash_ids(
    tokens: list[int], positions: range, orders: tuple[int, ...], table_size: int
) -> list[list[int]]:
    """[len(positions)][len(orders)] table rows for the tokens at ``positions`` of one request."""
    out = []
    for p in positions:
        row = []
        for n in orders:
            window = [tokens[q] if q >= 0 else _SENTINEL for q in range(p - n + 1, p + 1)]
            row.append(ngram_hash(window, table_size))
        out.append(row)
    return out


def memory(ids: torch.Tensor, tables: list[torch.Tensor]) -> torch.Tensor:
    """ids [T, orders] int64, tables [rows + 1, E] bf16 (last row zero) -> e [T, orders * E] bf16."""
    return torch.cat([table[ids[:, k]] for k, table in enumerate(tables)], dim=-1)


def engram_add(
    stream: torch.Tensor,
    ids: torch.Tensor,
    tables: list[torch.Tensor],
    w_key: torch.Tensor,
    w_value: torch.Tensor,
) -> torch.Tensor:
    """stream [T, hc, D] bf16 -> bf16(X_j + gate_j * value) for every stream j; fp32 math."""
    e = memory(ids, tables)
    key, value = (e @ w_key.t()).float(), (e @ w_value.t()).float()
    x = stream.float()
    x_n = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + RMS_EPS)
    k_n = key * torch.rsqrt(key.square().mean(dim=-1, keepdim=True) + RMS_EPS)
    d = (x_n * k_n.unsqueeze(1)).sum(dim=-1) / math.sqrt(stream.shape[-1])  # [T, hc]
    gate = torch.sigmoid(torch.sign(d) * torch.sqrt(d.abs().clamp_min(GATE_EPS)))
    return (x + gate.unsqueeze(-1) * value.unsqueeze(1)).to(torch.bfloat16)
