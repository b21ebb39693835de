// CUDA kernels of the model runner's glue around the mHC ops (internal ops, `_`-prefixed): the
// rotary embedding with the KV-cache write, and the FFN's SiLU-and-multiply. Each reads its inputs
// once and writes its outputs once, where the eager torch code moves fp32 copies of the whole
// tensor several times. Same IEEE operations in the same order as that code (no FMA contraction):
// the same bits as the CPU kernels in python/spkernels/ops.py.
#include <cuda_bf16.h>
#include <torch/library.h>

#include "ops/mhc_ops.h"

namespace spk::glue {

constexpr int kGlueThreads = 256;

union Vec8 {  // 8 bf16 in one 16-byte access
  uint4 u;
  __nv_bfloat16 h[8];
};

__device__ __forceinline__ Vec8 load8(const __nv_bfloat16* p) { return {*reinterpret_cast<const uint4*>(p)}; }
__device__ __forceinline__ void store8(__nv_bfloat16* p, const Vec8& v) { *reinterpret_cast<uint4*>(p) = v.u; }

// (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos): each product in fp32, each sum rounded to bf16 once.
__device__ __forceinline__ void rotate(Vec8& x1, Vec8& x2, const float (&c)[8], const float (&s)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float a = __bfloat162float(x1.h[e]), b = __bfloat162float(x2.h[e]);
    x1.h[e] = __float2bfloat16_rn(__fsub_rn(__fmul_rn(a, c[e]), __fmul_rn(b, s[e])));
    x2.h[e] = __float2bfloat16_rn(__fadd_rn(__fmul_rn(a, s[e]), __fmul_rn(b, c[e])));
  }
}

// A thread per (token, head, 8 columns of the first half): q rotated in place, k rotated and v
// stored into the cache at (row, position); qkv's k and v untouched. qkv [T, 3, H, hd]; cos, sin
// [T, hd / 2]; cache [2, R, H, S, hd]. A row or position out of range writes nothing to the cache.
__global__ void __launch_bounds__(kGlueThreads) rope_kv_cache_kernel(__nv_bfloat16* __restrict__ qkv,
                                                                     const float* __restrict__ cos,
                                                                     const float* __restrict__ sin,
                                                                     __nv_bfloat16* __restrict__ cache,
                                                                     const int64_t* __restrict__ rows,
                                                                     const int64_t* __restrict__ positions, int T,
                                                                     int H, int hd, int64_t R, int64_t S) {
  const int half = hd / 2, chunks = half / 8;
  const int64_t item = (int64_t)blockIdx.x * kGlueThreads + threadIdx.x;
  if (item >= (int64_t)T * H * chunks) return;
  const int j = (int)(item % chunks) * 8, h = (int)(item / chunks % H);
  const int64_t t = item / chunks / H;
  float c[8], s[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    c[e] = cos[t * half + j + e];
    s[e] = sin[t * half + j + e];
  }
  __nv_bfloat16* q = qkv + (t * 3 * H + h) * hd;
  const __nv_bfloat16* k = q + (int64_t)H * hd;
  const __nv_bfloat16* v = k + (int64_t)H * hd;
  Vec8 q1 = load8(q + j), q2 = load8(q + j + half), k1 = load8(k + j), k2 = load8(k + j + half);
  const Vec8 v1 = load8(v + j), v2 = load8(v + j + half);
  rotate(q1, q2, c, s);
  rotate(k1, k2, c, s);
  store8(q + j, q1);
  store8(q + j + half, q2);
  const int64_t row = rows[t], pos = positions[t];
  if (row < 0 || row >= R || pos < 0 || pos >= S) return;
  __nv_bfloat16* ck = cache + ((row * H + h) * S + pos) * hd;
  __nv_bfloat16* cv = ck + R * H * S * hd;
  store8(ck + j, k1);
  store8(ck + j + half, k2);
  store8(cv + j, v1);
  store8(cv + j + half, v2);
}

