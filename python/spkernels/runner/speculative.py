"""Greedy speculative decoding with the MTP draft layer: K drafted tokens per request per step.

A step schedules each decoding request's last token and its K drafts (K + 1 tokens, one uniform
decode batch when no prompt is in the step) and prefill chunks, runs the target over them and takes
the longest prefix of drafts that matches the target's greedy tokens plus the target's next token.
The target's K/V at the rejected positions stay in the cache but are never read: attention only sees
positions below a row's context length, and the next step writes them again before reading them.

Then, on the last pipeline stage, the draft. The MTP layer at position p reads the target's stream at
p and the token after p. First it runs once over the target's rows (same positions, KV rows, padding
and SP decision), each row's token replaced by the token after it (pad for rows past the accepted
ones): that writes the MTP cache for every accepted position and, at a request's last accepted row,
proposes its first draft. Each further draft is one row per request at the next position, fed the
last draft token and the MTP's own stream of the row before. Its padded count is its own, and so is
its SP decision (the target's rule). Rejected positions of the MTP cache are likewise rewritten
before they are read.

Draft modes (tests, benchmarks): ``mtp`` proposes the MTP layer's greedy tokens; ``oracle`` the
tokens of a plain greedy run (every draft accepted: the upper bound of the machinery); ``wrong`` a
token that is not the plain run's (none accepted). The MTP layer runs in every mode: the oracle and
wrong tokens replace its proposals, so the steps cost what they cost with the real draft.

With FULL_DECODE_ONLY graphs a pure verify step replays the target's graph for its padded count and
the MTP's graph for the same count; the drafts replay the MTP's graph for theirs.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import pipeline
from .engine import Engine, ForwardInfo, Request, StepInfo, capture_graph, schedule
from .model import Batch

DRAFT_MODES = ("mtp", "oracle", "wrong")


@dataclass
class SpecRequest(Request):
    draft: list[int] = field(default_factory=list)  # proposed tokens after the last generated one

    def _parts(self) -> tuple[list[int], ...]:
        return self.prompt, self.generated, self.draft

    @property
    def decode_tokens(self) -> int:
        return 1 + len(self.draft)


@dataclass
class SpecStepInfo(StepInfo):
    generated: int = 0  # tokens appended to the requests (accepted drafts and the target's next)
    verified: int = 0  # requests whose drafts this step verified
    drafted: int = 0  # drafts verified that the request could use (not past its max_new_tokens)
    accepted: int = 0  # of those, accepted


def accept(draft: list[int], target: list[int]) -> int:
    """Drafts accepted: the longest prefix of ``draft`` equal to the target's greedy tokens."""
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return n


