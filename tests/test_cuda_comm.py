"""Fused collectives on GPUs (tp = 2 on the GPU machine; skipped with fewer GPUs).

Every fused op against reference.py (fp64) + the reference reduction, for both backends
(`lsa` fused kernels and `nccl` host collectives), SP gathered == TP, TP bitwise equal across
ranks, CUDA-graph replay == eager, 1000 back-to-back calls without a host sync, and close().
Tolerances as in test_cuda_local.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from test_cuda_local import expected_layer_input, post_slack

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
MIX_ATOL = 1e-4


def _gen_inputs(seed, T, D, rank):
    """Global inputs identical on every rank (shared seed) + this rank's partial."""
    from conftest import MHCInputs

    g = MHCInputs(seed)
    stream = g.stream(T, D)
    post_mix, res_mix = g.mixes(T)
    site = g.site(D, norm=bool(T % 4))
    pmi = g.pre_mix_in(T) if T % 3 == 0 else None
    partials = [g.y(T, D) for _ in range(dist.get_world_size())]
    cuda = lambda t: t.cuda() if isinstance(t, torch.Tensor) else t
    return (
        cuda(stream), cuda(post_mix), cuda(res_mix), {k: cuda(v) for k, v in site.items()}, cuda(pmi),
        [cuda(p) for p in partials],
    )  # fmt: skip


def _check_case(comm, T, D, seed, zero_copy):
    import conftest
    import spkernels.reference as ref

    ops = torch.ops.spkernels
    rank, tp = dist.get_rank(), dist.get_world_size()
    stream, post_mix, res_mix, site, pmi, partials = _gen_inputs(seed, T, D, rank)
    partial = partials[rank]
    if zero_copy:
        buf = comm.partial_buffer(T)
        buf.copy_(partial)
        partial = buf
    y = ref.reduce_partials(partials)
    pre_args = (site["fn"], site["scale"], site["base"], site["norm_weight"])
    eps = (1e-6, 1e-6, 1e-6, 20, 2.0)
    f64 = torch.float64

    # TP boundary: every rank mixes all T rows.
    got = ops.mhc_post_pre_ar(partial, stream, post_mix, res_mix, *pre_args, pmi, *eps, comm.handle)
    new_stream = ref.mhc_post(y, stream, post_mix, res_mix, compute_dtype=f64)
    new_slack = post_slack(y, stream, post_mix, res_mix)
    conftest.assert_bf16_close(got[0], new_stream, f"TP new_stream T={T}", slack=new_slack)
    want = ref.mhc_pre(got[0], *pre_args, pmi, compute_dtype=f64)
    for g_, w_, n in zip(got[2:], want[1:], ("post", "res", "pre"), strict=True):
        conftest.assert_mix_close(g_, w_, f"TP {n} T={T}", atol=MIX_ATOL)
    expected, slack = expected_layer_input(got[0], got[4], pmi, site["norm_weight"])
    conftest.assert_bf16_close(got[1], expected, f"TP layer_input T={T}", ulps=2, slack=slack)
    # Replicas must be bitwise identical (fixed summation order on every rank).
    for t in got:
        gathered = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(gathered, t.contiguous())
        assert all(torch.equal(gathered[0], x) for x in gathered), f"TP output differs across ranks, T={T}"
    tp_out = got
    if zero_copy:
        comm.partial_buffer(T).copy_(partials[rank])

    got_post = ops.mhc_post_ar(partial, stream, post_mix, res_mix, comm.handle)
    assert torch.equal(got_post, tp_out[0]), "mhc_post_ar differs from mhc_post_pre_ar's post"

    # SP boundary: this rank's token shard.
    n = T // tp
    rows = slice(rank * n, (rank + 1) * n)
    shard = lambda t: None if t is None else t[rows].contiguous()
    if zero_copy:
        comm.partial_buffer(T).copy_(partials[rank])
    sp = ops.mhc_post_pre_rs_ag(
        partial, shard(stream), shard(post_mix), shard(res_mix), *pre_args, shard(pmi), *eps, comm.handle
    )
    conftest.assert_bf16_close(sp[0], new_stream[rows], f"SP new_stream T={T}", slack=new_slack[rows])
    # Same math as TP on the same rows: SP gathered must equal TP up to bf16 flips.
    conftest.assert_bf16_close(sp[1], tp_out[1], f"SP layer_input vs TP T={T}", ulps=2)
    for g_, w_, nm in zip(sp[2:], tp_out[2:], ("post", "res", "pre"), strict=True):
        conftest.assert_mix_close(g_, w_[rows], f"SP {nm} T={T}", atol=MIX_ATOL)
    if zero_copy:
        comm.partial_buffer(T).copy_(partials[rank])
    rs = ops.mhc_post_rs(partial, shard(stream), shard(post_mix), shard(res_mix), comm.handle)
    assert torch.equal(rs, sp[0]), "mhc_post_rs differs from the fused boundary's post"
    ag = ops.mhc_pre_ag(sp[0], *pre_args, shard(pmi), *eps, comm.handle)
    for a_, b_ in zip(ag, sp[1:], strict=True):
        assert torch.equal(a_, b_), "mhc_pre_ag differs from the fused boundary's pre"
    # The local pre of this rank's rows equals the SP boundary's bitwise (its rows of the gathered
    # layer_input and its mixes): SP and TP engage per forward, so a row must not depend on which.
    local = ops.mhc_pre(sp[0], *pre_args, shard(pmi), *eps)
    assert torch.equal(local[0], sp[1][rows]), "local mhc_pre differs from the SP boundary's layer_input"
    for a_, b_ in zip(local[1:], sp[2:], strict=True):
        assert torch.equal(a_, b_), "local mhc_pre's mixes differ from the SP boundary's"
    # sp_all_gather: trimmed, any dtype and trailing dims.
    full_pre = ops.sp_all_gather(sp[4], T - 1, comm.handle)
    conftest.assert_mix_close(full_pre, tp_out[4][: T - 1], f"sp_all_gather(pre_mix) T={T}", atol=MIX_ATOL)
    return sp[1]


