#pragma once
// The mHC kernels behind every op, local or fused with a collective (torch-free). Two passes:
//
// 1. mhc_rows_kernel. CTA (g, s) owns column slice s of D (at most 256 columns of each of the
//    4 streams) and the 16-token tiles g, g + G, ... For each tile it
//    A. loads the stream slice (and for a post: y, or the sum of every peer's partial rows in
//       rank order 0..tp-1 over NVLink), mixes it and stores the new stream;
//    B. for a pre: m = fn · x on bf16 tensor cores, fn split into bf16 hi + lo (fp32-grade
//       accuracy), and the sum of x^2, summed warp -> CTA in a fixed order and written to a
//       workspace ws[T][S][rows + 1]. No CTA ever waits for another: the pass streams at HBM
//       (and NVLink) speed. At decode sizes (tiles x slices x 3 CTAs fit one per SM) CTA (g, s, p)
//       computes only fn rows 8p..8p+7 (a = 3 parts): three times the CTAs, each loading a third
//       of fn, with every sum bitwise unchanged (each row's mma chain is the same).
// 2. mhc_collapse_row_kernel / mhc_collapse_loop_kernel (pres only; a CTA per row while the rows'
//    CTAs fit on the GPU in two waves, above that a CTA per SM slot looping over rows): sums each
//    row's S partials in slice order, computes the coefficients on a coefficient warp (sigmoids,
//    Sinkhorn; one quad of lanes per row; the collapse starts once the pre weights are out),
//    collapses the stream (+ fused RMSNorm) and writes layer_input; in SP mode it also stores each row straight into
//    every peer's gather region (NVLink pushes overlapping the pass's HBM work), and
//    lsa_copy_in_kernel moves the peers' rows into layer_input (protocol in lsa_gather.cuh).
//    Pass 2 is a programmatic dependent launch of pass 1 (pdl.cuh).
// Every summation has a fixed order: replicated ranks compute bitwise-identical results, and a
// row's result does not depend on T (SP rows equal TP rows).
#include <nccl.h>
#include <nccl_device.h>

#include "kernels/lsa_barrier.cuh"
#include "kernels/mhc_math.cuh"
#include "kernels/pdl.cuh"

namespace spk {

// Where a post's y comes from: none (a pre alone), a local tensor, the sum of every peer's partial
// rows pulled over NVLink after an entry barrier (kPeers), or mhc_post_ar at decode sizes
// (kPushed): each rank stores its own partial rows into every peer's push region, and a row's
// reader polls its region until the rows are there (protocol at PushArgs).
enum class YSrc : int { kNone, kLocal, kPeers, kPushed };

// Pass-1 CTAs per SM (the kernel's launch bounds; a pre's 96 KB fn slice + static smem fit twice).
constexpr int kRowsCtasPerSm = 2;

// Where pass 1 of a pre takes its fn fragments, chosen at launch: global memory (one tile per CTA),
// shared memory (several tiles per CTA: staged once), global memory for one part of 8 fn rows
// (decode: a.parts > 1), or registers (a pre's tile loop on mhc_rows_fnreg_kernel: each thread's
// fragments loaded once). Each its own kernel: every path in one kernel cost the others registers
// (the local post_pre's spilled 48-92 bytes) and a select per fragment compiled to a branch around
// each load (SASS of 3ab923e).
enum class FnSrc : int { kGlobal, kShared, kParts, kRegs };

// FnSrc::kRegs: the tiles of x in flight through shared memory (mhc_rows' ring). 2 was 3-7% faster
// than the teams kernel's one stage for mhc_pre; 4 and 6 gave it back (ab_fnreg_2026-11-30).
constexpr int kFnRegRing = 2;

// The pushed TP op (YSrc::kPushed: mhc_post_ar at T <= PushArgs::rows): no barrier. Push region
// of rank r: [2 slots][world senders][rows][D] bf16, every element the sentinel 0x8000 (-0.0)
// unless a value is in flight. A call uses slot `calls & 1`. Each CTA loads its rows of this
// rank's partial, turns -0.0 into +0.0 (the sum starts at +0.0, so its bits do not change) and
// stores them at [slot][rank] in every peer's region; it then polls [slot][peer] of its own
// region until no lane is the sentinel, sums the rows in rank order as kPeers does, and puts the
// sentinel back at once (it is the vector's only reader). The own partial is read where the caller
// has it (TileArgs::y), not from the window: no staging copy. Each CTA then takes a ticket; the
// last one resets it and increments `calls` (every CTA has read it by then). A peer writes a slot
// again two pushed calls later, after it read this rank's rows of the call in between, which this
// rank pushed only after this call's kernel completed: so the slot is clear by then. Nobody reads
// this rank's partial region remotely, so there is no exit barrier either. (mhc_post_pre_ar pushed
// the same way, its pass 2 clearing the slot, was 0-16% slower than pulled at T <= 128 and its
// :plain form at most 10% faster: bench/results/ab_tppush_2026-11-30.txt.)
struct PushArgs {
  size_t offset;     // bytes: this rank's push region of the window
  int rows;          // rows per (slot, sender)
  uint32_t* calls;   // local: pushed calls so far
  uint32_t* ticket;  // local: CTAs done reading `calls` in this call
};

struct LsaArgs {
  ncclWindow_t window;
  size_t partial_offset;  // bytes: this rank's [max_tokens, D] partial region of the window
  size_t gather_offset;   // bytes: this rank's [max_tokens, D] gather region of the window
  int rank, world;
  int partial_row0;  // first partial row this rank reduces (SP: rank * T_local; TP: 0)
  BarrierArgs barrier;
  PushArgs push;
};

struct TileArgs {
  int num_tokens;  // rows this rank mixes: T_local in SP mode, T otherwise
  int hidden;
  const __nv_bfloat16* stream;  // [num_tokens, 4, D]
  const __nv_bfloat16* y;       // [num_tokens, D]: YSrc::kLocal's y, YSrc::kPushed's own partial
  const float* post_mix_in;     // [num_tokens, 4]
  const float* res_mix_in;      // [num_tokens, 4, 4]
  const float* fn;              // [24, 4D] ([4, 4D] for the head)
  const float* scale;
  const float* base;
  const __nv_bfloat16* norm_weight;  // [D] or null
  const float* pre_mix_in;           // [num_tokens, 4] or null
  MhcEps eps;
  __nv_bfloat16* new_stream;   // [num_tokens, 4, D] (posts; null otherwise)
  __nv_bfloat16* layer_input;  // [tp * num_tokens, D] in gather mode (rank-major), else [num_tokens, D]
  float* post_mix;             // [num_tokens, 4]
  float* res_mix;              // [num_tokens, 4, 4]
  float* pre_mix;              // [num_tokens, 4]
  float* ws;                   // [num_tokens, slices, rows + 1]: pass 1 -> pass 2 (pres)
  int slices;                  // S: column slices of D, a function of D only
  int groups;                  // G: CTAs per slice in pass 1
  int parts;                   // pass 1 CTAs per (tile, slice): 1, or one per 8 fn rows at decode sizes
  bool exit_barrier;           // pass 2: an extra last CTA syncs with the peers' (peers done reading partials)
  bool push_barrier;           // pass 1 without an entry barrier: CTA 0 syncs before pass 2 pushes (SP)
  LsaArgs lsa;
};

// The tiles of one column slice that a CTA of mhc_rows_fnreg_kernel runs in one pass of its tile
// loop: first, first + step, ... below end (its fn fragments loaded once per run).
struct TileRun {
  int slice, first, step, end;
};

// fn rows padded to whole mma n-tiles: 24 for pre, 4 -> 8 for the head; +1 workspace value (sum x^2).
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

__host__ __device__ inline int row_slices(int hidden) { return (hidden / 8 + kSliceVecs - 1) / kSliceVecs; }

__host__ __device__ inline int slice_groups(int hidden, int slices) {
  const int nvec = hidden / 8;
  return ((nvec + slices - 1) / slices + 3) / 4;  // groups of 4 vectors in the widest slice
}

template <bool kHead>
__host__ __device__ inline size_t fn_smem_bytes(int hidden) {
  const int slices = row_slices(hidden);
  return (size_t)kHC * slice_groups(hidden, slices) * 2 * FnRows<kHead>::kRows * 4 * sizeof(uint4);
}

// Pass 1 of a pre stages its fn slice in shared memory when its CTAs have several tiles.
__host__ __device__ inline bool rows_staged(int num_tiles, int groups) { return num_tiles > groups; }

// Four fn values as an mma A fragment, split into bf16 hi and lo: {hi01, lo01, hi23, lo23}, i.e.
// hi in the m-tile's row g and lo in row g + 8.
__device__ __forceinline__ uint4 fn_split(const float4& f) {
  uint4 q;
  split_bf16x2(f.x, f.y, q.x, q.y);
  split_bf16x2(f.z, f.w, q.z, q.w);
  return q;
}

// One entry of the CTA's fn slice as a fragment: for fn row n and stream i, elements 4s..4s+3 of
// vector `vec` of the slice (zeros past the valid rows and the slice's columns). The k order
// inside a 16-wide mma step is permuted (thread t owns 4 contiguous elements) identically for A
// and B, so the product is unchanged and both operands load as plain vectors.
template <bool kHead>
__device__ __forceinline__ uint4 fn_fragment(const TileArgs& a, int i, int n, int vec, int s, int v0, int W) {
  float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
  if (n < FnRows<kHead>::kValid && vec < W)
    f = __ldg(reinterpret_cast<const float4*>(a.fn + (size_t)n * kHC * a.hidden + (size_t)i * a.hidden +
                                              (size_t)(v0 + vec) * 8 + 4 * s));
  return fn_split(f);
}

// The slice's fragments in shared memory for CTAs that reuse them over several tiles. Entry
// (((i * gmax + grp) * 2 + s) * kRows + n) * 4 + t. Staged before the entry barrier, so that its
// latency hides behind the peers' arrival. Thread (i, grp, s, t) (256 = 4 streams x 8 groups x 2
// halves x 4 vectors; gmax <= 8) stages fn rows 0..kRows-1 of its 4 floats: one base pointer per
// thread and a stride of one fn row, every load in flight before the first split (nothing else
// is live yet). Its first form walked the entries in index order, which cost ~1860 instructions
// per warp of index arithmetic for 24 loads (ncu at T = 1024: a third of pass 1's samples).
// The peers-source kernel calls it out of line (stage_fn_slice_call): inlined there, it moved the
// tile loop to 8 bytes of spills.
template <bool kHead>
__device__ __forceinline__ void stage_fn_slice(const TileArgs& a, int v0, int W, int gmax) {
  constexpr int kRows = FnRows<kHead>::kRows, kValid = FnRows<kHead>::kValid;
  static_assert(kThreads == kHC * 8 * 2 * 4, "a thread per (stream, group, half, vector)");
  extern __shared__ __align__(16) uint4 s_fn[];
  const int t = threadIdx.x & 3, s = (threadIdx.x >> 2) & 1, grp = (threadIdx.x >> 3) & 7, i = threadIdx.x >> 6;
  if (threadIdx.x < kThreads && grp < gmax) {  // a teams kernel's first team stages for all
    const int vec = grp * 4 + t;
    const size_t row = (size_t)kHC * a.hidden;  // one fn row
    const float* src = a.fn + (size_t)i * a.hidden + (size_t)(v0 + vec) * 8 + 4 * s;
    uint4* dst = s_fn + (((i * gmax + grp) * 2 + s) * kRows) * 4 + t;
    float4 f[kRows];
#pragma unroll
    for (int n = 0; n < kRows; ++n)
      f[n] = n < kValid && vec < W ? __ldg(reinterpret_cast<const float4*>(src + n * row))
                                   : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int n = 0; n < kRows; ++n) dst[n * 4] = fn_split(f[n]);
  }
  __syncthreads();
}

