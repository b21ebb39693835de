"""The multi-token-prediction (MTP) draft layer of a DeepSeek-V4/V4.1-shaped model.

At position p the layer reads the target's whole pre-head stream there (``previous_hidden``, flat
[T, hc * D]) and the embedding of the token after p, and predicts the token after that:

    stream = h_proj(hnorm(previous_hidden)) + e_proj(enorm(embed))    (per stream; [T, hc, D])
    -> one V4 decoder block over the mHC stream (the target's sublayers and fused boundaries)
    -> exit collapse (V4: its own head_mix; V4.1: the last pre_mix) -> its own norm -> LM head

The embedding and the LM head are the target's (shared tensors on the last pipeline stage, where the
draft runs). The block has its own KV cache, one row per request like the target's. In V4.1 the
block's first site collapses with the uniform mean of the hc streams (every stream carries the token's
embedding through e_proj, and its own stream of the target's hidden through h_proj).

Under SP (decided on the draft forward's own padded token count, the target's rule) the input rows
are token-sharded before the projections, the block runs sharded-in/sharded-out through the same
fused boundaries as the target's layers, its final mHC post runs on the shard, and the stream (with
V4.1's pre_mix) is all-gathered before the exit: ``residual`` is then the whole flat stream, the
``previous_hidden`` of the next draft step. The target stashes its own ``residual`` the same way
(``Model.stash_residual``).
"""

from __future__ import annotations

import torch

from .. import api
from .config import ModelConfig
from .model import Batch, Model


def block_weights(weights: dict) -> dict:
    """The MTP layer's tensors under the names of a one-layer Model: ``mtp.layer.*`` -> ``layers.0.*``,
    ``mtp.head_mix.*`` -> ``head_mix.*``, ``mtp.norm`` -> ``norm``; embedding and LM head shared."""
    out = {name: weights[name] for name in ("embed.weight", "lm_head.weight")}
    out["norm.weight"] = weights["mtp.norm.weight"]
    for name, tensor in weights.items():
        for prefix, renamed in (("mtp.layer.", "layers.0."), ("mtp.head_mix.", "head_mix.")):
            if name.startswith(prefix):
                out[renamed + name[len(prefix) :]] = tensor
    return out


class MTPLayer(Model):
    """A one-layer Model whose entry is the MTP projection: the target's sublayers, boundaries and exit
    run unchanged. ``target``: the model whose embedding and LM head it shares (its last stage)."""

    def __init__(
        self, config: ModelConfig, weights: dict, device, comm=None, max_requests=1, max_seq_len=None,
        target: Model | None = None,
    ):  # fmt: skip
        if not config.mtp_layers:
            raise ValueError(
                "the model has no MTP layer (config.mtp_layers = 0): speculative decoding with the MTP "
                "draft needs weights with one (random weights get it with --mtp)"
            )
        if target is not None and not target.last_stage:
            raise ValueError(
                f"the MTP draft shares the LM head: it runs on the last pipeline stage, not on stage "
                f"{target.stage.index} of {target.stage.pp_size}"
            )
        block = config.replace(num_layers=1, engram_layers=(), mtp_layers=0)
        super().__init__(block, block_weights(weights), device, comm, max_requests, max_seq_len)
        if target is not None:  # one copy of the vocabulary-sized tensors
            self.lm_head = target.lm_head
            if target.first_stage:
                self.embed = target.embed
        dev = self.device
        self.enorm = weights["mtp.enorm.weight"].to(dev).float()
        self.hnorm = weights["mtp.hnorm.weight"].to(dev).float()
        self.e_proj = weights["mtp.e_proj.weight"].to(dev)
        self.h_proj = weights["mtp.h_proj.weight"].to(dev)
        self.stash_residual = True
        self.previous_hidden: torch.Tensor | None = None

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.square().mean(dim=-1, keepdim=True) + self.config.norm_eps) * weight
        return h.to(torch.bfloat16)

    def _enter(self, batch: Batch, use_sp: bool, received=None):
        hc, dim = self.config.hc, self.config.hidden_size
        embed = self.embed[batch.input_ids]  # [T, D]
        hidden = self.previous_hidden.view(-1, hc, dim)  # [T, hc, D]
        if hidden.shape[0] != embed.shape[0]:
            raise ValueError(f"previous_hidden has {hidden.shape[0]} rows, the batch {embed.shape[0]}")
        if use_sp:  # token-shard the inputs: the projections are per token
            embed = api.sp_shard(embed, self.comm)
            hidden = api.sp_shard(hidden.contiguous(), self.comm)
        e = self._norm(embed, self.enorm) @ self.e_proj.t()
        h = self._norm(hidden, self.hnorm) @ self.h_proj.t()
        stream = (h.float() + e.float().unsqueeze(1)).to(torch.bfloat16)
        pre_mix = None
        if self.delayed:
            pre_mix = torch.full((stream.shape[0], hc), 1.0 / hc, dtype=torch.float32, device=stream.device)
        return stream, pre_mix

    def draft(self, batch: Batch, previous_hidden: torch.Tensor, use_sp: bool):
        """-> (fp32 logits of the sampled rows, the whole flat stream [rows, hc * D]). ``previous_hidden``
        has one row per batch row (pad rows zero)."""
        self.previous_hidden = previous_hidden
        logits = self.forward(batch, use_sp)
        return logits, self.residual
