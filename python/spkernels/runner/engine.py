"""Scheduling, padding and CUDA graphs around a Model: tokens in, greedy tokens out.

Each step schedules decode tokens first, then prefill chunks up to ``max_tokens_per_step``. The
SPPolicy pads the step (a pure-decode batch to a capture size, an SP forward to a multiple of tp)
and decides SP vs TP from the padded count alone. Pure-decode steps whose padded count was captured
replay a CUDA graph (FULL_DECODE_ONLY); everything else runs eagerly. The schedule depends only on
lengths, never on token values, so every rank runs the same steps in lock-step.

With ``microbatches`` M > 1 a step's requests are split into up to M contiguous groups of whole
requests, each its own forward with its own padded count and SP decision; with pipeline stages the
forwards overlap (pipeline.py). A request's tokens never straddle two forwards and all forwards of a
step take the step's attention path (decode or prefill), so each request sees exactly what it would
in one forward. A step of N tokens is split into at most N // ``microbatch_min_tokens`` forwards (at
least one): every forward costs the host a fixed time to enqueue, and a stage whose microbatches are
too small to keep the GPU busy for that long is host-bound, so splitting it only adds forwards. Small
steps, pure decode steps in particular, run as one forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..policy import SPPolicy
from . import engram, pipeline
from .model import Batch, Model
from .profile import STEP_RANGE

# A forward costs the host a fixed time to enqueue and the GPU a time per token. Eagerly, on the H200
# machine, v4-flash-like's 2 layers per stage take the host ~2 ms (PP2 decode: 4.66 ms per step of
# 8 tokens) and the GPU a few us per prefill token: below ~1k tokens a microbatch's GPU time does not
# cover the next one's enqueue. An estimate from those runs, not a sweep (--microbatch-min-tokens).
MICROBATCH_MIN_TOKENS = 1024


@dataclass
class Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new_tokens

    @property
    def decoding(self) -> bool:
        return self.num_computed >= len(self.prompt)

    @property
    def decode_tokens(self) -> int:
        """Tokens a decode step feeds for this request: its last token (and, speculating, its drafts)."""
        return 1


@dataclass
class StepInfo:
    """One step. With microbatches: ``padded`` sums the forwards' padded counts, ``use_sp`` is whether
    any forward ran SP, ``graph`` whether all replayed a graph (ForwardInfo has each forward)."""

    num_tokens: int
    padded: int
    use_sp: bool
    graph: bool
    prefill_tokens: int
    seconds: float


@dataclass
class ForwardInfo:
    step: int  # index into Engine.steps
    num_tokens: int
    padded: int
    use_sp: bool
    graph: bool
    prefill_tokens: int


def schedule(requests: list[Request], budget: int) -> list[tuple[Request, int]]:
    """[(request, token count)]: each decoding request's decode tokens, then prompt chunks, within
    budget."""
    entries = []
    for req in requests:
        count = req.decode_tokens
        if not req.done and req.decoding and budget >= count:
            entries.append((req, count))
            budget -= count
    for req in requests:
        if not req.decoding and budget > 0:
            count = min(len(req.prompt) - req.num_computed, budget)
            entries.append((req, count))
            budget -= count
    return entries


def split_microbatches(
    entries: list[tuple[Request, int]], num_microbatches: int, min_tokens: int = 1
) -> list[list]:
    """Up to ``num_microbatches`` contiguous groups of whole entries, and no more than the entries'
    tokens // ``min_tokens`` (at least one), balanced by token count: each entry joins the group its
    middle token falls in (fewer groups when there are fewer entries)."""
    total = sum(count for _, count in entries)
    num_microbatches = max(1, min(num_microbatches, total // min_tokens))
    groups = [[] for _ in range(num_microbatches)]
    done = 0
    for entry in entries:
        count = entry[1]
        groups[min(num_microbatches - 1, (2 * done + count) * num_microbatches // (2 * total))].append(entry)
        done += count
    return [group for group in groups if group]


class Engine:
    request_class = Request
    lookahead = 0  # positions past a request's last token that a step may write (speculative drafts)

    def __init__(
        self,
        model: Model,
        policy: SPPolicy,
        max_tokens_per_step: int,
        record_logits=False,
        check_graphs=False,
        log=None,
        microbatches: int = 1,
        microbatch_min_tokens: int = MICROBATCH_MIN_TOKENS,
        meet=None,
    ):
        if policy.tp_size != model.tp_size:
            raise ValueError(f"policy.tp_size = {policy.tp_size} but the model runs on tp = {model.tp_size}")
        if not isinstance(max_tokens_per_step, int) or max_tokens_per_step < 1:
            raise ValueError(f"max_tokens_per_step must be a positive int, got {max_tokens_per_step!r}")
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise ValueError(
                f"microbatches must be an int >= 1 (1: each step is one forward), got {microbatches!r}"
            )
        if type(microbatch_min_tokens) is not int or microbatch_min_tokens < 1:
            raise ValueError(f"microbatch_min_tokens must be a positive int, got {microbatch_min_tokens!r}")
        self.model, self.policy, self.max_tokens_per_step = model, policy, max_tokens_per_step
        self.microbatches, self.microbatch_min_tokens = microbatches, microbatch_min_tokens
        self.device = model.device
        # Where a step's clock starts: every rank's device drained and the ranks met (launch passes
        # one for a distributed model), else this device drained. Without the meeting a rank that
        # ended its last step early counts its peers' lag as its own time (its first collective
        # waits for them).
        self.meet = meet or self._sync
        self.record_logits, self.check_graphs, self.log = record_logits, check_graphs, log
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Batch, torch.Tensor]] = {}
        self.graph_max_diff = 0.0
        self.steps: list[StepInfo] = []
        self.forwards: list[ForwardInfo] = []
        # Profiled runs (launch sets it): each timed step inside a record_function range named for its
        # kind, so the profile splits wall and GPU time by prefill / decode (profile.by_step_kind).
        self.label_steps = False

    # ------------------------------------------------------------------ batches
    def _tensor(self, values):
        # From pageable memory a CUDA copy waits for the stream to drain, i.e. for every forward already
        # enqueued; from pinned memory it is queued like a kernel, so the host goes on building the next
        # microbatch while the GPU runs this one.
        t = torch.tensor(values, dtype=torch.int64)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def _pad_batch(self, padded: int) -> Batch:
        """A pure-pad decode batch: the static inputs of a graph before the first replay."""
        m = self.model
        full = lambda v: torch.full((padded,), v, dtype=torch.int64, device=self.device)  # noqa: E731
        batch = Batch(full(m.pad_id), full(0), full(m.trash_row), full(1), padded, None, None)
        if m.config.engram_layers:
            batch.hash_ids = torch.stack([full(m.config.engram_table_size)] * len(m.config.engram_orders), 1)
        return batch

    def build_batch(self, entries, padded: int, decode: bool) -> tuple[Batch, list[tuple[Request, int]]]:
        """The step's Batch and [(request, batch row)] of the rows to sample."""
        m = self.model
        cfg = m.config
        ids, positions, rows, seq_lens, segments, samples, hashes = [], [], [], [], [], [], []
        for req, count in entries:
            start, first = req.num_computed, len(ids)
            ids += req.tokens[start : start + count]
            positions += range(start, start + count)
            rows += [req.index] * count
            seq_lens += range(start + 1, start + count + 1)
            segments.append((req.index, first, start, count))
            if cfg.engram_layers:  # over the request's whole history, before any sharding
                span = range(start, start + count)
                hashes += engram.hash_ids(req.tokens, span, cfg.engram_orders, cfg.engram_table_size)
            if start + count == len(req.tokens):
                samples.append((req, len(ids) - 1))
        num_tokens, pad = len(ids), padded - len(ids)
        # One host-to-device copy for the four per-token inputs: it sits on every decode step.
        columns = [
            ids + [m.pad_id] * pad,
            positions + [0] * pad,
            rows + [m.trash_row] * pad,
            seq_lens + [1] * pad,
        ]
        if cfg.engram_layers:  # pad rows hash to the tables' zero row
            hashes += [[cfg.engram_table_size] * len(cfg.engram_orders)] * pad
            columns += [list(col) for col in zip(*hashes, strict=True)]
        packed = self._tensor(columns)
        input_ids, positions_t, rows_t, seq_lens_t = packed[:4].unbind(0)
        batch = Batch(
            input_ids=input_ids,
            positions=positions_t,
            rows=rows_t,
            seq_lens=seq_lens_t,
            num_tokens=num_tokens,
            segments=None if decode else segments,
            sample_idx=None if decode else self._tensor([row for _, row in samples]),
            hash_ids=packed[4:].t().contiguous() if cfg.engram_layers else None,
        )
        return batch, samples

    # ------------------------------------------------------------------ graphs
    def capture(self, max_batch: int) -> None:
        """Capture one FULL_DECODE_ONLY graph per capture size a decode batch of at most ``max_batch``
        requests can land on; largest first so the smaller ones reuse its memory pool."""
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need --device cuda")
        if self.microbatches > 1:
            raise ValueError("CUDA graphs replay whole decode steps: they need microbatches = 1")
        largest = self.policy.graph_size(max_batch, True) or self.policy.max_capture_size
        sizes = [s for s in self.policy.capture_sizes if s <= largest]
        pool = None
        for padded in sorted(sizes, reverse=True):
            use_sp = self.policy.use_sp(padded)
            static = self._pad_batch(padded)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside capture: lazy inits, workspaces
                for _ in range(2):
                    self.model.forward(static, use_sp)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model.forward(static, use_sp)
            pool = graph.pool()
            self.graphs[padded] = (graph, static, logits)
            if self.log:
                self.log(f"captured decode graph T={padded} ({'SP' if use_sp else 'TP'})")
        torch.cuda.synchronize()

    def _replay(self, batch: Batch) -> torch.Tensor:
        graph, static, logits = self.graphs[batch.input_ids.shape[0]]
        for name in ("input_ids", "positions", "rows", "seq_lens", "hash_ids"):
            if getattr(batch, name) is not None:
                getattr(static, name).copy_(getattr(batch, name))
        graph.replay()
        return logits

    # ------------------------------------------------------------------ stepping
    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _forward(self, batch: Batch, use_sp: bool, graph: bool, received) -> torch.Tensor | None:
        """-> a replay's logits, an eager forward's final hidden (Model.head to come), or None."""
        if not graph:
            return self.model.forward(batch, use_sp, received, head=False)
        if self.check_graphs:  # eager first: the replay then leaves its own K/V in the cache
            eager = self.model.forward(batch, use_sp)[: batch.num_tokens]
            logits = self._replay(batch)
            diff = (logits[: batch.num_tokens] - eager).abs().max().item()
            self.graph_max_diff = max(self.graph_max_diff, diff)
            return logits
        return self._replay(batch)

    def step(self, requests: list[Request]) -> StepInfo:
        entries = schedule(requests, self.max_tokens_per_step)
        decode = all(req.decoding for req, _ in entries)  # every microbatch takes the step's path
        forwards = []  # ForwardInfo and entries per microbatch
        for group in split_microbatches(entries, self.microbatches, self.microbatch_min_tokens):
            num_tokens = sum(count for _, count in group)
            padded = self.policy.pad(num_tokens, decode)
            use_sp, graph = self.policy.use_sp(padded), decode and padded in self.graphs
            forwards.append((ForwardInfo(len(self.steps), num_tokens, padded, use_sp, graph, decode), group))
        m = self.model
        self.meet()
        begin = time.perf_counter()
        label = None
        if self.label_steps:
            label = torch.profiler.record_function(STEP_RANGE + ("decode" if decode else "prefill"))
            label.__enter__()
        # A later stage posts every forward's receive first: microbatch k + 1's activations then
        # arrive while it computes microbatch k (and the stage before it computes k + 2).
        receives = [m.post_recv(f.num_tokens, f.padded, f.use_sp) for f, _ in forwards]
        samples, hidden, logits = [], [], None
        for (f, group), received in zip(forwards, receives, strict=True):
            # Built right before its forward (Engram hashes included), while the GPU runs the last one.
            batch, batch_samples = self.build_batch(group, f.padded, decode)
            out = self._forward(batch, f.use_sp, f.graph, received)
            samples += batch_samples
            if out is None:  # a stage before the last
                continue
            out = out[: len(batch_samples)]  # a decode forward returns every padded row
            if f.graph:  # graphs imply one forward per step (capture refuses microbatches)
                logits = out
            else:
                hidden.append(out)
        m.wait_sends()
        if hidden:
            # One LM head over every forward's sampled rows: the same rows in the same order as one
            # forward, so microbatching leaves even the fp32 logits bitwise unchanged (a GEMM's
            # rounding may depend on its row count).
            logits = m.head(hidden[0] if len(hidden) == 1 else torch.cat(hidden))
        if m.stage is not None and m.stage.pp_size > 1:
            # only the last stage has logits: its tokens (and logits) go to every rank
            next_ids, logits = pipeline.share_samples(
                m.stage, logits, len(samples), m.config.vocab_size, self.device, self.record_logits
            )
        else:
            next_ids = logits.argmax(dim=-1).tolist()
        self._sync()
        if label is not None:
            label.__exit__(None, None, None)
        seconds = time.perf_counter() - begin
        prefill = sum(count for req, count in entries if not req.decoding)
        for req, count in entries:
            req.num_computed += count
        for j, (req, _) in enumerate(samples):
            req.generated.append(next_ids[j])
            if self.record_logits:
                req.logits.append(logits[j].float().cpu())
        forwards = [f for f, _ in forwards]
        self.forwards += forwards
        info = StepInfo(
            sum(f.num_tokens for f in forwards),
            sum(f.padded for f in forwards),
            any(f.use_sp for f in forwards),
            all(f.graph for f in forwards),
            prefill,
            seconds,
        )
        self.steps.append(info)
        return info

    def generate(self, prompts: list[list[int]], max_new_tokens: int, progress=None) -> list[Request]:
        if len(prompts) > self.model.trash_row:
            raise ValueError(f"{len(prompts)} requests but the KV cache holds {self.model.trash_row}")
        longest = max(len(p) for p in prompts) + max_new_tokens + self.lookahead
        if longest > self.model.max_seq_len:
            raise ValueError(
                f"a request needs {longest} positions but the KV cache holds "
                f"max_seq_len = {self.model.max_seq_len}"
            )
        requests = [self.request_class(i, list(p), max_new_tokens) for i, p in enumerate(prompts)]
        while not all(req.done for req in requests):
            info = self.step(requests)
            if self.log:
                forwards = [f for f in self.forwards if f.step == len(self.steps) - 1]
                parts = ", ".join(
                    f"T={f.padded} {'SP' if f.use_sp else 'TP'} {'graph' if f.graph else 'eager'}"
                    for f in forwards
                )
                split = f" in {len(forwards)} microbatches" if len(forwards) > 1 else ""
                self.log(
                    f"step {len(self.steps)}: {info.num_tokens} tokens (prefill {info.prefill_tokens})"
                    f"{split} -> {parts} {info.seconds * 1e3:.2f} ms"
                )
            if progress:
                progress(sum(len(r.generated) for r in requests))
        return requests

    def _decode_tokens(self, steps: list[StepInfo]) -> int:
        """Tokens generated by decode steps: one per request per step."""
        return sum(s.num_tokens for s in steps)

    def stats(self) -> dict:
        prefill = [s for s in self.steps if s.prefill_tokens]
        decode = [s for s in self.steps if not s.prefill_tokens]
        prefill_s, decode_s = sum(s.seconds for s in prefill), sum(s.seconds for s in decode)
        return {
            "steps": len(self.steps),
            "microbatches": len(self.forwards),  # forwards run; up to --microbatches per step
            "max_microbatches": self.microbatches,
            "seconds": sum(s.seconds for s in self.steps),
            "sp_steps": sum(s.use_sp for s in self.steps),
            "graph_steps": sum(s.graph for s in self.steps),
            "prefill_tokens": sum(s.prefill_tokens for s in prefill),
            "prefill_tokens_per_s": sum(s.prefill_tokens for s in prefill) / prefill_s if prefill_s else 0.0,
            "decode_steps": len(decode),
            "decode_ms_per_step": 1e3 * sum(s.seconds for s in decode) / len(decode) if decode else 0.0,
            "decode_tokens_per_s": self._decode_tokens(decode) / decode_s if decode_s else 0.0,
            "graph_max_diff": self.graph_max_diff,
            "peak_stream_bytes": self.model.peak_stream_bytes,
        }