template <bool kHead>
__device__ __noinline__ void stage_fn_slice_call(const TileArgs& a, int v0, int W, int gmax) {
  stage_fn_slice<kHead>(a, v0, W, gmax);
}

// Pushed rows (PushArgs): the sentinel in both bf16 lanes of a word, -0.0 -> +0.0, and the poll.
constexpr uint32_t kPushSentinel = 0x80008000u;

__device__ __forceinline__ uint32_t no_neg_zero(uint32_t w) {
  if ((w & 0xffffu) == 0x8000u) w &= 0xffff0000u;
  if ((w >> 16) == 0x8000u) w &= 0x0000ffffu;
  return w;
}

__device__ __forceinline__ bool has_sentinel(uint32_t w) { return (w & 0xffffu) == 0x8000u || (w >> 16) == 0x8000u; }

__device__ __forceinline__ bool has_sentinel(const uint4& v) {
  return has_sentinel(v.x) || has_sentinel(v.y) || has_sentinel(v.z) || has_sentinel(v.w);
}

// A load from L2 on every call (the peers' NVLink stores land there), never an L1 line. The
// "memory" clobber keeps the compiler from moving the post's clearing store (same address) above it.
__device__ __forceinline__ uint4 ld_volatile(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// The end of a pushed post (PushArgs): the last CTA to take a ticket, when every CTA has read
// `calls`, moves the next call to the other slot.
__device__ __forceinline__ void push_ticket(const TileArgs& a) {
  __syncthreads();  // every thread of the CTA has read `calls`
  if (threadIdx.x != 0) return;
  cuda::atomic_ref<uint32_t, cuda::thread_scope_device> ticket(*a.lsa.push.ticket);
  if (ticket.fetch_add(1, cuda::memory_order_acq_rel) != gridDim.x - 1) return;
  ticket.store(0, cuda::memory_order_relaxed);
  *a.lsa.push.calls += 1;
}

// The post's new stream j for one 8-column vector: bf16(post[j] * y + sum_i res[i][j] * x_i), the
// sum in stream order. mix = post[4] | res[4][4] (res[i][j] at kHC + i * kHC + j). Both post
// kernels use it, so a row is bitwise the same whichever runs it.
__device__ __forceinline__ uint4 post_mix_vector(const float* mix, const float (&xf)[kHC][8], const float (&yv)[8],
                                                 int j) {
  float nv[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < kHC; ++i) acc += mix[kHC + i * kHC + j] * xf[i][e];
    nv[e] = mix[j] * yv[e] + acc;
  }
  return float_to_bf16x8(nv);
}

