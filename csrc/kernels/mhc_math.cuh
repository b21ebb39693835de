#pragma once
// The per-token mHC math (torch-free): the coefficients of docs/contract.md ("Coefficients"), Sinkhorn,
// and the post mix. Everything here is deterministic: fixed summation orders only, so replicated
// ranks compute bitwise-identical results.
#include "kernels/common.cuh"
#include "kernels/mhc_shape.h"

namespace spk {

struct MhcEps {
  float rms_eps, hc_eps, norm_eps;
  int sinkhorn_iters;
  float post_alpha;
  float sinkhorn_eps;  // the Sinkhorn's softmax and row/column sums; hc_eps stays the pre weights'
};

// The coefficient math is a latency-bound chain on one warp (20 Sinkhorn sweeps per row), so it
// uses the SFU's approximate exp and reciprocal (~2 ulp each; the mixes' tolerance is 1e-4).
// Deterministic instructions: replicated ranks still agree bitwise.
__device__ __forceinline__ float fast_rcp(float x) { return __fdividef(1.0f, x); }
__device__ __forceinline__ float sigmoidf(float x) { return fast_rcp(1.0f + __expf(-x)); }

// Per-token coefficients (docs/contract.md), for lane i of a quad. m: the 24 raw products (fn · x)
// of the token; r: its RMS factor, applied after the product as the contract says. The pre weight of
// stream i comes alone, first: it is all the collapse needs, so pass 2 collapses while the rest
// (post, Sinkhorn) is still running.
__device__ __forceinline__ float mhc_pre_weight(const float* m, float r, const float* scale, const float* base,
                                                const MhcEps& eps, int i) {
  return sigmoidf(m[i] * r * scale[0] + base[i]) + eps.hc_eps;
}

// The post weight of stream i and row i of the Sinkhorn matrix (res[j] = res[i][j], source stream i
// -> destination stream j). Every lane computes the whole 4 x 4 matrix in registers, so the column
// sums need no shuffles: a quad's shuffle butterflies were most of the 20 iterations' latency
// chain. Sums: a row's in column order; a column's (c0 + c1) + (c2 + c3), the same bits on every
// lane (and those of the quad butterfly this replaced), which replicated ranks rely on.
__device__ __forceinline__ void mhc_post_res_row(const float* m, float r, const float* scale, const float* base,
                                                 const MhcEps& eps, int i, float& post, float (&res)[kHC]) {
  post = eps.post_alpha * sigmoidf(m[kHC + i] * r * scale[1] + base[kHC + i]);
  float c[kHC][kHC];
#pragma unroll
  for (int q = 0; q < kHC; ++q) {  // softmax of each row
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kHC; ++j) {
      const int k = 2 * kHC + q * kHC + j;
      c[q][j] = m[k] * r * scale[2] + base[k];
      mx = fmaxf(mx, c[q][j]);
    }
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < kHC; ++j) {
      c[q][j] = __expf(c[q][j] - mx);
      s += c[q][j];
    }
    const float inv_s = fast_rcp(s);
#pragma unroll
    for (int j = 0; j < kHC; ++j) c[q][j] = c[q][j] * inv_s + eps.sinkhorn_eps;
  }
  // One column normalisation, then (iters - 1) x (rows, then columns).
  for (int it = 0; it < eps.sinkhorn_iters; ++it) {
    if (it > 0) {
#pragma unroll
      for (int q = 0; q < kHC; ++q) {
        float rs = 0.f;
#pragma unroll
        for (int j = 0; j < kHC; ++j) rs += c[q][j];
        const float inv = fast_rcp(rs + eps.sinkhorn_eps);
#pragma unroll
        for (int j = 0; j < kHC; ++j) c[q][j] *= inv;
      }
    }
#pragma unroll
    for (int j = 0; j < kHC; ++j) {
      const float inv = fast_rcp((c[0][j] + c[1][j]) + (c[2][j] + c[3][j]) + eps.sinkhorn_eps);
#pragma unroll
      for (int q = 0; q < kHC; ++q) c[q][j] *= inv;
    }
  }
#pragma unroll
  for (int q = 0; q < kHC; ++q)  // row i (a constant index keeps c in registers)
    if (q == i)
#pragma unroll
      for (int j = 0; j < kHC; ++j) res[j] = c[q][j];
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

}  // namespace spk
