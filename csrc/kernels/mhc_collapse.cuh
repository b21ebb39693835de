#pragma once
// Pass 2 of a pre (torch-free): coefficients, then the collapse of the stream (+ fused RMSNorm)
// into layer_input, and in SP mode the pushes of each row into the peers' gather regions.
#include "kernels/mhc_args.cuh"
#include "kernels/pdl.cuh"

namespace spk {

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
// pointers held through the collapse spill at large D): each store asks the window.
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
// last rows first: pass 1 read the last tiles last, and their stream is still in L2; not for a
// post_pre, which reads pass 1's new stream). i >= n (the TP exit-barrier CTA) maps to itself.
__device__ __forceinline__ int collapse_block(const TileArgs& a, int i, int n) {
  return a.new_stream == nullptr && i < n ? n - 1 - i : i;
}

// The end of a row for the row and loop kernels' collapse threads (tid < 224; thread t owns vectors
// t + 224 m): y = sum_i w_i x_i, the fused norm's sum through s_sq in a fixed order (per-
// vector sums, lane v % 32 partials in increasing v, the xor butterfly; named barrier kBarNorm), and
// the stores. nw: the norm weight's vectors, or null to load them only here (the loop kernel: live
// through the collapse, they spill at large D; an L1 hit after its first row).
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