// Named barrier `id` (0 is __syncthreads) over `count` threads: arrive, or arrive and wait.
__device__ __forceinline__ void bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// kTeams > 1 (mhc_rows_teams_kernel, the head): the CTA is kTeams teams of kThreads threads on one staged fn
// slice, team k of CTA b acting as CTA ((b / S) * kTeams + k) * S + b % S of the one-team grid; each
// team has its own reduction buffers and syncs on named barrier 1 + k.
//
// kFn == FnSrc::kRegs runs the tiles of `run`; every other kernel CTA (g, s)'s tiles g, g + G, ...
template <YSrc kSrc, bool kPost, bool kPre, bool kHead, FnSrc kFn, int kTeams = 1>
__device__ __forceinline__ void mhc_rows(const TileArgs& a, const TileRun& run = {}) {
  constexpr int kRows = FnRows<kHead>::kRows;
  constexpr int kVals = FnRows<kHead>::kVals;
  constexpr int kNT = kRows / 8;
  extern __shared__ __align__(16) uint4 s_fn[];
  // Warp partial products (in two rounds) and sums of squares, double-buffered by tile parity:
  // a tile's writes and the previous tile's workspace reads are then apart without a barrier
  // (A/B on 2xH200 at T = 8192, D = 4096: mhc_pre 240 -> 229 us, TP boundary 448 -> 431).
  __shared__ float s_red_team[kTeams][2][kWarps / 2][kTileTokens][kRows];
  __shared__ float s_redsq_team[kTeams][2][kWarps][kTileTokens];
  __shared__ float s_mixin_team[kTeams][kTileTokens][kMix - kHC];  // incoming post | res of the tile
  static_assert(kTeams == 1 || (kHead && kFn == FnSrc::kShared), "teams: the staged head");
  const int team = kTeams == 1 ? 0 : threadIdx.x / kThreads;
  auto& s_red = s_red_team[team];
  auto& s_redsq = s_redsq_team[team];
  auto& s_mixin = s_mixin_team[team];
  auto team_sync = [&] {
    if constexpr (kTeams == 1)
      __syncthreads();
    else
      bar_sync(1 + team, kThreads);
  };

  const int parts = a.parts, part = blockIdx.x % parts;
  const int cta =
      kTeams == 1 ? blockIdx.x / parts : ((blockIdx.x / a.slices) * kTeams + team) * a.slices + blockIdx.x % a.slices;
  constexpr bool kRun = kFn == FnSrc::kRegs;
  const int S = a.slices, slice = kRun ? run.slice : cta % S;
  const int tid = kTeams == 1 ? threadIdx.x : threadIdx.x % kThreads;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int D = a.hidden, nvec = D >> 3, T = a.num_tokens;
  const int v0 = slice * nvec / S, W = (slice + 1) * nvec / S - v0;
  const int gmax = slice_groups(D, S);
  const int num_tiles = (T + kTileTokens - 1) / kTileTokens;
  // The tiles: `run`'s (kRegs), else CTA (g, s)'s, each read where it is used as before the runs
  // (held in registers, they moved the decode TP boundary's pass 1 to 20 bytes of spills).
  auto first = [&] {
    if constexpr (kRun)
      return run.first;
    else
      return cta / S;
  };
  auto step = [&] {
    if constexpr (kRun)
      return run.step;
    else
      return a.groups;
  };
  auto tile_end = [&] {
    if constexpr (kRun)
      return run.end;
    else
      return num_tiles;
  };
  const size_t srow = (size_t)kHC * D;
  const int vec = warp * 4 + t;  // this thread's vector of the slice (per stream)
  const size_t col = (size_t)(v0 + vec) * 8;
  // kPushed: this call's slot (the call before incremented `calls` and has completed).
  const uint32_t pslot = kSrc == YSrc::kPushed ? __ldcg(a.lsa.push.calls) & 1u : 0u;

  // ---- A: every stream load of a tile issued at once; x[h][i] = token g + 8h, stream i. A local
  // post's y rows go out with them (yr[h]), not after the barrier that stages the tile's mixes:
  // at decode sizes that was a second HBM round trip per call. Not for a post_pre: its pass 1
  // has no registers to spare (128 with 4 bytes spilled). Not for a pushed post either: its own
  // rows there were 10-20% slower at T = 16-32 than loaded after the pushes (`mine` below;
  // bench/results/ab_yr_2026-11-30.txt).
  constexpr bool kEarlyY = kPost && !kPre && kSrc == YSrc::kLocal;
  // kStageX (fn in registers: a pre's mhc_rows_fnreg_kernel): the tile's x comes by 16-byte
  // cp.async through a ring of kFnRegRing tiles in shared memory, this thread's own 8 slots per
  // tile (slot k of thread t at k * kThreads + t: no bank conflicts). A tile's copies are issued
  // right after the mma of the tile kFnRegRing before it has read that slot, and are one commit
  // group (an empty one past the last tile), so tile j waits with wait_group<kFnRegRing - 1>. No L2
  // prefetch: the copy is the only read, so each byte crosses the L2 partitions' fabric once.
  // With the fragments in registers, pass 1 no longer fills the shared-memory pipe with their
  // 98 KB of loads per tile at D = 7168 (ncu_d7168_cpx_2026-11-30): mhc_pre 3-7% faster than the
  // teams kernel's one stage (ab_fnreg_2026-11-30). Only a pre's: the local post_pre and the fused
  // boundaries so (their old stream and y through the ring, one CTA per SM) were 6-49% slower.
  constexpr int kRing = kFn == FnSrc::kRegs ? kFnRegRing : 0;
  constexpr bool kStageX = kRing > 0;
  static_assert(!kStageX || (kSrc == YSrc::kNone && !kPost && !kHead), "the ring: a pre's x");
  uint4* const x_stage = s_fn;                 // mhc_rows_fnreg_kernel's dynamic shared memory is the ring
  auto issue_tile = [&](int tile, int slot) {  // and commit; only the commit past the last tile
    if (tile < tile_end()) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = tile * kTileTokens + g + 8 * h;
        const bool valid = vec < W && row < T;
#pragma unroll
        for (int i = 0; i < kHC; ++i)
          cp_async16(x_stage + ((slot * 2 + h) * kHC + i) * kThreads + tid,
                     valid ? a.stream + row * srow + (size_t)i * D + col : a.stream, valid ? 16 : 0);
      }
    }
    cp_async_commit();
  };
  uint4 x[2][kHC], yr[2];
  auto load_tile = [&](int row_base, int slot) {
    if constexpr (kStageX) {
      cp_async_wait<kRing - 1>();
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < kHC; ++i) x[h][i] = x_stage[((slot * 2 + h) * kHC + i) * kThreads + tid];
      return;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_base + g + 8 * h;
      const bool valid = vec < W && row < T;
#pragma unroll
      for (int i = 0; i < kHC; ++i)
        x[h][i] = valid ? *reinterpret_cast<const uint4*>(a.stream + row * srow + (size_t)i * D + col)
                        : make_uint4(0, 0, 0, 0);
      if constexpr (kEarlyY)
        yr[h] = valid ? *reinterpret_cast<const uint4*>(a.y + (size_t)row * D + col) : make_uint4(0, 0, 0, 0);
    }
  };
  // The head reads x only in the mma phase: the next tile's loads go out right after it, into the
  // same registers, and are in flight through this tile's CTA sums and workspace stores (A/B on
  // 2xH200, T = 8192: mhc_head 173 -> 161 us; the same for mhc_pre and mhc_pre_ag was 4-6 %
  // slower than their L2 prefetch below, so they keep it). The local post_pre too, keeping the
  // prefetch: its x is dead once the mma has read the new stream, so the next tile's old stream
  // loads there (`mhc_post_pre` T >= 1024 1-10% faster, most at T = 16384; without the stream's
  // prefetch 8-11% slower than before: bench/results/ab_pipepp_2026-12-01.txt). The fused
  // post_pres (kPeers) are not measured so yet (runbook 22).
  static_assert(!(kHead && kPost), "the head is a pre without a post");
  constexpr bool kPipe = kHead || (kPost && kPre && kSrc == YSrc::kLocal);
  if (kPipe && first() < tile_end()) load_tile(first() * kTileTokens, 0);
  // A post's incoming mixes (post | res, kMixIn per token). The piped post_pre loads the next
  // tile's right after the mma (this thread's idx = tid + k * kThreads), and the tile's top only
  // stores them: level on their own (ab_pipepp), but with them loaded at the top the piped kernel
  // spilled 16 bytes in its one-tile (FnSrc::kGlobal) form.
  constexpr int kMixIn = kMix - kHC, kMixPer = (kTileTokens * kMixIn + kThreads - 1) / kThreads;
  constexpr bool kMixAhead = kPipe && kPost;
  auto mix_in = [&](int row, int c) {
    return c < kHC ? a.post_mix_in[row * kHC + c] : a.res_mix_in[row * kHC * kHC + c - kHC];
  };
  float mix_next[kMixAhead ? kMixPer : 1];
  auto load_mix = [&](int row_base, int k) {
    const int idx = tid + k * kThreads, row = row_base + idx / kMixIn;
    return idx < kTileTokens * kMixIn && row < T ? mix_in(row, idx % kMixIn) : 0.f;
  };
  if constexpr (kMixAhead)
    if (first() < tile_end())
#pragma unroll
      for (int k = 0; k < kMixPer; ++k) mix_next[k] = load_mix(first() * kTileTokens, k);
  if constexpr (kStageX)
#pragma unroll
    for (int r = 0; r < kRing; ++r) issue_tile(first() + r * step(), r);
  // kRegs: this thread's fn fragments, loaded once (a warp past the slice's columns adds zeros).
  uint4 fq[kFn == FnSrc::kRegs ? kHC : 1][kNT][2];
  if constexpr (kFn == FnSrc::kRegs)
    if (warp < gmax)
#pragma unroll
      for (int i = 0; i < kHC; ++i)
#pragma unroll
        for (int p = 0; p < kNT; ++p)