// A thread per (token, 8 columns): out = bf16(silu(gate) * up), silu(x) = x / (1 + exp(-x)) in fp32.
// gate_up [T, 2F] (gate | up), out [T, F].
__global__ void __launch_bounds__(kGlueThreads) silu_mul_kernel(const __nv_bfloat16* __restrict__ gate_up,
                                                                __nv_bfloat16* __restrict__ out, int64_t T, int F) {
  const int chunks = F / 8;
  const int64_t item = (int64_t)blockIdx.x * kGlueThreads + threadIdx.x;
  if (item >= T * chunks) return;
  const int64_t t = item / chunks;
  const int f = (int)(item % chunks) * 8;
  const Vec8 g = load8(gate_up + t * 2 * F + f), u = load8(gate_up + t * 2 * F + F + f);
  Vec8 o;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float x = __bfloat162float(g.h[e]);
    const float silu = __fdiv_rn(x, __fadd_rn(1.0f, expf(-x)));
    o.h[e] = __float2bfloat16_rn(__fmul_rn(silu, __bfloat162float(u.h[e])));
  }
  store8(out + t * F + f, o);
}

unsigned glue_blocks(int64_t items) { return (unsigned)((items + kGlueThreads - 1) / kGlueThreads); }

void check_index(const char* name, const Tensor& t, int64_t T, const at::Device& device) {
  check_tensor(name, t, at::kLong, {T}, device, false);
}

void rope_kv_cache_cuda(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const Tensor& kv_cache,
                        const Tensor& rows, const Tensor& positions) {
  SPK_CHECK(qkv.dim() == 4 && qkv.size(1) == 3, "qkv must have shape [T, 3, heads, head_dim], got ",
            qkv.sizes());
  const int64_t T = qkv.size(0), H = qkv.size(2), hd = qkv.size(3);
  SPK_CHECK(hd % 16 == 0, "qkv's head_dim must be a multiple of 16, got ", hd);
  check_tensor("qkv", qkv, at::kBFloat16, {T, 3, H, hd}, qkv.device(), true);
  SPK_CHECK(kv_cache.dim() == 5, "kv_cache must have shape [2, rows, heads, max_seq_len, head_dim], got ",
            kv_cache.sizes());
  check_tensor("kv_cache", kv_cache, at::kBFloat16, {2, -1, H, -1, hd}, qkv.device(), true);
  for (const auto& [name, t] : {std::pair{"cos", &cos}, std::pair{"sin", &sin}})
    SPK_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == T * hd / 2 &&
                  t->device() == qkv.device(),
              name, " must be a contiguous float32 tensor of [T, head_dim / 2] = [", T, ", ", hd / 2, "] values on ",
              qkv.device(), ", got ", t->scalar_type(), " ", t->sizes(), " on ", t->device());
  check_index("rows", rows, T, qkv.device());
  check_index("positions", positions, T, qkv.device());
  const int64_t items = T * H * (hd / 16);
  if (items == 0) return;
  const c10::cuda::CUDAGuard guard(qkv.device());
  rope_kv_cache_kernel<<<glue_blocks(items), kGlueThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      ptr<__nv_bfloat16>(qkv), cptr<float>(cos), cptr<float>(sin), ptr<__nv_bfloat16>(kv_cache),
      cptr<int64_t>(rows), cptr<int64_t>(positions), (int)T, (int)H, (int)hd, kv_cache.size(1), kv_cache.size(3));
  SPK_CUDA_CHECK(cudaGetLastError());
}

Tensor silu_mul_cuda(const Tensor& gate_up) {
  SPK_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 16 == 0,
            "gate_up must have shape [T, 2F] with F a multiple of 8, got ", gate_up.sizes());
  const int64_t T = gate_up.size(0), F = gate_up.size(1) / 2;
  check_tensor("gate_up", gate_up, at::kBFloat16, {T, 2 * F}, gate_up.device(), true);
  Tensor out = at::empty({T, F}, gate_up.options());
  if (T * F == 0) return out;
  const c10::cuda::CUDAGuard guard(gate_up.device());
  silu_mul_kernel<<<glue_blocks(T * (F / 8)), kGlueThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      cptr<__nv_bfloat16>(gate_up), ptr<__nv_bfloat16>(out), T, (int)F);
  SPK_CUDA_CHECK(cudaGetLastError());
  return out;
}

}  // namespace spk::glue

TORCH_LIBRARY_IMPL(spkernels, CUDA, m) {
  m.impl("_rope_kv_cache", &spk::glue::rope_kv_cache_cuda);
  m.impl("_silu_mul", &spk::glue::silu_mul_cuda);
}
