"""The collective ops on CPU with gloo at tp = 2 and 4, in spawned processes (one spawn per tp).

- SP mode (token-sharded stream) equals TP mode (replicated stream) on the same global inputs,
  for T not divisible by tp and T < tp (sp_shard pads with zero rows, sp_all_gather trims them);
- every SP/TP op equals reference.py (fp64) after the explicit reference reduction of §2;
- TP outputs are bitwise identical on every rank;
- sp_shard / sp_all_gather round trips, the Communicator's lifetime and its argument errors.

Both modes sum partials in fp32 in rank order and round to bf16 before the post (docs/contract.md), so
the post results of SP and TP must be bitwise equal; the pre results are compared with tolerances
(the fp32 product over a shard's rows and over all rows may differ in the last bit).

The ranks run every op and check what must hold exactly there (cross-rank equality, padding);
they return their outputs and the test process compares them with reference.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from spkernels import Communicator
from spkernels import reference as ref
from spkernels.ops import sp_shard_rows
from test_ops_cpu import v41_model

ops = torch.ops.spkernels
bf16, f32, f64 = torch.bfloat16, torch.float32, torch.float64
HC, D = 4, 32
EPS = (1e-6, 1e-6, 1e-6, 20, 2.0)
CAPACITY = 64
# Per tp: T < tp, T not a multiple of tp, T a multiple of tp.
TOKENS = {2: [1, 5, 8], 4: [3, 6, 8]}


def site_args(p: dict, pre_mix_in=None) -> tuple:
    return p["fn"], p["scale"], p["base"], p["norm_weight"], pre_mix_in


def make_case(mhc, tp: int, num_tokens: int) -> dict:
    post_mix, res_mix = mhc.mixes(num_tokens)
    return {
        "T": num_tokens,
        "stream": mhc.stream(num_tokens, D),
        "partials": [mhc.y(num_tokens, D) for _ in range(tp)],  # rank r's row-parallel output
        "post_mix": post_mix,
        "res_mix": res_mix,
        "site": mhc.site(D),
        "pre_mix_in": mhc.pre_mix_in(num_tokens),
    }


# ----------------------------------------------------------------------------- in the ranks
def gather_objects(x):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def assert_same_on_all_ranks(name: str, x: torch.Tensor) -> None:
    for r, other in enumerate(gather_objects(x)):
        assert torch.equal(other, x), f"{name}: rank {r} differs from rank {dist.get_rank()}"


def assert_equal(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)} != {list(want.shape)}"
    assert torch.equal(got, want), f"{name}: max diff {(got.double() - want.double()).abs().max().item()}"


def pad_rows(x: torch.Tensor, num_rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(num_rows - x.shape[0], *x.shape[1:])])


def sp_vs_tp(rank: int, tp: int, case: dict, comm: int, delayed: bool) -> dict:
    T, stream = case["T"], case["stream"]
    site = case["site"]
    pre_in = case["pre_mix_in"] if delayed else None
    partial = case["partials"][rank]
    mixes = (case["post_mix"], case["res_mix"])

    # TP mode: replicated stream, all-reduce inside the op.
    tp_post = ops.mhc_post_ar(partial, stream, *mixes, comm)
    tp_pp = ops.mhc_post_pre_ar(partial, stream, *mixes, *site_args(site, pre_in), *EPS, comm)
    tp_pre = ops.mhc_pre(stream, *site_args(site, pre_in), *EPS)
    for i, t in enumerate((tp_post, *tp_pp)):
        assert_same_on_all_ranks(f"TP output {i}", t)

    # SP mode: the same global inputs, sharded; partials padded with zero rows to tp * T_local.
    shard = lambda x: ops.sp_shard(x, comm)  # noqa: E731
    gather = lambda x: ops.sp_all_gather(x, T, comm)  # noqa: E731
    stream_sh, post_sh, res_sh = shard(stream), shard(mixes[0]), shard(mixes[1])
    pre_in_sh = None if pre_in is None else shard(pre_in)
    T_local = stream_sh.shape[0]
    assert T_local == -(-T // tp)
    start, end = sp_shard_rows(T, tp, rank)
    assert_equal("sp_shard rows", stream_sh[: max(0, min(end, T) - start)], stream[start:end])
    assert (stream_sh[max(0, min(end, T) - start) :] == 0).all(), "sp_shard pad rows are not zero"
    partial_pad = pad_rows(partial, T_local * tp)

    sp_post = ops.mhc_post_rs(partial_pad, stream_sh, post_sh, res_sh, comm)
    sp_pre = ops.mhc_pre_ag(stream_sh, *site_args(site, pre_in_sh), *EPS, comm)
    sp_pp = ops.mhc_post_pre_rs_ag(
        partial_pad, stream_sh, post_sh, res_sh, *site_args(site, pre_in_sh), *EPS, comm
    )
    for name, li in (("mhc_pre_ag", sp_pre[0]), ("mhc_post_pre_rs_ag", sp_pp[1])):
        assert li.shape == (T_local * tp, D), f"{name}: layer_input_full shape {list(li.shape)}"
        assert_same_on_all_ranks(f"{name} layer_input_full", li)
        assert (li[T:] == 0).all(), f"{name}: layer_input of pad rows is not zero"
    for i, t in enumerate(sp_pp):
        assert torch.isfinite(t).all(), f"mhc_post_pre_rs_ag output {i}: non-finite values (pad rows?)"
    return {
        "tp_post": tp_post,
        "tp_pp": tp_pp,
        "tp_pre": tp_pre,
        # The SP results gathered to the global token order, pad rows trimmed.
        "sp_post": gather(sp_post),
        "sp_pre": (sp_pre[0][:T], *(gather(t) for t in sp_pre[1:])),
        "sp_pp": (gather(sp_pp[0]), sp_pp[1][:T], *(gather(t) for t in sp_pp[2:])),
    }


def partial_buffer_checks(comm: Communicator, case: dict, rank: int) -> None:
    """Poison comm.partial_buffer, write the partial into it: the op must read exactly that."""
    T, stream, partial = case["T"], case["stream"], case["partials"][rank]
    mixes = (case["post_mix"], case["res_mix"])
    h = comm.handle

    def staged(num_rows: int, x: torch.Tensor) -> torch.Tensor:
        buf = comm.partial_buffer(num_rows)
        assert buf.shape == (num_rows, D) and buf.dtype == bf16
        buf.fill_(float("nan"))
        buf.copy_(x)
        return buf

    want = ops.mhc_post_ar(partial, stream, *mixes, h)
    assert_equal(
        "mhc_post_ar from partial_buffer", ops.mhc_post_ar(staged(T, partial), stream, *mixes, h), want
    )
    stream_sh, post_sh, res_sh = (ops.sp_shard(x, h) for x in (stream, *mixes))
    T_pad = stream_sh.shape[0] * comm.tp_size
    partial_pad = pad_rows(partial, T_pad)
    want = ops.mhc_post_rs(partial_pad, stream_sh, post_sh, res_sh, h)
    got = ops.mhc_post_rs(staged(T_pad, partial_pad), stream_sh, post_sh, res_sh, h)
    assert_equal("mhc_post_rs from partial_buffer", got, want)


def roundtrip_checks(tp: int, comm: int, tensors: list[torch.Tensor]) -> None:
    for x in tensors:
        T = x.shape[0]
        sh = ops.sp_shard(x, comm)
        assert sh.dtype == x.dtype and sh.shape == (-(-T // tp), *x.shape[1:])
        assert_equal(f"round trip {x.dtype} {list(x.shape)}", ops.sp_all_gather(sh, T, comm), x)
        assert_equal("trimmed gather", ops.sp_all_gather(sh, T // 2, comm), x[: T // 2])


def lifetime_and_error_checks(rank: int, tp: int, mhc_case: dict) -> None:
    stream = mhc_case["stream"][:3]
    with Communicator(max_tokens=8, hidden_size=D) as comm:
        assert not comm.closed and comm.tp_size == tp and comm.rank == rank
        handle = comm.handle
        for bad in (0, 9, -1):
            with pytest.raises(ValueError, match="num_tokens"):
                comm.partial_buffer(bad)
        assert comm.partial_buffer(8).shape == (8, D)
        # T % tp != 0: an SP partial must have tp * T_local rows.
        stream_sh = ops.sp_shard(stream, handle)
        post_sh, res_sh = (
            ops.sp_shard(mhc_case["post_mix"][:3], handle),
            ops.sp_shard(mhc_case["res_mix"][:3], handle),
        )
        with pytest.raises(ValueError, match="partial"):
            ops.mhc_post_rs(mhc_case["partials"][rank][:3], stream_sh, post_sh, res_sh, handle)
        # Above capacity: T = tp * T_local > max_tokens.
        big = mhc_case["stream"][: 8 // tp + 1]
        with pytest.raises(ValueError, match="max_tokens"):
            ops.mhc_pre_ag(big, *site_args(mhc_case["site"]), *EPS, handle)
        with pytest.raises(ValueError, match="num_tokens"):
            ops.sp_all_gather(stream_sh, stream_sh.shape[0] * tp + 1, handle)
    assert comm.closed
    comm.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        comm.partial_buffer(1)
    with pytest.raises(ValueError, match="comm"):
        ops.sp_shard(stream, handle)
    with pytest.raises(ValueError, match="comm"):
        ops.mhc_post_ar(mhc_case["partials"][rank], mhc_case["stream"], mhc_case["post_mix"],
                        mhc_case["res_mix"], handle)  # fmt: skip


def _rank_main(rank: int, tp: int, cases: list[dict], extra: dict) -> dict:
    results = []
    with Communicator(max_tokens=CAPACITY, hidden_size=D) as comm:
        for case in cases:
            for delayed in (False, True):
                results.append(sp_vs_tp(rank, tp, case, comm.handle, delayed))
            partial_buffer_checks(comm, case, rank)
        roundtrip_checks(tp, comm.handle, extra["roundtrip"])
        # A model-like chain of boundaries (V4.1 delayed pre-mix) in both modes, compared in the test.
        m = extra["model"]
        sp_out = v41_model(m["emb"], m["sites"], m["weights"], comm.handle, True)
        tp_out = v41_model(m["emb"], m["sites"], m["weights"], comm.handle, False)
        assert_same_on_all_ranks("TP model", tp_out)
        assert_same_on_all_ranks("SP model (gathered)", sp_out)
    lifetime_and_error_checks(rank, tp, cases[-1])
    return {"cases": results, "model": (sp_out, tp_out)}


# ----------------------------------------------------------------------------- in the test process
def roundtrip_tensors(mhc, tp: int) -> list[torch.Tensor]:
    """Other dtypes and trailing dims; T = 1, tp + 1 (pad rows) and 0 (every shard empty)."""
    return [
        (100 * mhc.randn(tp + 1, 3, 2)).to(torch.int64),
        mhc.randn(1, dtype=torch.float16),
        mhc.randn(tp + 1, 5) > 0,
        mhc.randn(2 * tp, 2, 2, 2, dtype=f64),
        mhc.randn(0, 7),
    ]


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_collective_ops_gloo(mhc, tp):
    cases = [make_case(mhc, tp, T) for T in TOKENS[tp]]
    sites = [mhc.site(D) for _ in range(3)]
    weights = [(mhc.randn(D, D) / D**0.5).to(bf16) for _ in range(3)]
    model = {"emb": mhc.y(TOKENS[tp][1], D), "sites": sites, "weights": weights}
    results = run_distributed(
        tp, _rank_main, cases, {"roundtrip": roundtrip_tensors(mhc, tp), "model": model}
    )

    # TP outputs are bitwise equal on every rank and the gathered SP outputs too (checked in the
    # ranks), so rank 0's results cover every op.
    got = iter(results[0]["cases"])
    for case in cases:
        stream, mixes, site = case["stream"], (case["post_mix"], case["res_mix"]), case["site"]
        y = ref.reduce_partials(case["partials"])  # fp32 in rank order, one bf16 rounding
        want_new = ref.mhc_post(y, stream, *mixes, compute_dtype=f64)
        for pre_in in (None, case["pre_mix_in"]):
            out = next(got)
            tag = f"T={case['T']} delayed={pre_in is not None}"
            for mode in ("tp", "sp"):
                post, pp, pre = out[f"{mode}_post"], out[f"{mode}_pp"], out[f"{mode}_pre"]
                mhc.assert_bf16_close(post, want_new, f"{mode} {tag}: post new_stream")
                mhc.assert_bf16_close(pp[0], want_new, f"{mode} {tag}: post_pre new_stream")
                # The pre half on the op's own new_stream (see test_ops_cpu.test_mhc_post_pre).
                check_pre(mhc, pp[1:], pp[0], site, pre_in, f"{mode} {tag}: post_pre")
                check_pre(mhc, pre, stream, site, pre_in, f"{mode} {tag}: pre")
            # SP against TP directly. Not bitwise: the fp32 fn . x product of a T_local-row shard
            # and of all T rows may be blocked differently by the BLAS (1 fp32 ulp in m), which
            # the reference tolerances above absorb; the post alone is per element and exact.
            assert torch.equal(out["sp_post"], out["tp_post"]), f"{tag}: mhc_post_rs != mhc_post_ar"
            assert torch.equal(out["sp_pp"][0], out["tp_pp"][0]), f"{tag}: new_stream SP != TP"
            check_close(mhc, out["sp_pre"], out["tp_pre"], f"{tag}: mhc_pre_ag vs mhc_pre")
            check_close(mhc, out["sp_pp"][1:], out["tp_pp"][1:], f"{tag}: post_pre SP vs TP")
    assert next(got, None) is None
    sp_out, tp_out = results[0]["model"]
    mhc.assert_bf16_close(sp_out, tp_out, "V4.1 model: SP stream vs TP stream")


def check_pre(mhc, out, stream, site, pre_in, name) -> None:
    want = ref.mhc_pre(stream, *site_args(site, pre_in), *EPS, compute_dtype=f64)
    check_close(mhc, out, want, name)


def check_close(mhc, out, want, name) -> None:
    # layer_input passes the fused norm: a flipped y_b moves it by up to 2 bf16 spacings.
    mhc.assert_bf16_close(out[0], want[0], f"{name} layer_input", ulps=2)
    for i, mix in enumerate(("post_mix", "res_mix", "pre_mix"), start=1):
        mhc.assert_mix_close(out[i], want[i], f"{name} {mix}")