#pragma unroll
          for (int s = 0; s < 2; ++s) fq[i][p][s] = fn_fragment<kHead>(a, i, p * 8 + g, vec, s, v0, W);

  for (int tile = first(), buf = 0, slot = 0; tile < tile_end();
       tile += step(), buf ^= 1, slot = slot + 1 < kRing ? slot + 1 : 0) {
    const int row_base = tile * kTileTokens;
    if constexpr (!kPipe) load_tile(row_base, slot);
    // The CTA's next tile into L2 while this one computes: one bulk prefetch per (token, stream)
    // slice row (and y's), so the next loads wait on L2, not HBM (ncu at T = 8192, D = 4096:
    // post_pre pass 1 288 -> 262 us, pre 144 -> 139). The ranges are dealt round the warps: the
    // bulk prefetch takes uniform operands, so a warp runs its lanes' ranges one after another,
    // and with them on the first threads two warps ran 32 steps while the others waited at the
    // next barrier (ncu: ~7% of pass 1's stall samples; A/B on 2xH200 at T = 8192, D = 4096:
    // mhc_pre 231 -> 225 us, post_pre 364 -> 353, SP boundary 347 -> 338).
    constexpr int kPer = kHC + (kSrc == YSrc::kLocal ? 1 : 0);  // ranges per token: streams, y
    static_assert(kTileTokens * kPer % kWarps == 0, "whole shares per warp");
    if (const int next = row_base + step() * kTileTokens;
        kPre && !kHead && !kStageX && next < T && lane < kTileTokens * kPer / kWarps) {
      const int k = lane * kWarps + warp, row = next + k / kPer, i = k % kPer;
      if (row < T && i < kHC)
        prefetch_l2(a.stream + row * srow + (size_t)i * D + (size_t)v0 * 8, W * 16);
      else if (row < T)
        prefetch_l2(a.y + (size_t)row * D + (size_t)v0 * 8, W * 16);
    }
    // The previous tile's readers of s_mixin are done: a post alone has no later barrier; with a
    // pre they read before its sums' barriers (and s_red is the other buffer).
    if constexpr (!kPre) team_sync();
    if constexpr (kPost) {
      // kPushed: this rank's vector `v` of row `row` in `sender`'s place of a push region (PushArgs).
      auto push_off = [&](int sender, int row, int v) {
        return a.lsa.push.offset +
               ((((size_t)pslot * a.lsa.world + sender) * a.lsa.push.rows + row) * D + (size_t)(v0 + v) * 8) * 2;
      };
      uint4 mine[2];                          // kPushed: this rank's own partial vectors of tokens g and g + 8
      if constexpr (kSrc == YSrc::kPushed) {  // the rows out first, before the mixes' barrier
        // The (tile, slice)'s rows of this rank's partial into every peer's push region, a warp
        // per run of 32 vectors of a row: whole 128-byte lines over NVLink, where the tile layout
        // would store 64-byte pieces of 8 rows.
        const int rows = min(kTileTokens, T - row_base);
        for (int i = tid; i < rows * W; i += kThreads) {
          const int row = row_base + i / W, v = i % W;
          uint4 y = *reinterpret_cast<const uint4*>(a.y + (size_t)row * D + (size_t)(v0 + v) * 8);
          y = make_uint4(no_neg_zero(y.x), no_neg_zero(y.y), no_neg_zero(y.z), no_neg_zero(y.w));
          for (int k = 0; k < a.lsa.world - 1; ++k)
            *static_cast<uint4*>(ncclGetLsaPointer(a.lsa.window, push_off(a.lsa.rank, row, v), k + (k >= a.lsa.rank))) =
                y;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = row_base + g + 8 * h;
          mine[h] = vec < W && row < T ? *reinterpret_cast<const uint4*>(a.y + (size_t)row * D + col)
                                       : make_uint4(0, 0, 0, 0);
        }
      }
      if constexpr (kMixAhead) {
#pragma unroll
        for (int k = 0; k < kMixPer; ++k)
          if (const int idx = tid + k * kThreads; idx < kTileTokens * kMixIn)
            s_mixin[idx / kMixIn][idx % kMixIn] = mix_next[k];
      } else {  // the strided loop as before: through load_mix, the fused posts' registers moved
        for (int idx = tid; idx < kTileTokens * kMixIn; idx += kThreads) {
          const int tok = idx / kMixIn, c = idx % kMixIn, row = row_base + tok;
          s_mixin[tok][c] = row < T ? mix_in(row, c) : 0.f;
        }
      }
      team_sync();
      // y of token g + 8h in bf16 (the peers' partials summed in rank order 0..tp-1, the same
      // order on every rank, and rounded like the reference reduction); zeros outside the tile.
      auto fetch_y = [&](int h) {
        const int row = row_base + g + 8 * h;
        uint4 y = make_uint4(0, 0, 0, 0);
        if (vec < W && row < T) {
          if constexpr (kSrc == YSrc::kPeers) {
            const size_t off = a.lsa.partial_offset + ((size_t)(a.lsa.partial_row0 + row) * D + col) * 2;
            float yv[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            // Four peers' loads in flight at a time (fewer registers than all kMaxPeers).
#pragma unroll
            for (int p0 = 0; p0 < kMaxPeers; p0 += 4) {
              if (p0 >= a.lsa.world) break;
              uint4 pv[4];
#pragma unroll
              for (int k = 0; k < 4; ++k)
                if (p0 + k < a.lsa.world)
                  pv[k] = *reinterpret_cast<const uint4*>(ncclGetLsaPointer(a.lsa.window, off, p0 + k));
#pragma unroll
              for (int k = 0; k < 4; ++k) {
                if (p0 + k >= a.lsa.world) break;
                float f[8];
                bf16x8_to_float(pv[k], f);
#pragma unroll
                for (int e = 0; e < 8; ++e) yv[e] += f[e];
              }
            }
            y = float_to_bf16x8(yv);
          } else if constexpr (kSrc == YSrc::kPushed) {
            float yv[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            // Four peers' polls in flight at a time, as kPeers' loads.
#pragma unroll
            for (int p0 = 0; p0 < kMaxPeers; p0 += 4) {
              if (p0 >= a.lsa.world) break;
              const uint4* src[4];
              uint4 pv[4];
#pragma unroll
              for (int k = 0; k < 4; ++k) {
                const int p = p0 + k;
                if (p < a.lsa.world && p != a.lsa.rank) {
                  src[k] =
                      static_cast<const uint4*>(ncclGetLsaPointer(a.lsa.window, push_off(p, row, vec), a.lsa.rank));
                  pv[k] = ld_volatile(src[k]);
                }
              }
#pragma unroll
              for (int k = 0; k < 4; ++k) {
                const int p = p0 + k;
                if (p >= a.lsa.world) break;
                if (p == a.lsa.rank) {
                  pv[k] = mine[h];
                } else {
                  if (has_sentinel(pv[k]))
                    spin_until([&] { return !has_sentinel(pv[k] = ld_volatile(src[k])); }, a.lsa.barrier, blockIdx.x, p,
                               BarrierSite::kPushedRows);
                  *const_cast<uint4*>(src[k]) =  // the vector's only reader: clear it now (PushArgs)
                      make_uint4(kPushSentinel, kPushSentinel, kPushSentinel, kPushSentinel);
                }
                float f[8];
                bf16x8_to_float(pv[k], f);
#pragma unroll
                for (int e = 0; e < 8; ++e) yv[e] += f[e];
              }
            }
            y = float_to_bf16x8(yv);
          } else if constexpr (kEarlyY) {
            y = yr[h];
          } else {
            y = *reinterpret_cast<const uint4*>(a.y + (size_t)row * D + col);
          }
        }
        return y;
      };
      // Token g + 8's y is fetched before token g's stores: a store may alias y, so the compiler
      // keeps a later load after it, and token g + 8's loads waited for them (one more round trip
      // from T = 9 on, over NVLink for the peers' partials). Where registers allow, both before
      // token g's mix; a local post_pre only after it (16 bytes spilled otherwise).
      constexpr bool kYFirst = kSrc == YSrc::kPeers || kSrc == YSrc::kPushed || kEarlyY;
      uint4 yb[2];
      yb[0] = fetch_y(0);
      if constexpr (kYFirst) yb[1] = fetch_y(1);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int tok = g + 8 * h, row = row_base + tok;
        const bool valid = vec < W && row < T;
        float yv[8];
        bf16x8_to_float(yb[h], yv);
        float xf[kHC][8];
#pragma unroll
        for (int i = 0; i < kHC; ++i) bf16x8_to_float(x[h][i], xf[i]);
#pragma unroll
        for (int j = 0; j < kHC; ++j) x[h][j] = post_mix_vector(s_mixin[tok], xf, yv, j);
        if constexpr (!kYFirst)
          if (h == 0) yb[1] = fetch_y(1);
        if (valid && part == 0)
#pragma unroll
          for (int j = 0; j < kHC; ++j)
            *reinterpret_cast<uint4*>(a.new_stream + row * srow + (size_t)j * D + col) = x[h][j];
      }
    }

    if constexpr (kPre) {
      // ---- B: m = fn · x on tensor cores and sum x^2, reduced warp -> CTA in a fixed order.
      // x is the mma's B operand (n = token): each 16-byte stream load is two k-steps' B fragments
      // as loaded, (x.x, x.y) and (x.z, x.w), with no register moves (as the A operand, each
      // fragment took 4 moves from two tokens' loads: ~150 of pass 1's ~600 instructions per warp
      // and tile, ncu at 2be9a11). fn is A: m-tile p holds fn rows 8p..8p+7, hi in its rows 0..7
      // and lo in 8..15, so acc[p][h] = {hi, hi, lo, lo} sums of row 8p + g for tokens 8h + 2t,
      // 8h + 2t + 1, and m = hi + lo once every k-step is in.
      // The sums of squares on the tensor cores too: m16n8k8 with A = (x.x, x.y) and B = x.x gives
      // D[g][g] = token g's x.x · x.x (rows g + 8 and the other columns are cross products, unused),
      // B = x.y gives D[g + 8][g] = x.y · x.y: bf16 products are exact in fp32, so this is the
      // sum of a loop of FFMAs in another order, for 32 mma per warp and tile instead of ~130
      // conversions and FFMAs.
      // sq[h]: this warp's sum of squares of token 8h + g in thread (g, g / 2), from D[g][g] (sqa: c0 /
      // c1) and D[g + 8][g] (sqb: c2 / c3).
      float sq[2] = {0.f, 0.f};
      auto diagonal = [&](const float(&sqa)[2][4], const float(&sqb)[2][4]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) sq[h] = g & 1 ? sqa[h][1] + sqb[h][3] : sqa[h][0] + sqb[h][2];
      };
      // m = hi + lo: v[p][h][e] is row 8 (p + p0) + g, token 8h + 2t + e; at decode a CTA has its
      // part's m-tile only, in v[0].
      const int p0 = kFn == FnSrc::kParts ? part : 0;
      constexpr int np = kFn == FnSrc::kParts ? 1 : kNT;
      float v[kNT][2][2];
      auto fold = [&](const float(&c)[2][4], int p) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          v[p][h][0] = c[h][0] + c[h][2];
          v[p][h][1] = c[h][1] + c[h][3];
        }
      };
      auto squares = [](float(&sqa)[4], float(&sqb)[4], const uint4& v) {
        mma_bf16_1688(sqa, v.x, v.y, v.x);
        mma_bf16_1688(sqb, v.x, v.y, v.y);
        mma_bf16_1688(sqa, v.z, v.w, v.z);
        mma_bf16_1688(sqb, v.z, v.w, v.w);
      };
      auto products = [&](float(&c)[2][4], const uint4& q0, const uint4& q1, int i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          mma_bf16_16816(c[h], q0.x, q0.y, q0.z, q0.w, x[h][i].x, x[h][i].y);
          mma_bf16_16816(c[h], q1.x, q1.y, q1.z, q1.w, x[h][i].z, x[h][i].w);
        }
      };
      static_assert(kFn != FnSrc::kParts || kNT > 1, "parts split the fn rows");
      if (warp >= gmax) {  // warp-uniform: a warp past the slice's columns adds zeros
        const float zero[2][4] = {};
#pragma unroll
        for (int p = 0; p < np; ++p) fold(zero, p);
      } else if constexpr (kFn == FnSrc::kParts) {  // decode: this CTA's 8 fn rows (m-tile `part`)
        uint4 q[kHC][2];                            // every fragment in flight at once
#pragma unroll
        for (int i = 0; i < kHC; ++i)
#pragma unroll
          for (int s = 0; s < 2; ++s) q[i][s] = fn_fragment<kHead>(a, i, part * 8 + g, vec, s, v0, W);
        float acc[2][4] = {}, sqa[2][4] = {}, sqb[2][4] = {};
#pragma unroll
        for (int i = 0; i < kHC; ++i) products(acc, q[i][0], q[i][1], i);  // the same mma order as below
        fold(acc, 0);
#pragma unroll
        for (int i = 0; i < kHC; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) squares(sqa[h], sqb[h], x[h][i]);
        diagonal(sqa, sqb);
      } else {
        float acc[kNT][2][4] = {}, sqa[2][4] = {}, sqb[2][4] = {};
#pragma unroll
        for (int i = 0; i < kHC; ++i) {
#pragma unroll
          for (int p = 0; p < kNT; ++p) {
            uint4 q[2];
#pragma unroll
            for (int s = 0; s < 2; ++s) {
              if constexpr (kFn == FnSrc::kShared)
                q[s] = s_fn[(((i * gmax + warp) * 2 + s) * kRows + p * 8 + g) * 4 + t];
              else if constexpr (kFn == FnSrc::kRegs)
                q[s] = fq[i][p][s];
              else
                q[s] = fn_fragment<kHead>(a, i, p * 8 + g, vec, s, v0, W);
            }
            products(acc[p], q[0], q[1], i);
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) squares(sqa[h], sqb[h], x[h][i]);
        }
#pragma unroll
        for (int p = 0; p < kNT; ++p) fold(acc[p], p);
        diagonal(sqa, sqb);
      }
      if constexpr (kPipe)
        if (tile + step() < tile_end()) load_tile(row_base + step() * kTileTokens, 0);
      if constexpr (kStageX)  // every mma has read its x from the registers: the slot is free
        issue_tile(tile + kRing * step(), slot);
      if constexpr (kMixAhead)
        if (tile + step() < tile_end())
