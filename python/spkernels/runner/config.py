"""Model sizes. ``tiny`` runs on CPU in CI; ``v4-flash-like`` has DeepSeek-V4-Flash's hidden size and
head shape (D = 4096, 32 heads x 128) with a few dense layers, for the GPU benchmarks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .. import reference as ref


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    ffn_size: int
    max_seq_len: int  # KV-cache length per request (prompt + generated tokens)
    hc: int = ref.HC
    arch: str = "v4"
    rope_theta: float = 10000.0
    # Logit spread of the random LM head (std of the logits in units of the normalised hidden): wide
    # spreads give top-2 margins far above the bf16 noise between TP layouts, so greedy tokens are a
    # fair thing to compare across tp sizes and modes.
    logit_std: float = 8.0
    lm_head_init: str = "permuted-embedding"  # or "random"; see weights.random_weights
    rms_eps: float = ref.RMS_EPS
    hc_eps: float = ref.HC_EPS
    norm_eps: float = ref.NORM_EPS
    sinkhorn_iters: int = ref.SINKHORN_ITERS
    post_alpha: float = ref.POST_ALPHA

    @property
    def eps(self) -> tuple:
        """The five mixing scalars in the op schemas' order (SPEC.md §3)."""
        return (self.rms_eps, self.hc_eps, self.norm_eps, self.sinkhorn_iters, self.post_alpha)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def validate(self, tp_size: int) -> None:
        for field in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "head_dim",
            "ffn_size",
            "max_seq_len",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"config.{field} must be a positive int, got {value!r}")
        if self.hc != 4:
            raise ValueError(
                f"config.hc must be 4 (every DeepSeek mHC model; the kernels specialise it), got {self.hc}"
            )
        if self.arch not in ("v4", "v4.1"):
            raise ValueError(f"config.arch must be 'v4' or 'v4.1', got {self.arch!r}")
        if self.head_dim % 2:
            raise ValueError(f"config.head_dim must be even (rotary embedding), got {self.head_dim}")
        if self.num_heads % tp_size:
            raise ValueError(
                f"num_heads = {self.num_heads} is not divisible by tp = {tp_size}: attention "
                f"heads are split evenly across the TP group"
            )
        if self.ffn_size % tp_size:
            raise ValueError(
                f"ffn_size = {self.ffn_size} is not divisible by tp = {tp_size}: FFN columns "
                f"are split evenly across the TP group"
            )


PRESETS = {
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=128, num_layers=2, num_heads=8, head_dim=16, ffn_size=128, max_seq_len=128
    ),
    "v4-flash-like": ModelConfig(
        vocab_size=32768,
        hidden_size=4096,
        num_layers=4,
        num_heads=32,
        head_dim=128,
        ffn_size=8192,
        max_seq_len=8448,
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name].replace(**{k: v for k, v in overrides.items() if v is not None})
