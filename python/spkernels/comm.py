"""spkernels.Communicator: the opaque ``comm`` handle that every collective op takes
(docs/contract.md, "The communicator").

Backends: ``lsa`` (fused kernels over NCCL symmetric memory, every peer NVLink/P2P reachable),
``nccl`` (NCCL host collectives + local kernels: multi-node, no P2P, or ``fused=False``), ``gloo``
(CPU tensors, reference math). The handle indexes a process-wide registry; ops look it up, so a
closed or unknown handle is an error naming it instead of a crash.
"""

from __future__ import annotations

import itertools
import math
import os
import threading

import torch
import torch.distributed as dist

_registry: dict[int, Communicator] = {}
_next_handle = itertools.count(1)
_lock = threading.Lock()
_BACKENDS = {0: "lsa", 1: "nccl"}
DEFAULT_BARRIER_TIMEOUT_S = 120.0


def _env_flag(name: str) -> bool:
    """An on/off SPK_* variable: on unless set to "0"."""
    return os.environ.get(name, "1").strip() != "0"


def _check_timeout(value, what: str) -> float:
    """Seconds in [0, 1e9]: a number as an argument, its text in the environment."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        seconds = float(value) if number or isinstance(value, str) else math.nan
    except ValueError:
        seconds = math.nan
    if not (number or what.startswith("SPK_")) or not 0 <= seconds <= 1e9:  # also refuses nan and inf
        raise ValueError(f"{what} must be a number of seconds in [0, 1e9] (0: wait forever), got {value!r}")
    return seconds


# Communicator setting -> the environment variable that gives its default.
ENV_VARS = {"fused": "SPK_FUSED", "tp_push": "SPK_TP_PUSH", "barrier_timeout": "SPK_BARRIER_TIMEOUT"}


def env_default(setting: str):
    """The default of a Communicator setting whose argument is None: the one place that reads SPK_*.

    ``fused``: SPK_FUSED (on unless "0"; off = the nccl backend even where the fused one would run);
    ``tp_push``: SPK_TP_PUSH (on unless "0"; off = mhc_post_ar never pushes); ``barrier_timeout``:
    SPK_BARRIER_TIMEOUT (seconds, default 120; 0 = wait forever)."""
    name = ENV_VARS[setting]
    if setting != "barrier_timeout":
        return _env_flag(name)
    raw = os.environ.get(name, "").strip()
    return DEFAULT_BARRIER_TIMEOUT_S if not raw else _check_timeout(raw, name)


def lookup(handle: int) -> Communicator:
    comm = _registry.get(int(handle))
    if comm is None:
        raise ValueError(f"comm {handle} is not an open spkernels.Communicator (closed, or never created)")
    return comm


class Communicator:
    """Collective over a torch.distributed group; owns the symmetric buffers sized for ``max_tokens``.

    Construct it on every rank of ``group`` at the same point (it is collective), then pass it to
    the ``spkernels.*`` functions (its ``.handle`` only to the raw ``torch.ops.spkernels`` ops).
    ``device`` defaults to CUDA for NCCL groups and CPU for gloo.

    Settings (each None takes its default from the environment, see :func:`env_default`):
    ``fused`` (False: the nccl backend even where the fused lsa kernels would run), ``tp_push``
    (False: ``mhc_post_ar`` never pushes, below), ``barrier_timeout`` (seconds, 0 = forever).

    No infinite hang: a fused kernel waits at most ``barrier_timeout`` seconds for a peer at each of
    its barriers. A peer that died or stopped
    calling the same ops makes the waiting kernel give up (its outputs are garbage) and marks the
    communicator failed: every later op on it, and ``check()``, raises a RuntimeError naming the
    barrier and the missing rank. The communicator is then unusable: ``close()`` aborts its NCCL
    communicator (no collective teardown with a peer gone); exit the process or recreate the
    process group.

    At T <= 128 ``mhc_post_ar`` meets no barrier: each rank pushes its partial rows into the peers'
    buffers and waits (with the same timeout) for theirs. ``tp_push=False`` on any rank (the ranks
    agree on the minimum) keeps it pulling after an entry barrier at every T. ``fused`` and
    ``tp_push`` only matter for CUDA communicators.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        max_tokens: int,
        hidden_size: int,
        hc: int = 4,
        device: torch.device | str | None = None,
        fused: bool | None = None,
        tp_push: bool | None = None,
        barrier_timeout: float | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("spkernels.Communicator needs torch.distributed to be initialised first")
        for name, v in (("max_tokens", max_tokens), ("hidden_size", hidden_size), ("hc", hc)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.tp_size = dist.get_world_size(self.group)
        self.max_tokens, self.hidden_size, self.hc = max_tokens, hidden_size, hc
        for name, v in (("fused", fused), ("tp_push", tp_push)):
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name} must be a bool or None, got {v!r}")
        self.fused = env_default("fused") if fused is None else fused
        self.tp_push = env_default("tp_push") if tp_push is None else tp_push
        self.barrier_timeout_s = (
            env_default("barrier_timeout")
            if barrier_timeout is None
            else _check_timeout(barrier_timeout, "barrier_timeout")
        )
        group_backend = str(dist.get_backend(self.group))
        if device is None:
            device = "cuda" if "nccl" in group_backend else "cpu"
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        with _lock:
            self.handle = next(_next_handle)
        self._closed = False
        self._buffer: torch.Tensor | None = None
        if device.type == "cpu":
            self.backend = "gloo"
            self._buffer = torch.empty((max_tokens, hidden_size), dtype=torch.bfloat16)
        elif device.type == "cuda":
            self.backend = self._create_cuda(group_backend)
        else:
            raise ValueError(f"device must be cpu or cuda, got {device}")
        _registry[self.handle] = self

    def _create_cuda(self, group_backend: str) -> str:
        from ._library import HAS_CUDA_KERNELS

        if not HAS_CUDA_KERNELS:
            raise RuntimeError("this spkernels build has no CUDA kernels (torch was CPU-only at build time)")
        if "nccl" not in group_backend:
            raise ValueError(f"a CUDA Communicator needs a group with the nccl backend, got {group_backend}")
        ops = torch.ops.spkernels
        uid = [ops._nccl_unique_id() if self.rank == 0 else None]
        # The unique id travels over the torch group, so the NCCL comm spans exactly its ranks.
        dist.broadcast_object_list(uid, src=dist.get_global_rank(self.group, 0), group=self.group)
        code = ops._comm_create(
            self.handle, uid[0], self.rank, self.tp_size, self.device.index,
            self.max_tokens, self.hidden_size, self.hc, self.fused, self.tp_push, self.barrier_timeout_s,
        )  # fmt: skip
        return _BACKENDS[int(code)]

    @property
    def closed(self) -> bool:
        return self._closed

    def partial_buffer(self, num_tokens: int) -> torch.Tensor:
        """A [num_tokens, hidden_size] bf16 view of this rank's symmetric input buffer.

        A sublayer that writes its partial output here lets the fused op read peers without a copy.
        The view is overwritten by the next fused op's input staging: write, call the op, reuse.
        """
        self._check_open()
        if not 0 < num_tokens <= self.max_tokens:
            raise ValueError(f"num_tokens must be in [1, max_tokens = {self.max_tokens}], got {num_tokens}")
        if self._buffer is not None:
            return self._buffer[:num_tokens]
        return torch.ops.spkernels._comm_partial_buffer(self.handle, num_tokens)

    def check(self) -> None:
        """Raise the RuntimeError of a fused kernel's barrier that timed out, if one did.

        Synchronises this communicator's device first, so that every op issued so far has finished
        or given up. A gloo communicator has no barriers: nothing to check.
        """
        self._check_open()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.ops.spkernels._comm_check(self.handle)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"spkernels.Communicator {self.handle} is closed")

    def close(self) -> None:
        """Collective: release buffers, windows and the NCCL communicator. Idempotent. After a barrier
        timeout (see the class docstring) it is local: the NCCL communicator is aborted."""
        if self._closed:
            return
        self._closed = True
        _registry.pop(self.handle, None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.ops.spkernels._comm_destroy(self.handle)
        self._buffer = None
        # Drop the process group: a closed communicator must not keep it alive past
        # dist.destroy_process_group(), or its gloo threads die in interpreter teardown, where they
        # sporadically abort the process ("terminate called without an active exception"). Gloo can
        # also abort there when a peer process exits first: the ranks meet (dist.barrier()) before
        # tearing down, as the README example does, or exit without teardown, as the runner does.
        self.group = None

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"Communicator(handle={self.handle}, backend={self.backend}, rank={self.rank}/{self.tp_size}, "
            f"max_tokens={self.max_tokens}, hidden_size={self.hidden_size}, {state})"
        )