#pragma unroll
          for (int k = 0; k < kMixPer; ++k) mix_next[k] = load_mix(row_base + step() * kTileTokens, k);
      // Warps 4..7 write, then warps 0..3 add: half the buffer. Then warp w < kNT completes rows
      // 8w..8w+7 (0 + p0 + p1 + p2 + p3, p_w = a_{w+4} + a_w) in its own mma layout and warp kNT
      // the sums of squares: ~40 instructions on 4 warps per tile where a loop over the 400 values
      // on all 8 warps took ~130 each (SASS of 3ab923e).
      if (warp >= kWarps / 2) {
#pragma unroll
        for (int p = 0; p < np; ++p) {
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 2; ++e) s_red[buf][warp - kWarps / 2][8 * h + 2 * t + e][(p + p0) * 8 + g] = v[p][h][e];
        }
      }
      if (t == g >> 1) {
#pragma unroll
        for (int h = 0; h < 2; ++h) s_redsq[buf][warp][8 * h + g] = sq[h];
      }
      team_sync();
      if (warp < kWarps / 2) {
#pragma unroll
        for (int p = 0; p < np; ++p) {
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 2; ++e) s_red[buf][warp][8 * h + 2 * t + e][(p + p0) * 8 + g] += v[p][h][e];
        }
      }
      team_sync();
      static_assert(kNT < kWarps, "a warp per m-tile and one for the squares");
      if (warp < kNT && (parts == 1 || warp == part)) {  // warp-uniform; decode: this part's m-tile
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = 8 * (e >> 1) + 2 * t + (e & 1), n = warp * 8 + g, row = row_base + tok;
          float v = 0.f;
#pragma unroll
          for (int w = 0; w < kWarps / 2; ++w) v += s_red[buf][w][tok][n];
          if (row < T) a.ws[((size_t)row * S + slice) * kVals + n] = v;
        }
      } else if (const int row = row_base + lane; warp == kNT && lane < kTileTokens && row < T && part == 0) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) v += s_redsq[buf][w][lane];
        a.ws[((size_t)row * S + slice) * kVals + kRows] = v;
      }
    }
  }
}

// mhc_pre_ag's pass 1 (a.push_barrier): CTA 0 syncs with the peers once, so that pass 2 may push
// into their gather regions ((B) in lsa_gather.cuh; see mhc_rows_kernel).
__device__ __forceinline__ void gather_push_sync(const TileArgs& a) {
  if (a.push_barrier && blockIdx.x == 0) {  // CTA-uniform
    LsaBarrier bar(a.lsa.window, a.lsa.rank, a.lsa.world, a.lsa.barrier, 0);
    bar.sync(BarrierSite::kGatherPush);
  }
}

// Pass 1, a programmatic dependent of whatever kernel precedes the op (pdl.cuh): every thread
// waits first, before its barriers (F2 in lsa_gather.cuh) and before it lets pass 2 launch. Posts
// without a pre synchronise with the peers at entry (partials written) and exit (nobody reads this
// rank's partial any more); with a pre the exit is pass 2's or the copy-in's. In SP mode without a
// post (mhc_pre_ag), CTA 0 syncs once so that pass 2 may push into the peers' gather regions
// ((B) in lsa_gather.cuh).
//
// kFn: where a pre's fn fragments come from (FnSrc); kGlobal for a post alone.
template <YSrc kSrc, bool kPost, bool kPre, bool kHead, FnSrc kFn>
__global__ void __launch_bounds__(kThreads, kRowsCtasPerSm) mhc_rows_kernel(const __grid_constant__ TileArgs a) {
  static_assert(kPre || kFn == FnSrc::kGlobal, "only a pre has fn");
  static_assert(kSrc != YSrc::kPushed || (kPost && !kPre), "pushed rows: a TP post alone");
  pdl_wait();
  // With a pre, the next kernel is our pass 2, which waits for this grid's completion before it
  // touches memory (pdl.cuh): letting it launch now only hides its launch latency. After the wait:
  // pass 2 loads the op's own inputs before its own wait, so every kernel before the op must have
  // completed by the time it launches.
  if constexpr (kPre) pdl_launch_dependents();
  if constexpr (kFn == FnSrc::kShared) {
    const int S = a.slices, slice = blockIdx.x / a.parts % S, nvec = a.hidden >> 3;
    const int v0 = slice * nvec / S;
    const int W = (slice + 1) * nvec / S - v0, gmax = slice_groups(a.hidden, S);
    if constexpr (kSrc == YSrc::kPeers)
      stage_fn_slice_call<kHead>(a, v0, W, gmax);
    else
      stage_fn_slice<kHead>(a, v0, W, gmax);
  }
  if constexpr (kSrc == YSrc::kPeers) {
    LsaBarrier bar(a.lsa.window, a.lsa.rank, a.lsa.world, a.lsa.barrier, blockIdx.x);
    // Entry: every peer's partial is written. A wait that timed out returns too (the host reports it).
    bar.sync(BarrierSite::kEntry);
    mhc_rows<kSrc, kPost, kPre, kHead, kFn>(a);
    if constexpr (!kPre) bar.sync(BarrierSite::kExit);
  } else {
    if constexpr (kSrc == YSrc::kNone && kPre) gather_push_sync(a);
    mhc_rows<kSrc, kPost, kPre, kHead, kFn>(a);
    if constexpr (kSrc == YSrc::kPushed) push_ticket(a);
  }
}

// The head with fn staged: kPreTeams teams of kThreads threads per CTA on one fn slice (mhc_rows'
// kTeams), one CTA per SM: the 16 warps per SM of two one-team CTAs on one 96 KB fn copy. Same
// tiles, same per-tile code: the same bits. Three teams (24 warps, at the 80-register cap) were no
// faster (ab_teams_2026-11-30).
constexpr int kPreTeams = 2;

static __global__ void __launch_bounds__(kThreads* kPreTeams, 1)
    mhc_rows_teams_kernel(const __grid_constant__ TileArgs a) {
  pdl_wait();
  pdl_launch_dependents();  // pass 2 (see mhc_rows_kernel)
  const int S = a.slices, slice = blockIdx.x % S, nvec = a.hidden >> 3;
  const int v0 = slice * nvec / S;
  stage_fn_slice<true>(a, v0, (slice + 1) * nvec / S - v0, slice_groups(a.hidden, S));
  gather_push_sync(a);
  mhc_rows<YSrc::kNone, false, true, true, FnSrc::kShared, kPreTeams>(a);
}

// mhc_rows_fnreg_kernel splits its tiles over every SM (a.groups = 0) from 512 tiles (T > 8176)
// where the strided grid leaves at least 1/12 of the SMs idle (H200: D = 5120, 12 of 132; 7168,
// 20). mhc_pre T = 8192 / 16384 at D = 7168 3% / 5% faster, D = 5120 1% / 2-3%; with fewer tiles
// the runs' fn reloads cost more than the idle SMs give (T = 1024, D = 5120 / 7168: 4-5% slower),
// and D = 4096's 4 idle SMs take a tile per CTA off (64 -> 63 at T = 8192) for 4 fn reloads each
// (mhc_pre_ag T = 16384 level to 4% slower): bench/results/ab_evenreg_2026-12-01.txt.
__host__ __device__ inline bool even_split(int num_tiles, int slices, int resident) {
  return num_tiles >= 512 && resident % slices * 12 >= resident;
}

