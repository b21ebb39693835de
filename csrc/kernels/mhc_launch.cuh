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
//
// Host side of the mHC kernels (torch-free): the launch plan, a function of the shapes (and of a
// rank-agreed CTA cap for the fused ops) only, so every rank launches the same grids.
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

#include "kernels/lsa_gather.cuh"
#include "kernels/mhc_collapse.cuh"
#include "kernels/mhc_pass1.cuh"
#include "kernels/mhc_post_row.cuh"

namespace spk {

// SPK_DEBUG=1 prints every launch plan to stderr.
inline bool debug_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("SPK_DEBUG");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }();
  return on;
}

template <YSrc kSrc, bool kPost, bool kPre, bool kHead>
inline size_t rows_smem_bytes(int hidden) {
  return kPre ? fn_smem_bytes<kHead>(hidden) : 0;
}

// CTAs of `kernel` (`threads` each, `smem` bytes of dynamic shared memory) that fit on the device
// at once, cached per device, kernel and smem size.
inline cudaError_t resident_ctas(const void* kernel, int threads, size_t smem, int* out) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, size_t>, int> cache;
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find({device, kernel, smem}); it != cache.end()) {
    *out = it->second;
    return cudaSuccess;
  }
  if ((e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)) != cudaSuccess ||
      (e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem)) != cudaSuccess ||
      (e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess)
    return e;
  cache[{device, kernel, smem}] = *out = per_sm * sms;
  return per_sm > 0 ? cudaSuccess : cudaErrorInvalidConfiguration;
}

// Pass-1 CTAs of this variant that fit on the device at once.
template <YSrc kSrc, bool kPost, bool kPre, bool kHead>
inline cudaError_t rows_max_ctas(int hidden, int* out) {
  constexpr FnSrc kFn = kPre ? FnSrc::kShared : FnSrc::kGlobal;
  return resident_ctas((const void*)mhc_rows_kernel<kSrc, kPost, kPre, kHead, kFn>, kThreads,
                       rows_smem_bytes<kSrc, kPost, kPre, kHead>(hidden), out);
}

// Pass 2 of a pre (launch_collapse): a CTA per row while the rows' CTAs fit on the device in
// kRowWaves waves (each row's loads in one round, the rows side by side); above that, a CTA per
// slot that loops over the rows (mhc_collapse_loop_kernel). Both give the same bits. With
// a.exit_barrier (TP) one more CTA than the rows need: it does the exit barrier alone.

// One of a kernel's five instantiations by kV, the 16-byte vectors per collapse thread (kV * 224 >=
// D / 8); null past D = 8192 (the ops check D first).
using CollapseKernel = void (*)(TileArgs);
inline CollapseKernel by_vectors(int hidden, const CollapseKernel (&by_kv)[5]) {
  const int kv = (hidden / 8 + kCollapseThreads - 1) / kCollapseThreads;
  return kv >= 1 && kv <= 5 ? by_kv[kv - 1] : nullptr;
}

template <bool kHead, bool kGather>
inline cudaError_t launch_collapse(const TileArgs& a, cudaStream_t stream) {
  const int T = a.num_tokens, D = a.hidden, extra = a.exit_barrier ? 1 : 0;
  const CollapseKernel row =
      by_vectors(D, {mhc_collapse_row_kernel<kHead, kGather, 1>, mhc_collapse_row_kernel<kHead, kGather, 2>,
                     mhc_collapse_row_kernel<kHead, kGather, 3>, mhc_collapse_row_kernel<kHead, kGather, 4>,
                     mhc_collapse_row_kernel<kHead, kGather, 5>});
  int resident = 0;
  if (row == nullptr) return cudaErrorInvalidValue;
  if (cudaError_t e = resident_ctas((const void*)row, kThreads, 0, &resident); e != cudaSuccess) return e;
  const bool by_row = T + extra <= kRowWaves * resident;
  if (debug_enabled())
    std::fprintf(stderr, "spkernels: collapse T=%d: %s\n", T, by_row ? "a CTA per row" : "looping row CTAs");
  if (by_row) return launch_dependent(row, T + extra, kThreads, 0, stream, a);
  const CollapseKernel loop =
      by_vectors(D, {mhc_collapse_loop_kernel<kHead, kGather, 1>, mhc_collapse_loop_kernel<kHead, kGather, 2>,
                     mhc_collapse_loop_kernel<kHead, kGather, 3>, mhc_collapse_loop_kernel<kHead, kGather, 4>,
                     mhc_collapse_loop_kernel<kHead, kGather, 5>});
  if (cudaError_t e = resident_ctas((const void*)loop, kThreads, 0, &resident); e != cudaSuccess) return e;
  return launch_dependent(loop, (T < resident - extra ? T : resident - extra) + extra, kThreads, 0, stream, a);
}

