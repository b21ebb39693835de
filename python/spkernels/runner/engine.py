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

Overlap (the default where it applies): because the schedule never looks at token values, step n + 1
is scheduled, built and enqueued while the GPU still runs step n. A step's greedy tokens stay on the
device (a decode input not yet on the host is gathered there from the previous step's ids, and its
Engram n-grams, hashed on the host up to that token, are completed there with it) and reach the
host through a non-blocking copy that the host reads only after enqueuing the next step, so the GPU
does not idle while the host builds a batch or reads tokens. It needs a schedule that ignores token
values (not SpeculativeEngine's) and sampling on every rank (pp = 1); elsewhere, and with
``overlap=False``, each step runs synchronously: devices drained and ranks met, build, forward,
tokens read.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch

from ..policy import SPPolicy
from . import engram, pipeline
from .model import Batch, Model
from .profile import STEP_RANGE

# A generated token the host has not read yet (overlap): its value is on the device, among the ids
# its step sampled. Token ids are never negative.
PENDING = -1

# A forward costs the host a fixed time to enqueue and the GPU a time per token. Eagerly, on the H200
# machine, v4-flash-like's 2 layers per stage take the host ~2 ms (PP2 decode: 4.66 ms per step of
# 8 tokens) and the GPU a few us per prefill token: below ~1k tokens a microbatch's GPU time does not
# cover the next one's enqueue. An estimate from those runs, not a sweep (--microbatch-min-tokens).
MICROBATCH_MIN_TOKENS = 1024


def capture_graph(forward, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """``forward()`` captured into a CUDA graph (in memory pool ``pool``), after two warm-up calls on a
    side stream (lazy inits, workspaces). Python's garbage collector runs before the capture and is
    paused during it: torch.cuda.graph no longer collects first (torch.compiler.config
    .force_cudagraph_gc), and a collection inside the capture that frees an earlier engine's graphs
    destroys them mid-capture, which CUDA forbids: it invalidates the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
    finally:
        if enabled:
            gc.enable()
    return graph, out


@dataclass
class Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    # The prompt as an int64 tensor, made when the request arrives: a step slices its chunks from it
    # rather than turning thousands of Python ints into a tensor while the GPU waits.
    prompt_ids: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        self.prompt_ids = torch.tensor(self.prompt, dtype=torch.int64)

    def _parts(self) -> tuple[list[int], ...]:
        """The token history's lists, oldest first."""
        return self.prompt, self.generated

    def token_span(self, start: int, end: int) -> list[int]:
        """The history's tokens [start, end), without building the history: a step reads a request's
        last few tokens, and a long context's history is a long list to copy every step."""
        out = []
        for part in self._parts():
            n = len(part)
            if start < n and end > 0:
                out += part[start if start > 0 else 0 : end]
            start -= n
            end -= n
        return out

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
    any forward ran SP, ``graph`` whether all replayed a graph (ForwardInfo has each forward).
    ``seconds``: synchronous, from the step's start (devices drained, ranks met) to its tokens on the
    host; overlapped, from the previous step's completion (the first step: from the meeting) to its
    own, so the steps' times add up to the generation's."""

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


@dataclass
class InFlight:
    """An overlapped step whose tokens are still on their way to the host."""

    info: StepInfo
    kind: str  # its profile range: "prefill" or "decode"
    ids: torch.Tensor  # the sampled ids on the device, one per sample
    host_ids: torch.Tensor  # their host copy (pinned; on cpu the ids themselves)
    host_logits: torch.Tensor | None  # record_logits: the sampled rows' fp32 logits on the host
    samples: list[tuple[Request, int]]  # (request, index of its PENDING token in generated)
    sample_of: dict[int, int]  # request index -> its row of ids
    done: torch.cuda.Event | None  # recorded after the copies; None on cpu (done when enqueued)
    completed: bool = False  # its clock stopped and its profile range closed


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
    schedule_ignores_tokens = True  # what overlap needs (module docstring); not speculative decoding's

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
        overlap: bool = True,
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
        self._range = None  # the open step range
        # Overlap step n + 1's host work with step n's device work (module docstring): where the
        # schedule ignores token values and the last stage samples on every rank.
        pp = model.stage.pp_size if model.stage is not None else 1
        self.overlap = overlap and self.schedule_ignores_tokens and pp == 1
        self.inflight: list[InFlight] = []  # oldest first; at most one between steps
        self._clock = 0.0  # overlap: when the last completed step completed

    # ------------------------------------------------------------------ batches
    # From pageable memory a CUDA copy waits for the stream to drain, i.e. for every forward already
    # enqueued; from pinned memory it is queued like a kernel, so the host goes on building the next
    # microbatch while the GPU runs this one: host inputs are made pinned.
    def _host(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, pin_memory=self.device.type == "cuda")

    def _tensor(self, values):
        return self._to_device(self._host(values))

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def _pad_batch(self, padded: int) -> Batch:
        """A pure-pad decode batch: the static inputs of a graph before the first replay."""
        m = self.model
        full = lambda v: torch.full((padded,), v, dtype=torch.int64, device=self.device)  # noqa: E731
        batch = Batch(full(m.pad_id), full(0), full(m.trash_row), full(1), padded, None, None)
        if m.config.engram_layers:
            batch.hash_ids = torch.stack([full(m.config.engram_table_size)] * len(m.config.engram_orders), 1)
        return batch

    def build_batch(self, entries, padded: int, decode: bool) -> tuple[Batch, list[tuple[Request, int]]]:
        """The step's Batch and [(request, batch row)] of the rows to sample. A prompt chunk's inputs are
        written as ranges (its ids sliced from the request's prompt tensor, its Engram hashes for all
        its tokens at once), the other tokens' one by one from lists; every input goes to the device in
        one copy. A decode token that is still PENDING is taken on the device from the ids of the step
        in flight that sampled it, and its Engram hashes are completed there."""
        m = self.model
        cfg = m.config
        # Engram: each token's hashes over its request's history, before any sharding; n-grams ending
        # at positions [start, end) need the request's tokens from start - (width - 1) on (width 1:
        # a row's own tokens only, without Engram).
        orders, table_size = cfg.engram_orders, cfg.engram_table_size
        num_hashes, width = (len(orders), max(orders)) if cfg.engram_layers else (0, 1)
        chunks = []  # (first batch row, request, first position, count) per prompt chunk
        # the other rows' inputs, one by one: ids, positions, cache rows, context lengths, hashes
        listed = [[] for _ in range(4 + num_hashes)]
        ids, positions, rows, seq_lens = listed[:4]
        spans = []  # (first batch row, count) of each request's listed rows
        segments, samples = [], []
        take = []  # (batch row, row of the in-flight step's ids) per PENDING token
        n = 0
        for req, count in entries:
            start, end = req.num_computed, req.num_computed + count
            segments.append((req.index, n, start, count))
            if start < end <= len(req.prompt):  # a prompt chunk: sampled where it ends the prompt
                chunks.append((n, req, start, count))
                sampled = end == len(req.prompt)
            else:
                origin = max(0, start - width + 1)  # the position of history[0]
                history = req.token_span(origin, end + 1)  # and the token after the row's, if any
                sampled = len(history) == end - origin  # none: the request's last token
                del history[end - origin :]
                tokens = history[start - origin :]
                ids += tokens
                positions += range(start, end)
                rows += [req.index] * count
                seq_lens += range(start + 1, end + 1)
                pending = count > 0 and tokens[-1] == PENDING  # only a request's last token can be
                if pending:
                    take.append((n + count - 1, self.inflight[-1].sample_of[req.index]))
                if num_hashes:  # a PENDING token's n-grams left open, closed on the device
                    span = range(start - origin, end - origin - pending)
                    hashed = engram.hash_ids(history, span, orders, table_size)
                    if pending:
                        hashed.append(engram.open_hashes(history, end - 1 - origin, orders))
                    for k, column in enumerate(zip(*hashed, strict=True)):
                        listed[4 + k] += column
                spans.append((n, count))
            n += count
            if sampled:
                samples.append((req, n - 1))
        # One block, one copy to the device: rows 0-3 the per-token inputs, then the Engram hashes, the
        # PENDING tokens' gather (row i, or padded + its row of the in-flight ids) and the sampled rows,
        # where the step has them.
        gather_row = 4 + num_hashes
        pad = padded - n
        if pad:  # pad rows (hashing to the tables' zero row): listed after the rest
            for values, value in zip(
                listed, [m.pad_id, 0, m.trash_row, 1] + [table_size] * num_hashes, strict=True
            ):
                values += [value] * pad
            spans.append((n, pad))
        if not chunks:  # decode rows only, a few per request: the block from lists in one host op
            if take:
                source = list(range(padded))
                for row, j in take:
                    source[row] = padded + j
                listed.append(source)
            if not decode:
                listed.append([row for _, row in samples] + [0] * (padded - len(samples)))
            packed = self._host(listed)
        else:  # prompt chunks written as ranges into a pinned block, the listed rows copied run by run
            packed = torch.empty(
                (gather_row + bool(take) + (not decode), padded),
                dtype=torch.int64,
                pin_memory=self.device.type == "cuda",
            )
            for row, req, start, count in chunks:
                span = slice(row, row + count)
                packed[0, span] = req.prompt_ids[start : start + count]
                torch.arange(start, start + count, out=packed[1, span])
                packed[2, span] = req.index
                torch.arange(start + 1, start + count + 1, out=packed[3, span])

            def put(rows: slice, values: torch.Tensor, spans) -> None:
                """values' columns, in order, into the batch rows [row, row + count) of each span,
                consecutive spans copied as one."""
                runs = spans[:1]
                for row, count in spans[1:]:
                    last_row, last_count = runs[-1]
                    if last_row + last_count == row:
                        runs[-1] = (last_row, last_count + count)
                    else:
                        runs.append((row, count))
                done = 0
                for row, count in runs:
                    packed[rows, row : row + count] = values[:, done : done + count]
                    done += count

            if num_hashes:  # every chunk's n-gram windows hashed in one go (a few dozen ops per call)
                grams = [
                    engram.windows(req.prompt_ids[max(0, start - width + 1) : start + count], start, width)
                    for _, req, start, count in chunks
                ]
                hashed = engram.hash_windows(torch.cat(grams), orders, table_size).t()
                put(slice(4, gather_row), hashed, [(row, count) for row, _, _, count in chunks])
            if spans:
                put(slice(0, gather_row), torch.tensor(listed, dtype=torch.int64), spans)
            if take:
                torch.arange(padded, out=packed[gather_row])
                at, sources = torch.tensor([(row, padded + j) for row, j in take]).t()
                packed[gather_row, at] = sources
            if not decode:
                packed[-1, : len(samples)] = torch.tensor([row for _, row in samples])
        on_device = self._to_device(packed)
        input_ids, positions_t, rows_t, seq_lens_t = on_device[:4].unbind(0)
        hash_ids = on_device[4:gather_row].t() if num_hashes else None
        if take:
            source = on_device[gather_row]
            input_ids = torch.cat((input_ids, self.inflight[-1].ids))[source]
            if num_hashes:
                closed = engram.close_hashes(hash_ids, input_ids, table_size)
                hash_ids = torch.where((source >= padded)[:, None], closed, hash_ids)
        batch = Batch(
            input_ids=input_ids,
            positions=positions_t,
            rows=rows_t,
            seq_lens=seq_lens_t,
            num_tokens=n,
            segments=None if decode else segments,
            sample_idx=None if decode else on_device[-1, : len(samples)],
            hash_ids=hash_ids.contiguous() if num_hashes else None,
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
            graph, logits = capture_graph(lambda s=static, u=use_sp: self.model.forward(s, u), pool)
            pool = graph.pool()
            self.graphs[padded] = (graph, static, logits)
            if self.log:
                self.log(f"captured decode graph T={padded} ({'SP' if use_sp else 'TP'})")
        torch.cuda.synchronize()

    def _replay(self, batch: Batch) -> torch.Tensor:
        graph, static, logits = self.graphs[batch.input_ids.shape[0]]
        # One multi-tensor copy kernel for the inputs, not one copy each: it sits on every decode step.
        names = ("input_ids", "positions", "rows", "seq_lens", "hash_ids")
        names = [n for n in names if getattr(batch, n) is not None]
        torch._foreach_copy_([getattr(static, n) for n in names], [getattr(batch, n) for n in names])
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

    def _plan(self, requests: list[Request]):
        """-> (entries, decode, [(ForwardInfo, entries)] per microbatch) of the next step."""
        entries = schedule(requests, self.max_tokens_per_step)
        decode = all(req.decoding for req, _ in entries)  # every microbatch takes the step's path
        forwards = []
        for group in split_microbatches(entries, self.microbatches, self.microbatch_min_tokens):
            num_tokens = sum(count for _, count in group)
            padded = self.policy.pad(num_tokens, decode)
            use_sp, graph = self.policy.use_sp(padded), decode and padded in self.graphs
            forwards.append((ForwardInfo(len(self.steps), num_tokens, padded, use_sp, graph, decode), group))
        return entries, decode, forwards

    def _run(self, forwards, decode: bool):
        """Enqueue the step's forwards and LM head: -> (fp32 logits of the sampled rows, None on a stage
        before the last; [(request, batch row)] of the sampled rows)."""
        m = self.model
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
        return logits, samples

    def _record(self, entries, forwards, seconds: float) -> StepInfo:
        """Count the step's tokens as computed; keep its StepInfo and ForwardInfos."""
        prefill = sum(count for req, count in entries if not req.decoding)
        for req, count in entries:
            req.num_computed += count
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

    def _label(self, kind: str | None) -> None:
        """Close the open step range; open one for a step of ``kind`` (None: none) when profiled."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if kind is not None and self.label_steps:
            self._range = torch.profiler.record_function(STEP_RANGE + kind)
            self._range.__enter__()

    def step(self, requests: list[Request]) -> StepInfo:
        """Schedule, run and sample one step. Overlapped, the step stays in flight (its tokens PENDING,
        its ``seconds`` not known yet) and the one before it is resolved; ``finish`` resolves the last."""
        if self.overlap:
            return self._step_overlapped(requests)
        entries, decode, forwards = self._plan(requests)
        m = self.model
        self.meet()
        begin = time.perf_counter()
        self._label("decode" if decode else "prefill")
        logits, samples = self._run(forwards, decode)
        if m.stage is not None and m.stage.pp_size > 1:
            # only the last stage has logits: its tokens (and logits) go to every rank
            next_ids, logits = pipeline.share_samples(
                m.stage, logits, len(samples), m.config.vocab_size, self.device, self.record_logits
            )
        else:
            next_ids = logits.argmax(dim=-1).tolist()
        self._sync()
        self._label(None)
        info = self._record(entries, forwards, time.perf_counter() - begin)
        for j, (req, _) in enumerate(samples):
            req.generated.append(next_ids[j])
            if self.record_logits:
                req.logits.append(logits[j].float().cpu())
        return info

    # ------------------------------------------------------------------ overlap
    def _step_overlapped(self, requests: list[Request]) -> StepInfo:
        self._poll()
        entries, decode, forwards = self._plan(requests)
        kind = "decode" if decode else "prefill"
        if not self.inflight:  # a fresh start: the clock starts where a synchronous step's does
            self.meet()
            self._clock = time.perf_counter()
        if self._range is None:  # else the range of the step in flight goes on until it completes
            self._label(kind)
        logits, samples = self._run(forwards, decode)
        ids = logits.argmax(dim=-1)  # stays on the device: the next step's decode inputs
        host_ids, host_logits, done = ids, logits.float() if self.record_logits else None, None
        if self.device.type == "cuda":
            # Copies to pinned memory, queued behind the step like a kernel; read once the next step
            # is enqueued (a blocking read now would wait for it all).
            host_ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host_ids.copy_(ids, non_blocking=True)
            if host_logits is not None:
                pinned = torch.empty(host_logits.shape, dtype=torch.float32, pin_memory=True)
                host_logits = pinned.copy_(host_logits, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        info = self._record(entries, forwards, 0.0)
        marks = []
        for req, _ in samples:
            req.generated.append(PENDING)
            marks.append((req, len(req.generated) - 1))
        sample_of = {req.index: j for j, (req, _) in enumerate(samples)}
        step = InFlight(info, kind, ids, host_ids, host_logits, marks, sample_of, done)
        self.inflight.append(step)
        if done is None:  # on cpu the work ran as it was enqueued
            self._complete(step)
        if len(self.inflight) > 1:
            self._resolve(self.inflight.pop(0))
        return info

    def _poll(self) -> None:
        """Complete, in order and without waiting, the steps in flight that the device has finished:
        their clock and range stop before the host enqueues more work."""
        for step in self.inflight:
            if not step.completed:
                if not step.done.query():
                    break
                self._complete(step)

    def _complete(self, step: InFlight) -> None:
        """Stop a step's clock; the profile range moves on to the next step in flight, if any."""
        now = time.perf_counter()
        step.info.seconds, self._clock = now - self._clock, now
        step.completed = True
        later = next((s for s in self.inflight if not s.completed), None)
        self._label(later.kind if later is not None else None)

    def _resolve(self, step: InFlight) -> None:
        """Wait for a step taken out of flight and hand its tokens (and logits) to its requests."""
        if not step.completed:
            step.done.synchronize()
            self._complete(step)
        for (req, k), token in zip(step.samples, step.host_ids.tolist(), strict=True):
            req.generated[k] = token
        if step.host_logits is not None:
            for (req, _), row in zip(step.samples, step.host_logits, strict=True):
                req.logits.append(row)

    def finish(self) -> None:
        """Resolve every step still in flight: the requests then hold all their tokens."""
        while self.inflight:
            self._resolve(self.inflight.pop(0))

    # ------------------------------------------------------------------ generation
    def _log_steps(self, first: int) -> int:
        """Log the steps from index ``first`` on whose time is known; -> the first one not logged."""
        known = len(self.steps) - sum(not s.completed for s in self.inflight)
        for i in range(first, known):
            if self.log:
                self.log(self._step_line(i))
        return known

    def _step_line(self, i: int) -> str:
        info, forwards = self.steps[i], [f for f in self.forwards if f.step == i]
        parts = ", ".join(
            f"T={f.padded} {'SP' if f.use_sp else 'TP'} {'graph' if f.graph else 'eager'}" for f in forwards
        )
        split = f" in {len(forwards)} microbatches" if len(forwards) > 1 else ""
        return (
            f"step {i + 1}: {info.num_tokens} tokens (prefill {info.prefill_tokens})"
            f"{split} -> {parts} {info.seconds * 1e3:.2f} ms"
        )

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
        logged = len(self.steps)
        try:
            while not all(req.done for req in requests):  # done counts PENDING tokens
                self.step(requests)
                logged = self._log_steps(logged)
                if progress:
                    progress(sum(len(r.generated) for r in requests))
        except BaseException:
            self.inflight.clear()  # a failed generation's steps are abandoned: the next one starts clean
            raise
        self.finish()
        self._log_steps(logged)
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
            "overlap": self.overlap,  # steps overlapped (else each synchronous)
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
