#pragma once
// Pass 2's row output (torch-free): the collapse of a row's streams with its weights (+ fused
// RMSNorm), and where the row goes (RowOut: layer_input, and in SP mode every peer's gather
// region).
#include "kernels/mhc_args.cuh"

namespace spk {

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

// y = sum_i w_i x_i over one 16-byte vector of each stream, rounded to bf16 (the contract's rounding
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
// in one round: the row and loop kernels' stream loads. kLastRead: evict-first loads (ld.global.cs),
// the op's last read of the row (the loop kernel).
template <int kV, bool kLastRead = false>
__device__ __forceinline__ void load_collapse_row(const __nv_bfloat16* stream, int row, int D, uint4 (&x)[kV][kHC]) {
  const int nvec = D >> 3;
  const uint4* src = reinterpret_cast<const uint4*>(stream + (size_t)row * kHC * D);
#pragma unroll
  for (int m = 0; m < kV; ++m) {
    const int v = threadIdx.x + kCollapseThreads * m;
    if (v < nvec) {
#pragma unroll
      for (int i = 0; i < kHC; ++i) {
        const uint4* p = src + (size_t)i * nvec + v;
        x[m][i] = kLastRead ? __ldcs(p) : *p;
      }
    }
  }
}

}  // namespace spk