def _fused_worker(rank, world_size, D, sizes):
    import spkernels

    results = {}
    for fused in (True, False):
        with spkernels.Communicator(max_tokens=max(sizes), hidden_size=D, fused=fused) as comm:
            assert comm.backend == ("lsa" if fused else "nccl"), comm.backend
            for i, T in enumerate(sizes):
                results[(comm.backend, T)] = _check_case(comm, T, D, seed=1000 * D + T, zero_copy=bool(i % 2))
    # lsa and nccl backends agree (up to NCCL's own summation order in bf16).
    import conftest

    for T in sizes:
        conftest.assert_bf16_close(results[("lsa", T)], results[("nccl", T)], f"lsa vs nccl T={T}", ulps=2)
    return True


@pytest.mark.parametrize("D", [4096, 5120])
def test_fused_ops_match_reference(D):
    run_distributed(2, _fused_worker, D, [2, 6, 64, 1000, 8192], backend="nccl", timeout=600)


def _odd_tokens_worker(rank, world_size):
    import conftest
    import spkernels
    import spkernels.reference as ref

    ops = torch.ops.spkernels
    D, T = 4096, 1001  # T not divisible by tp: sp_shard pads with zero rows
    with spkernels.Communicator(max_tokens=1024, hidden_size=D) as comm:
        stream, post_mix, res_mix, site, pmi, partials = _gen_inputs(7, T, D, rank)
        sh = lambda t: ops.sp_shard(t, comm.handle)
        pad = lambda t: torch.cat([t, t.new_zeros((1, *t.shape[1:]))])
        pre_args = (site["fn"], site["scale"], site["base"], site["norm_weight"], None)
        got = ops.mhc_post_pre_rs_ag(
            pad(partials[rank]), sh(stream), sh(post_mix), sh(res_mix), *pre_args, 1e-6, 1e-6, 1e-6, 20, 2.0,
            comm.handle,
        )  # fmt: skip
        assert torch.isfinite(got[1]).all() and all(torch.isfinite(t).all() for t in got[2:])
        stream_full = ops.sp_all_gather(got[0], T, comm.handle)
        y = ref.reduce_partials(partials)
        want = ref.mhc_post(y, stream, post_mix, res_mix, compute_dtype=torch.float64)
        conftest.assert_bf16_close(
            stream_full, want, "gathered stream", slack=post_slack(y, stream, post_mix, res_mix)
        )
        pre_full = ops.sp_all_gather(got[4], T, comm.handle)
        expected, slack = expected_layer_input(stream_full, pre_full, None, site["norm_weight"])
        conftest.assert_bf16_close(got[1][:T], expected, "layer_input", ulps=2, slack=slack)
        assert torch.isfinite(got[1][T:]).all(), "the pad row's layer_input must be finite"
    return True


