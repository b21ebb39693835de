"""Engram (n-gram memory): hashed n-gram embeddings added to the stream through a per-stream gate.

For each token and each n-gram order n, the ids of the last n tokens of its request (prompt and
generated tokens; positions before the start use a sentinel) hash to a row of that order's table.
The rows, concatenated, are the token's memory ``e``; ``key = W_key e`` and ``value = W_value e``.
Stream j gets ``gate_j * value`` with ``gate_j = sigmoid(sign(d_j) * sqrt(max(|d_j|, 1e-6)))`` and
``d_j = <rms(X_j), rms(key)> / sqrt(D)``, the normalised dot product of the stream and the key.

Hashes need neighbouring tokens, so the host computes them from the request's tokens before any
sharding (a prompt chunk's for all its tokens at once: hash_windows); everything after the lookup
is per token, so a token-sharded (SP) stream just takes its rows of the hash ids. Each table has
one extra zero row, the pad id: a pad row's memory, key and value are zero, so its stream row is
left unchanged (zero rows stay zero).
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


def _state(tokens: list[int], n: int) -> int:
    """The hash state of an n-gram after ``tokens``, its first ones (oldest first)."""
    h = n
    for token in tokens:
        h = (h * _MULT + token + 2) % _PRIME
    return h


def ngram_hash(window: list[int], table_size: int) -> int:
    """Row of the table for the n-gram ``window`` (oldest token first): the definition, one n-gram
    at a time (hash_windows computes it for a batch)."""
    return _state(window, len(window)) % table_size


def hash_ids(
    tokens: list[int], positions: range, orders: tuple[int, ...], table_size: int
) -> list[list[int]]:
    """[len(positions)][len(orders)] table rows for the tokens at ``positions`` of one request, one
    token at a time: what hash_windows must give."""
    out = []
    for p in positions:
        row = []
        for n in orders:
            window = [tokens[q] if q >= 0 else _SENTINEL for q in range(p - n + 1, p + 1)]
            row.append(ngram_hash(window, table_size))
        out.append(row)
    return out


def open_hashes(tokens: list[int], p: int, orders: tuple[int, ...]) -> list[int]:
    """Per order n, the hash of the n-gram ending at position ``p`` of one request, left open before
    its last token (tokens[p], not on the host yet: overlapped steps): close_hashes completes it.
    The state before the token, times the multiplier, plus 2, modulo the prime."""
    out = []
    for n in orders:
        before = [tokens[q] if q >= 0 else _SENTINEL for q in range(p - n + 1, p)]
        out.append((_state(before, n) * _MULT + 2) % _PRIME)
    return out


def close_hashes(opened: torch.Tensor, tokens: torch.Tensor, table_size: int) -> torch.Tensor:
    """[T, orders] open_hashes values completed with each row's last token [T] (on the device): the
    table rows ngram_hash gives."""
    return _mod_prime(opened + tokens[:, None]) % table_size


def windows(history: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """[len(history) - min(start, width - 1), width] int64: for each token of a request from position
    ``start`` on, the ``width`` tokens ending at it, oldest first (_SENTINEL before the request's
    first token). ``history``: the request's tokens from position max(0, start - width + 1) on."""
    pad = torch.full((max(0, width - 1 - start),), _SENTINEL, dtype=torch.int64)
    return torch.cat((pad, history)).unfold(0, width, 1)


def _mod_prime(x: torch.Tensor) -> torch.Tensor:
    """x % _PRIME for int64 x in [0, 2^63): 2^61 = 1 modulo the prime, so the bits above 61 fold down."""
    x = (x & _PRIME) + (x >> 61)
    x = (x & _PRIME) + (x >> 61)  # now at most _PRIME
    return torch.where(x == _PRIME, 0, x)


def _mul_mod_prime(a: torch.Tensor, b: int) -> torch.Tensor:
    """(a * b) % _PRIME for int64 a and int b in [0, _PRIME), without overflow: in 31-bit halves,
    a * b = hh 2^62 + (hl + lh) 2^31 + ll with every product below 2^62, and 2^62 = 2, 2^61 = 1."""
    low = (1 << 31) - 1
    a_hi, a_lo, b_hi, b_lo = a >> 31, a & low, b >> 31, b & low
    mid = a_hi * b_lo + a_lo * b_hi  # < 2^62; mid 2^31 = (mid >> 30) 2^61 + (mid & (2^30 - 1)) 2^31
    mid_folded = (mid >> 30) + ((mid & ((1 << 30) - 1)) << 31)
    return _mod_prime(2 * (a_hi * b_hi) + mid_folded + _mod_prime(a_lo * b_lo))


def hash_windows(rows: torch.Tensor, orders: tuple[int, ...], table_size: int) -> torch.Tensor:
    """[T, max(orders)] int64 token windows (``windows``) -> [T, len(orders)] table rows: ngram_hash
    of each order's last n tokens, for every token at once, in int64 arithmetic that gives the exact
    value (an 8192-token chunk: ~1 ms on the host against ~30 ms one n-gram at a time)."""
    width, out = rows.shape[1], []
    for n in orders:
        h = torch.full(rows.shape[:1], n, dtype=torch.int64)
        for j in range(width - n, width):
            h = _mod_prime(_mul_mod_prime(h, _MULT) + rows[:, j] + 2)
        out.append(h % table_size)
    return torch.stack(out, 1)


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
