#pragma once
// The pass-1 kernels (torch-free): mhc_rows_kernel (every op; fn from global or shared memory, or
// by 8-row parts at decode sizes), mhc_rows_teams_kernel (the head, fn staged, two teams per CTA)
// and mhc_rows_fnreg_kernel (a pre, fn in registers). All run the tile loop of mhc_rows.cuh.
#include "kernels/mhc_rows.cuh"
#include "kernels/pdl.cuh"

namespace spk {

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
// pulling y from the peers (kPeers) without a pre synchronise with them at entry (partials
// written) and exit (nobody reads this rank's partial any more); with a pre the exit is pass 2's
// or the copy-in's; a pushed post has no barrier (tp_push.cuh). In SP mode without a
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
// kTeams), one CTA per SM: the 16 warps per SM of two one-team CTAs on one fn copy. Same
// tiles, same per-tile code: the same bits.
__global__ void __launch_bounds__(kThreads* kPreTeams, 1)
    mhc_rows_teams_kernel(const __grid_constant__ TileArgs a) {
  pdl_wait();
  pdl_launch_dependents();  // pass 2 (see mhc_rows_kernel)
  const int S = a.slices, slice = blockIdx.x % S, nvec = a.hidden >> 3;
  const int v0 = slice * nvec / S;
  stage_fn_slice<true>(a, v0, (slice + 1) * nvec / S - v0, slice_groups(a.hidden, S));
  gather_push_sync(a);
  mhc_rows<YSrc::kNone, false, true, true, FnSrc::kShared, kPreTeams>(a);
}

// A pre's (local or SP) tile loop: one team of kThreads threads per CTA, one CTA per SM, each
// thread's 96 registers of fn fragments loaded once per run, x through mhc_rows' ring (kRowCopies:
// filled a warp per row, TilePolicy). The same fragments in the same mma order: the same bits as
// the other kernels.
//
// a.groups > 0: CTA b runs slice b % S's tiles b / S, b / S + G, ... (G = a.groups CTAs per slice;
// gridDim.x = S * G, SMs mod S idle). a.groups == 0 (even_split): every SM works.
// With K = gridDim.x / S, CTA b < S * K strides its home slice's tiles below
// M = K * ceil(S * N / gridDim.x) by K (all slices on one window of tiles, as above), and the
// R = gridDim.x - S * K others split the slices' tails [M, N) slice-major into contiguous runs,
// reloading fn at a slice change (at most a few runs).
template <bool kRowCopies>
__global__ void __launch_bounds__(kThreads, 1) mhc_rows_fnreg_kernel(const __grid_constant__ TileArgs a) {
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
    if (run.first < run.end) mhc_rows<YSrc::kNone, false, true, false, FnSrc::kRegs, 1, kRowCopies>(a, run);
    if (u >= u_end) break;
    __syncthreads();  // the last run's reduction buffers are read before the next run writes them
    run = next_run();
  }
}

}  // namespace spk
