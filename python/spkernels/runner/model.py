"""A DeepSeek-V4/V4.1-shaped decoder over an mHC stream, tensor-parallel over a Communicator's group,
optionally one pipeline stage of it.

embedding -> hc copies -> L x [pre -> attention -> post; pre -> FFN -> post] -> exit collapse -> RMSNorm
-> LM head. Every mixing site goes through spkernels' typed functions (spkernels.api): the boundary
between two sublayers is one op (``sp_boundary`` in SP mode, ``tp_boundary`` in TP mode, the local
``mhc_post_pre`` without a TP group), so the same code runs on CPU (gloo) and CUDA.

V4 collapses each site with its own pre and exits through the learned ``mhc_head``. V4.1 (delayed
pre-mix) collapses each site with the pre of the *previous* site (``pre_mix_in``; a one-hot on
stream 0 at the first site, which reproduces the embedding) and exits collapsing with the last
pre_mix. At an Engram layer the boundary before the attention is split: post, Engram add, pre.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import api
from ..api import Mixes
from . import engram, glue, moe, pipeline
from .config import ModelConfig
from .weights import shard

# Fresh prompts of up to this many tokens are padded to it and share one attention call (_prefill_groups).
PAD_GROUP_MAX = 256


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
    # [T, len(engram_orders)] Engram table rows, from each request's whole token history (pad rows:
    # the zero row); None when the model has no Engram layer.
    hash_ids: torch.Tensor | None = None


class Model:
    """``stage``: the pipeline stage this rank runs (pipeline.make_stage); None for the whole model."""

    def __init__(
        self, config: ModelConfig, weights: dict, device, comm=None, max_requests=1, max_seq_len=None,
        stage: pipeline.Stage | None = None,
    ):  # fmt: skip
        self.config, self.device, self.comm, self.stage = config, torch.device(device), comm, stage
        self.tp_size = comm.tp_size if comm is not None else 1
        rank = comm.rank if comm is not None else 0
        config.validate(self.tp_size, stage.pp_size if stage else 1)
        self.delayed = config.arch == "v4.1"
        self.layer_ids = stage.layers if stage else range(config.num_layers)
        self.first_stage = stage is None or stage.first
        self.last_stage = stage is None or stage.last
        dev = self.device

        def w(name):
            return shard(name, weights[name], rank, self.tp_size).to(dev)

        def site(prefix, head=False):
            names = ("fn", "scale", "base") if head else ("fn", "scale", "base", "norm_weight")
            return config.mixing_site(*(w(f"{prefix}.{n}") for n in names))

        self.pad_id = config.vocab_size  # an extra zero row: pad tokens embed to zero stream rows
        if self.first_stage:
            embed = w("embed.weight")
            self.embed = torch.cat([embed, embed.new_zeros(1, config.hidden_size)])
        experts_per_rank = config.num_experts // self.tp_size
        self.layers = []
        for i in self.layer_ids:
            p = f"layers.{i}"
            layer = {
                "attn_mix": site(f"{p}.attn_mix"),
                "wqkv": torch.cat([w(f"{p}.attn.{n}") for n in ("wq", "wk", "wv")]),
                "wo": w(f"{p}.attn.wo"),
                "ffn_mix": site(f"{p}.ffn_mix"),
                "w_gate_up": torch.cat([w(f"{p}.ffn.w_gate"), w(f"{p}.ffn.w_up")]),
                "w_down": w(f"{p}.ffn.w_down"),
            }
            if config.num_experts:
                layer["router"] = w(f"{p}.moe.router")
                layer["experts"] = tuple(w(f"{p}.moe.{n}") for n in ("w_gate", "w_up", "w_down"))
                layer["first_expert"] = rank * experts_per_rank
            if i in config.engram_layers:
                # the extra zero row is the pad id (engram.py): pad rows get zero memory
                tables = [w(f"{p}.engram.table{n}") for n in config.engram_orders]
                tables = [torch.cat([t, t.new_zeros(1, t.shape[1])]) for t in tables]
                layer["engram"] = (tables, w(f"{p}.engram.w_key"), w(f"{p}.engram.w_value"))
            self.layers.append(layer)
        if self.last_stage:
            if not self.delayed:
                self.head_mix = site("head_mix", head=True)
            self.norm_weight = w("norm.weight").float()
            # fp32 logits: bf16 would quantise them coarsely enough to create argmax ties.
            self.lm_head = w("lm_head.weight").float()

        self.local_heads = config.num_heads // self.tp_size
        self.max_seq_len = max_seq_len or config.max_seq_len
        self.trash_row = max_requests  # pad rows write their K/V here; never read by real tokens
        shape = (len(self.layers), 2, max_requests + 1, self.local_heads, self.max_seq_len, config.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=torch.bfloat16, device=dev)
        half = config.head_dim // 2
        self.inv_freq = config.rope_theta ** (-torch.arange(half, device=dev, dtype=torch.float32) / half)
        self.key_positions = torch.arange(self.max_seq_len, device=dev)  # masks slice it, never build it
        # Several tokens of one batch may share a KV row (a speculative verify: K + 1 per request);
        # decode attention then cannot scatter one query per cache row (_attend_in_place).
        self.queries_share_rows = False
        self._forward_tables: tuple = (None, None)  # (batch, tables) of the forward running (_tables)
        self.peak_stream_bytes = 0
        self.pending_sends: list = []  # (work, buffer) of this stage's sends in flight (pipeline.isend)
        # With an MTP draft (mtp.py) the last stage keeps each forward's whole pre-head stream, flat
        # [rows, hc * D] (all rows, before sample_idx): the draft's previous_hidden.
        self.stash_residual, self.residual = False, None

    # ------------------------------------------------------------------ sublayers
    def _row_parallel(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T; with a TP group, written straight into the communicator's partial buffer so
        the boundary op reads it without a copy."""
        if self.comm is None:
            return x @ weight.t()
        return torch.mm(x, weight.t(), out=self.comm.partial_buffer(x.shape[0]))

    def _tables(self, index: int, batch: Batch) -> dict:
        """What every layer of a forward shares, computed once at its first layer (or for a batch it
        has not seen): the rotary cos/sin [T, 1, 1, hd/2] fp32 and, on the decode path, the [T, S]
        visibility mask. Recomputed at the first layer of every forward, never carried over from
        the last one: a captured graph must record it, so that a replay recomputes it from the
        static batch's new positions. On the prefill path: the attention calls (_prefill_groups)."""
        if index == 0 or self._forward_tables[0] is not batch:
            freqs = batch.positions.float()[:, None, None, None] * self.inv_freq
            tables = {"cos": freqs.cos(), "sin": freqs.sin()}
            if batch.segments is not None:
                tables["groups"] = self._prefill_groups(batch)
            else:  # [T or cache rows, 1, 1, S] (_decode_attention)
                visible = self.key_positions < batch.seq_lens[:, None]
                if self._attend_in_place(batch):
                    rows = self.kv_cache.shape[2]
                    mask = torch.zeros((rows, visible.shape[1]), dtype=torch.bool, device=visible.device)
                    mask[:, 0] = True  # rows outside the batch see one key: outputs never read
                    mask[batch.rows] = visible
                    visible = mask
                tables["visible"] = visible[:, None, None]
            self._forward_tables = (batch, tables)
        return self._forward_tables[1]

    def attention(self, index: int, layer_input: torch.Tensor, batch: Batch) -> torch.Tensor:
        layer = self.layers[index]
        tables = self._tables(index, batch)
        T, heads, hd = layer_input.shape[0], self.local_heads, self.config.head_dim
        qkv = (layer_input @ layer["wqkv"].t()).view(T, 3, heads, hd)
        # q and k rotated, k and v into the cache at each token's (row, position): one kernel
        cache = self.kv_cache[index]
        q = glue.rope_kv_cache(qkv, tables["cos"], tables["sin"], cache, batch.rows, batch.positions)
        k_cache, v_cache = cache
        if batch.segments is None:
            out = self._decode_attention(q, k_cache, v_cache, batch, tables["visible"])
        else:
            out = self._prefill_attention(q, k_cache, v_cache, batch, tables["groups"])
        return self._row_parallel(out.reshape(T, heads * hd), layer["wo"])

    def _attend_in_place(self, batch: Batch) -> bool:
        """Decode: attend every cache row in place (queries scattered to their rows, outputs gathered
        back) rather than copy each batch row's keys and values out of the cache (a copy reads and
        writes what the attention then reads again), once the batch has at least a third as many
        rows as the cache, and never when tokens share a cache row. Decided from shapes and settings
        alone: the same in a graph and in its replays."""
        return not self.queries_share_rows and 3 * batch.input_ids.shape[0] >= self.kv_cache.shape[2]

    def _decode_attention(self, q, k_cache, v_cache, batch, visible):
        """One query per row against its request's cache row, masked to its length: fixed shapes
        and no host reads, so it records into a CUDA graph. Pad rows all share the trash row; in
        place, whichever of them lands there, their output is never used."""
        if not self._attend_in_place(batch):
            keys, values = k_cache[batch.rows], v_cache[batch.rows]  # [T, heads, S, hd]
            return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=visible).squeeze(2)
        # rows outside the batch keep whatever query the buffer holds: their outputs are never read
        query = q.new_empty((k_cache.shape[0], q.shape[1], 1, q.shape[2]))
        query[batch.rows] = q.unsqueeze(2)
        out = F.scaled_dot_product_attention(query, k_cache, v_cache, attn_mask=visible)
        return out[batch.rows].squeeze(2)

    def _prefill_groups(self, batch: Batch) -> list[tuple]:
        """The attention calls of a prefill batch, (row, first, start, total, n, length, dest) each: n
        requests from cache row ``row`` and batch row ``first``, ``total`` tokens, each request's
        queries and keys ``length`` long. A fresh prompt of at most PAD_GROUP_MAX tokens is padded to
        that length (its query i at row i of a padded block: ``dest``, computed on the device once per
        forward); consecutive fresh prompts on consecutive cache rows of one such length share one
        causal call. A short prompt's attention costs its launches, not its arithmetic, and the fixed
        length keeps each request's arithmetic the same whichever requests share its call (results
        do not depend on the batch). Pad queries see stale keys; their outputs are dropped. Later
        chunks and decode tokens: one call each."""
        short = min(PAD_GROUP_MAX, self.max_seq_len)
        groups = []  # [row, first, start, total, n, length, exact]
        for row, first, start, count in batch.segments:
            length = short if start == 0 and count <= short else count
            g = groups[-1] if groups else None
            if (
                g is not None and start == 0 and g[2] == 0 and g[5] == length
                and g[0] + g[4] == row and g[1] + g[3] == first
            ):  # fmt: skip
                g[3], g[4], g[6] = g[3] + count, g[4] + 1, g[6] and count == length
            else:
                groups.append([row, first, start, count, 1, length, count == length])
        out = []
        for row, first, start, total, n, length, exact in groups:
            dest = None
            if not exact:
                span = slice(first, first + total)
                dest = (batch.rows[span] - row) * length + batch.positions[span]
            out.append((row, first, start, total, n, length, dest))
        return out

    def _prefill_attention(self, q, k_cache, v_cache, batch, groups):
        """Causal attention per request, or per group of fresh prompts (_prefill_groups); one call
        that covers every row returns its output without a copy."""
        T = q.shape[0]
        out = None
        for row, first, start, total, n, length, dest in groups:
            end = start + length
            if dest is None:
                query = q[first : first + total]
            else:  # into a padded block: row i * length + position per query
                query = q.new_empty((n * length, *q.shape[1:]))
                query[dest] = q[first : first + total]
            # 4-D [n, heads, len, hd]: what the fused (flash / memory-efficient) SDPA kernels take
            query = query.view(n, length, *q.shape[1:]).transpose(1, 2)
            keys, values = k_cache[row : row + n, :, :end], v_cache[row : row + n, :, :end]
            if start == 0:
                res = F.scaled_dot_product_attention(query, keys, values, is_causal=True)
            else:  # a later chunk or a decode token: causal with the cached prefix in front
                mask = self.key_positions[:end] <= (start + self.key_positions[:length])[:, None]
                res = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
            res = res.transpose(1, 2).reshape(n * length, *q.shape[1:])
            if dest is not None:
                res = res[dest]
            if total == T:  # one call covered every row: no pad rows, nothing to place
                return res
            if out is None:
                out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
                out[batch.num_tokens :].zero_()  # pad rows attend to nothing
            out[first : first + total] = res
        return out

    def ffn(self, index: int, layer_input: torch.Tensor) -> torch.Tensor:
        layer = self.layers[index]
        act = glue.silu_mul(layer_input @ layer["w_gate_up"].t())
        if "router" not in layer:
            return self._row_parallel(act, layer["w_down"])
        # MoE: this rank's shard of the shared expert plus its own routed experts, one bf16 partial
        gates = moe.gates(layer_input, layer["router"], self.config.moe_top_k)
        first = layer["first_expert"]
        local = gates[:, first : first + layer["experts"][0].shape[0]]
        out = (act @ layer["w_down"].t()).float() + moe.routed_experts(
            layer_input, local, *layer["experts"], self.config.moe_top_k
        )
        if self.comm is None:
            return out.to(torch.bfloat16)
        return self.comm.partial_buffer(out.shape[0]).copy_(out)

    # ------------------------------------------------------------------ mixing boundaries
    def _pre(self, stream, site, pre_mix_in, use_sp) -> api.PreResult:
        if use_sp:
            return api.sp_pre(stream, site, self.comm, pre_mix_in=pre_mix_in)
        return api.mhc_pre(stream, site, pre_mix_in=pre_mix_in)

    def _post_pre(self, partial, stream, mixes, site, pre_mix_in, use_sp) -> api.BoundaryResult:
        if self.comm is None:
            return api.mhc_post_pre(partial, stream, mixes, site, pre_mix_in=pre_mix_in)
        boundary = api.sp_boundary if use_sp else api.tp_boundary
        return boundary(partial, stream, mixes, site, self.comm, pre_mix_in=pre_mix_in)

    def _post(self, partial, stream, mixes, use_sp) -> torch.Tensor:
        if self.comm is None:
            return api.mhc_post(partial, stream, mixes)
        if use_sp:
            return api.sp_post(partial, stream, mixes, self.comm)
        return api.tp_post(partial, stream, mixes, self.comm)

    # ------------------------------------------------------------------ forward
    def post_recv(self, num_tokens: int, padded: int, use_sp: bool) -> pipeline.Receive | None:
        """A later stage: post the receive of a forward's stream (and pre_mix) from the previous stage
        now; posting every microbatch's receive before computing the first lets each transfer overlap
        the compute of the ones before it. None on the first stage."""
        if self.first_stage:
            return None
        hc, dim = self.config.hc, self.config.hidden_size
        rows = padded // self.tp_size if use_sp and self.stage.direct_shards else num_tokens
        specs = [((rows, hc, dim), torch.bfloat16)]
        if self.delayed:
            specs.append(((rows, hc), torch.float32))
        return pipeline.Receive(specs, self.stage.world_rank(self.stage.index - 1), self.device)

    def wait_sends(self) -> None:
        """Wait for every send this stage has posted (forward leaves them in flight)."""
        pipeline.wait_sends(self.pending_sends)

    def _enter(self, batch: Batch, use_sp: bool, received: pipeline.Receive | None):
        """-> (stream, pre_mix): the embedding on the first stage, else what the previous stage sent."""
        hc = self.config.hc
        if not self.first_stage:
            padded = batch.input_ids.shape[0]
            received = (received or self.post_recv(batch.num_tokens, padded, use_sp)).wait()
            if not (use_sp and self.stage.direct_shards):
                received = pipeline.stage_entry(received, padded, use_sp, self.comm)
            return received[0], received[1] if self.delayed else None
        hidden = self.embed[batch.input_ids]
        if use_sp:  # shard the [T, D] embedding rather than the 4x larger stream: same rows
            hidden = api.sp_shard(hidden, self.comm)
        stream = hidden.unsqueeze(1).expand(-1, hc, -1).contiguous()
        pre_mix = None
        if self.delayed:  # the first site collapses with a one-hot on stream 0: exactly the embedding
            pre_mix = torch.zeros((stream.shape[0], hc), dtype=torch.float32, device=stream.device)
            pre_mix[:, 0] = 1.0
        return stream, pre_mix

    def _exit(self, stream, pre_mix, batch: Batch, use_sp: bool, head: bool):
        """Last stage: logits (or with ``head`` False the bf16 hidden) of the sampled rows; other stages:
        send the stream (and pre_mix) on."""
        if not self.last_stage:
            out = [stream] + ([pre_mix] if self.delayed else [])
            if not (use_sp and self.stage.direct_shards):
                out = pipeline.stage_exit(out, batch.num_tokens, use_sp, self.comm)
            self.pending_sends += pipeline.isend(out, self.stage.world_rank(self.stage.index + 1))
            return None
        if self.stash_residual:
            # The draft needs every token's whole stream: gather it (and pre_mix) first, then collapse
            # the full tensors: the same per-token math as collapsing the shard.
            if use_sp:
                stream = api.sp_all_gather(stream, batch.num_tokens, self.comm)
                if self.delayed:
                    pre_mix = api.sp_all_gather(pre_mix, batch.num_tokens, self.comm)
                use_sp = False
            self.residual = stream.flatten(1)
        if self.delayed:  # reference.collapse: bf16(sum_i w_i X_i) in fp32, w the last pre_mix
            hidden = (pre_mix.unsqueeze(-1) * stream.float()).sum(dim=1).to(torch.bfloat16)
        else:
            hidden = api.mhc_head(stream, self.head_mix)
        if use_sp:  # the collapse is per token: collapse the shard, then gather 1/hc of the stream's bytes
            hidden = api.sp_all_gather(hidden, batch.num_tokens, self.comm)
        if batch.sample_idx is not None:
            hidden = hidden[batch.sample_idx]
        return self.head(hidden) if head else hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm and LM head: bf16 hidden [n, D] -> fp32 logits [n, vocab]."""
        h = hidden.float()
        h = h * torch.rsqrt(h.square().mean(dim=-1, keepdim=True) + self.config.norm_eps) * self.norm_weight
        return h @ self.lm_head.t()

    def forward(
        self, batch: Batch, use_sp: bool, received: pipeline.Receive | None = None, head: bool = True
    ) -> torch.Tensor | None:
        """-> fp32 logits of the sampled rows (None on a pipeline stage before the last); with ``head``
        False their bf16 final hidden instead, for ``head`` to run on several forwards' rows. ``use_sp``
        needs a TP group and T % tp == 0. A later stage takes its input from ``received`` (post_recv)
        or, when None, receives it now; a stage before the last leaves its send in flight until
        ``wait_sends``."""
        T = batch.input_ids.shape[0]
        if use_sp and (self.comm is None or T % self.tp_size):
            raise ValueError(
                f"SP needs a TP group and a padded token count divisible by tp = {self.tp_size}, got T = {T}"
            )
        stream, pre_mix = self._enter(batch, use_sp, received)
        self.peak_stream_bytes = max(self.peak_stream_bytes, stream.numel() * stream.element_size())
        hash_ids = batch.hash_ids
        if hash_ids is not None and use_sp:  # hashed on the full sequence; the add is per token
            hash_ids = api.sp_shard(hash_ids, self.comm)
        pending: tuple[torch.Tensor, Mixes] | None = None  # (partial, mixes) of the post still to come
        for i, layer in enumerate(self.layers):
            # Each site collapses with the previous site's pre in V4.1 (pre_mix_in) or its own in V4.
            if "engram" in layer:  # post, Engram, pre: Engram sits between them
                if pending is not None:
                    stream = self._post(pending[0], stream, pending[1], use_sp)
                stream = engram.engram_add(stream, hash_ids, *layer["engram"])
                pending = None
            if pending is None:
                layer_input, mixes = self._pre(stream, layer["attn_mix"], pre_mix, use_sp)
            else:
                stream, layer_input, mixes = self._post_pre(
                    pending[0], stream, pending[1], layer["attn_mix"], pre_mix, use_sp
                )
            pre_mix = mixes.pre_mix if self.delayed else None
            partial = self.attention(i, layer_input, batch)
            stream, layer_input, mixes = self._post_pre(
                partial, stream, mixes, layer["ffn_mix"], pre_mix, use_sp
            )
            pre_mix = mixes.pre_mix if self.delayed else None
            pending = (self.ffn(i, layer_input), mixes)
        stream = self._post(pending[0], stream, pending[1], use_sp)
        return self._exit(stream, pre_mix, batch, use_sp, head)
