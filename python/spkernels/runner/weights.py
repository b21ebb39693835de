"""Weights by name: random from a seed, or a safetensors file with the same names (torch.save when
safetensors is not installed); and the TP shard of each tensor for one rank.

Every rank builds the same full tensors (same seed, same generator order) and keeps its shard, so
any tp size sees the same model. The CPU and CUDA generators differ, so one seed gives different
weights on the two devices.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from .. import reference as ref
from .config import ModelConfig

try:
    import safetensors.torch as _safetensors
except ImportError:  # the runner still saves and loads, through torch.save
    _safetensors = None

bf16, f32 = torch.bfloat16, torch.float32
# Column-parallel weights split their rows (output features) across ranks; row-parallel weights
# split their columns (input features) and produce the partial sums that the boundary op reduces.
COLUMN_PARALLEL = ("attn.wq", "attn.wk", "attn.wv", "ffn.w_gate", "ffn.w_up")
ROW_PARALLEL = ("attn.wo", "ffn.w_down")
# Routed experts are split whole across the TP group (expert parallel): rank r owns a contiguous
# block of experts, and its partial output holds only their contributions.
EXPERT_PARALLEL = ("moe.w_gate", "moe.w_up", "moe.w_down")


def _mix_specs(prefix: str, config: ModelConfig, head: bool = False) -> dict:
    hc, dim = config.hc, config.hidden_size
    rows = hc if head else ref.num_mix(hc)
    # fn ~ N(0, 1/(hc*D)) makes m = fn . x * r ~ N(0, 1): the mixes start neither saturated nor flat.
    specs = {
        f"{prefix}.fn": ((rows, hc * dim), f32, ("normal", 1 / math.sqrt(hc * dim))),
        f"{prefix}.scale": ((1 if head else 3,), f32, ("uniform", 0.5, 1.5)),
        f"{prefix}.base": ((rows,), f32, ("normal", 0.5)),
    }
    if not head:
        specs[f"{prefix}.norm_weight"] = ((dim,), bf16, ("uniform", 0.8, 1.2))
    return specs


def _moe_specs(prefix: str, config: ModelConfig) -> dict:
    n, dim, ffn = config.num_experts, config.hidden_size, config.moe_ffn_size
    # router logits ~ N(0, 2^2): wide enough that the top-k choice is clear for most tokens
    return {
        f"{prefix}.moe.router": ((n, dim), f32, ("normal", 2 / math.sqrt(dim))),
        f"{prefix}.moe.w_gate": ((n, ffn, dim), bf16, ("normal", 1 / math.sqrt(dim))),
        f"{prefix}.moe.w_up": ((n, ffn, dim), bf16, ("normal", 1 / math.sqrt(dim))),
        f"{prefix}.moe.w_down": ((n, dim, ffn), bf16, ("normal", 1 / math.sqrt(ffn))),
    }


def _engram_specs(prefix: str, config: ModelConfig) -> dict:
    rows, width, dim = config.engram_table_size, config.engram_dim, config.hidden_size
    total = width * len(config.engram_orders)
    specs = {
        f"{prefix}.engram.table{n}": ((rows, width), bf16, ("normal", 1.0)) for n in config.engram_orders
    }
    specs[f"{prefix}.engram.w_key"] = ((dim, total), bf16, ("normal", 1 / math.sqrt(total)))
    # values ~ 1/4 of the stream's scale: the memory nudges the stream rather than replacing it
    specs[f"{prefix}.engram.w_value"] = ((dim, total), bf16, ("normal", 0.25 / math.sqrt(total)))
    return specs


def _layer_specs(p: str, config: ModelConfig, engram: bool) -> dict:
    dim, inner, ffn = config.hidden_size, config.num_heads * config.head_dim, config.ffn_size
    specs = _mix_specs(f"{p}.attn_mix", config)
    for name in ("wq", "wk", "wv"):
        specs[f"{p}.attn.{name}"] = ((inner, dim), bf16, ("normal", 1 / math.sqrt(dim)))
    specs[f"{p}.attn.wo"] = ((dim, inner), bf16, ("normal", 1 / math.sqrt(inner)))
    specs.update(_mix_specs(f"{p}.ffn_mix", config))
    specs[f"{p}.ffn.w_gate"] = ((ffn, dim), bf16, ("normal", 1 / math.sqrt(dim)))
    specs[f"{p}.ffn.w_up"] = ((ffn, dim), bf16, ("normal", 1 / math.sqrt(dim)))
    specs[f"{p}.ffn.w_down"] = ((dim, ffn), bf16, ("normal", 1 / math.sqrt(ffn)))
    if config.num_experts:
        specs.update(_moe_specs(p, config))
    if engram:
        specs.update(_engram_specs(p, config))
    return specs


def _mtp_specs(config: ModelConfig) -> dict:
    """The MTP draft layer: enorm/hnorm, e_proj/h_proj, one decoder block (``mtp.layer``, no Engram),
    its own exit (head_mix in V4) and final norm; the embedding and LM head are the target's."""
    if not config.mtp_layers:
        return {}
    dim = config.hidden_size
    specs = {
        "mtp.enorm.weight": ((dim,), bf16, ("uniform", 0.8, 1.2)),
        "mtp.hnorm.weight": ((dim,), bf16, ("uniform", 0.8, 1.2)),
        "mtp.e_proj.weight": ((dim, dim), bf16, ("normal", 1 / math.sqrt(dim))),
        "mtp.h_proj.weight": ((dim, dim), bf16, ("normal", 1 / math.sqrt(dim))),
    }
    specs.update(_layer_specs("mtp.layer", config, engram=False))
    if config.arch == "v4":
        specs.update(_mix_specs("mtp.head_mix", config, head=True))
    specs["mtp.norm.weight"] = ((dim,), bf16, ("uniform", 0.8, 1.2))
    return specs


