#pragma once
// The geometry of the mHC kernels, shared by the device code and the host launch plan. Plain C++
// (no CUDA headers): the plan compiles with g++ in the CPU-only build and is unit-tested there.
#include <cstddef>

#ifdef __CUDACC__
#define SPK_HD __host__ __device__
#else
#define SPK_HD
#endif

namespace spk {

constexpr int kHC = 4;                 // stream count; kernels are specialised for 4
constexpr int kMix = (2 + kHC) * kHC;  // 24 mixing values: pre | post | res (row-major i, j)
constexpr int kTileTokens = 16;        // tokens per tile: two n8 halves of mma.m16n8k16 (n = token)
constexpr int kThreads = 256;          // threads per CTA
constexpr int kWarps = kThreads / 32;
constexpr int kMaxPeers = 8;      // LSA ranks the fused kernels sum over (one NVLink node)
constexpr int kMaxHidden = 8192;  // D limit: the fn slice of a CTA must fit in shared memory

// Pass-1 CTAs per SM (the tile kernel's launch bounds; a pre's 96 KB fn slice + static smem fit twice).
constexpr int kRowsCtasPerSm = 2;

// Tiles of x in flight through shared memory in the fn-in-registers pass 1 (mhc_rows' ring).
constexpr int kFnRegRing = 2;
// From this many tiles (T > 1008) that ring's copies go a warp per 512-byte row (row copies,
// TilePolicy): 1-3% faster at D = 4096 / 5120 from T = 4096 on an H100 when merged, within 1% since
// fnfirst and fetch256; ~1% slower at T <= 512 (docs/performance.md).
constexpr int kRowCopiesMinTiles = 64;

// The head's teams kernel: teams of kThreads threads per CTA on one staged fn slice.
constexpr int kPreTeams = 2;

// fn rows padded to whole m-tiles (8 rows): 24 for pre, 4 -> 8 for the head; +1 workspace value (sum x^2).
template <bool kHead>
struct FnRows {
  static constexpr int kRows = kHead ? 8 : kMix;
  static constexpr int kValid = kHead ? kHC : kMix;
  static constexpr int kVals = kRows + 1;
};

constexpr int kSliceVecs = 32;                       // 16-byte vectors per stream in a slice: one group of 4 per warp
constexpr int kCollapseThreads = (kWarps - 1) * 32;  // pass 2's collapse threads (warps 0..6; 7: coefficients)
constexpr int kQuadRows = 8;                         // rows of the coefficient warp's quads
constexpr int kWsBatch = 16;                         // pass 2: workspace partials loaded at once per value

SPK_HD inline int row_slices(int hidden) { return (hidden / 8 + kSliceVecs - 1) / kSliceVecs; }

SPK_HD inline int slice_groups(int hidden, int slices) {
  const int nvec = hidden / 8;
  return ((nvec + slices - 1) / slices + 3) / 4;  // groups of 4 vectors in the widest slice
}

template <bool kHead>
SPK_HD inline size_t fn_smem_bytes(int hidden) {
  const int slices = row_slices(hidden);
  return (size_t)kHC * slice_groups(hidden, slices) * 2 * FnRows<kHead>::kRows * 4 * 16;
}

// Pass 1 of a pre stages its fn slice in shared memory when its CTAs have several tiles.
SPK_HD inline bool rows_staged(int num_tiles, int groups) { return num_tiles > groups; }

// The fn-in-registers pass 1 splits its tiles over every SM (a.groups = 0) from 512 tiles
// (T > 8176) where the strided grid leaves at least 1/12 of the SMs idle (H200: D = 5120, 12 of
// 132; 7168, 20); with fewer tiles the runs' fn reloads cost more than the idle SMs give.
SPK_HD inline bool even_split(int num_tiles, int slices, int resident) {
  return num_tiles >= 512 && resident % slices * 12 >= resident;
}

// Dynamic shared memory of the fn-in-registers pass 1: its x ring (16-byte slots).
constexpr size_t kFnRegSmemBytes = (size_t)kFnRegRing * 2 * kHC * kThreads * 16;

// mhc_post alone runs the row kernel up to this T (its grid's y limit: a row per grid row), with
// blocks of this many threads; the tile kernel above (why: docs/performance.md).
constexpr int kPostRowRows = 65535;
constexpr int kPostRowThreads = 64;

// Pass 2 of a pre: a CTA per row while the rows' CTAs fit on the device in this many waves, else a
// CTA per slot looping over the rows.
constexpr int kRowWaves = 2;

// Pass 2's loop kernel reads its rows evict-first (its last read of them) from this many vectors
// per collapse thread and stream (D > 5376): 2-4% faster at D = 7168 on an H100, up to 2% slower
// at D = 4096 from T = 4096 (docs/performance.md, "l2last")...
constexpr int kLastReadMinVecs = 4;
// ... and at every D for a local pre of at most this many rows: 3-5% faster at T = 1008, D = 4096,
// level at T = 512 on an H200 (docs/performance.md, "l2last for short calls").
constexpr int kLastReadMaxRows = 1024;

}  // namespace spk