// A pre's (local or SP) tile loop: one team of kThreads threads per CTA, one CTA per SM, each
// thread's 96 registers of fn fragments loaded once per run, x through mhc_rows' ring (229
// registers, no spills). The same fragments in the same mma order: the same bits as the other
// kernels.
//
// a.groups > 0: CTA b runs slice b % S's tiles b / S, b / S + G, ... (G = a.groups CTAs per slice;
// gridDim.x = S * G, SMs mod S idle). a.groups == 0 (even_split): every SM works.
// With K = gridDim.x / S, CTA b < S * K strides its home slice's tiles below
// M = K * ceil(S * N / gridDim.x) by K (all slices on one window of tiles, as above), and the
// R = gridDim.x - S * K others split the slices' tails [M, N) slice-major into contiguous runs,
// reloading fn at a slice change (at most a few runs): D = 7168, T = 8192 at most 109 tiles per
// CTA where a.groups = 4 gives 128.
static __global__ void __launch_bounds__(kThreads, 1) mhc_rows_fnreg_kernel(const __grid_constant__ TileArgs a) {
  pdl_wait();
  pdl_launch_dependents();  // pass 2 (see mhc_rows_kernel)
  gather_push_sync(a);
  const int S = a.slices, N = (a.num_tokens + kTileTokens - 1) / kTileTokens, b = blockIdx.x;
  TileRun run{b % S, b / S, a.groups, N};
  long long u = 0, u_end = 0;  // a helper's units [u, u_end) of the tails, `tail` tiles per slice
  int tail = 1;
  auto next_run = [&] {
    const int s = (int)(u / tail), first = N - tail + (int)(u % tail);
    const int n = (int)min(u_end - u, (long long)(N - first));
    u += n;
    return TileRun{s, first, 1, first + n};
  };
  if (a.groups == 0) {
    const int G = gridDim.x, K = G / S, M = min(N, K * ((S * N + G - 1) / G));
    if (b < S * K) {
      run.step = K;
      run.end = M;
    } else if (M < N) {
      tail = N - M;
      const long long R = G - S * K, U = (long long)S * tail, r = b - S * K;
      u = r * U / R;
      u_end = (r + 1) * U / R;
      run = next_run();
    } else {
      run.end = 0;  // nothing left for the helpers
    }
  }
  for (;;) {  // one call site: the tile loop is inlined once
    if (run.first < run.end) mhc_rows<YSrc::kNone, false, true, false, FnSrc::kRegs>(a, run);
    if (u >= u_end) break;
    __syncthreads();  // the last run's reduction buffers are read before the next run writes them
    run = next_run();
  }
}
constexpr size_t kFnRegSmemBytes = (size_t)kFnRegRing * 2 * kHC * kThreads * sizeof(uint4);

// mhc_post alone at decode sizes (T <= kPostRowRows): a thread per 8-column vector of one token,
// every load of it (4 stream vectors, y, the token's 20 mixes) in one round, then its 4 stores; no
// shared memory, no barrier. The tile kernel runs a 16-token tile there (at T = 1, 4 of a warp's
// 32 lanes work) and stages the mixes behind a CTA barrier. Grid (vector blocks, T); blocks of 64
// threads spread a decode token over more SMs (T = 1, D = 4096: 8 CTAs; 5-8% faster than 128 at
// T <= 8, the same from T = 16 on: bench/results/ab_postvec_2026-11-30.txt). Launched as a
// programmatic dependent of whatever kernel precedes it (pdl.cuh), so its launch overlaps that
// kernel's teardown: T = 1 1.4 -> 1.0 us (bench/results/ab_postpdl_2026-11-30.txt).
constexpr int kPostRowRows = 128;
constexpr int kPostRowThreads = 64;

static __global__ void __launch_bounds__(kPostRowThreads) mhc_post_row_kernel(const __grid_constant__ TileArgs a) {
  pdl_wait();  // the previous kernel (any: a GEMM, another op) may have written y, the stream, the mixes
  const int row = blockIdx.y, v = blockIdx.x * kPostRowThreads + threadIdx.x;
  if (v >= a.hidden >> 3) return;
  const size_t D = a.hidden, col = (size_t)v * 8;
  const __nv_bfloat16* x_row = a.stream + (size_t)row * kHC * D + col;
  uint4 xv[kHC];
#pragma unroll
  for (int i = 0; i < kHC; ++i) xv[i] = *reinterpret_cast<const uint4*>(x_row + i * D);
  const uint4 yw = *reinterpret_cast<const uint4*>(a.y + (size_t)row * D + col);
  // The token's 20 mixes (the same addresses across the block: one request per warp, broadcast),
  // as five 16-byte loads where the tensors allow (rows of 4 and 16 floats from 16-byte aligned
  // bases; a view may start anywhere), else twenty scalar ones. Uniform branch.
  float mix[kMix - kHC];
  const float* pm = a.post_mix_in + row * kHC;
  const float* rm = a.res_mix_in + row * kHC * kHC;
  if (((reinterpret_cast<uintptr_t>(a.post_mix_in) | reinterpret_cast<uintptr_t>(a.res_mix_in)) & 15) == 0) {
    float4 q[1 + kHC];
    q[0] = __ldg(reinterpret_cast<const float4*>(pm));
#pragma unroll
    for (int i = 0; i < kHC; ++i) q[1 + i] = __ldg(reinterpret_cast<const float4*>(rm) + i);
#pragma unroll
    for (int i = 0; i < 1 + kHC; ++i) {
      mix[4 * i] = q[i].x, mix[4 * i + 1] = q[i].y, mix[4 * i + 2] = q[i].z, mix[4 * i + 3] = q[i].w;
    }
  } else {
#pragma unroll
    for (int c = 0; c < kHC; ++c) mix[c] = __ldg(pm + c);
#pragma unroll
    for (int c = 0; c < kHC * kHC; ++c) mix[kHC + c] = __ldg(rm + c);
  }
  float xf[kHC][8], yv[8];
#pragma unroll
  for (int i = 0; i < kHC; ++i) bf16x8_to_float(xv[i], xf[i]);
  bf16x8_to_float(yw, yv);
#pragma unroll
  for (int j = 0; j < kHC; ++j)
    *reinterpret_cast<uint4*>(a.new_stream + (size_t)row * kHC * D + j * D + col) = post_mix_vector(mix, xf, yv, j);
}

// ---- Pass 2 (pres): coefficients, then the collapse of the stream (+ fused RMSNorm) into
// layer_input. Two kernels with bitwise-identical rows: mhc_collapse_row_kernel (a CTA per row,
// every load of the row in one round; while the rows' CTAs fit in two waves) and
// mhc_collapse_loop_kernel (a CTA per SM slot looping over the rows; above that).
// Rounding and summation orders shared by both: y = fma chain over the streams in stream order,
// rounded to bf16; a vector's 8 squares summed by fma in element order; vector v's sum added to
// lane (v % 32)'s partial in increasing v; the 32 partials by the xor butterfly.

// Named barriers (0 is __syncthreads); kBarFull / kBarEmpty + parity: mhc_collapse_loop_kernel's ring.
enum : int { kBarCoef = 1, kBarNorm = 2, kBarFull = 3, kBarEmpty = 5 };

// Value k (an fn row's product, or kRows: the sum of squares) of `row`: its S workspace
// partials summed in slice order, kWsBatch loads in flight before the adds (a rolled loop would
// wait out one round trip per slice). Every pass-2 kernel sums this way: the same bits.
template <bool kHead>
__device__ __forceinline__ float ws_sum(const TileArgs& a, int row, int k) {
  constexpr int kVals = FnRows<kHead>::kVals;
  const int S = a.slices;
  const float* p = a.ws + (size_t)row * S * kVals + k;
  float v = 0.f;
  for (int s0 = 0; s0 < S; s0 += kWsBatch) {
    float part[kWsBatch];
#pragma unroll
    for (int q = 0; q < kWsBatch; ++q) part[q] = s0 + q < S ? p[(s0 + q) * kVals] : 0.f;
#pragma unroll
    for (int q = 0; q < kWsBatch; ++q)
      if (s0 + q < S) v += part[q];
  }
  return v;
}

// The RMS factor r = 1 / sqrt(mean(x^2) + rms_eps) from a row's sum of squares over 4 D values.
__device__ __forceinline__ float rms_scale(float sum_sq, const TileArgs& a) {
  return 1.0f / sqrtf(sum_sq / (float)(kHC * a.hidden) + a.eps.rms_eps);
}

// The site's coefficient scales and biases into shared memory (threads below kValid).
template <bool kHead>
__device__ __forceinline__ void stage_site(const TileArgs& a, float* s_scale, float* s_base) {
  if (threadIdx.x < FnRows<kHead>::kValid) s_base[threadIdx.x] = a.base[threadIdx.x];
  if (threadIdx.x < (kHead ? 1 : 3)) s_scale[threadIdx.x] = a.scale[threadIdx.x];
}

