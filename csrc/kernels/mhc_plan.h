#pragma once
// The launch plan of an mHC op (plain C++, no CUDA): which kernels, grids, blocks and shared
// memory, a pure function of the op's variant, its shapes, the CTA cap and the device's occupancy.
// mhc_kernels.cu queries the occupancy, computes the plan and launches it; the CPU build exposes
// the plan to Python (torch.ops.spkernels._launch_plan) for its unit tests.
//
// Every rank of a fused op launches the same pass-1 and copy-in grids: they depend on the shapes
// and the rank-agreed max_ctas only (the LSA barriers pair CTAs by index). Pass 2's grid also
// depends on the device's occupancy of the pass-2 kernels: the same on every rank of one GPU type,
// and its only barrier is the TP exit CTA's (the grid's last).
#include <cstddef>

#include "kernels/lsa_plan.h"
#include "kernels/mhc_shape.h"

namespace spk {

// The kernel variants of the ops: where a post's y comes from, what the op computes, whether pass 2
// pushes layer_input rows to the peers (SP gather).
enum class MhcVariant : int {
  kPre,                 // mhc_pre; mhc_pre_ag on the nccl backend
  kPost,                // mhc_post; the posts of the nccl backend
  kPostPre,             // mhc_post_pre; mhc_post_pre_ar on the nccl backend
  kHead,                // mhc_head
  kPostPeers,           // mhc_post_rs, mhc_post_ar above the pushed sizes: y summed from the peers
  kPostPushed,          // mhc_post_ar at decode sizes: the peers push their partial rows
  kPreGather,           // mhc_pre_ag: pass 2 pushes layer_input rows to the peers
  kPostPrePeers,        // mhc_post_pre_ar
  kPostPrePeersGather,  // mhc_post_pre_rs_ag
};
constexpr int kNumMhcVariants = 9;

// Where a post's y comes from: none (a pre alone), a local tensor, the sum of every peer's partial
// rows pulled over NVLink after an entry barrier (kPeers), or mhc_post_ar at decode sizes
// (kPushed): each rank stores its own partial rows into every peer's push region, and a row's
// reader polls its region until the rows are there (protocol in tp_push.cuh).
enum class YSrc : int { kNone, kLocal, kPeers, kPushed };

struct MhcTraits {
  YSrc src;
  bool post, pre, head, gather;
};

constexpr MhcTraits mhc_traits(MhcVariant v) {
  switch (v) {
    case MhcVariant::kPre:
      return {YSrc::kNone, false, true, false, false};
    case MhcVariant::kPost:
      return {YSrc::kLocal, true, false, false, false};
    case MhcVariant::kPostPre:
      return {YSrc::kLocal, true, true, false, false};
    case MhcVariant::kHead:
      return {YSrc::kNone, false, true, true, false};
    case MhcVariant::kPostPeers:
      return {YSrc::kPeers, true, false, false, false};
    case MhcVariant::kPostPushed:
      return {YSrc::kPushed, true, false, false, false};
    case MhcVariant::kPreGather:
      return {YSrc::kNone, false, true, false, true};
    case MhcVariant::kPostPrePeers:
      return {YSrc::kPeers, true, true, false, false};
    case MhcVariant::kPostPrePeersGather:
      return {YSrc::kPeers, true, true, false, true};
  }
  return {YSrc::kNone, false, false, false, false};
}

// Floats of the pass-1 -> pass-2 workspace of a pre: [T][slices][fn rows + 1].
inline size_t mhc_ws_floats(MhcVariant v, int num_tokens, int hidden) {
  const MhcTraits t = mhc_traits(v);
  if (!t.pre) return 0;
  return (size_t)num_tokens * row_slices(hidden) * (t.head ? FnRows<true>::kVals : FnRows<false>::kVals);
}

// The kernels a plan launches. kRows' fn source (FnSrc in mhc_args.cuh: global, shared, parts),
// kRowsFnReg's row copies (1 from kRowCopiesMinTiles tiles) and the collapse kernels' kV (16-byte
// vectors per collapse thread; the loop kernel's | kLastReadFlag, collapse_last_read) are in
// MhcLaunch::variant.
enum class MhcKernel : int { kPostRow, kRows, kRowsTeams, kRowsFnReg, kCollapseRow, kCollapseLoop, kCopyIn };

struct MhcLaunch {
  MhcKernel kernel;
  int variant;  // kRows: FnSrc; kRowsFnReg: row copies (0 / 1); kCollapseRow: kV; kCollapseLoop: kV | flag; else 0
  int grid_x, grid_y, block;
  size_t smem;
};

// CTAs of each candidate kernel that fit on the device at once (its occupancy x SMs), for the
// variant's kernels; the launcher queries them. rows: the tile kernel with fn staged (a pre's
// largest shared memory), the local ops' CTA cap; wide: the head's teams kernel or a pre's
// fn-in-registers kernel; collapse_row (fused pres) / collapse_loop: pass 2's kernels at the hidden
// size's kV.
struct MhcOccupancy {
  int rows, wide, collapse_row, collapse_loop;
};

struct MhcPlan {
  int slices, groups, parts;        // TileArgs' pass-1 geometry (groups = 0: the even split)
  bool exit_barrier, push_barrier;  // TileArgs' flags
  int num_launches;
  MhcLaunch launches[3];  // in stream order, each a programmatic dependent of the one before
};

// kV of the collapse kernels at `hidden`: kV * kCollapseThreads >= hidden / 8; 0 past D = 8960
// (the ops cap D at kMaxHidden = 8192).
inline int collapse_vectors(int hidden) {
  const int kv = (hidden / 8 + kCollapseThreads - 1) / kCollapseThreads;
  return kv >= 1 && kv <= 5 ? kv : 0;
}

// Whether pass 2's loop kernel reads its rows evict-first (the op's last read of them; variant |
// kLastReadFlag): from kLastReadMinVecs vectors, and for a local pre (no peers, no gather) of at
// most kLastReadMaxRows rows.
constexpr int kLastReadFlag = 8;
inline bool collapse_last_read(const MhcTraits& t, int num_tokens, int kv) {
  return kv >= kLastReadMinVecs || (t.src != YSrc::kPeers && !t.gather && num_tokens <= kLastReadMaxRows);
}

// Dynamic shared memory of the tile kernel: a pre's fn slice. Every pre variant of the kernel gets
// it, staged or not, so that each runs at the occupancy max_ctas was computed for.
inline size_t rows_smem_bytes(const MhcTraits& t, int hidden) {
  return !t.pre ? 0 : t.head ? fn_smem_bytes<true>(hidden) : fn_smem_bytes<false>(hidden);
}

// Whether a pre's pass 2 may run a CTA per row (mhc_collapse_row_kernel): the fused pres only. The
// local pres run the loop kernel at every T (same-run A/B on one H200, docs/performance.md: 5-18%
// faster at T = 300-512, within 3% elsewhere); the fused pres' A/B needs two GPUs.
constexpr bool collapse_row_used(const MhcTraits& t) { return t.pre && (t.src == YSrc::kPeers || t.gather); }

// mhc_post alone (every T the row kernel's grid holds): the row kernel, which needs no occupancy.
inline bool mhc_post_row_only(MhcVariant v, int num_tokens) {
  return v == MhcVariant::kPost && num_tokens <= kPostRowRows;
}

// The plan of op variant `v` on num_tokens rows of hidden columns (T_local in SP mode). max_ctas:
// the rank-agreed cap of the fused ops, or <= 0 for the local ops (then occ.rows). T = 0: no launch.
inline MhcPlan mhc_plan(MhcVariant v, int num_tokens, int hidden, int max_ctas, const MhcOccupancy& occ) {
  const MhcTraits t = mhc_traits(v);
  const int T = num_tokens, D = hidden;
  MhcPlan p = {};
  if (T <= 0) return p;
  if (mhc_post_row_only(v, T)) {
    p.num_launches = 1;
    p.launches[0] = {MhcKernel::kPostRow, 0, (D / 8 + kPostRowThreads - 1) / kPostRowThreads, T, kPostRowThreads, 0};
    return p;
  }
  if (max_ctas <= 0) max_ctas = occ.rows;
  const int num_tiles = (T + kTileTokens - 1) / kTileTokens;
  p.slices = row_slices(D);
  p.groups = max_ctas / p.slices < 1 ? 1 : max_ctas / p.slices < num_tiles ? max_ctas / p.slices : num_tiles;
  // Decode sizes: one CTA per 8 fn rows when every (tile, slice, part) has an SM to itself (split
  // at two CTAs per SM, it is slower than unsplit).
  const int fn_parts = (t.head ? FnRows<true>::kRows : FnRows<false>::kRows) / 8;
  p.parts = t.pre && fn_parts > 1 && (long)num_tiles * p.slices * fn_parts <= max_ctas / kRowsCtasPerSm ? fn_parts : 1;
  p.exit_barrier = t.src == YSrc::kPeers && t.pre && !t.gather;
  p.push_barrier = t.gather && t.src != YSrc::kPeers;  // kPeers: pass 1's entry barrier does it
  const bool staged = t.pre && rows_staged(num_tiles, p.groups);
  // FnSrc: 0 global, 1 shared (staged), 2 parts (decode).
  MhcLaunch rows = {MhcKernel::kRows,     p.parts > 1 ? 2 : staged ? 1 : 0, p.slices * p.groups * p.parts, 1, kThreads,
                    rows_smem_bytes(t, D)};
  if (t.src == YSrc::kNone && !t.post && t.pre) {
    // A pre or head without a post, fn staged, one CTA per SM, where a slice has more than
    // kPreTeams tiles per SM of its own: a pre on mhc_rows_fnreg_kernel (one team, fn in
    // registers, x through a ring), the head on mhc_rows_teams_kernel (kPreTeams teams on one fn
    // copy in shared memory). A CTA per (slice, tile set) leaves SMs mod S idle; where that is
    // worth it (even_split), a pre's pass 1 runs on every SM (groups = 0: the others take the
    // slices' tails, mhc_rows_fnreg_kernel).
    const int teams = t.head ? kPreTeams : 1;
    const int resident = staged ? occ.wide : 0;
    if (const int per_slice = resident / p.slices; per_slice >= 1 && num_tiles > per_slice * kPreTeams) {
      rows.kernel = t.head ? MhcKernel::kRowsTeams : MhcKernel::kRowsFnReg;
      rows.variant = !t.head && num_tiles >= kRowCopiesMinTiles ? 1 : 0;
      p.groups = per_slice * teams;
      rows.grid_x = p.slices * per_slice;
      if (!t.head && even_split(num_tiles, p.slices, resident)) {  // every SM
        p.groups = 0;
        rows.grid_x = resident;
      }
      rows.block = kThreads * teams;
      rows.smem = t.head ? fn_smem_bytes<true>(D) : kFnRegSmemBytes;
    }
  }
  p.launches[p.num_launches++] = rows;
  if (!t.pre) return p;
  // Pass 2 (launch order as in mhc_collapse.cuh): a fused pre runs a CTA per row while the rows'
  // CTAs fit on the device in kRowWaves waves; else (and a local pre at every T) a CTA per slot
  // looping over the rows. With exit_barrier (TP) one more CTA than the rows need: it does the
  // exit barrier alone.
  const int extra = p.exit_barrier ? 1 : 0, kv = collapse_vectors(D);
  if (collapse_row_used(t) && T + extra <= kRowWaves * occ.collapse_row)
    p.launches[p.num_launches++] = {MhcKernel::kCollapseRow, kv, T + extra, 1, kThreads, 0};
  else
    p.launches[p.num_launches++] = {MhcKernel::kCollapseLoop,
                                    kv | (collapse_last_read(t, T, kv) ? kLastReadFlag : 0),
                                    (T < occ.collapse_loop - extra ? T : occ.collapse_loop - extra) + extra,
                                    1,
                                    kThreads,
                                    0};
  if (t.gather)  // the copy-in of the rows the peers pushed: one rank's block, T rows of layer_input
    p.launches[p.num_launches++] = {MhcKernel::kCopyIn, 0, lsa_all_gather_grid((size_t)T * D * 2, max_ctas), 1,
                                    kGatherThreads,     0};
  return p;
}

}  // namespace spk
