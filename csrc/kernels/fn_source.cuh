#pragma once
// Where pass 1 takes fn from (torch-free): fn fragments split into bf16 hi + lo for the tensor
// cores, loaded from global memory per tile or staged once into shared memory per CTA.
#include "kernels/mhc_args.cuh"

namespace spk {

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
// is live yet), where walking the entries in index order costs more index arithmetic than loads.
// The peers-source kernel calls it out of line (stage_fn_slice_call): inlined there, the tile loop
// spills.
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

}  // namespace spk