// A pre's post weight and Sinkhorn row q of `row` (m: its summed values, rr: its RMS factor) into
// post_mix and res_mix.
__device__ __forceinline__ void store_post_res(const TileArgs& a, int row, int q, const float* m, float rr,
                                               const float* s_scale, const float* s_base) {
  float post, res[kHC];
  mhc_post_res_row(m, rr, s_scale, s_base, a.eps, q, post, res);
  a.post_mix[row * kHC + q] = post;
#pragma unroll
  for (int j = 0; j < kHC; ++j) a.res_mix[(row * kHC + q) * kHC + j] = res[j];
}

// Coefficients of `row` (the row kernel). Threads k < kVals sum value k's S partials (in slice
// order, ws_sum) into s_m; then the coefficient warp (its first quad, a lane per stream) puts the
// collapse weights in s_coef and releases the collapse threads (kBarCoef), and only then computes
// and writes a pre's post weights and Sinkhorn matrix: the collapse does not wait for the 20
// Sinkhorn sweeps. Returns true on the collapse threads once s_coef is ready, false on the
// coefficient warp when it is done.
template <bool kHead>
__device__ __forceinline__ bool collapse_coefficients(const TileArgs& a, int row, float* s_m, float* s_coef) {
  constexpr int kRows = FnRows<kHead>::kRows;
  constexpr int kVals = FnRows<kHead>::kVals;
  __shared__ float s_scale[3], s_base[kMix];
  const int tid = threadIdx.x;
  stage_site<kHead>(a, s_scale, s_base);
  if (tid < kVals) s_m[tid] = ws_sum<kHead>(a, row, tid);
  __syncthreads();
  if (tid < kCollapseThreads) {
    bar_sync(kBarCoef, kThreads);
    return true;
  }
  const int i = tid & 3;
  const bool quad0 = tid < kCollapseThreads + kHC;
  const float rr = rms_scale(s_m[kRows], a);
  const float pre = mhc_pre_weight(s_m, rr, s_scale, s_base, a.eps, i);
  if (quad0) s_coef[i] = pre;
  bar_arrive(kBarCoef, kThreads);  // the whole warp arrives
  if constexpr (!kHead) {
    if (!quad0) return false;
    a.pre_mix[row * kHC + i] = pre;
    store_post_res(a, row, i, s_m, rr, s_scale, s_base);
  }
  return false;
}

// Pass 2's prologue, shared by both kernels; false: this CTA is done. pdl_wait(): pass 1 complete
// and its writes (ws, new_stream, barrier epochs) visible; in SP mode also the peers' previous
// copy-in kernels have completed, so the pushes are safe ((B) in lsa_gather.cuh). TP boundary: the
// grid's extra last CTA does the exit barrier alone (every peer has finished pass 1, so nobody
// reads this rank's partial any more), so no row waits for the peers. After pdl_wait(): the peer's
// pass 2 arriving there implies its pass 1 completed (pdl.cuh).
template <bool kGather>
__device__ __forceinline__ bool collapse_prologue(const TileArgs& a) {
  pdl_wait();
  // In SP mode the next kernel is our copy-in kernel, which waits for this grid's completion.
  if constexpr (kGather) pdl_launch_dependents();
  if (a.exit_barrier && blockIdx.x == gridDim.x - 1) {  // CTA-uniform
    LsaBarrier bar(a.lsa.window, a.lsa.rank, a.lsa.world, a.lsa.barrier, 0);
    bar.sync(BarrierSite::kExit);
    return false;
  }
  return true;
}

// Where a collapsed row goes: layer_input and, in SP mode, the same row of every peer's gather
// region (its layer_input layout), where the peer's copy-in kernel finds it. Plain (weak) remote
// stores: the copy-in barrier publishes them after this kernel completes ((A) in lsa_gather.cuh).
// Unrolled over kMaxPeers, so the pointers stay in registers; kLazy (the loop kernel, where 7
// pointers held through the collapse spilled 48 bytes at D = 7168): each store asks the window.
template <bool kGather, bool kLazy = false>
struct RowOut {
  uint4* out;
  uint4* peer_out[kLazy ? 1 : kMaxPeers - 1];
  const TileArgs& a;
  size_t off;  // the row's byte offset in a gather region
  int peers;
  __device__ __forceinline__ RowOut(const TileArgs& args, int row) : a(args) {
    const size_t orow = kGather ? (size_t)a.lsa.rank * a.num_tokens + row : (size_t)row;
    out = reinterpret_cast<uint4*>(a.layer_input + orow * a.hidden);
    peers = kGather ? a.lsa.world - 1 : 0;
    off = a.lsa.gather_offset + orow * a.hidden * sizeof(__nv_bfloat16);
    if constexpr (kGather && !kLazy) {
#pragma unroll
      for (int k = 0; k < kMaxPeers - 1; ++k) peer_out[k] = k < peers ? peer(k) : nullptr;
    }
  }
  __device__ __forceinline__ uint4* peer(int k) const {
    return static_cast<uint4*>(ncclGetLsaPointer(a.lsa.window, off, k + (k >= a.lsa.rank ? 1 : 0)));
  }
  __device__ __forceinline__ void store(int v, const uint4& o) const {
    out[v] = o;
    if constexpr (kGather) {
#pragma unroll
      for (int k = 0; k < kMaxPeers - 1; ++k)
        if (k < peers) (kLazy ? peer(k) : peer_out[k])[v] = o;
    }
  }
};

// The collapse weights of `row`: its pre coefficients, or the carried-in pre_mix_in (V4.1).
template <bool kHead>
__device__ __forceinline__ void collapse_weights(const TileArgs& a, int row, const float* coef, float (&w)[kHC]) {
#pragma unroll
  for (int i = 0; i < kHC; ++i) w[i] = (!kHead && a.pre_mix_in != nullptr) ? a.pre_mix_in[row * kHC + i] : coef[i];
}

// y = sum_i w_i x_i over one 16-byte vector of each stream, rounded to bf16 (SPEC.md's rounding
// point); with `norm`, sq = the sum of its bf16 values' squares. Explicit fmas: both kernels
// must get the same bits whatever the compiler contracts.
__device__ __forceinline__ uint4 collapse_vec(const float (&w)[kHC], const uint4 (&x)[kHC], bool norm, float& sq) {
  float y[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < kHC; ++i) {
    float f[8];
    bf16x8_to_float(x[i], f);
#pragma unroll
    for (int e = 0; e < 8; ++e) y[e] = __fmaf_rn(w[i], f[e], y[e]);
  }
  const uint4 yb = float_to_bf16x8(y);
  sq = 0.f;
  if (norm) {
    bf16x8_to_float(yb, y);
#pragma unroll
    for (int e = 0; e < 8; ++e) sq = __fmaf_rn(y[e], y[e], sq);
  }
  return yb;
}

// The fused RMSNorm's scale from the 32 lane partials (every lane gets the same bits).
__device__ __forceinline__ float norm_rn(float ss, int D, float eps) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  return 1.0f / sqrtf(ss / (float)D + eps);
}

// y * rn * weight over one vector, rounded to bf16.
__device__ __forceinline__ uint4 norm_vec(const uint4& yb, const uint4& nwb, float rn) {
  float y[8], nw[8];
  bf16x8_to_float(yb, y);
  bf16x8_to_float(nwb, nw);
#pragma unroll
  for (int e = 0; e < 8; ++e) y[e] = y[e] * rn * nw[e];
  return float_to_bf16x8(y);
}

// Pass 2's order: block i of n collapses block i, or for a pre without a post block n - 1 - i (the
// last rows first: pass 1 read the last tiles last, and their stream is still in L2; A/B in
// bench/NOTES.md: mhc_pre T = 2048-16384 0 to -6%; for a post_pre, which reads pass 1's new
// stream, it was mixed, +7% at T = 16384). i >= n (the TP exit-barrier CTA) maps to itself.
__device__ __forceinline__ int collapse_block(const TileArgs& a, int i, int n) {
  return a.new_stream == nullptr && i < n ? n - 1 - i : i;
}

