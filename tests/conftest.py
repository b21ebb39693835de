"""Shared fixtures: ``mhc`` makes fresh random mHC inputs per test and holds the comparison helpers.

Inputs are seeded from the test's node id, so every case gets its own inputs and a failure
reproduces exactly. Nothing is ever zero unless a test says so (zero rows are padding).
"""

from __future__ import annotations

import math
import os
import zlib

import pytest
import torch
import torch.distributed as dist
from hypothesis import settings

bf16, f32, f64 = torch.bfloat16, torch.float32, torch.float64

# The fuzz tests draw the same examples on every run, so that a run's result does not depend on
# luck and a failure reproduces; HYPOTHESIS_PROFILE=explore draws fresh ones.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


def bf16_spacing(x: torch.Tensor) -> torch.Tensor:
    """Distance between adjacent bf16 values at |x| (8 significant bits: 2^(floor(log2|x|) - 7))."""
    mag = x.abs().to(f64).clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


def assert_bf16_close(
    out: torch.Tensor, expected: torch.Tensor, name: str, ulps: int = 1, slack: torch.Tensor | float = 0.0
) -> None:
    """``out`` (bf16 from an fp32 computation) against ``expected`` (the same math in fp64, rounded
    to bf16 at the same points).

    The two agree except where the fp32 and fp64 values straddle a bf16 rounding boundary: fp32's
    relative error (~1e-7 here) is ~1e-4 of bf16's spacing (2^-8 relative), so such flips are rare
    and move a value to the adjacent bf16 number. Hence: every element within ``ulps`` spacings
    (1 for a single rounding; 2 when a flipped bf16 intermediate feeds a second rounding, as the
    collapsed ``y_b`` feeds the fused norm), at most 1% of elements (or 2) differing at all, and a
    relative norm error below 1e-2 — together they fail on any real math error. ``slack`` adds a
    per-element absolute allowance where cancellation makes fp32's own error exceed a bf16 spacing
    of a tiny result (see test_cuda_local.expected_layer_input).
    """
    assert out.dtype == bf16, f"{name}: dtype {out.dtype}, want bf16"
    assert out.shape == expected.shape, f"{name}: shape {list(out.shape)}, want {list(expected.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    a, b = out.to(f64), expected.to(f64)
    err = (a - b).abs()
    bound = ulps * bf16_spacing(torch.maximum(a.abs(), b.abs())) + slack
    worst = int((err - bound).argmax()) if err.numel() else 0
    assert (err <= bound).all(), (
        f"{name}: |out - expected| = {err.flatten()[worst].item():.3g} > {ulps} bf16 spacing(s) "
        f"({bound.flatten()[worst].item():.3g}) at flat index {worst}: out {a.flatten()[worst].item()}, "
        f"expected {b.flatten()[worst].item()}"
    )
    flips = int((err > 0).sum())
    assert flips <= max(2, out.numel() // 100), f"{name}: {flips} of {out.numel()} elements differ"
    ref_norm = b.norm().item()
    if ref_norm > 0:
        rel = (a - b).norm().item() / ref_norm
        assert rel < 1e-2, f"{name}: relative norm error {rel:.3g}"


def assert_mix_close(out: torch.Tensor, expected: torch.Tensor, name: str, atol: float = 1e-5) -> None:
    """fp32 mixing coefficients against the fp64 reference. The values are O(1) (sigmoids, a
    doubly stochastic matrix); fp32's dot products over hc*D <= 256 terms and 20 Sinkhorn sweeps
    stay near 1e-6, so 1e-5 absolute leaves margin yet catches any wrong index or eps."""
    assert out.dtype == f32, f"{name}: dtype {out.dtype}, want float32"
    assert out.shape == expected.shape, f"{name}: shape {list(out.shape)}, want {list(expected.shape)}"
    torch.testing.assert_close(out.to(f64), expected.to(f64), atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")


class MHCInputs:
    """Random inputs for the mHC ops, from a generator seeded by the test id."""

    assert_bf16_close = staticmethod(assert_bf16_close)
    assert_mix_close = staticmethod(assert_mix_close)
    bf16_spacing = staticmethod(bf16_spacing)

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, dtype: torch.dtype = f32) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=f32).to(dtype)

    def uniform(self, *shape: int, low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(*shape, generator=self.gen)

    def stream(self, num_tokens: int, hidden_size: int, hc: int = 4) -> torch.Tensor:
        """bf16 [T, hc, D]; each token gets its own magnitude so the RMS factor matters."""
        token_scale = torch.exp(self.randn(num_tokens, 1, 1))
        return (self.randn(num_tokens, hc, hidden_size) * token_scale).to(bf16)

    def y(self, num_tokens: int, hidden_size: int) -> torch.Tensor:
        """A sublayer output (or a rank's partial): bf16 [T, D]."""
        return self.randn(num_tokens, hidden_size, dtype=bf16)

    def site(self, hidden_size: int, hc: int = 4, norm: bool = True) -> dict:
        """One mixing site's parameters: fn [M, hc*D], scale [3], base [M] fp32, norm_weight [D] bf16.

        fn ~ N(0, 1/(hc*D)) keeps m = (fn . x) * r at O(1) since x * r has unit RMS; scale[2] ~ 2
        gives Sinkhorn logits that are neither uniform nor saturated.
        """
        m = (2 + hc) * hc
        return {
            "fn": self.randn(m, hc * hidden_size) / math.sqrt(hc * hidden_size),
            "scale": self.uniform(3, low=0.5, high=2.5),
            "base": 0.5 * self.randn(m),
            "norm_weight": (1 + 0.2 * self.randn(hidden_size)).to(bf16) if norm else None,
        }

    def head(self, hidden_size: int, hc: int = 4) -> dict:
        return {
            "fn": self.randn(hc, hc * hidden_size) / math.sqrt(hc * hidden_size),
            "scale": self.uniform(1, low=0.5, high=2.5),
            "base": 0.5 * self.randn(hc),
        }

    def mixes(self, num_tokens: int, hc: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        """(post_mix [T, hc], res_mix [T, hc, hc]) fp32 of realistic range; res_mix is deliberately
        not symmetric, so a transposed res_mix gives a different result."""
        post_mix = 2 * torch.sigmoid(self.randn(num_tokens, hc))
        res_mix = torch.softmax(2 * self.randn(num_tokens, hc, hc), dim=-1)
        return post_mix, res_mix

    def pre_mix_in(self, num_tokens: int, hc: int = 4) -> torch.Tensor:
        return torch.sigmoid(self.randn(num_tokens, hc)) + 1e-6


@pytest.fixture
def mhc(request) -> MHCInputs:
    return MHCInputs(zlib.crc32(request.node.nodeid.encode()))


def pytest_collection_modifyitems(items):
    """Every test of a tests/test_cuda_*.py file but the CPU compile check is a GPU test:
    `pytest -m gpu tests` runs the GPU suite alone (tools/gpu_check.sh does)."""
    for item in items:
        name = item.path.name
        if name.startswith("test_cuda_") and name != "test_cuda_compile.py":
            item.add_marker(pytest.mark.gpu)


# A module's comm tests share one one-process gloo group (tp = 1 makes reduce-scatter, all-gather
# and all-reduce identities), created once per module and destroyed after it.
@pytest.fixture(scope="module")
def group1(tmp_path_factory):
    assert not dist.is_initialized(), "an earlier test left a process group initialised"
    store = tmp_path_factory.mktemp("group1") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def comm1(group1):
    from spkernels import Communicator  # conftest stays importable without the built library

    with Communicator(group1, max_tokens=32, hidden_size=64) as comm:
        yield comm