class SpeculativeEngine(Engine):
    """``mtp``: the MTPLayer on the last pipeline stage, None elsewhere. ``oracle``: per request the
    plain greedy run's tokens (the oracle and wrong modes)."""

    request_class = SpecRequest
    schedule_ignores_tokens = False  # the next step's schedule depends on this one's acceptance

    def __init__(
        self, model, mtp, policy, max_tokens_per_step: int, num_draft: int, draft_mode: str = "mtp",
        oracle: list[list[int]] | None = None, **kwargs,
    ):  # fmt: skip
        super().__init__(model, policy, max_tokens_per_step, **kwargs)
        if type(num_draft) is not int or num_draft < 1:
            raise ValueError(f"--mtp K drafts K >= 1 tokens per step, got K = {num_draft!r}")
        if draft_mode not in DRAFT_MODES:
            raise ValueError(f"draft mode must be one of {DRAFT_MODES}, got {draft_mode!r}")
        if draft_mode != "mtp" and oracle is None:
            raise ValueError(f"the {draft_mode} draft needs the plain run's tokens (oracle)")
        if self.microbatches > 1:
            raise ValueError("speculative decoding runs each step as one forward: it needs microbatches = 1")
        if max_tokens_per_step < num_draft + 1:
            raise ValueError(
                f"max_tokens_per_step = {max_tokens_per_step} cannot hold one verify of K + 1 = "
                f"{num_draft + 1} tokens"
            )
        if model.last_stage != (mtp is not None):
            raise ValueError("the MTP draft layer runs on the last pipeline stage, and only there")
        self.mtp, self.num_draft, self.draft_mode, self.oracle = mtp, num_draft, draft_mode, oracle
        self.lookahead = num_draft
        model.stash_residual = model.last_stage
        for m in (model, mtp):  # a verify's K + 1 tokens per request share its KV row
            if m is not None:
                m.queries_share_rows = True
        self.graph_residuals: dict[int, torch.Tensor] = {}
        self.mtp_graphs: dict[int, tuple] = {}

    # ------------------------------------------------------------------ graphs
    def capture(self, max_batch: int) -> None:
        """Graphs for every capture size a verify batch of up to ``max_batch`` requests (K + 1 tokens
        each) can land on: the target's and, on the last stage, the MTP's (the first draft forward
        has the verify's count, the later drafts one row per request, a smaller size)."""
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need --device cuda")
        tokens = max_batch * (self.num_draft + 1)
        largest = self.policy.graph_size(tokens, True) or self.policy.max_capture_size
        sizes = sorted((s for s in self.policy.capture_sizes if s <= largest), reverse=True)
        m, hidden = self.model, self.model.config.hc * self.model.config.hidden_size
        pools = [None, None]  # the target's and the MTP's: a target residual outlives MTP replays
        for padded in sizes:
            use_sp = self.policy.use_sp(padded)
            static = self._pad_batch(padded)
            graph, logits = capture_graph(lambda s=static, u=use_sp: m.forward(s, u), pools[0])
            pools[0] = graph.pool()
            self.graphs[padded] = (graph, static, logits)
            self.graph_residuals[padded] = m.residual
            if self.mtp is not None:
                static = dataclasses.replace(self._pad_batch(padded), hash_ids=None)
                previous = torch.zeros((padded, hidden), dtype=torch.bfloat16, device=self.device)
                graph, (logits, residual) = capture_graph(
                    lambda s=static, p=previous, u=use_sp: self.mtp.draft(s, p, u), pools[1]
                )
                pools[1] = graph.pool()
                self.mtp_graphs[padded] = (graph, static, previous, logits, residual)
            if self.log:
                self.log(f"captured verify and draft graphs T={padded} ({'SP' if use_sp else 'TP'})")
        torch.cuda.synchronize()

    # ------------------------------------------------------------------ draft forwards
    def _draft_forward(self, batch: Batch, previous: torch.Tensor, use_sp: bool):
        """-> (fp32 logits of the sampled rows or every padded row, residual rows)."""
        padded = batch.input_ids.shape[0]
        if previous.shape[0] != padded:  # pad rows: zero stream
            full = previous.new_zeros((padded, previous.shape[1]))
            full[: previous.shape[0]] = previous
            previous = full
        captured = self.mtp_graphs.get(padded) if batch.segments is None else None
        if captured is None:
            return self.mtp.draft(batch, previous, use_sp)
        graph, static, static_previous, logits, residual = captured
        if self.check_graphs:
            eager = self.mtp.draft(batch, previous, use_sp)[0][: batch.num_tokens]
        for name in ("input_ids", "positions", "rows", "seq_lens"):
            getattr(static, name).copy_(getattr(batch, name))
        static_previous.copy_(previous)
        graph.replay()
        if self.check_graphs:
            diff = (logits[: batch.num_tokens] - eager).abs().max().item()
            self.graph_max_diff = max(self.graph_max_diff, diff)
        return logits, residual

    def _proposal(self, req: SpecRequest, index: int, greedy: int) -> int:
        """Draft ``index`` (0-based) of ``req``: the MTP's greedy token or the oracle's (or not it)."""
        if self.draft_mode == "mtp":
            return greedy
        plain = self.oracle[req.index]
        position = len(req.generated) + index  # the generated token this draft stands for
        token = plain[position] if position < len(plain) else 0
        return token if self.draft_mode == "oracle" else (token + 1) % self.model.config.vocab_size

    def _draft(self, batch: Batch, entries, starts, rows, need, residual, use_sp) -> None:
        """The first draft forward over the target's rows, then K - 1 single-row drafts: sets the
        drafts of ``need`` (their last accepted tokens at batch ``rows``) on the last stage."""
        m, K = self.model, self.num_draft
        num_tokens, padded = batch.num_tokens, batch.input_ids.shape[0]
        ids = []
        for (req, count), start in zip(entries, starts, strict=True):
            # each token's successor (a pad past the last)
            ids += (req.token_span(start + 1, start + count + 1) + [m.pad_id] * count)[:count]
        ids += [m.pad_id] * (padded - num_tokens)
        first = dataclasses.replace(
            batch,
            input_ids=self._tensor(ids),
            hash_ids=None,
            sample_idx=None if batch.segments is None else self._tensor(rows),
        )
        logits, stream = self._draft_forward(first, residual[:num_tokens], use_sp)
        if batch.segments is None:
            logits = logits[rows]
        previous = stream[rows]
        for req in need:
            req.draft = []
        for k in range(K):
            greedy = logits.argmax(dim=-1).tolist()  # one device read per draft step
            for req, token in zip(need, greedy, strict=True):
                req.draft.append(self._proposal(req, k, token))
            if k == K - 1 or not need:
                break
            n = len(need)
            padded_k = self.policy.pad(n, True)
            use_sp_k = self.policy.use_sp(padded_k)
            positions = [len(req.prompt) + len(req.generated) - 1 + k for req in need]
            pad = padded_k - n
            columns = self._tensor(
                [
                    [req.draft[-1] for req in need] + [m.pad_id] * pad,
                    positions + [0] * pad,
                    [req.index for req in need] + [m.trash_row] * pad,
                    [p + 1 for p in positions] + [1] * pad,
                ]
            )
            step = Batch(*columns.unbind(0), num_tokens=n, segments=None, sample_idx=None)
            logits, stream = self._draft_forward(step, previous, use_sp_k)
            logits, previous = logits[:n], stream[:n]

    def _share_drafts(self, need: list[SpecRequest]) -> None:
        """The last stage's drafts to every rank (pipeline stages; TP ranks agree already)."""
        stage = self.model.stage
        if stage is None or stage.pp_size == 1 or not need:
            return
        drafts = torch.empty((len(need), self.num_draft), dtype=torch.int64, device=self.device)
        if stage.last:
            drafts.copy_(torch.tensor([req.draft for req in need], dtype=torch.int64))
        dist.broadcast(drafts, stage.world_rank(stage.pp_size - 1) - stage.tp_rank)
        for req, row in zip(need, drafts.tolist(), strict=True):
            req.draft = row

    # ------------------------------------------------------------------ stepping
    def step(self, requests: list[SpecRequest]) -> StepInfo:
        entries = schedule(requests, self.max_tokens_per_step)
        decode = all(req.decoding for req, _ in entries)
        num_tokens = sum(count for _, count in entries)
        padded = self.policy.pad(num_tokens, decode)
        use_sp, graph = self.policy.use_sp(padded), decode and padded in self.graphs
        m = self.model
        self.meet()
        begin = time.perf_counter()
        received = m.post_recv(num_tokens, padded, use_sp)
        batch, _ = self.build_batch(entries, padded, decode)
        # Sampled rows: every verify row, and the last row of a prompt's final chunk.
        sample_rows, firsts, row = [], [], 0
        for req, count in entries:
            firsts.append(row)
            if req.decoding:
                sample_rows += range(row, row + count)
            elif req.num_computed + count == len(req.prompt):
                sample_rows.append(row + count - 1)
            row += count
        if not decode:
            batch.sample_idx = self._tensor(sample_rows)
        out = self._forward(batch, use_sp, graph, received)
        m.wait_sends()
        logits = None
        if out is not None:
            out = out[: len(sample_rows)]
            logits = out if graph else m.head(out)
        if m.stage is not None and m.stage.pp_size > 1:
            ids, logits = pipeline.share_samples(
                m.stage, logits, len(sample_rows), m.config.vocab_size, self.device, self.record_logits
            )
        else:
            ids = logits.argmax(dim=-1).tolist()
        residual = self.graph_residuals[padded] if graph else m.residual

        starts = [req.num_computed for req, _ in entries]
        last_rows: dict[int, int] = {}  # request index -> batch row of its last accepted token
        info = SpecStepInfo(num_tokens, padded, use_sp, graph, 0, 0.0)
        j = 0  # into ids / logits
        for (req, count), first in zip(entries, firsts, strict=True):
            verify = req.decoding
            if verify:
                drafts = req.draft
                taken = accept(drafts, ids[j : j + count])
                # Only drafts the request can still use count: at most max_new_tokens - 1 - generated.
                useful = min(len(drafts), req.max_new_tokens - 1 - len(req.generated))
                info.verified += 1
                info.drafted += useful
                info.accepted += min(taken, useful)
                req.draft = []
                req.num_computed += taken + 1
                new = ids[j : j + taken + 1][: req.max_new_tokens - len(req.generated)]
                last_rows[req.index] = first + taken
            else:
                info.prefill_tokens += count
                req.num_computed += count
                if req.num_computed < len(req.prompt):
                    continue
                new = ids[j : j + 1]
                last_rows[req.index] = first + count - 1
            req.generated += new
            info.generated += len(new)
            if self.record_logits:
                req.logits += list(logits[j : j + len(new)].float().cpu())
            j += count if verify else 1
        need = [req for req, _ in entries if req.index in last_rows and not req.done]
        if self.mtp is not None:
            rows = [last_rows[req.index] for req in need]
            self._draft(batch, entries, starts, rows, need, residual, use_sp)
        self._share_drafts(need)
        self._sync()
        info.seconds = time.perf_counter() - begin
        self.forwards.append(ForwardInfo(len(self.steps), num_tokens, padded, use_sp, graph, decode))
        self.steps.append(info)
        return info

    def _decode_tokens(self, steps) -> int:
        return sum(s.generated for s in steps)

    def stats(self) -> dict:
        stats = super().stats()
        drafted = sum(s.drafted for s in self.steps)
        accepted = sum(s.accepted for s in self.steps)
        verified = sum(s.verified for s in self.steps)
        stats.update(
            mtp=self.num_draft,
            mtp_draft=self.draft_mode,
            drafted=drafted,
            accepted=accepted,
            acceptance_rate=accepted / drafted if drafted else 0.0,
            # tokens a request gains per verify: its accepted drafts plus the target's next token
            tokens_per_step=(accepted + verified) / verified if verified else 0.0,
        )
        return stats