// The end of a row for the row and loop kernels' collapse threads (tid < 224; thread t owns vectors
// t + 224 m): y = sum_i w_i x_i, the fused norm's sum through s_sq in a fixed order (per-
// vector sums, lane v % 32 partials in increasing v, the xor butterfly; named barrier kBarNorm), and
// the stores. nw: the norm weight's vectors, or null to load them only here (the loop kernel: live
// through the collapse, they spilled at D = 7168; an L1 hit after its first row).
template <bool kGather, int kV, bool kLazy = false>
__device__ __forceinline__ void collapse_store(const TileArgs& a, int row, const float (&w)[kHC],
                                               const uint4 (&x)[kV][kHC], bool norm, const uint4* nw, float* s_sq,
                                               float* s_rn) {
  const int tid = threadIdx.x, D = a.hidden, nvec = D >> 3;
  uint4 y[kV];
#pragma unroll
  for (int m = 0; m < kV; ++m) {
    const int v = tid + kCollapseThreads * m;
    if (v < nvec) {
      float sq;
      y[m] = collapse_vec(w, x[m], norm, sq);
      if (norm) s_sq[v] = sq;
    }
  }
  float rn = 1.f;
  uint4 nwv[kV];
  if (norm) {  // uniform over the collapse threads
    bar_sync(kBarNorm, kCollapseThreads);
    if (tid < 32) {
      float ss = 0.f;
      for (int v = tid; v < nvec; v += 32) ss += s_sq[v];
      rn = norm_rn(ss, D, a.eps.norm_eps);
      if (tid == 0) *s_rn = rn;
    }
    bar_sync(kBarNorm, kCollapseThreads);
    rn = *s_rn;
#pragma unroll
    for (int m = 0; m < kV; ++m)
      if (tid + kCollapseThreads * m < nvec)
        nwv[m] =
            nw != nullptr ? nw[m] : __ldg(reinterpret_cast<const uint4*>(a.norm_weight) + tid + kCollapseThreads * m);
  }
  const RowOut<kGather, kLazy> dst(a, row);
#pragma unroll
  for (int m = 0; m < kV; ++m) {
    const int v = tid + kCollapseThreads * m;
    if (v < nvec) dst.store(v, norm ? norm_vec(y[m], nwv[m], rn) : y[m]);
  }
}

// A collapse thread's vectors of `row` (tid + 224 m, m < kV) in each of the 4 streams, every load
// in one round: the row and loop kernels' stream loads.
template <int kV>
__device__ __forceinline__ void load_collapse_row(const __nv_bfloat16* stream, int row, int D, uint4 (&x)[kV][kHC]) {
  const int nvec = D >> 3;
  const uint4* src = reinterpret_cast<const uint4*>(stream + (size_t)row * kHC * D);
#pragma unroll
  for (int m = 0; m < kV; ++m) {
    const int v = threadIdx.x + kCollapseThreads * m;
    if (v < nvec) {
#pragma unroll
      for (int i = 0; i < kHC; ++i) x[m][i] = src[(size_t)i * nvec + v];
    }
  }
}

// Row collapse_block(blockIdx.x), a CTA per row: thread t < 224 owns vectors t + 224 m
// (m < kV, kV * 224 >= D / 8) and issues every load (the streams, the norm weight) before the
// coefficients are known, so one memory round trip overlaps the partials' sum; warp 7 is the
// coefficient warp.
template <bool kHead, bool kGather, int kV>
__global__ void __launch_bounds__(kThreads, kV <= 2   ? 3
                                            : kV <= 4 ? 2
                                                      : 1) mhc_collapse_row_kernel(const __grid_constant__ TileArgs a) {
  __shared__ float s_m[FnRows<kHead>::kVals];
  __shared__ float s_coef[kHC];
  __shared__ float s_sq[kV * kCollapseThreads];  // per-vector sums of squares
  __shared__ float s_rn;
  const int tid = threadIdx.x, D = a.hidden, nvec = D >> 3, row = collapse_block(a, blockIdx.x, a.num_tokens);
  const bool norm = !kHead && a.norm_weight != nullptr;
  // A pre's stream and the norm weight are the op's inputs, complete before pass 1 started and
  // written by no kernel of the op: loaded before pdl_wait() (pdl.cuh's exception), they are in
  // flight while pass 1 still runs. A post_pre's new stream is pass 1's output: after the wait.
  const bool early = a.new_stream == nullptr;
  uint4 x[kV][kHC], nw[kV];
  const bool collapser = tid < kCollapseThreads;
  if (collapser && row < a.num_tokens) {  // not the coefficient warp, not the TP exit-barrier CTA
    if (early) load_collapse_row(a.stream, row, D, x);
#pragma unroll
    for (int m = 0; m < kV; ++m)
      if (norm && tid + kCollapseThreads * m < nvec)
        nw[m] = __ldg(reinterpret_cast<const uint4*>(a.norm_weight) + tid + kCollapseThreads * m);
  }
  if (!collapse_prologue<kGather>(a)) return;
  if (collapser && !early) load_collapse_row(a.new_stream, row, D, x);
  if (!collapse_coefficients<kHead>(a, row, s_m, s_coef)) return;  // the coefficient warp
  float w[kHC];
  collapse_weights<kHead>(a, row, s_coef, w);
  collapse_store<kGather, kV>(a, row, w, x, norm, nw, s_sq, &s_rn);
}

// Pass 2 above the row kernel's two waves: a CTA per SM slot loops over rows i = blockIdx.x,
// + stride, ... (collapse_block order), with the warp roles of the row kernel turned into a
// two-deep ring, so that no CTA-wide barrier sits between rows:
// - the coefficient warp sums row k's partials itself (lane v < kVals: value v over the S slices in
//   slice order, as collapse_coefficients), puts its collapse weights in s_coef[k & 1] and
//   arrives at kBarFull + (k & 1); for row k + 2 it first waits at kBarEmpty + (k & 1) until the
//   collapse threads have read them. Every kQuadRows rows (and after the CTA's last) it computes
//   their post weights and Sinkhorn matrices at once, a quad per row, while the collapse goes on;
// - the collapse threads load row k (a pre's first row before pdl_wait, as the row kernel), take
//   the weights, collapse, norm and store as the row kernel (collapse_store), and bulk-prefetch
//   row k + 1 into L2 while they wait for row k's weights.
// Same sums in the same orders as the row kernel: the same bits.
template <bool kHead, bool kGather, int kV>
__global__ void __launch_bounds__(kThreads, kV <= 2   ? 3
                                            : kV <= 4 ? 2
                                                      : 1)
    mhc_collapse_loop_kernel(const __grid_constant__ TileArgs a) {
  constexpr int kRows = FnRows<kHead>::kRows, kVals = FnRows<kHead>::kVals;
  __shared__ float s_sq[kV * kCollapseThreads];
  __shared__ float s_m[kQuadRows][kVals];  // the coefficient warp's last rows
  __shared__ float s_coef[2][kHC];
  __shared__ float s_scale[3], s_base[kMix];
  __shared__ float s_rn;
  const int tid = threadIdx.x, D = a.hidden, n = a.num_tokens;
  const int stride = gridDim.x - (a.exit_barrier ? 1 : 0);
  const bool norm = !kHead && a.norm_weight != nullptr;
  const bool early = a.new_stream == nullptr;
  const __nv_bfloat16* stream = early ? a.stream : a.new_stream;
  uint4 x[kV][kHC];
  auto load_row = [&](int row) { load_collapse_row(stream, row, D, x); };
  const bool collapser = tid < kCollapseThreads;
  // A pre's first row before pdl_wait (not on the TP exit-barrier CTA).
  if (collapser && early && (int)blockIdx.x < stride && (int)blockIdx.x < n) load_row(collapse_block(a, blockIdx.x, n));
  stage_site<kHead>(a, s_scale, s_base);
  __syncthreads();
  if (!collapse_prologue<kGather>(a)) return;
  if (!collapser) {  // the coefficient warp
    const int lane = tid & 31;
    for (int k = 0, i = blockIdx.x; i < n; ++k, i += stride) {
      const int row = collapse_block(a, i, n), par = k & 1, slot = k % kQuadRows;
      if (lane < kVals) s_m[slot][lane] = ws_sum<kHead>(a, row, lane);
      __syncwarp();
      if (k >= 2) bar_sync(kBarEmpty + par, kThreads);  // row k - 2's weights are read
      if (lane < kHC) {
        const float rr = rms_scale(s_m[slot][kRows], a);
        const float pre = mhc_pre_weight(s_m[slot], rr, s_scale, s_base, a.eps, lane);
        s_coef[par][lane] = pre;
        if (!kHead) a.pre_mix[row * kHC + lane] = pre;
      }
      bar_arrive(kBarFull + par, kThreads);
      // A pre's post weights and Sinkhorn matrices for the last kQuadRows rows at once, a quad per
      // row (one row at a time, the 20 sweeps paced the rows).
      if (const int r = lane >> 2; !kHead && (slot == kQuadRows - 1 || i + stride >= n) && r <= slot) {
        const int rrow = collapse_block(a, i - (slot - r) * stride, n), q = lane & 3;
        store_post_res(a, rrow, q, s_m[r], rms_scale(s_m[r][kRows], a), s_scale, s_base);
      }
      __syncwarp();  // s_m[slot] is read before the slot comes round again
    }
    return;
  }
  for (int k = 0, i = blockIdx.x; i < n; ++k, i += stride) {
    const int row = collapse_block(a, i, n), par = k & 1;
    if (k > 0 || !early) load_row(row);
    if (const int next = i + stride; next < n && tid < kHC)  // row k + 1 into L2, a stream per thread
      prefetch_l2(stream + ((size_t)collapse_block(a, next, n) * kHC + tid) * D, (uint32_t)D * 2);
    bar_sync(kBarFull + par, kThreads);
    float w[kHC];
    collapse_weights<kHead>(a, row, s_coef[par], w);
    if (i + 2 * stride < n) bar_arrive(kBarEmpty + par, kThreads);  // the coefficient warp waits for it at row k + 2
    collapse_store<kGather, kV, true>(a, row, w, x, norm, nullptr, s_sq, &s_rn);
  }
}

}  // namespace spk
