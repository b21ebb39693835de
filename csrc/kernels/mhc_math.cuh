#pragma once
// Torch-free building blocks of the mHC kernels: bf16 vector helpers, the tensor-core product
// and the per-token coefficient math of SPEC.md §1. Everything here is deterministic: fixed
// summation orders only, so replicated ranks compute bitwise-identical results.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace spk {

constexpr int kHC = 4;                 // stream count; kernels are specialised for 4
constexpr int kMix = (2 + kHC) * kHC;  // 24 mixing values: pre | post | res (row-major i, j)
constexpr int kTileTokens = 16;        // tokens per tile = the M of mma.m16n8k16
constexpr int kThreads = 256;          // threads per CTA
constexpr int kWarps = kThreads / 32;
constexpr int kMaxPeers = 8;      // LSA ranks the fused kernels sum over (one NVLink node)
constexpr int kMaxHidden = 8192;  // D limit: the fn slice of a CTA must fit in shared memory

struct MhcEps {
  float rms_eps, hc_eps, norm_eps;
  int sinkhorn_iters;
  float post_alpha;
};

__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float2 p = __bfloat1622float2(h[k]);
    f[2 * k] = p.x;
    f[2 * k + 1] = p.y;
  }
}

__device__ __forceinline__ uint4 float_to_bf16x8(const float (&f)[8]) {
  uint4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
  return v;
}

// fp32 -> (hi, lo) bf16 pairs with hi + lo = f to ~2^-16 relative: the "split-bf16" product
// fn · x = hi · x + lo · x on bf16 tensor cores keeps fp32-grade accuracy (x is bf16, exact).
__device__ __forceinline__ void split_bf16x2(float a, float b, uint32_t& hi, uint32_t& lo) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  float2 hf = __bfloat1622float2(h);
  __nv_bfloat162 l = __floats2bfloat162_rn(a - hf.x, b - hf.y);
  hi = *reinterpret_cast<uint32_t*>(&h);
  lo = *reinterpret_cast<uint32_t*>(&l);
}

// Not volatile: the mma has no side effects, so the compiler may schedule it among the loads.
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_bf16_1688(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

// Asks the L2 to fetch [p, p + bytes) from HBM (sm_90 bulk prefetch; p and bytes multiples of 16).
// No registers, no completion to wait for: a later load of the range hits L2.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// 16 bytes global -> shared, asynchronously and through the L2 only (.cg); src_bytes = 0 stores
// zeros (src must still be a valid address). cp_async_wait<N>: this thread's copies but those of
// its N most recently committed groups have landed.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// The coefficient math is a latency-bound chain on one warp (20 Sinkhorn sweeps per row), so it
// uses the SFU's approximate exp and reciprocal (~2 ulp each; the mixes' tolerance is 1e-4).
// Deterministic instructions: replicated ranks still agree bitwise.
__device__ __forceinline__ float fast_rcp(float x) { return __fdividef(1.0f, x); }
__device__ __forceinline__ float sigmoidf(float x) { return fast_rcp(1.0f + __expf(-x)); }

// Per-token coefficients (SPEC.md section 1), for lane i of a quad. m: the 24 raw products (fn · x)
// of the token; r: its RMS factor, applied after the product as the SPEC says. The pre weight of
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
    for (int j = 0; j < kHC; ++j) c[q][j] = c[q][j] * inv_s + eps.hc_eps;
  }
  // One column normalisation, then (iters - 1) x (rows, then columns).
  for (int it = 0; it < eps.sinkhorn_iters; ++it) {
    if (it > 0) {
#pragma unroll
      for (int q = 0; q < kHC; ++q) {
        float rs = 0.f;
#pragma unroll
        for (int j = 0; j < kHC; ++j) rs += c[q][j];
        const float inv = fast_rcp(rs + eps.hc_eps);
#pragma unroll
        for (int j = 0; j < kHC; ++j) c[q][j] *= inv;
      }
    }
#pragma unroll
    for (int j = 0; j < kHC; ++j) {
      const float inv = fast_rcp((c[0][j] + c[1][j]) + (c[2][j] + c[3][j]) + eps.hc_eps);
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

}  // namespace spk
