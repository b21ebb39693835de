#pragma once
// Pass 2 of a pre (torch-free): coefficients, then the collapse of the stream (+ fused RMSNorm)
// into layer_input, and in SP mode the pushes of each row into the peers' gather regions.
#include "kernels/collapse_coef.cuh"
#include "kernels/collapse_store.cuh"

namespace spk {

// ---- Pass 2 (pres): coefficients, then the collapse of the stream (+ fused RMSNorm) into
// layer_input. Two kernels with bitwise-identical rows: mhc_collapse_loop_kernel (a CTA per SM slot
// looping over the rows) and, for the fused pres while the rows' CTAs fit in two waves,
// mhc_collapse_row_kernel (a CTA per row, every load of the row in one round).
// Rounding and summation orders shared by both: y = fma chain over the streams in stream order,
// rounded to bf16; a vector's 8 squares summed by fma in element order; vector v's sum added to
// lane (v % 32)'s partial in increasing v; the 32 partials by the xor butterfly.

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
// blockIdx.x + gridDim.x, ... (collapse_block order), with the warp roles of the row kernel turned into a
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
template <bool kHead, bool kGather, int kV, bool kLastRead>
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
  // kLastRead (collapse_last_read): the op's last read of its rows, evict-first loads and
  // prefetches, so that the rows pass 1 left in L2 (collapse_block: those come first) and the
  // workspace stay there until they are read.
  auto load_row = [&](int row) { load_collapse_row<kV, kLastRead>(stream, row, D, x); };
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
    if (const int next = i + stride; next < n && tid < kHC) {  // row k + 1 into L2, a stream per thread
      const __nv_bfloat16* p = stream + ((size_t)collapse_block(a, next, n) * kHC + tid) * D;
      if constexpr (kLastRead)
        prefetch_l2(p, (uint32_t)D * 2, l2_evict_first());
      else
        prefetch_l2(p, (uint32_t)D * 2);
    }
    bar_sync(kBarFull + par, kThreads);
    float w[kHC];
    collapse_weights<kHead>(a, row, s_coef[par], w);
    if (i + 2 * stride < n) bar_arrive(kBarEmpty + par, kThreads);  // the coefficient warp waits for it at row k + 2
    collapse_store<kGather, kV, true>(a, row, w, x, norm, nullptr, s_sq, &s_rn);
  }
}

}  // namespace spk
