"""Per-forward choice between SP and TP, and the CUDA-graph-safe token padding
(docs/contract.md, "Padding, dispatch and CUDA graphs").

The decision is a pure function of the *padded* token count, so a captured decode bucket takes the
same path at capture and at every replay. Capture sizes at or above the threshold are rounded up to
multiples of ``tp_size`` so that SP may engage inside a captured graph without further padding.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

CROSSOVER_TABLE = Path(__file__).with_name("sp_crossover.json")
# Used by ``sp_threshold="auto"`` when the table has no entry for (tp_size, hidden_size). Every
# shape measured so far (tp = 2) crosses over at 128-256 tokens (docs/performance.md); 4096 stays the
# cautious guess for tp sizes not measured, where SP's extra barriers may cost more.
DEFAULT_AUTO_THRESHOLD = 4096


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def auto_threshold(tp_size: int, hidden_size: int, table: str | Path | None = None) -> int:
    """The measured SP crossover for (tp_size, hidden_size) from the JSON table
    ``{"<tp>": {"<hidden_size>": threshold}}``, else ``DEFAULT_AUTO_THRESHOLD``."""
    path = Path(table) if table is not None else CROSSOVER_TABLE
    entries = json.loads(path.read_text()) if path.exists() else {}
    threshold = entries.get(str(tp_size), {}).get(str(hidden_size))
    if threshold is None:
        return DEFAULT_AUTO_THRESHOLD
    if not _is_int(threshold) or threshold < 1:
        raise ValueError(
            f"{path}: threshold for tp={tp_size}, hidden_size={hidden_size} must be a "
            f"positive int, got {threshold!r}"
        )
    return threshold


class SPPolicy:
    """``SPPolicy(tp_size, sp_threshold, capture_sizes=(), hidden_size=None)``.

    ``sp_threshold``: None (SP never engages), a positive int N (SP engages on a forward whose padded
    token count T satisfies T >= N and T >= tp_size, with tp_size > 1), or ``"auto"`` (N from the
    crossover table for ``tp_size`` and ``hidden_size``, which it then requires; see
    :func:`auto_threshold`).
    """

    def __init__(
        self,
        tp_size: int,
        sp_threshold: int | str | None,
        capture_sizes: Iterable[int] = (),
        hidden_size: int | None = None,
        crossover_table: str | Path | None = None,
    ):
        if not _is_int(tp_size) or tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
        if hidden_size is not None and (not _is_int(hidden_size) or hidden_size < 1):
            raise ValueError(f"hidden_size must be a positive int or None, got {hidden_size!r}")
        if sp_threshold == "auto":
            if hidden_size is None:
                raise ValueError("sp_threshold='auto' needs hidden_size (the crossover depends on it)")
            sp_threshold = auto_threshold(tp_size, hidden_size, crossover_table)
        elif sp_threshold is not None and (not _is_int(sp_threshold) or sp_threshold < 1):
            raise ValueError(f"sp_threshold must be a positive int, 'auto' or None, got {sp_threshold!r}")
        sizes = tuple(capture_sizes)
        for size in sizes:
            if not _is_int(size) or size < 1:
                raise ValueError(f"capture_sizes must be positive ints, got {sizes!r}")
        if any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
            raise ValueError(f"capture_sizes must be strictly increasing, got {sizes!r}")

        self.tp_size = tp_size
        self.sp_threshold = sp_threshold
        self.hidden_size = hidden_size
        # Sizes below the threshold stay as given and every size at or above it only grows, so the
        # rounded list stays sorted; rounding may merge neighbours, hence the dedupe.
        at_or_above = sp_threshold is not None and tp_size > 1
        rounded = [_round_up(s, tp_size) if at_or_above and s >= sp_threshold else s for s in sizes]
        self.capture_sizes = tuple(sorted(set(rounded)))

    @property
    def max_capture_size(self) -> int:
        return self.capture_sizes[-1] if self.capture_sizes else 0

    def _engages(self, num_tokens: int) -> bool:
        return (
            self.sp_threshold is not None
            and self.tp_size > 1
            and num_tokens >= self.sp_threshold
            and num_tokens >= self.tp_size
        )

    def use_sp(self, padded_num_tokens: int) -> bool:
        """Whether a forward over ``padded_num_tokens`` (the output of :meth:`pad`) runs in SP mode."""
        if not _is_int(padded_num_tokens) or padded_num_tokens < 1:
            raise ValueError(f"padded_num_tokens must be a positive int, got {padded_num_tokens!r}")
        return self._engages(padded_num_tokens)

    def graph_size(self, num_tokens: int, uniform_decode: bool) -> int | None:
        """The capture size a batch replays (FULL_DECODE_ONLY), or None when it runs eagerly."""
        if not uniform_decode or num_tokens > self.max_capture_size:
            return None
        return next(s for s in self.capture_sizes if s >= num_tokens)

    def pad(self, num_tokens: int, uniform_decode: bool) -> int:
        """Padded token count: a uniform decode batch that fits a capture size takes the smallest one
        that holds it; then, if SP engages on that count, it is rounded up to a multiple of tp_size.
        Pad rows are zero and are trimmed at the model exit."""
        if not _is_int(num_tokens) or num_tokens < 1:
            raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
        padded = self.graph_size(num_tokens, uniform_decode) or num_tokens
        # Decided on the count before rounding, so rounding never pulls a TP forward into SP; a
        # captured size that engages SP is already a tp multiple (see __init__), so it stays put.
        return _round_up(padded, self.tp_size) if self._engages(padded) else padded

    def __repr__(self) -> str:
        return (
            f"SPPolicy(tp_size={self.tp_size}, sp_threshold={self.sp_threshold}, "
            f"capture_sizes={self.capture_sizes})"
        )
