"""A DeepSeek-V4-shaped decoder over an mHC stream, tensor-parallel over a Communicator's group.

embedding -> hc copies -> L x [pre -> attention -> post; pre -> FFN -> post] -> mhc_head -> RMSNorm
-> LM head. Every mixing site goes through ``torch.ops.spkernels``: the boundary between two
sublayers is one op (``mhc_post_pre_rs_ag`` in SP mode, ``mhc_post_pre_ar`` in TP mode, the local
``mhc_post_pre`` without a TP group), so the same code runs on CPU (gloo) and CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .weights import shard

ops = torch.ops.spkernels


@dataclass
class Batch:
    """One forward over T padded rows. Pad rows carry the pad token (a zero embedding, so their stream
    rows stay zero), position 0, KV row ``trash_row`` and context length 1; they are never sampled."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    rows: torch.Tensor  # [T] int64, each token's KV-cache row (its request's)
    seq_lens: torch.Tensor  # [T] int64, context length including this token (decode path)
    num_tokens: int  # real rows, gathered at the SP exit; the padded count under graph capture
    # (row, first batch row, first position, count) per request for the prefill path; None for a
    # pure decode batch, whose attention reads only tensors (CUDA-graph safe).
    segments: list[tuple[int, int, int, int]] | None
    sample_idx: torch.Tensor | None  # batch rows whose logits are returned; None: all rows