def _target_specs(config: ModelConfig) -> dict:
    dim = config.hidden_size
    specs = {"embed.weight": ((config.vocab_size, dim), bf16, ("normal", 1.0))}
    for i in range(config.num_layers):
        specs.update(_layer_specs(f"layers.{i}", config, i in config.engram_layers))
    if config.arch == "v4":  # V4.1 has no learned head: its exit collapses with the last pre_mix
        specs.update(_mix_specs("head_mix", config, head=True))
    specs["norm.weight"] = ((dim,), bf16, ("uniform", 0.8, 1.2))
    specs["lm_head.weight"] = ((config.vocab_size, dim), bf16, ("normal", config.logit_std / math.sqrt(dim)))
    return specs


def param_specs(config: ModelConfig) -> dict:
    """name -> (shape, dtype, init); the full (unsharded) model, MTP layer included."""
    return {**_target_specs(config), **_mtp_specs(config)}


def random_weights(config: ModelConfig, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = _draw(_target_specs(config), gen, device)
    if config.lm_head_init == "permuted-embedding":
        # LM head row v = embedding row perm[v]: the residual path then favours one next token per
        # input token by ~sqrt(D) standard deviations of the other logits, while attention and FFN
        # still move the stream. Greedy margins far above bf16 noise make tokens comparable across
        # TP layouts; a scrambled stream (wrong rows, wrong mixing) still changes tokens and logits.
        perm = torch.randperm(config.vocab_size, generator=gen, device=device)
        scale = config.logit_std / math.sqrt(config.hidden_size)
        weights["lm_head.weight"] = (weights["embed.weight"].float()[perm] * scale).to(bf16)
    # drawn last: a config with the MTP layer has the same target weights as one without it
    weights.update(_draw(_mtp_specs(config), gen, device))
    return weights


def _draw(specs: dict, gen: torch.Generator, device) -> dict[str, torch.Tensor]:
    weights = {}
    for name, (shape, dtype, init) in specs.items():
        t = torch.empty(shape, dtype=f32, device=device)
        if init[0] == "normal":
            t.normal_(0.0, init[1], generator=gen)
        else:
            t.uniform_(init[1], init[2], generator=gen)
        weights[name] = t.to(dtype)
    return weights


def check_weights(weights: dict[str, torch.Tensor], config: ModelConfig, source: str) -> None:
    specs = param_specs(config)
    missing, unexpected = specs.keys() - weights.keys(), weights.keys() - specs.keys()
    if missing or unexpected:
        raise ValueError(
            f"{source}: missing tensors {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    for name, (shape, dtype, _) in specs.items():
        t = weights[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{source}: {name} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")


def save_weights(path: str | Path, weights: dict[str, torch.Tensor], config: ModelConfig) -> str:
    """Writes safetensors (config in the metadata) when available, else torch.save; returns the format."""
    check_weights(weights, config, str(path))
    meta = json.dumps(dataclasses.asdict(config))
    tensors = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    if _safetensors is not None:
        _safetensors.save_file(tensors, str(path), metadata={"config": meta})
        return "safetensors"
    torch.save({"config": meta, "tensors": tensors}, str(path))
    return "torch"


def load_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Reads either format (told apart by the zip magic of torch.save); tensors land on CPU."""
    path = Path(path)
    with path.open("rb") as f:
        is_zip = f.read(2) == b"PK"
    if is_zip:
        blob = torch.load(str(path), map_location="cpu", weights_only=True)
        meta, weights = blob["config"], blob["tensors"]
    else:
        if _safetensors is None:
            raise RuntimeError(f"{path} is a safetensors file: `pip install safetensors` to read it")
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = (f.metadata() or {}).get("config")
            weights = {name: f.get_tensor(name) for name in f.keys()}
    if meta is None:
        raise ValueError(f"{path} has no 'config' metadata: write it with spkernels.runner save_weights")
    config = ModelConfig(**json.loads(meta))
    check_weights(weights, config, str(path))
    return weights, config


def shard(name: str, weight: torch.Tensor, rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice: heads, FFN columns and experts split evenly, everything else replicated."""
    kind = name.split(".", 2)[-1]
    if kind in COLUMN_PARALLEL:
        return weight.chunk(tp_size, dim=0)[rank].contiguous()
    if kind in ROW_PARALLEL:
        return weight.chunk(tp_size, dim=1)[rank].contiguous()
    if kind in EXPERT_PARALLEL:
        return weight.chunk(tp_size, dim=0)[rank].contiguous()
    return weight
