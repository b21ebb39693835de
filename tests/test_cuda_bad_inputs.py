"""CUDA ops x bad arguments: every bad input raises a RuntimeError/ValueError that names the argument,
and the process goes on (a good call right after the bad one succeeds).

The table is generated from the op schemas, as in test_ops_cpu.py's CPU table. Kinds of bad argument:
dtype, shape (one more trailing column), rows (one more token), ndim, non-contiguous, a CPU tensor
among CUDA ones, a tensor on the other GPU, a view that does not start on a 16-byte boundary (the
tensors the kernels read as vectors), hc != 4, D not a multiple of 8, D > 8192, sinkhorn_iters
= 0; for the comm ops also T above the communicator's capacity, a stream whose D is not the
communicator's hidden_size, an SP partial whose T is not tp * T_local (T % tp != 0), a closed
communicator and an unknown handle, and sp_all_gather's num_tokens out of range.

Local ops run in this process (one GPU; the other-GPU cases need two). The comm ops run the whole
table in one 2-rank nccl spawn: both ranks make the same calls with the same shapes, so every check
fails on both ranks before any collective is issued and the collective good calls stay paired.
Skipped without CUDA (and the comm table without 2 GPUs).
"""

from __future__ import annotations

import re

import pytest
import spkernels  # noqa: F401  (registers torch.ops.spkernels)
import torch
from conftest import MHCInputs
from distributed import run_distributed
from test_ops_cpu import BAD_EPS, BAD_EPS_VALUE  # the bad scalars: the CPU table's

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ops = torch.ops.spkernels
bf16, f32 = torch.bfloat16, torch.float32
EPS = (1e-6, 1e-6, 1e-6, 20, 2.0)  # rms_eps, hc_eps, norm_eps, sinkhorn_iters, post_alpha
T_LOCAL, D, TP, CAPACITY = 4, 64, 2, 16  # comm ops: T = TP * T_LOCAL = 8 <= CAPACITY
LOCAL_OPS = ["mhc_pre", "mhc_post", "mhc_post_pre", "mhc_head"]
COMM_OPS = ["mhc_post_rs", "mhc_pre_ag", "mhc_post_pre_rs_ag", "sp_all_gather", "sp_shard"]
COMM_OPS += ["mhc_post_ar", "mhc_post_pre_ar"]
SP_PARTIAL_OPS = ("mhc_post_rs", "mhc_post_pre_rs_ag")  # partial is [tp * T_local, D]
VEC16_ARGS = ("y", "partial", "fn", "norm_weight")  # and the stream: read in 16-byte vectors
# Whole consistent calls at another (hc, D): only the hc / D rule is broken.
SHAPE_KINDS = {"hc3": (3, D), "d_not8": (4, 60), "d_big": (4, 8200), "hidden": (4, 72)}


def schema_args(op_name: str) -> list:
    return list(getattr(ops, op_name).default._schema.arguments)


def valid_args(
    g: MHCInputs, op_name: str, comm: int, device, num_tokens: int = T_LOCAL, hc: int = 4, hidden: int = D
) -> dict:
    """Arguments (schema order) of a call that succeeds. ``num_tokens`` is the stream's row count
    (the local shard in SP mode); the SP partial and sp_all_gather cover TP times as many rows."""
    T, tp = num_tokens, (TP if op_name in COMM_OPS else 1)
    post_mix, res_mix = g.mixes(T, hc)
    site = g.head(hidden, hc) if op_name == "mhc_head" else g.site(hidden, hc)
    pool = {
        "stream": g.stream(T, hidden, hc),
        "y": g.y(T, hidden),
        "partial": g.y(T * tp if op_name in SP_PARTIAL_OPS else T, hidden),
        "post_mix": post_mix,
        "res_mix": res_mix,
        **site,
        "pre_mix_in": g.pre_mix_in(T, hc),
        "x_local": g.y(T, hidden),
        "x": g.stream(T, hidden, hc),
        "num_tokens": T * tp,
        "comm": comm,
        **dict(zip(("rms_eps", "hc_eps", "norm_eps", "sinkhorn_iters", "post_alpha"), EPS, strict=True)),
    }
    args = {a.name: pool.get(a.name, a.default_value) for a in schema_args(op_name)}
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def other_device(device: torch.device) -> torch.device:
    return torch.device("cuda", 1 - device.index)


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    out = wide[..., ::2]
    out.copy_(t)
    assert not out.is_contiguous()
    return out