class Model:
    def __init__(
        self, config: ModelConfig, weights: dict, device, comm=None, max_requests=1, max_seq_len=None
    ):
        if config.arch != "v4":
            raise NotImplementedError(
                f"arch {config.arch!r}: only 'v4' is implemented (V4.1's delayed pre-mix and head-less "
                f"exit land with issue 7)"
            )
        self.config, self.device, self.comm = config, torch.device(device), comm
        self.tp_size = comm.tp_size if comm is not None else 1
        rank = comm.rank if comm is not None else 0
        config.validate(self.tp_size)
        dev = self.device

        def w(name):
            return shard(name, weights[name], rank, self.tp_size).to(dev)

        def site(prefix, head=False):
            names = ("fn", "scale", "base") if head else ("fn", "scale", "base", "norm_weight")
            return tuple(w(f"{prefix}.{n}") for n in names)

        embed = w("embed.weight")
        self.pad_id = config.vocab_size  # an extra zero row: pad tokens embed to zero stream rows
        self.embed = torch.cat([embed, embed.new_zeros(1, config.hidden_size)])
        self.layers = []
        for i in range(config.num_layers):
            p = f"layers.{i}"
            self.layers.append(
                {
                    "attn_mix": site(f"{p}.attn_mix"),
                    "wqkv": torch.cat([w(f"{p}.attn.{n}") for n in ("wq", "wk", "wv")]),
                    "wo": w(f"{p}.attn.wo"),
                    "ffn_mix": site(f"{p}.ffn_mix"),
                    "w_gate_up": torch.cat([w(f"{p}.ffn.w_gate"), w(f"{p}.ffn.w_up")]),
                    "w_down": w(f"{p}.ffn.w_down"),
                }
            )
        self.head_mix = site("head_mix", head=True)
        self.norm_weight = w("norm.weight").float()
        # fp32 logits: bf16 would quantise them coarsely enough to create argmax ties.
        self.lm_head = w("lm_head.weight").float()

        self.local_heads = config.num_heads // self.tp_size
        self.max_seq_len = max_seq_len or config.max_seq_len
        self.trash_row = max_requests  # pad rows write their K/V here; never read by real tokens
        shape = (config.num_layers, 2, max_requests + 1, self.local_heads, self.max_seq_len, config.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=torch.bfloat16, device=dev)
        half = config.head_dim // 2
        self.inv_freq = config.rope_theta ** (-torch.arange(half, device=dev, dtype=torch.float32) / half)
        self.peak_stream_bytes = 0

    # ------------------------------------------------------------------ sublayers
    def _row_parallel(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T; with a TP group, written straight into the communicator's partial buffer so
        the boundary op reads it without a copy."""
        if self.comm is None:
            return x @ weight.t()
        return torch.mm(x, weight.t(), out=self.comm.partial_buffer(x.shape[0]))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.float()[:, None, None] * self.inv_freq  # [T, 1, hd/2]
        cos, sin = freqs.cos(), freqs.sin()
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)

    def attention(self, index: int, layer_input: torch.Tensor, batch: Batch) -> torch.Tensor:
        layer = self.layers[index]
        T, heads, hd = layer_input.shape[0], self.local_heads, self.config.head_dim
        q, k, v = (layer_input @ layer["wqkv"].t()).view(T, 3, heads, hd).unbind(1)
        q, k = self._rope(q, batch.positions), self._rope(k, batch.positions)
        k_cache, v_cache = self.kv_cache[index]
        k_cache[batch.rows, :, batch.positions] = k
        v_cache[batch.rows, :, batch.positions] = v
        if batch.segments is None:
            out = self._decode_attention(q, k_cache, v_cache, batch)
        else:
            out = self._prefill_attention(q, k_cache, v_cache, batch)
        return self._row_parallel(out.reshape(T, heads * hd), layer["wo"])

    def _decode_attention(self, q, k_cache, v_cache, batch):
        """One query per row against its request's cache row, masked to its length: fixed shapes
        and no host reads, so it records into a CUDA graph."""
        keys, values = k_cache[batch.rows], v_cache[batch.rows]  # [T, heads, S, hd]
        visible = torch.arange(self.max_seq_len, device=q.device) < batch.seq_lens[:, None]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=visible[:, None, None])
        return out.squeeze(2)

    def _prefill_attention(self, q, k_cache, v_cache, batch):
        out = torch.zeros_like(q)  # pad rows attend to nothing
        for row, first, start, count in batch.segments:
            end = start + count
            # 4-D [1, heads, len, hd]: what the fused (flash / memory-efficient) SDPA kernels take
            query = q[first : first + count].transpose(0, 1).unsqueeze(0)
            keys, values = k_cache[row : row + 1, :, :end], v_cache[row : row + 1, :, :end]
            if start == 0:
                res = F.scaled_dot_product_attention(query, keys, values, is_causal=True)
            else:  # a later chunk or a decode token: causal with the cached prefix in front
                queries = start + torch.arange(count, device=q.device)
                mask = torch.arange(end, device=q.device) <= queries[:, None]
                res = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
            out[first : first + count] = res[0].transpose(0, 1)
        return out

    def ffn(self, index: int, layer_input: torch.Tensor) -> torch.Tensor:
        layer = self.layers[index]
        gate, up = (layer_input @ layer["w_gate_up"].t()).chunk(2, dim=-1)
        act = (F.silu(gate.float()) * up.float()).to(torch.bfloat16)
        return self._row_parallel(act, layer["w_down"])

    # ------------------------------------------------------------------ mixing boundaries
    def _pre(self, stream, site, use_sp):
        if use_sp:
            return ops.mhc_pre_ag(stream, *site, None, *self.config.eps, self.comm.handle)
        return ops.mhc_pre(stream, *site, None, *self.config.eps)

    def _post_pre(self, partial, stream, post_mix, res_mix, site, use_sp):
        args = (partial, stream, post_mix, res_mix, *site, None, *self.config.eps)
        if self.comm is None:
            return ops.mhc_post_pre(*args)
        if use_sp:
            return ops.mhc_post_pre_rs_ag(*args, self.comm.handle)
        return ops.mhc_post_pre_ar(*args, self.comm.handle)

    def _post(self, partial, stream, post_mix, res_mix, use_sp):
        if self.comm is None:
            return ops.mhc_post(partial, stream, post_mix, res_mix)
        if use_sp:
            return ops.mhc_post_rs(partial, stream, post_mix, res_mix, self.comm.handle)
        return ops.mhc_post_ar(partial, stream, post_mix, res_mix, self.comm.handle)

    # ------------------------------------------------------------------ forward
    def forward(self, batch: Batch, use_sp: bool) -> torch.Tensor:
        """-> fp32 logits of the sampled rows. ``use_sp`` needs a TP group and T % tp == 0."""
        T = batch.input_ids.shape[0]
        if use_sp and (self.comm is None or T % self.tp_size):
            raise ValueError(
                f"SP needs a TP group and a padded token count divisible by tp = {self.tp_size}, got T = {T}"
            )
        hidden = self.embed[batch.input_ids]
        if use_sp:  # shard the [T, D] embedding rather than the 4x larger stream: same rows
            hidden = ops.sp_shard(hidden, self.comm.handle)
        stream = hidden.unsqueeze(1).expand(-1, self.config.hc, -1).contiguous()
        self.peak_stream_bytes = max(self.peak_stream_bytes, stream.numel() * stream.element_size())
        layer_input, post_mix, res_mix, _ = self._pre(stream, self.layers[0]["attn_mix"], use_sp)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            partial = self.attention(i, layer_input, batch)
            stream, layer_input, post_mix, res_mix, _ = self._post_pre(
                partial, stream, post_mix, res_mix, layer["ffn_mix"], use_sp
            )
            partial = self.ffn(i, layer_input)
            if i == last:
                stream = self._post(partial, stream, post_mix, res_mix, use_sp)
            else:
                stream, layer_input, post_mix, res_mix, _ = self._post_pre(
                    partial, stream, post_mix, res_mix, self.layers[i + 1]["attn_mix"], use_sp
                )
        eps = self.config.eps
        hidden = ops.mhc_head(stream, *self.head_mix, eps[0], eps[1])
        if use_sp:  # the head is per token: collapse the shard, then gather 1/hc of the stream's bytes
            hidden = ops.sp_all_gather(hidden, batch.num_tokens, self.comm.handle)
        if batch.sample_idx is not None:
            hidden = hidden[batch.sample_idx]
        h = hidden.float()
        h = h * torch.rsqrt(h.square().mean(dim=-1, keepdim=True) + self.config.norm_eps) * self.norm_weight
        return h @ self.lm_head.t()
