"""The mHC kernels' launch plan (csrc/kernels/mhc_plan.h), a pure host function, on CPU through the
private op ``_launch_plan``: which kernels, grids, blocks and shared memory each op variant launches,
and where its regimes switch. Occupancies are given (an H200's unless a test says otherwise), so
the plan is checked without a GPU."""

from __future__ import annotations

import itertools

import pytest
import spkernels  # noqa: F401  (loads the extension and its ops)
import torch

VARIANTS = [
    "pre", "post", "post_pre", "head", "post_peers", "post_pushed", "pre_gather", "post_pre_peers",
    "post_pre_peers_gather",
]  # fmt: skip
KERNELS = ["post_row", "rows", "rows_teams", "rows_fnreg", "collapse_row", "collapse_loop", "copy_in"]
FUSED = ["post_peers", "post_pushed", "pre_gather", "post_pre_peers", "post_pre_peers_gather"]
PRES = ["pre", "post_pre", "head", "pre_gather", "post_pre_peers", "post_pre_peers_gather"]

SMS = 132
# CTAs per device: the tile kernel (2 per SM), the wide pass-1 kernels (1 per SM), pass 2's kernels.
H200 = (2 * SMS, SMS, 3 * SMS, 3 * SMS)
TILE, THREADS, SLICE_VECS = 16, 256, 32
LAST_READ_FLAG, LAST_READ_MIN_VECS, LAST_READ_MAX_ROWS = 8, 4, 1024  # pass 2's evict-first loads
SMEM_PER_SM, SMEM_PER_CTA, STATIC_SMEM = 228 << 10, 227 << 10, 16 << 10  # static: ptxas says <= 14.3 KB


def plan(variant: str, T: int, D: int, max_ctas: int = 0, occ=H200) -> dict:
    out = torch.ops.spkernels._launch_plan(VARIANTS.index(variant), T, D, max_ctas, list(occ))
    head = dict(zip(["slices", "groups", "parts", "exit_barrier", "push_barrier"], out[:5], strict=True))
    head["launches"] = [
        dict(kernel=KERNELS[k], variant=v, grid=(gx, gy), block=b, smem=s)
        for k, v, gx, gy, b, s in (out[i : i + 6] for i in range(6, len(out), 6))
    ]
    assert len(head["launches"]) == out[5]
    return head