def test_tokens_not_divisible_by_tp():
    run_distributed(2, _odd_tokens_worker, backend="nccl", timeout=300)


def _graph_and_race_worker(rank, world_size):
    import conftest
    import spkernels
    import spkernels.reference as ref

    ops = torch.ops.spkernels
    D, T = 4096, 64
    eps = (1e-6, 1e-6, 1e-6, 20, 2.0)
    with spkernels.Communicator(max_tokens=T, hidden_size=D) as comm:
        stream, post_mix, res_mix, site, _, partials = _gen_inputs(11, T, D, rank)
        pre_args = (site["fn"], site["scale"], site["base"], site["norm_weight"], None)
        buf = comm.partial_buffer(T)
        n = T // world_size
        rows = slice(rank * n, (rank + 1) * n)
        sh_stream, sh_post, sh_res = stream[rows].clone(), post_mix[rows].clone(), res_mix[rows].clone()

        def boundaries():
            a = ops.mhc_post_pre_ar(buf, stream, post_mix, res_mix, *pre_args, *eps, comm.handle)
            b = ops.mhc_post_pre_rs_ag(buf, sh_stream, sh_post, sh_res, *pre_args, *eps, comm.handle)
            return a[0], a[1], b[0], b[1]

        buf.copy_(partials[rank])
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            boundaries()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = boundaries()
        gen = torch.Generator(device="cuda").manual_seed(100 + rank)
        for _ in range(20):
            buf.copy_(torch.randn(T, D, device="cuda", generator=gen).to(torch.bfloat16))
            graph.replay()
            eager = boundaries()
            for g_, e_ in zip(static_out, eager, strict=True):
                assert torch.equal(g_, e_), "graph replay differs from eager"

        # 1000 back-to-back boundaries, no host sync, the partial rewritten right after each call.
        outs = []
        for i in range(1000):
            buf.copy_((partials[rank].float() * (1 + (i % 7) / 8)).to(torch.bfloat16))
            outs.append(ops.mhc_post_ar(buf, stream, post_mix, res_mix, comm.handle))
        torch.cuda.synchronize()
        for i in range(0, 1000, 97):
            y = ref.reduce_partials([(p.float() * (1 + (i % 7) / 8)).to(torch.bfloat16) for p in partials])
            want = ref.mhc_post(y, stream, post_mix, res_mix, compute_dtype=torch.float64)
            slack = post_slack(y, stream, post_mix, res_mix)
            conftest.assert_bf16_close(outs[i], want, f"back-to-back call {i}", slack=slack)
    # A second communicator after the first one closed works.
    with spkernels.Communicator(max_tokens=16, hidden_size=64) as comm2:
        x = torch.full((8, 4), float(rank), device="cuda")
        full = ops.sp_all_gather(x, 16, comm2.handle)
        assert torch.equal(full, torch.cat([torch.zeros(8, 4), torch.ones(8, 4)]).cuda())
    with pytest.raises((RuntimeError, ValueError), match="not an open"):
        ops.sp_all_gather(x, 16, comm2.handle)
    return True


def test_graph_replay_back_to_back_and_close():
    run_distributed(2, _graph_and_race_worker, backend="nccl", timeout=300)


