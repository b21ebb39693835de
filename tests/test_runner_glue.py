"""The runner's glue ops (runner/glue.py): the rotary embedding with the KV-cache write, and SiLU-and-mul.
CPU: against a plain restatement of the math (fp32 products, one bf16 rounding per output) and
against bad input. GPU: the CUDA kernels bitwise against the CPU kernels (rotary) and against the
eager torch code they replace (SiLU-and-mul, whose exp may differ from the CPU's in the last bit),
at odd sizes and T = 1."""

from __future__ import annotations

import pytest
import torch
from spkernels.runner import glue

bf16 = torch.bfloat16
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rope_case(T, heads, hd, rows=3, seq=40, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, 3, heads, hd, generator=g).to(bf16)
    row = torch.randperm(rows, generator=g)[:1].expand(T).clone()  # one request: distinct positions
    positions = torch.randperm(seq, generator=g)[:T]
    freqs = positions.float()[:, None] * 10000.0 ** (-torch.arange(hd // 2) / (hd // 2))
    cache = torch.randn(2, rows, heads, seq, hd, generator=g).to(bf16)
    args = (qkv, freqs.cos()[:, None, None], freqs.sin()[:, None, None], cache, row, positions)
    return tuple(a.to(device) for a in args)


def rope_restated(qkv, cos, sin):
    """q and k rotated: (x1 cos - x2 sin, x1 sin + x2 cos) in fp32, rounded to bf16."""
    x1, x2 = qkv[:, :2].float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(bf16)


@pytest.mark.parametrize("T,heads,hd", [(1, 1, 16), (7, 3, 32), (33, 4, 128)])
def test_rope_kv_cache_against_the_math(T, heads, hd):
    qkv, cos, sin, cache, rows, positions = rope_case(T, heads, hd)
    want_qk, kv, before = rope_restated(qkv, cos, sin), qkv[:, 1:].clone(), cache.clone()
    q = glue.rope_kv_cache(qkv, cos, sin, cache, rows, positions)
    assert torch.equal(q, want_qk[:, 0]) and q.data_ptr() == qkv.data_ptr()  # in place
    assert torch.equal(qkv[:, 1:], kv)  # k and v left as they were
    v = kv[:, 1]
    assert torch.equal(cache[0, rows, :, positions], want_qk[:, 1])
    assert torch.equal(cache[1, rows, :, positions], v)
    written = torch.zeros(cache.shape[1], cache.shape[3], dtype=torch.bool)
    written[rows, positions] = True
    by_position = lambda c: c.permute(0, 1, 3, 2, 4)  # noqa: E731  [2, rows, seq, heads, hd]
    assert torch.equal(by_position(cache)[:, ~written], by_position(before)[:, ~written])  # nothing else


def test_silu_mul_against_the_math():
    gate_up = torch.randn(5, 48).to(bf16)
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = gate / (1 + torch.exp(-gate)) * up  # exact up to fp32 rounding, then one bf16 rounding
    torch.testing.assert_close(glue.silu_mul(gate_up).double(), want, rtol=2**-8, atol=0)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: (a[0].float(), *a[1:]), "qkv must be torch.bfloat16"),
        (lambda a: (a[0][:, :, :, :8].contiguous(), *a[1:]), "head_dim must be a multiple of 16"),
        (lambda a: (a[0], a[1][:-1], *a[2:]), "cos must be a contiguous float32"),
        (lambda a: (*a[:2], a[2].double(), *a[3:]), "sin must be a contiguous float32"),
        (lambda a: (*a[:3], a[3][:, :, :1], *a[4:]), "kv_cache must have shape"),
        (lambda a: (*a[:4], a[4].int(), a[5]), "rows must be torch.int64"),
        (lambda a: (*a[:4], a[4] + 100, a[5]), r"rows must be in \[0, 3\)"),
        (lambda a: (*a[:5], a[5][:-1]), "positions must have shape"),
    ],
)
def test_rope_kv_cache_bad_input(change, match):
    with pytest.raises((ValueError, RuntimeError), match=match):
        glue.rope_kv_cache(*change(rope_case(4, 2, 32)))


def test_silu_mul_bad_input():
    with pytest.raises(ValueError, match="gate_up must be torch.bfloat16"):
        glue.silu_mul(torch.randn(2, 32))
    with pytest.raises(ValueError, match="F a multiple of 8"):
        glue.silu_mul(torch.randn(2, 24).to(bf16))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("T,heads,hd", [(1, 1, 16), (7, 3, 32), (33, 4, 128), (1000, 32, 128)])
def test_gpu_rope_kv_cache_equals_cpu(T, heads, hd):
    cpu = rope_case(T, heads, hd, rows=5, seq=max(T, 40), seed=T)
    gpu = tuple(a.cuda() for a in cpu)
    q_cpu = glue.rope_kv_cache(*cpu)
    q_gpu = glue.rope_kv_cache(*gpu)
    assert torch.equal(q_gpu.cpu(), q_cpu) and q_gpu.data_ptr() == gpu[0].data_ptr()
    assert torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[3].cpu(), cpu[3])  # all of qkv, the cache


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])])
def test_glue_empty_inputs(device):
    """No tokens, no heads, no FFN columns: nothing to do, no launch (a zero grid is a CUDA error)."""
    for T, heads in [(0, 2), (3, 0)]:
        args = rope_case(T, heads, 32, device=device)
        cache = args[3].clone()
        assert glue.rope_kv_cache(*args).shape == (T, heads, 32) and torch.equal(args[3], cache)
    for shape in [(0, 16), (3, 0)]:
        assert glue.silu_mul(torch.zeros(shape, device=device, dtype=bf16)).shape == (shape[0], shape[1] // 2)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("T,F", [(1, 8), (5, 24), (300, 8192)])
def test_gpu_silu_mul_equals_eager(T, F):
    gate_up = torch.randn(T, 2 * F, device="cuda").to(bf16)
    gate, up = gate_up.chunk(2, dim=-1)
    eager = torch.mul(torch.nn.functional.silu(gate.float()), up, out=up.new_empty(up.shape))
    torch.testing.assert_close(glue.silu_mul(gate_up), eager, rtol=2**-7, atol=1e-6)  # one bf16 step


@pytest.mark.gpu
@requires_cuda
def test_gpu_glue_bad_input():
    qkv, cos, sin, cache, rows, positions = (a.cuda() for a in rope_case(4, 2, 32))
    with pytest.raises(RuntimeError, match="kv_cache must be"):
        glue.rope_kv_cache(qkv, cos, sin, cache.float(), rows, positions)
    with pytest.raises(RuntimeError, match="cos must be a contiguous float32"):
        glue.rope_kv_cache(qkv, cos.cpu(), sin, cache, rows, positions)
    with pytest.raises(RuntimeError, match="F a multiple of 8"):
        glue.silu_mul(torch.zeros(2, 24, device="cuda", dtype=bf16))
