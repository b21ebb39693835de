#pragma once
// Pass 2's coefficients (torch-free): each row's workspace partials summed in slice order, its RMS
// factor, the pre weights for the collapse and the post weights and Sinkhorn matrix into the
// outputs; and pass 2's prologue (the PDL wait, the TP exit barrier).
#include "kernels/mhc_args.cuh"
#include "kernels/pdl.cuh"

namespace spk {

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

}  // namespace spk
