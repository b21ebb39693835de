"""Pipeline stages: contiguous layer ranges, one TP(+SP) group per stage, activations between stages.

World rank ``s * tp + r`` is TP rank r of stage s. At a stage's exit the stream (and, in V4.1's
delayed mode, the pre_mix the next site collapses with) goes to the next stage's rank r with
``torch.distributed`` send/recv (gloo on CPU, NCCL on GPU). Under SP the exit gathers both and trims
them to the true token count, and the entry pads them back to the step's padded count and shards
them (docs/contract.md), so the wire carries no pad rows and the two stages need not agree on a layout.
With ``direct_shards`` (both stages have the same tp, always true here) an SP step instead sends each
rank's shard straight to its peer: the same padded count and tp give the same shard layout, so the
result is bitwise identical and the gather, trim, pad and shard disappear. The last stage samples;
its tokens (and logits, when recorded) are broadcast to every rank, which all run the same schedule
in lock-step.

Microbatches (engine.py) make the stages overlap, GPipe-style: every stage runs a step's microbatches
in order, sends are non-blocking (``isend``; drained at the end of the step) and a later stage posts
every microbatch's receive before it computes the first, so stage s works on microbatch k while
stage s + 1 works on k - 1. Both backends match the point-to-point messages between two ranks in
posting order, and both sides post them in microbatch order, so no tags are needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import api


def stage_layers(num_layers: int, pp_size: int, stage: int) -> range:
    """Stage ``stage``'s layers: contiguous, sizes differing by at most one (earlier stages smaller)."""
    return range(stage * num_layers // pp_size, (stage + 1) * num_layers // pp_size)


@dataclass(frozen=True)
class Stage:
    index: int
    pp_size: int
    tp_size: int
    tp_rank: int
    layers: range
    direct_shards: bool = False  # SP steps: send each shard to the peer rank, no gather / re-shard

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.pp_size - 1

    def world_rank(self, stage: int) -> int:
        """This rank's peer (same TP rank) in ``stage``."""
        return stage * self.tp_size + self.tp_rank


def make_stage(rank: int, tp_size: int, pp_size: int, num_layers: int, direct_shards: bool = False):
    """-> (Stage, this stage's process group or None for tp = 1). Collective over the world group:
    every rank creates every stage's group, in the same order."""
    stage, tp_rank = divmod(rank, tp_size)
    group = None
    if tp_size > 1:
        for s in range(pp_size):
            g = dist.new_group(ranks=list(range(s * tp_size, (s + 1) * tp_size)))
            if s == stage:
                group = g
    layers = stage_layers(num_layers, pp_size, stage)
    return Stage(stage, pp_size, tp_size, tp_rank, layers, direct_shards), group


# ----------------------------------------------------------------------------- stage boundary
def stage_exit(tensors: list[torch.Tensor], num_tokens: int, use_sp: bool, comm) -> list[torch.Tensor]:
    """Per-token tensors [T(_local), ...] -> the first ``num_tokens`` rows of the full tensors."""
    if use_sp:
        return [api.sp_all_gather(t.contiguous(), num_tokens, comm) for t in tensors]
    return [t[:num_tokens].contiguous() for t in tensors]


def stage_entry(tensors: list[torch.Tensor], padded: int, use_sp: bool, comm) -> list[torch.Tensor]:
    """The inverse of stage_exit for a step of ``padded`` rows: zero pad rows, then this rank's
    shard under SP (padded is a multiple of tp there, so every rank gets padded / tp rows)."""
    out = []
    for t in tensors:
        full = t.new_zeros((padded, *t.shape[1:]))
        full[: t.shape[0]] = t
        out.append(api.sp_shard(full, comm) if use_sp else full)
    return out


# ----------------------------------------------------------------------------- point to point
def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    # gloo's send/recv does not take every dtype (bf16): move raw bytes, which both backends carry.
    return t.contiguous().view(torch.uint8).reshape(-1)


class Receive:
    """Receives posted now (``irecv``) into fresh tensors of the given (shape, dtype)s; ``wait()``
    returns them once they have arrived."""

    def __init__(self, specs: list[tuple[tuple[int, ...], torch.dtype]], src: int, device):
        self.tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
        self.works = [dist.irecv(_as_bytes(t), src) for t in self.tensors]  # views: irecv fills t

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.tensors


def isend(tensors: list[torch.Tensor], dst: int) -> list[tuple[dist.Work, torch.Tensor]]:
    """Non-blocking sends; -> (work, buffer) pairs: the buffers must live until the works are waited on
    (``wait_sends``), so the next microbatch's compute overlaps the transfer."""
    out = []
    for t in tensors:
        buf = _as_bytes(t)
        out.append((dist.isend(buf, dst), buf))
    return out


def wait_sends(sends: list[tuple[dist.Work, torch.Tensor]]) -> None:
    for work, _ in sends:
        work.wait()
    sends.clear()


def share_samples(
    stage: Stage, logits: torch.Tensor | None, count: int, vocab_size: int, device, record: bool
):
    """The last stage's greedy tokens (and fp32 logits when ``record``) for the ``count`` sampled
    rows, on every rank: -> (token list, logits [count, vocab] or None)."""
    src = stage.world_rank(stage.pp_size - 1) - stage.tp_rank  # TP rank 0 of the last stage
    ids = torch.empty(count, dtype=torch.int64, device=device)
    if stage.last:
        logits = logits[:count].float().contiguous()
        ids.copy_(logits.argmax(dim=-1))
    dist.broadcast(ids, src)
    if record:
        if not stage.last:
            logits = torch.empty((count, vocab_size), dtype=torch.float32, device=device)
        dist.broadcast(logits, src)
    return ids.tolist(), logits