def mutate(t: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "dtype":
        return t.to(f32 if t.dtype == bf16 else bf16)
    if kind == "shape":  # one more column: consistent in T, wrong in the trailing size
        return torch.randn(*t.shape[:-1], t.shape[-1] + 1, device=t.device).to(t.dtype)
    if kind in ("rows", "t_mod_tp"):  # one more token (an SP partial: T % tp != 0)
        return torch.randn(t.shape[0] + 1, *t.shape[1:], device=t.device).to(t.dtype)
    if kind == "ndim":
        return t[0]
    if kind == "ndim0":
        return torch.randn((), device=t.device).to(t.dtype)
    if kind == "noncontiguous":
        return noncontiguous(t)
    if kind == "cpu":
        return t.cpu()
    if kind == "misaligned":  # contiguous, but one element past a 16-byte boundary
        flat = torch.empty(t.numel() + 16, dtype=t.dtype, device=t.device)
        return flat[1 : 1 + t.numel()].view(t.shape).copy_(t)
    if kind == "other_gpu":
        return t.to(other_device(t.device))
    raise AssertionError(kind)


def tensor_kinds(op_name: str, arg: str) -> list[str]:
    """Bad kinds that apply to a tensor argument. The stream sets T, hc and D of the call, so its
    trailing sizes are tested through SHAPE_KINDS; sp_shard / sp_all_gather take any dtype and
    trailing dims (and sp_shard any strides and any CUDA device: it is plain indexing in Python);
    size-1 tensors (the head's scale) cannot be made non-contiguous."""
    if op_name == "sp_shard":
        return ["ndim0", "cpu"]
    if op_name == "sp_all_gather":
        return ["ndim0", "noncontiguous", "cpu", "other_gpu"]
    if arg == "stream":
        return ["dtype", "ndim", "noncontiguous", "misaligned", "cpu", "other_gpu"]
    kinds = ["dtype", "shape", "noncontiguous", "cpu", "other_gpu"]
    if arg in VEC16_ARGS:
        kinds.append("misaligned")
    if arg in ("y", "post_mix", "res_mix", "pre_mix_in") or (arg == "partial" and op_name.endswith("_ar")):
        kinds.append("rows")
    if arg == "partial" and op_name in SP_PARTIAL_OPS:
        kinds.append("t_mod_tp")
    if op_name == "mhc_head" and arg == "scale":
        kinds.remove("noncontiguous")
    return kinds


def needles(op_name: str, arg: str, kind: str) -> list[str]:
    """Regexes that must all appear in the error message: the argument's name, and for the special
    kinds what was expected."""
    if kind == "capacity":
        return [r"\bmax_tokens\b", "capacity"]
    if kind in ("closed", "unknown"):
        return [r"\bcomm\b", "not an open"]
    if kind == "cpu" and op_name == "sp_all_gather":
        # A lone CPU tensor dispatches to the CPU kernel, which names the device mismatch with the
        # communicator (not x_local by name): "comm H is a lsa communicator for cuda tensors, got cpu".
        return [r"\bcomm\b", r"got cpu tensors?"]
    if kind == "other_gpu" and arg in ("stream", "x_local") and op_name in COMM_OPS:
        return [r"\bcomm\b", "lives on cuda"]  # the communicator's device is checked first
    extra = {
        "hc3": [r"hc = 4"],
        "d_not8": [r"multiple of 8", r"got D = 60"],
        "d_big": [r"8192", r"got D = 8200"],
        "hidden": [r"\bhidden_size\b"],
        "t_mod_tp": [r"multiple of tp"],
        "misaligned": [r"16-byte boundary"],
        "cpu": [r"\bcpu\b"],
    }.get(kind, [])
    # A stream on the other GPU (local ops) is reported through the first argument that is not on
    # the stream's device: "fn must be on cuda:1 like the stream, got cuda:0".
    return [rf"\b{re.escape(arg)}\b", *extra]


def bad_cases(op_names: list[str]) -> list[tuple[str, str, str]]:
    cases = []
    for op_name in op_names:
        for a in schema_args(op_name):
            if str(a.type) in ("Tensor", "Optional[Tensor]"):
                cases += [(op_name, a.name, k) for k in tensor_kinds(op_name, a.name)]
                if a.name == "stream":
                    kinds = ["hc3", "d_not8", "d_big"] + (["hidden"] if op_name in COMM_OPS else [])
                    cases += [(op_name, "stream", k) for k in kinds]
            elif a.name == "sinkhorn_iters":
                cases += [(op_name, a.name, "zero"), (op_name, a.name, "huge")]
            elif a.name in BAD_EPS:
                cases += [(op_name, a.name, k) for k in BAD_EPS[a.name]]
        if op_name in COMM_OPS:
            # sp_shard never touches the communicator's buffers: no capacity.
            for kind in ("closed", "unknown") + (() if op_name == "sp_shard" else ("capacity",)):
                cases.append((op_name, "comm", kind))
    cases += [("sp_all_gather", "num_tokens", k) for k in ("negative", "too_many")]
    return [c for c in cases if c[0] in op_names]


def bad_args(g: MHCInputs, op_name: str, arg: str, kind: str, comm: int, closed: int, device) -> dict:
    """The arguments of one bad call: a valid call with one thing broken."""
    if kind in SHAPE_KINDS:
        hc, hidden = SHAPE_KINDS[kind]
        return valid_args(g, op_name, comm, device, hc=hc, hidden=hidden)
    if kind == "capacity":  # a consistent call with T one token (SP: tp tokens) above the capacity
        sp = op_name in SP_PARTIAL_OPS + ("mhc_pre_ag", "sp_all_gather")
        tokens = CAPACITY // TP + 1 if sp else CAPACITY + 1
        return valid_args(g, op_name, comm, device, num_tokens=tokens)
    args = valid_args(g, op_name, comm, device)
    if kind == "zero":
        args[arg] = 0
    elif kind == "huge":
        args[arg] = 1001
    elif kind in BAD_EPS_VALUE:
        args[arg] = BAD_EPS_VALUE[kind]
    elif kind == "closed":
        args[arg] = closed
    elif kind == "unknown":
        args[arg] = 1 << 40
    elif kind == "negative":
        args[arg] = -1
    elif kind == "too_many":
        args[arg] += 1
    else:
        args[arg] = mutate(args[arg], kind)
    return args


def run_case(g: MHCInputs, case, comm: int, closed: int, device) -> str | None:
    """The bad call must raise naming the argument; the good call after it must work. -> a failure
    description, or None."""
    op_name, arg, kind = case
    op = getattr(ops, op_name)
    where = f"{op_name}({arg}: {kind})"
    try:
        op(*bad_args(g, op_name, arg, kind, comm, closed, device).values())
        torch.cuda.synchronize()
        failure = f"{where}: no error"
    except (RuntimeError, ValueError) as e:
        msg = str(e)
        missing = [n for n in needles(op_name, arg, kind) if not re.search(n, msg)]
        failure = f"{where}: message lacks {missing}: {msg[:300]!r}" if missing else None
        if "Declaration:" in msg:  # the dispatcher's own type error quotes the whole schema
            failure = f"{where}: dispatcher error instead of the op's check: {msg[:300]!r}"
    except Exception as e:  # noqa: BLE001 - any other type is a failure of the contract
        failure = f"{where}: {type(e).__name__} (want RuntimeError/ValueError): {str(e)[:300]!r}"
    try:
        out = op(*valid_args(g, op_name, comm, device).values())
        torch.cuda.synchronize()
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not all(torch.isfinite(o.float()).all() for o in outs):
            failure = (failure or where) + "; the good call after it gave non-finite output"
    except Exception as e:  # noqa: BLE001
        failure = (failure or where) + f"; the good call after it failed: {type(e).__name__}: {str(e)[:300]}"
    return failure


# ----------------------------------------------------------------------------- local ops, in-process
LOCAL_CASES = bad_cases(LOCAL_OPS)


@requires_cuda
@pytest.mark.parametrize("op_name", LOCAL_OPS)
def test_valid_args_succeed(mhc, op_name):
    """The baseline of the table: unmodified, every call works."""
    getattr(ops, op_name)(*valid_args(mhc, op_name, 0, torch.device("cuda", 0)).values())
    torch.cuda.synchronize()


@requires_cuda
@pytest.mark.parametrize("op_name, arg, kind", LOCAL_CASES, ids=["-".join(c) for c in LOCAL_CASES])
def test_local_bad_argument_is_named(mhc, op_name, arg, kind):
    if kind == "other_gpu" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    failure = run_case(mhc, (op_name, arg, kind), 0, 0, torch.device("cuda", 0))
    assert failure is None, failure


# ----------------------------------------------------------------------------- comm ops, one 2-rank spawn
COMM_CASES = bad_cases(COMM_OPS)


def _comm_table_worker(rank, world_size, seed):
    from spkernels import Communicator

    device = torch.device("cuda", rank)
    g = MHCInputs(seed)  # same seed on both ranks: identical shapes, identical calls
    closed = Communicator(max_tokens=CAPACITY, hidden_size=D)
    closed.close()
    failures = []
    with Communicator(max_tokens=CAPACITY, hidden_size=D) as comm:
        for op_name in COMM_OPS:  # the baseline: unmodified calls work
            getattr(ops, op_name)(*valid_args(g, op_name, comm.handle, device).values())
        torch.cuda.synchronize()
        for case in COMM_CASES:
            failure = run_case(g, case, comm.handle, closed.handle, device)
            if failure is not None:
                failures.append(failure)
        backend = comm.backend
    return {"failures": failures, "cases": len(COMM_CASES), "backend": backend}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_comm_bad_arguments_are_named(mhc):
    results = run_distributed(TP, _comm_table_worker, mhc.seed, backend="nccl", timeout=600)
    report = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["failures"]]
    cases, backend = results[0]["cases"], results[0]["backend"]
    print(f"comm bad-argument table: {cases} cases x {TP} ranks, backend {backend}")
    assert not report, f"{len(report)} failures:\n" + "\n".join(report[:40])


def test_table_covers_every_op():
    """Every public op is in the table, and every comm op gets the communicator kinds (CPU too: a
    new op is missed here before the GPU machine runs the table)."""
    registered = {
        n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("spkernels::")
    }
    public = {n for n in registered if not n.startswith("_")}
    table = set(LOCAL_OPS + COMM_OPS)
    assert public == table, f"ops missing from the table: {public - table}"
    for op_name in COMM_OPS:
        kinds = {k for o, a, k in COMM_CASES if o == op_name and a == "comm"}
        assert {"closed", "unknown"} <= kinds, op_name


if __name__ == "__main__":
    print(f"local cases: {len(LOCAL_CASES)}, comm cases: {len(COMM_CASES)} (x {TP} ranks)")