def slices(D: int) -> int:
    return (D // 8 + SLICE_VECS - 1) // SLICE_VECS


def tiles(T: int) -> int:
    return (T + TILE - 1) // TILE


HIDDEN = [256, 1024, 4096, 5120, 7168, 8192]
TOKENS = [1, 16, 17, 64, 128, 129, 512, 1024, 4096, 8192, 8193, 16384]


def test_zero_tokens_launch_nothing():
    for v in VARIANTS:
        assert plan(v, 0, 4096)["launches"] == []


def test_kernels_per_variant():
    """A post alone: pass 1 only (the local post: its row kernel); a pre: pass 1 and pass 2; the SP
    gathers also the copy-in."""
    for v, T, D in itertools.product(VARIANTS, [256, 8192], HIDDEN):
        kernels = [launch["kernel"] for launch in plan(v, T, D, 264 if v in FUSED else 0)["launches"]]
        first = ("post_row",) if v == "post" else ("rows", "rows_teams", "rows_fnreg")
        assert kernels[0] in first, (v, kernels)
        want = 1 + (v in PRES) + v.endswith("gather")
        assert len(kernels) == want, (v, T, D, kernels)
        if v.endswith("gather"):
            assert kernels[-1] == "copy_in"


def test_post_row_kernel_up_to_the_grid_limit():
    for D in HIDDEN:
        for T in (1, 128, 8192, 65535):
            p = plan("post", T, D)["launches"]
            assert [launch["kernel"] for launch in p] == ["post_row"]
            assert p[0]["grid"] == ((D // 8 + 63) // 64, T) and p[0]["block"] == 64 and p[0]["smem"] == 0
        assert plan("post", 65536, D)["launches"][0]["kernel"] == "rows"
        # Only the local post: the fused posts keep their tile kernel at every size.
        assert plan("post_peers", 1, D, 264)["launches"][0]["kernel"] == "rows"


@pytest.mark.parametrize("variant", FUSED)
def test_fused_grids_identical_on_every_rank(variant):
    """The kernels whose every CTA syncs on an LSA barrier (pass 1 of the peers' and pushed posts,
    the copy-in) launch grids that depend on the shapes and the rank-agreed max_ctas only, never
    on a rank's own occupancy, and fit the barrier slots. mhc_pre_ag's pass 1 syncs on barrier 0
    alone (its CTA 0), so it may take the wide kernel where the device has room."""
    paired_kernels = ("copy_in",) if variant == "pre_gather" else ("rows", "copy_in")
    for T, D, cap in itertools.product(TOKENS, HIDDEN, [132, 264]):
        plans = [plan(variant, T, D, cap, occ) for occ in (H200, (1, 1, 1, 1), (999, 77, 5, 9))]
        paired = [[x for x in p["launches"] if x["kernel"] in paired_kernels] for p in plans]
        assert paired[0] == paired[1] == paired[2], (variant, T, D, cap)
        assert all(launch["grid"][0] <= cap for launch in paired[0]), (variant, T, D, cap, paired[0])
        flags = [(p["slices"], p["parts"], p["exit_barrier"], p["push_barrier"]) for p in plans]
        assert flags[0] == flags[1] == flags[2]
        if variant != "pre_gather":
            assert plans[0]["groups"] == plans[1]["groups"] == plans[2]["groups"]


def test_barrier_flags():
    for v in VARIANTS:
        p = plan(v, 1024, 4096, 264)
        assert p["exit_barrier"] == (v == "post_pre_peers"), v  # the TP boundary's pass 2
        assert p["push_barrier"] == (v == "pre_gather"), v  # the SP pre's pass 1 (else the entry barrier)


def test_decode_parts_switch():
    """A pre's pass 1 splits the 24 fn rows into 3 CTAs of 8 when every (tile, slice, part) has an SM."""
    for v, D in itertools.product(["pre", "post_pre", "pre_gather", "post_pre_peers"], HIDDEN):
        cap = 264
        for T in range(1, 2049, 15):
            p = plan(v, T, D, cap if v in FUSED else 0)
            split = tiles(T) * slices(D) * 3 <= cap // 2
            assert p["parts"] == (3 if split else 1), (v, T, D)
            rows = p["launches"][0]
            if rows["kernel"] == "rows":
                assert rows["variant"] == (2 if split else 1 if tiles(T) > p["groups"] else 0), (v, T, D, p)
                assert rows["grid"][0] == p["slices"] * p["groups"] * p["parts"]
    assert plan("head", 16, 4096)["parts"] == 1  # the head's 4 fn rows: one part


def test_wide_pass1_switch():
    """A pre (fn in registers) or the head (two teams) leaves the tile kernel where a slice has more
    than two tiles per SM of its own, fn staged; a pre's ring is filled a warp per row from 64 tiles."""
    for v, D in itertools.product(["pre", "head", "pre_gather"], HIDDEN):
        S = slices(D)
        per_slice = SMS // S
        for T in TOKENS + [TILE * per_slice * 2, TILE * per_slice * 2 + 1]:
            rows = plan(v, T, D, 264 if v in FUSED else 0)["launches"][0]
            staged = tiles(T) > min(max(264 // S, 1), tiles(T))
            wide = staged and tiles(T) > per_slice * 2
            want = ("rows_teams" if v == "head" else "rows_fnreg") if wide else "rows"
            assert rows["kernel"] == want, (v, T, D, rows)
            if rows["kernel"] == "rows_fnreg":  # row copies from 64 tiles (T > 1008)
                assert rows["variant"] == (tiles(T) >= 64), (v, T, D, rows)
    for v, T in itertools.product(["pre", "pre_gather"], [1008, 1009]):
        rows = plan(v, T, 4096, 264 if v in FUSED else 0)["launches"][0]
        assert (rows["kernel"], rows["variant"]) == ("rows_fnreg", T > 1008), (v, T, rows)
    for v in ["post_pre", "post_pre_peers"]:  # a post's pass 1 stays on the tile kernel
        assert plan(v, 16384, 7168, 264 if v in FUSED else 0)["launches"][0]["kernel"] == "rows"


def test_even_split_from_512_tiles():
    """A pre's fn-in-registers pass 1 runs on every SM (groups = 0) from 512 tiles where the strided
    grid leaves at least 1/12 of the SMs idle (D = 7168: 28 slices, 132 % 28 = 20 idle)."""
    for T, D in itertools.product([511 * TILE, 512 * TILE], [4096, 7168]):
        p = plan("pre", T, D)
        idle = SMS % slices(D) * 12 >= SMS
        if tiles(T) >= 512 and idle:
            assert p["groups"] == 0 and p["launches"][0]["grid"][0] == SMS, (T, D, p)
        else:
            assert p["groups"] == SMS // slices(D) and p["launches"][0]["grid"][0] == slices(D) * p["groups"]


def test_collapse_regimes():
    """Pass 2: a local pre loops at every T (a CTA per slot); a fused pre runs a CTA per row while the
    rows fit in two waves, then loops; the TP boundary adds one CTA for its exit barrier."""
    occ = (264, 132, 100, 150)
    for v in ["pre", "post_pre", "head", "post_pre_peers", "pre_gather", "post_pre_peers_gather"]:
        extra = v == "post_pre_peers"
        for T in [1, 149 - extra, 150 - extra, 199 - extra, 200 - extra, 201 - extra, 1000]:
            p = plan(v, T, 4096, 264 if v in FUSED else 0, occ)
            c = p["launches"][1]
            if v in FUSED and T + extra <= 200:
                assert c["kernel"] == "collapse_row" and c["grid"][0] == T + extra, (v, T, c)
            else:
                want = min(T, 150 - extra) + extra
                assert c["kernel"] == "collapse_loop" and c["grid"][0] == want, (v, T, c)


def test_collapse_vectors():
    for D in range(8, 8193, 8):
        kv = plan("pre", 64, D)["launches"][1]["variant"] & (LAST_READ_FLAG - 1)
        assert (kv - 1) * 224 < D // 8 <= kv * 224


@pytest.mark.parametrize("v", PRES)
def test_collapse_last_read(v):
    """The loop kernel reads evict-first from 4 vectors per thread (D > 5376), and below that for a
    local pre of at most 1024 rows (a fused pre's only from 4 vectors); the row kernel never does."""
    local = v in ("pre", "post_pre", "head")
    hidden, tokens = [256, 4096, 5120, 5376, 5384, 7168, 8192], [1, 64, 512, 1023, 1024, 1025, 8192]
    for D, T in itertools.product(hidden, tokens):
        for launch in plan(v, T, D, 0 if local else 264)["launches"]:
            kv, flag = launch["variant"] & (LAST_READ_FLAG - 1), launch["variant"] & LAST_READ_FLAG
            if launch["kernel"] == "collapse_loop":
                want = kv >= LAST_READ_MIN_VECS or (local and T <= LAST_READ_MAX_ROWS)
                assert bool(flag) == want, (v, D, T, launch)
            elif launch["kernel"] == "collapse_row":
                assert not flag, (v, D, T, launch)


def test_shared_memory_within_limits():
    """Every launch's dynamic shared memory fits a CTA, and the tile kernel's fits twice per SM
    (its launch bounds) with its static shared memory, at every hidden size."""
    for v, D, T in itertools.product(VARIANTS, range(8, 8193, 8), [16, 16384]):
        for launch in plan(v, T, D, 264 if v in FUSED else 0)["launches"]:
            assert launch["smem"] + STATIC_SMEM <= SMEM_PER_CTA, (v, D, launch)
            if launch["kernel"] == "rows":
                assert 2 * (launch["smem"] + STATIC_SMEM) <= SMEM_PER_SM, (v, D, launch)
                assert launch["block"] == THREADS