def _gather_race_worker(rank, world_size, T, D):
    """The pushed all-gather's protocol (lsa_gather.cuh): mhc_pre_ag and mhc_post_pre_rs_ag push
    rows into the peers' gather regions, sp_all_gather stages into and pulls from the same regions,
    and the zero-copy partial is rewritten right after each boundary. 90 such calls back to back
    without a host sync, one rank lagging by a varying amount before each call (torch.cuda._sleep),
    must each give bitwise the result of the same call run alone between host syncs (every op is
    deterministic): a push landing before the peer's copy-in of the previous call finished, or a
    copy-in reading before the pushes landed, changes rows."""
    import spkernels

    ops = torch.ops.spkernels
    eps = (1e-6, 1e-6, 1e-6, 20, 2.0)
    n = T // world_size
    rows = slice(rank * n, (rank + 1) * n)
    with spkernels.Communicator(max_tokens=T, hidden_size=D, fused=True) as comm:
        assert comm.backend == "lsa", comm.backend
        stream, post_mix, res_mix, site, _, partials = _gen_inputs(21, T, D, rank)
        pre_args = (site["fn"], site["scale"], site["base"], site["norm_weight"], None)
        sh_stream, sh_post, sh_res = (
            stream[rows].contiguous(),
            post_mix[rows].contiguous(),
            res_mix[rows].contiguous(),
        )
        buf = comm.partial_buffer(T)
        h = comm.handle

        def call(i):
            scale = 1 + (i % 7) / 8
            st = (sh_stream.float() * scale).to(torch.bfloat16)
            if i % 3 == 0:
                return ops.mhc_pre_ag(st, *pre_args, *eps, h)
            if i % 3 == 1:
                buf.copy_((partials[rank].float() * scale).to(torch.bfloat16))
                return ops.mhc_post_pre_rs_ag(buf, st, sh_post, sh_res, *pre_args, *eps, h)
            return (ops.sp_all_gather(st[:, i % 4].contiguous(), T, h),)

        outs = []
        for i in range(90):
            if rank == i % 2:
                torch.cuda._sleep(20_000 * (1 + i % 5))
            outs.append(call(i))
        for i in range(90):
            torch.cuda.synchronize()
            dist.barrier()
            alone = call(i)
            torch.cuda.synchronize()
            for k, (got, want) in enumerate(zip(outs[i], alone, strict=True)):
                assert torch.equal(got, want), (
                    f"call {i} (kind {i % 3}) output {k} differs from the call run alone"
                )
    return True


@pytest.mark.parametrize(("T", "D"), [(512, 1024), (4096, 4096)])
def test_gather_protocol_back_to_back(T, D):
    run_distributed(2, _gather_race_worker, T, D, backend="nccl", timeout=600)


def _tp_push_race_worker(rank, world_size, D):
    """The pushed mhc_post_ar's protocol (kernels/tp_push.cuh): 90 calls back to back without a
    host sync, pushed (T <= 128: slots alternate, each vector's reader clears it) and pulled
    (T = 200), interleaved with mhc_post_pre_ar calls (pulled: the same window's barriers and
    partial region), the zero-copy partial rewritten right after each call, one rank lagging by a
    varying amount before each call, must each give bitwise the result of the same call on a
    communicator that only pulls (tp_push=False), run alone between host syncs: a row read before
    its push landed, a slot not cleared in time or a push into a slot still being read changes rows
    or hangs (then the barrier timeout fails the test). Also: -0.0 partials (the sentinel's bits)
    arrive as zeros."""
    import spkernels

    ops = torch.ops.spkernels
    eps = (1e-6, 1e-6, 1e-6, 20, 2.0)
    Tmax = 200
    stream, post_mix, res_mix, site, _, partials = _gen_inputs(31, Tmax, D, rank)
    pre_args = (site["fn"], site["scale"], site["base"], site["norm_weight"], None)
    partials[rank][::5, ::3] = -0.0  # the sentinel's bit pattern, in every call's rows
    sizes = (1, 8, 17, 128, Tmax, 64, 33)

    def call(i, comm, buf):
        T = sizes[i % len(sizes)]
        part = (partials[rank][:T].float() * (1 + (i % 7) / 8)).to(torch.bfloat16)
        if buf is not None:
            part = buf[:T].copy_(part)
        post = (part, stream[:T], post_mix[:T], res_mix[:T])
        if i % 3 == 2:
            return ops.mhc_post_pre_ar(*post, *pre_args, *eps, comm.handle)
        return (ops.mhc_post_ar(*post, comm.handle),)

    pulled = spkernels.Communicator(max_tokens=Tmax, hidden_size=D, fused=True, tp_push=False)
    with spkernels.Communicator(max_tokens=Tmax, hidden_size=D, fused=True, tp_push=True) as comm, pulled:
        buf = comm.partial_buffer(Tmax)
        outs = []
        for i in range(90):
            if rank == i % 2:
                torch.cuda._sleep(20_000 * (1 + i % 5))
            outs.append(call(i, comm, buf if i % 2 else None))
        for i in range(90):
            torch.cuda.synchronize()
            dist.barrier()
            alone = call(i, pulled, None)
            torch.cuda.synchronize()
            for k, (got, want) in enumerate(zip(outs[i], alone, strict=True)):
                assert torch.equal(got, want), (
                    f"call {i} (T = {sizes[i % len(sizes)]}) output {k} differs from pulled"
                )
        comm.check()
    return True


