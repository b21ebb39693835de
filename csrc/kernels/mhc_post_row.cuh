#pragma once
// mhc_post's row kernel (torch-free).
#include "kernels/mhc_args.cuh"
#include "kernels/pdl.cuh"

namespace spk {

// mhc_post alone (T <= kPostRowRows): a thread per 8-column vector of one token, every load of it
// (4 stream vectors, y, the token's 20 mixes) in one round, then its 4 stores; no shared memory,
// no barrier: a pure streaming kernel, with 80 bytes of loads in flight per thread. The tile
// kernel would run a 16-token tile (at T = 1, 4 of a warp's 32 lanes work), stage the mixes behind
// a CTA barrier and leave a tail wave of tiles. Grid (vector blocks, T); blocks of
// kPostRowThreads threads spread a decode token over more SMs. Launched as a programmatic
// dependent of whatever kernel precedes it (pdl.cuh), so its launch overlaps that kernel's teardown.
__global__ void __launch_bounds__(kPostRowThreads) mhc_post_row_kernel(const __grid_constant__ TileArgs a) {
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

}  // namespace spk
