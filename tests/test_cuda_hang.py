"""No infinite hang: when a peer dies, the fused kernels' barriers time out.

Two ranks (cuda:0, cuda:1) with SPK_BARRIER_TIMEOUT=2 create one Communicator per fused op and
run each op once together; then rank 1 exits abruptly (os._exit, no teardown). Rank 0 calls each
op again on its own communicator: the kernel must give up, ``comm.check()`` must raise naming the
barrier and rank 1 within the timeout + 10 s (printed as ``hang detection: 2.03 s``), and the
next call must raise before launching anything, and ``close()`` must return (it aborts the NCCL
communicator instead of the collective teardown).

The ranks are plain subprocesses rather than run_distributed: a rank that dies on purpose is a
failure there, and with a peer gone NCCL's teardown may block, so rank 0 leaves with os._exit
too. Both are killed at a hard deadline: this test can never hang the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
TIMEOUT_S = 2.0
DETECT_LIMIT_S = TIMEOUT_S + 10
CLOSE_LIMIT_S = 20  # close() after a timeout aborts NCCL: it must not wait for the dead peer
DEADLINE_S = 300  # both ranks, start to exit: imports, six NCCL communicators, five timeouts
T, D = 32, 512
# The barrier (or wait) each op's kernel meets first (lsa_barrier.cuh's names).
OPS = {
    "mhc_post_pre_rs_ag": "entry",
    "mhc_pre_ag": "gather push",
    "sp_all_gather": "gather entry",
    "mhc_post_pre_ar": "entry",
    "mhc_post_ar": "pushed rows",  # T <= 128: no barrier, a wait for the peer's rows
}


def op_calls(rank: int) -> dict:
    """One call per op in OPS, on inputs that every rank derives from the same seed."""
    ops = torch.ops.spkernels
    gen = torch.Generator(device="cuda").manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)
    stream = randn(T, 4, D).bfloat16()
    post_mix, res_mix = randn(T, 4).sigmoid(), randn(T, 4, 4).softmax(-1)
    site = (randn(24, 4 * D) / D, randn(3), randn(24), None, None)
    eps = (1e-6, 1e-6, 1e-6, 20, 2.0)
    partial = randn(T, D).bfloat16()
    rows = slice(rank * T // 2, (rank + 1) * T // 2)
    shard = lambda t: t[rows].contiguous()
    return {
        "mhc_post_pre_rs_ag": lambda h: ops.mhc_post_pre_rs_ag(
            partial, shard(stream), shard(post_mix), shard(res_mix), *site, *eps, h
        ),
        "mhc_pre_ag": lambda h: ops.mhc_pre_ag(shard(stream), *site, *eps, h),
        "sp_all_gather": lambda h: ops.sp_all_gather(shard(post_mix), T, h),
        "mhc_post_pre_ar": lambda h: ops.mhc_post_pre_ar(partial, stream, post_mix, res_mix, *site, *eps, h),
        "mhc_post_ar": lambda h: ops.mhc_post_ar(partial, stream, post_mix, res_mix, h),
    }


def detect(name: str, call, comm) -> None:
    """Rank 0, rank 1 gone: the op's kernel gives up, check() raises, the next call raises at once."""
    start = time.monotonic()
    call(comm.handle)
    try:
        comm.check()
    except RuntimeError as e:
        elapsed, msg = time.monotonic() - start, str(e)
    else:
        raise AssertionError(f"{name}: comm.check() raised nothing after rank 1 exited")
    print(f"hang detection: {elapsed:.2f} s ({name})", flush=True)
    print(f"  error: {msg}", flush=True)
    want = f"rank 0's LSA barrier ({OPS[name]}, CTA "
    assert want in msg and "waiting for rank 1" in msg and "SPK_BARRIER_TIMEOUT" in msg, msg
    assert TIMEOUT_S <= elapsed < DETECT_LIMIT_S, f"{name}: detected after {elapsed:.2f} s"
    start = time.monotonic()
    try:
        call(comm.handle)
    except RuntimeError as e:
        assert want in str(e), str(e)
    else:
        raise AssertionError(f"{name}: the call after a timeout did not raise")
    print(f"  next call raised after {time.monotonic() - start:.3f} s", flush=True)
    # close() aborts instead of the collective teardown that would wait for rank 1. In a thread,
    # so that a close() that blocks fails the test instead of eating its deadline.
    start = time.monotonic()
    closer = threading.Thread(target=comm.close, daemon=True)
    closer.start()
    closer.join(CLOSE_LIMIT_S)
    assert not closer.is_alive(), f"{name}: close() after the timeout blocked for {CLOSE_LIMIT_S} s"
    assert comm.closed
    print(f"  close() returned after {time.monotonic() - start:.3f} s", flush=True)


def rank_main(rank: int, store: str) -> None:
    import torch.distributed as dist
    from spkernels import Communicator

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2)
    calls = op_calls(rank)
    comms = {name: Communicator(max_tokens=T, hidden_size=D) for name in calls}
    if any(c.backend != "lsa" for c in comms.values()):
        print(f"SKIP: backend {comms['sp_all_gather'].backend}: the barriers are lsa's", flush=True)
        os._exit(0)
    for name, call in calls.items():
        call(comms[name].handle)
        comms[name].check()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    if rank == 1:
        os._exit(0)  # abruptly: no close(), no process-group teardown
    for name, call in calls.items():
        detect(name, call, comms[name])


def test_dead_peer_times_out():
    # Async error handling off: torch's watchdog must not take rank 0 down when rank 1 vanishes.
    env = {
        **os.environ,
        "SPK_BARRIER_TIMEOUT": str(TIMEOUT_S),
        "SPK_FUSED": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
        "PYTHONUNBUFFERED": "1",
    }
    with tempfile.TemporaryDirectory(prefix="spk_hang_") as tmp:
        logs = [Path(tmp) / f"rank{r}.log" for r in range(2)]
        procs = []
        for r in range(2):
            with open(logs[r], "w") as out:
                cmd = [sys.executable, __file__, str(r), str(Path(tmp) / "store")]
                procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + DEADLINE_S
        try:
            for p in procs:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        text = [log.read_text() for log in logs]
    print(text[0])
    report = "".join(
        f"\n--- rank {r} (exit {p.returncode}) ---\n{text[r][-6000:]}" for r, p in enumerate(procs)
    )
    if "SKIP:" in text[0]:
        pytest.skip(text[0].split("SKIP: ", 1)[1].splitlines()[0])
    assert [p.returncode for p in procs] == [0, 0], f"ranks failed or hung past {DEADLINE_S} s:{report}"
    for name in OPS:
        assert f"s ({name})" in text[0], f"{name}: no detection reported:{report}"


if __name__ == "__main__":
    try:
        rank_main(int(sys.argv[1]), sys.argv[2])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    # Skip interpreter and NCCL teardown: the peer is gone (rank 0) or going.
    sys.stdout.flush()
    os._exit(0)
