"""Model sizes. ``tiny`` runs on CPU in CI; ``v4-flash-like`` has DeepSeek-V4-Flash's hidden size and
head shape (D = 4096, 32 heads x 128) with a few dense layers, for the GPU benchmarks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .. import reference as ref
from ..api import MhcParams


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
    # Engram (n-gram memory, V4.1): layers that add it before their attention pre-mix, the n-gram
    # orders hashed, rows per hash table, and the width of each table's embedding.
    engram_layers: tuple[int, ...] = ()
    engram_orders: tuple[int, ...] = (2, 3)
    engram_table_size: int = 4093
    engram_dim: int = 32
    # MoE FFN: 0 = the dense FFN; else routed experts (split across the TP group: expert parallel) of
    # width moe_ffn_size, top moe_top_k per token, plus the dense FFN above as the shared expert.
    num_experts: int = 0
    moe_top_k: int = 2
    moe_ffn_size: int = 64
    # Multi-token prediction: 1 adds the MTP draft layer (runner/mtp.py; its weights under ``mtp.``),
    # 0 leaves it out. It shares the embedding and the LM head with the target.
    mtp_layers: int = 0
    # Logit spread of the random LM head (std of the logits in units of the normalised hidden): wide
    # spreads give top-2 margins far above the bf16 noise between TP layouts, so greedy tokens are a
    # fair thing to compare across tp sizes and modes.
    logit_std: float = 8.0
    lm_head_init: str = "permuted-embedding"  # or "random"; see weights.random_weights
    rms_eps: float = ref.RMS_EPS
    hc_eps: float = ref.HC_EPS
    sinkhorn_eps: float | None = None  # None: hc_eps (DeepSeek's checkpoints have one hc_eps)
    norm_eps: float = ref.NORM_EPS
    sinkhorn_iters: int = ref.SINKHORN_ITERS
    post_alpha: float = ref.POST_ALPHA

    def __post_init__(self):  # JSON metadata gives lists: keep tuples so configs compare equal
        for name in ("engram_layers", "engram_orders"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def mixing_site(self, fn, scale, base, norm_weight=None) -> MhcParams:
        """One mixing site's weights with this model's mixing scalars."""
        return MhcParams(
            fn, scale, base, norm_weight, self.rms_eps, self.hc_eps, self.sinkhorn_eps, self.norm_eps,
            self.sinkhorn_iters, self.post_alpha,
        )  # fmt: skip

    @property
    def eps(self) -> tuple:
        """The five mixing scalars in the op schemas' order."""
        return (self.rms_eps, self.hc_eps, self.norm_eps, self.sinkhorn_iters, self.post_alpha)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def validate(self, tp_size: int, pp_size: int = 1) -> None:
        for field in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "head_dim",
            "ffn_size",
            "max_seq_len",
            "engram_table_size",
            "engram_dim",
            "moe_top_k",
            "moe_ffn_size",
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
        if self.head_dim % 16:
            raise ValueError(
                f"config.head_dim must be a multiple of 16 (the rotary kernel's 16-byte halves), "
                f"got {self.head_dim}"
            )
        if self.num_heads % tp_size:
            raise ValueError(
                f"num_heads = {self.num_heads} is not divisible by tp = {tp_size}: attention "
                f"heads are split evenly across the TP group"
            )
        if self.ffn_size % (8 * tp_size):
            raise ValueError(
                f"ffn_size = {self.ffn_size} is not a multiple of 8 * tp = {8 * tp_size}: FFN columns "
                f"are split evenly across the TP group, 8 per 16-byte vector of the SiLU-and-mul kernel"
            )
        if not isinstance(pp_size, int) or not 1 <= pp_size <= self.num_layers:
            raise ValueError(
                f"pp = {pp_size} must be in [1, num_layers = {self.num_layers}]: every pipeline stage "
                f"holds at least one layer"
            )
        bad = [i for i in self.engram_layers if not isinstance(i, int) or not 0 <= i < self.num_layers]
        if bad or len(set(self.engram_layers)) != len(self.engram_layers):
            raise ValueError(
                f"config.engram_layers must be distinct layer indices in [0, {self.num_layers}), "
                f"got {self.engram_layers}"
            )
        if not self.engram_orders or any(not isinstance(n, int) or n < 1 for n in self.engram_orders):
            raise ValueError(f"config.engram_orders must be positive n-gram orders, got {self.engram_orders}")
        if self.mtp_layers not in (0, 1) or isinstance(self.mtp_layers, bool):
            raise ValueError(f"config.mtp_layers must be 0 or 1 (one MTP layer), got {self.mtp_layers!r}")
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"config.num_experts must be an int >= 0 (0: dense FFN), got {self.num_experts}")
        if self.num_experts:
            if self.moe_top_k >= self.num_experts:
                raise ValueError(
                    f"config.moe_top_k = {self.moe_top_k} must be below num_experts = {self.num_experts} "
                    f"(the gate weighs each chosen expert by its margin over the first one left out)"
                )
            if self.num_experts % tp_size:
                raise ValueError(
                    f"num_experts = {self.num_experts} is not divisible by tp = {tp_size}: experts are "
                    f"split evenly across the TP group (expert parallel; in SP mode each rank runs its "
                    f"experts on all gathered tokens)"
                )
            if self.moe_ffn_size % 8:
                raise ValueError(
                    f"config.moe_ffn_size must be a multiple of 8 (the experts' grouped GEMMs need "
                    f"16-byte rows), got {self.moe_ffn_size}"
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
    """A preset with overrides (None values ignored). V4.1 gets Engram at layers 1 and L - 1 unless
    told otherwise (layers 1 and 14 of the full model, scaled to the preset's depth)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    config = PRESETS[name].replace(**{k: v for k, v in overrides.items() if v is not None})
    if config.arch == "v4.1" and overrides.get("engram_layers") is None:
        last = config.num_layers - 1
        config = config.replace(engram_layers=tuple(sorted({min(1, last), last})))
    return config
