#pragma once
// Pass 1's tensor-core steps for one tile (torch-free): m = fn · x in split bf16 and the sums of
// squares, in mma.m16n8k16 / m16n8k8 fragments. x is the mma's B operand (n = token): each 16-byte
// stream load is two k-steps' B fragments as loaded, (x.x, x.y) and (x.z, x.w), with no register
// moves. fn is A: m-tile p holds fn rows 8p..8p+7, hi in its rows 0..7 and lo in 8..15, so the
// accumulators of token half h are {hi, hi, lo, lo} sums of row 8p + g for tokens 8h + 2t and
// 8h + 2t + 1, and m = hi + lo once every k-step is in.
#include "kernels/common.cuh"
#include "kernels/mhc_shape.h"

namespace spk {

// c[h] += fn m-tile (q0: k-steps of x.x/x.y, q1: of x.z/x.w) times stream i's x of token half h.
__device__ __forceinline__ void mma_products(float (&c)[2][4], const uint4& q0, const uint4& q1,
                                             const uint4 (&x)[2][kHC], int i) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mma_bf16_16816(c[h], q0.x, q0.y, q0.z, q0.w, x[h][i].x, x[h][i].y);
    mma_bf16_16816(c[h], q1.x, q1.y, q1.z, q1.w, x[h][i].z, x[h][i].w);
  }
}

// The sums of squares on the tensor cores too: m16n8k8 with A = (x.x, x.y) and B = x.x gives
// D[g][g] = token g's x.x · x.x (rows g + 8 and the other columns are cross products, unused), B =
// x.y gives D[g + 8][g] = x.y · x.y: bf16 products are exact in fp32, so this is the sum of a loop
// of FFMAs in another order, for 32 mma per warp and tile instead of ~130 conversions and FFMAs.
__device__ __forceinline__ void mma_squares(float (&sqa)[4], float (&sqb)[4], const uint4& v) {
  mma_bf16_1688(sqa, v.x, v.y, v.x);
  mma_bf16_1688(sqb, v.x, v.y, v.y);
  mma_bf16_1688(sqa, v.z, v.w, v.z);
  mma_bf16_1688(sqb, v.z, v.w, v.w);
}

// m = hi + lo of one m-tile: v[h][e] is row 8p + g, token 8h + 2t + e.
__device__ __forceinline__ void fold_hi_lo(const float (&c)[2][4], float (&v)[2][2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    v[h][0] = c[h][0] + c[h][2];
    v[h][1] = c[h][1] + c[h][3];
  }
}

// sq[h]: this warp's sum of squares of token 8h + g in thread (g, g / 2), from D[g][g] (sqa: c0 /
// c1) and D[g + 8][g] (sqb: c2 / c3).
__device__ __forceinline__ void diagonal_squares(const float (&sqa)[2][4], const float (&sqb)[2][4], int g,
                                                 float (&sq)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) sq[h] = g & 1 ? sqa[h][1] + sqb[h][3] : sqa[h][0] + sqb[h][2];
}

}  // namespace spk