// The whole op: pass 1, pass 2 for a pre, and in SP mode the copy-in kernel that completes the
// all-gather of layer_input that pass 2 pushed (protocol in lsa_gather.cuh). `a.ws` must hold
// num_tokens * row_slices(hidden) * FnRows<kHead>::kVals floats for a pre. max_ctas <= 0: the
// device's own limit (local ops); the fused ops pass the cap every rank agreed on.
//
// Launches: every kernel (pass 1, pass 2, the copy-in kernel; mhc_post's row kernel) as a
// programmatic dependent of the kernel before it (pdl.cuh). Barriers: pass 1 uses indices
// [0, slices * groups * parts) <= max_ctas, pass 2 index 0 (its last CTA), the copy-in kernel
// [0, grid) <= max_ctas; a pushed post none (its CTAs, all resident, wait for the peers' rows).
template <YSrc kSrc, bool kPost, bool kPre, bool kHead, bool kGather>
inline cudaError_t launch_mhc(TileArgs a, int max_ctas, cudaStream_t stream) {
  const int T = a.num_tokens, D = a.hidden;
  if (T == 0) return cudaSuccess;
  if constexpr (kSrc == YSrc::kLocal && kPost && !kPre) {
    if (T <= kPostRowRows) {
      if (debug_enabled()) std::fprintf(stderr, "spkernels: post row kernel T=%d D=%d\n", T, D);
      const dim3 grid((D / 8 + kPostRowThreads - 1) / kPostRowThreads, T);
      return launch_dependent(mhc_post_row_kernel, grid, kPostRowThreads, 0, stream, a);
    }
  }
  cudaError_t e;
  if (max_ctas <= 0 && (e = rows_max_ctas<kSrc, kPost, kPre, kHead>(D, &max_ctas)) != cudaSuccess) return e;
  const int num_tiles = (T + kTileTokens - 1) / kTileTokens;
  a.slices = row_slices(D);
  a.groups = max_ctas / a.slices < 1 ? 1 : max_ctas / a.slices < num_tiles ? max_ctas / a.slices : num_tiles;
  // Decode sizes: one CTA per 8 fn rows when every (tile, slice, part) has an SM to itself (split
  // at two CTAs per SM, it is slower than unsplit).
  constexpr int kParts = FnRows<kHead>::kRows / 8;
  a.parts = kPre && kParts > 1 && (long)num_tiles * a.slices * kParts <= max_ctas / kRowsCtasPerSm ? kParts : 1;
  a.exit_barrier = kSrc == YSrc::kPeers && kPre && !kGather;
  a.push_barrier = kGather && kSrc != YSrc::kPeers;  // kPeers: pass 1's entry barrier does it
  const bool staged = kPre && rows_staged(num_tiles, a.groups);
  void (*rows)(TileArgs) = mhc_rows_kernel<kSrc, kPost, kPre, kHead, FnSrc::kGlobal>;
  if constexpr (kPre) {
    if (staged) rows = mhc_rows_kernel<kSrc, kPost, kPre, kHead, FnSrc::kShared>;
    if constexpr (kParts > 1)
      if (a.parts > 1) rows = mhc_rows_kernel<kSrc, kPost, kPre, kHead, FnSrc::kParts>;
  }
  size_t smem = rows_smem_bytes<kSrc, kPost, kPre, kHead>(D);
  int grid = a.slices * a.groups * a.parts, block = kThreads;
  if constexpr (kSrc == YSrc::kNone && !kPost && kPre) {
    // A pre or head without a post, fn staged, one CTA per SM, where a slice has more than
    // kPreTeams tiles per SM of its own: a pre on mhc_rows_fnreg_kernel (one team, fn in
    // registers, x through a ring), the head on mhc_rows_teams_kernel (kPreTeams teams on one fn
    // copy in shared memory). A CTA per (slice, tile
    // set) leaves SMs mod S idle; where that is worth it (even_split), a pre's pass 1 runs on
    // every SM (a.groups = 0: the others take the slices' tails, mhc_rows_fnreg_kernel).
    constexpr int kTeams = kHead ? kPreTeams : 1;
    void (*const k)(TileArgs) = kHead ? mhc_rows_teams_kernel : mhc_rows_fnreg_kernel;
    const size_t k_smem = kHead ? fn_smem_bytes<kHead>(D) : kFnRegSmemBytes;
    int resident = 0;
    if (staged && (e = resident_ctas((const void*)k, kThreads * kTeams, k_smem, &resident)) != cudaSuccess) return e;
    if (const int per_slice = resident / a.slices; per_slice >= 1 && num_tiles > per_slice * kPreTeams) {
      rows = k;
      a.groups = per_slice * kTeams;
      grid = a.slices * per_slice;
      if (!kHead && even_split(num_tiles, a.slices, resident)) {  // every SM
        a.groups = 0;
        grid = resident;
      }
      block = kThreads * kTeams;
      smem = k_smem;
    }
  }
  if ((e = cudaFuncSetAttribute((const void*)rows, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)) !=
      cudaSuccess)
    return e;
  if (debug_enabled())
    std::fprintf(stderr, "spkernels: rows kernel T=%d D=%d slices=%d groups=%d parts=%d smem=%zu%s%s\n", T, D, a.slices,
                 a.groups, a.parts, smem, staged ? " (fn staged)" : "",
                 rows == mhc_rows_fnreg_kernel ? " (fn in registers)"
                 : block > kThreads            ? " (teams)"
                                               : "");
  if ((e = launch_dependent(rows, grid, block, smem, stream, a)) != cudaSuccess || !kPre) return e;
  if ((e = launch_collapse<kHead, kGather>(a, stream)) != cudaSuccess || !kGather) return e;
  const size_t bytes = (size_t)T * D * 2;  // one rank's block: T_local rows
  return launch_dependent(lsa_copy_in_kernel, lsa_all_gather_grid(bytes, max_ctas), kGatherThreads, 0, stream,
                          a.lsa.window, a.lsa.gather_offset, bytes, a.lsa.rank, a.lsa.world, a.lsa.barrier,
                          reinterpret_cast<char*>(a.layer_input));
}

}  // namespace spk