@pytest.mark.parametrize("D", [1024, 7168])
def test_tp_push_protocol_back_to_back(D):
    run_distributed(2, _tp_push_race_worker, D, backend="nccl", timeout=600)


def _link_probe_worker(rank, world_size):
    """The bench's link probe (`_lsa_link_probe`: the all-gather kernel alone, or its push twin) runs
    on every rank, names a bad byte count, leaves the gather regions usable (sp_all_gather exact
    after it) and refuses the nccl backend."""
    import spkernels

    T, D = 256, 512
    probe = torch.ops.spkernels._lsa_link_probe
    with spkernels.Communicator(max_tokens=T, hidden_size=D, fused=True) as comm:
        assert comm.backend == "lsa", comm.backend
        block = T // world_size * D * 2  # the largest: tp blocks fill the gather region
        for push in (False, True, False):
            probe(comm.handle, block, push)
        x = torch.randn(T // world_size, D, device="cuda").to(torch.bfloat16)
        want = torch.empty(T, D, device="cuda", dtype=torch.bfloat16)
        dist.all_gather_into_tensor(want, x)
        assert torch.equal(torch.ops.spkernels.sp_all_gather(x, T, comm.handle), want)
        for bad in (0, 24, block + 16):
            with pytest.raises(RuntimeError, match="bytes must be a positive multiple of 16"):
                probe(comm.handle, bad, False)
        torch.cuda.synchronize()
    with spkernels.Communicator(max_tokens=T, hidden_size=D, fused=False) as comm:
        with pytest.raises(RuntimeError, match="needs the lsa backend"):
            probe(comm.handle, 1024, False)
    return True


def test_link_probe():
    import spkernels  # noqa: F401  (registers the ops)

    if not hasattr(torch.ops.spkernels, "_lsa_link_probe"):
        pytest.skip("the link probe is bench-only: build with SPK_BENCH_PROBES=1")
    run_distributed(2, _link_probe_worker, backend="nccl", timeout=120)


def _bad_input_worker(rank, world_size):
    import spkernels

    ops = torch.ops.spkernels
    D = 64
    with spkernels.Communicator(max_tokens=32, hidden_size=D) as comm:
        stream = torch.randn(8, 4, D, device="cuda").to(torch.bfloat16)
        mix = (torch.rand(8, 4, device="cuda"), torch.rand(8, 4, 4, device="cuda"))
        for partial, needle in [
            (torch.randn(15, D, device="cuda").to(torch.bfloat16), "pad T to a multiple of tp"),
            (torch.randn(16, D, device="cuda"), "partial"),
        ]:
            with pytest.raises((RuntimeError, ValueError), match=needle):
                ops.mhc_post_rs(partial, stream, *mix, comm.handle)
        big = torch.randn(40, 4, D, device="cuda").to(torch.bfloat16)
        with pytest.raises((RuntimeError, ValueError), match="capacity"):
            ops.mhc_post_ar(
                torch.randn(40, D, device="cuda").to(torch.bfloat16),
                big,
                torch.rand(40, 4, device="cuda"),
                torch.rand(40, 4, 4, device="cuda"),
                comm.handle,
            )
        with pytest.raises((RuntimeError, ValueError), match="not an open"):
            ops.mhc_post_rs(torch.randn(16, D, device="cuda").to(torch.bfloat16), stream, *mix, 987654)
    with pytest.raises((RuntimeError, ValueError), match="not an open"):
        ops.mhc_post_rs(torch.randn(16, D, device="cuda").to(torch.bfloat16), stream, *mix, comm.handle)
    return True


def test_bad_inputs_raise():
    run_distributed(2, _bad_input_worker, backend="nccl", timeout=120)
