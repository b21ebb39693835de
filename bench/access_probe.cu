// Read bandwidth of the mHC stream's access patterns, without the kernels' arithmetic: each thread
// only folds what it loads into a checksum. Which part of pass 1's ~2 TB/s (against ~3.7 for
// pass 2's rows) the access pattern alone costs. Build and run (GPU machine; gpu_run.sh probe):
//   nvcc -O3 -std=c++17 -arch=sm_90a bench/access_probe.cu -o /tmp/access_probe && /tmp/access_probe
// Patterns, on a [T, 4, D] bf16 stream (rows of 4 * D * 2 bytes), grids as the kernels':
//   slice       pass 1 (mhc_rows_kernel): CTA (g, s) owns slice s (512 bytes of each of the 4 streams)
//               of tiles g, g + G, ...; lane (token, 16-byte vector); one 16-token tile's 8 loads per
//               thread in flight; 2 CTAs per SM.
//   slice_sync  + a CTA barrier per tile (pass 1's warps wait for each other).
//   slice_pf    + pass 1's bulk L2 prefetch of the CTA's next tile.
//   warptile    mhc_stream_kernel (branch `stream`): a warp per tile, its 8 chunks of 64 bytes per
//               (token, stream) one after another.
//   slice2k     a slice as 2 KB of one stream (contiguous), 8 loads per thread in flight.
//   rows        pass 2 (warp per row): a warp reads a token's 32 KB row, 16 loads per lane in flight.
//   sweep       grid-stride over the whole stream, 8 loads per thread in flight (the read ceiling).
//   ring_bulk   the one-pass kernel's stage ring (branch `onepass`): 1 CTA per SM, slice as in pass 1,
//               a 3-stage shared-memory ring filled by 64 bulk copies of 512 bytes per tile (one warp
//               issues), the CTA folds a tile from shared memory, then refills its stage.
//   ring_cp16   the same ring filled by 16-byte cp.async (8 per thread and tile), each thread's
//               completion an mbarrier arrival (cp.async.mbarrier.arrive.noinc).
//   lag0        slice with every load ld.global.cg (L2 only), the base of the lag rows.
//   lagL        lag0, and after each tile the CTA reads its tile of L steps earlier a second time
//               (ld.cg): the memory traffic of any two-read design whose second read of a byte comes
//               from L2 (the window between the reads is L * 2 * SMs * 32 KB, 8.4 MB per step).
//               GB/s counts the stream's bytes once, as the floor does: at 0.8 of the copy rate it
//               would leave a two-read mhc_pre room for the 80% target.
//   l2sweep     a buffer of B MB (B < L2) swept 8 times per launch by all CTAs (ld.cg): the SMs'
//               read rate from L2 alone.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

constexpr int kThreads = 256;

__device__ __forceinline__ uint32_t fold(const uint4& v) { return v.x ^ v.y ^ v.z ^ v.w; }

struct Shape {
  const uint4* x;  // [T][4][nvec]
  int T, nvec, S, G;
  uint32_t* out;
};

// Pass 1's loads of one thread for one 16-token tile: vector `vec` of the 4 streams of tokens
// row and row + 8, all 8 in flight, folded. kCg: ld.global.cg (L2 only; the lag rows).
template <bool kCg = false>
__device__ __forceinline__ uint32_t fold_chunk(const Shape& p, int row, int vec) {
  const size_t srow = 4 * (size_t)p.nvec;
  uint4 v[2][4];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4* q = p.x + (row + 8 * h) * srow + i * p.nvec + vec;
      v[h][i] = kCg ? __ldcg(q) : *q;
    }
  uint32_t acc = 0;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc += fold(v[h][i]);
  return acc;
}

template <int kLag>  // 0: one read; L > 0: + the tile of L steps earlier again
__global__ void __launch_bounds__(kThreads, 2) lag_kernel(Shape p) {
  const int s = blockIdx.x % p.S, grp = blockIdx.x / p.S, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gl = lane >> 2, t = lane & 3, tiles = p.T / 16, vec = s * 32 + warp * 4 + t;
  uint32_t acc = 0;
#pragma unroll 1
  for (int tile = grp; tile < tiles + kLag * p.G; tile += p.G) {
    if (tile < tiles) acc += fold_chunk<true>(p, tile * 16 + gl, vec);
    if (kLag > 0 && tile >= grp + kLag * p.G) acc += fold_chunk<true>(p, (tile - kLag * p.G) * 16 + gl, vec);
  }
  p.out[blockIdx.x * kThreads + threadIdx.x] = acc;
}

template <int kMode>  // 0 plain, 1 + barrier per tile, 2 + bulk L2 prefetch of the next tile
__global__ void __launch_bounds__(kThreads, 2) slice_kernel(Shape p) {
  const int s = blockIdx.x % p.S, grp = blockIdx.x / p.S, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gl = lane >> 2, t = lane & 3, tiles = p.T / 16;
  const size_t srow = 4 * (size_t)p.nvec;
  uint32_t acc = 0;
#pragma unroll 1
  for (int tile = grp; tile < tiles; tile += p.G) {
    if (kMode == 2 && tile + p.G < tiles && lane < 8) {
      const int k = lane * 8 + warp, row = (tile + p.G) * 16 + k / 4, i = k % 4;
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p.x + row * srow + i * p.nvec + s * 32), "r"(512)
                   : "memory");
    }
    acc += fold_chunk(p, tile * 16 + gl, s * 32 + warp * 4 + t);
    if (kMode == 1) __syncthreads();
  }
  p.out[blockIdx.x * kThreads + threadIdx.x] = acc;
}

__global__ void __launch_bounds__(kThreads, 2) warptile_kernel(Shape p) {
  const int s = blockIdx.x % p.S, grp = blockIdx.x / p.S, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gl = lane >> 2, t = lane & 3, tiles = p.T / 16;
  uint32_t acc = 0;
#pragma unroll 1
  for (int tile = grp + p.G * warp; tile < tiles; tile += p.G * 8)
#pragma unroll 1
    for (int c = 0; c < 8; ++c) acc += fold_chunk(p, tile * 16 + gl, s * 32 + c * 4 + t);
  p.out[blockIdx.x * kThreads + threadIdx.x] = acc;
}

__global__ void __launch_bounds__(kThreads, 2) slice2k_kernel(Shape p) {
  // S slices of nvec * 4 / S vectors: slice s = stream s / (S / 4), vectors from (s % (S / 4)) * w.
  const int s = blockIdx.x % p.S, grp = blockIdx.x / p.S, per = p.S / 4, w = p.nvec / per;
  const int tok = threadIdx.x / 16, v16 = threadIdx.x % 16, tiles = p.T / 16;
  const size_t srow = 4 * (size_t)p.nvec, base = (size_t)(s / per) * p.nvec + (s % per) * w;
  uint32_t acc = 0;
#pragma unroll 1
  for (int tile = grp; tile < tiles; tile += p.G) {
    const uint4* r = p.x + (tile * 16 + tok) * srow + base;
#pragma unroll 1
    for (int j0 = 0; j0 < w; j0 += 128) {
      uint4 v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = j0 + v16 + 16 * j < w ? r[j0 + v16 + 16 * j] : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc += fold(v[j]);
    }
  }
  p.out[blockIdx.x * kThreads + threadIdx.x] = acc;
}

__global__ void __launch_bounds__(kThreads, 2) rows_kernel(Shape p) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, per_row = 4 * p.nvec;
  uint32_t acc = 0;
#pragma unroll 1
  for (int row = blockIdx.x * 8 + warp; row < p.T; row += gridDim.x * 8) {
    const uint4* r = p.x + (size_t)row * per_row;
#pragma unroll 1
    for (int j0 = 0; j0 < per_row; j0 += 16 * 32) {
      uint4 v[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) v[j] = r[j0 + j * 32 + lane];
#pragma unroll
      for (int j = 0; j < 16; ++j) acc += fold(v[j]);
    }
  }
  p.out[blockIdx.x * kThreads + threadIdx.x] = acc;
}

template <int kPasses = 1, bool kCg = false>  // l2sweep: 8 passes, ld.cg
__global__ void __launch_bounds__(kThreads, 2) sweep_kernel(Shape p) {
  const size_t n = (size_t)p.T * 4 * p.nvec, stride = (size_t)gridDim.x * kThreads;
  uint32_t acc = 0;
#pragma unroll 1
  for (int pass = 0; pass < kPasses; ++pass)
#pragma unroll 1
    for (size_t i0 = (size_t)blockIdx.x * kThreads + threadIdx.x; i0 < n; i0 += 8 * stride) {
      uint4 v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint4* q = p.x + i0 + j * stride;
        v[j] = i0 + j * stride < n ? (kCg ? __ldcg(q) : *q) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) acc += fold(v[j]);
    }
  p.out[blockIdx.x * kThreads + threadIdx.x] = acc;
}

__device__ __forceinline__ uint32_t saddr(const void* q) { return static_cast<uint32_t>(__cvta_generic_to_shared(q)); }

// kMode 0: ring_bulk, 1: ring_cp16 (see the top). One CTA per SM, 3 stages of one 16-token slice tile.
template <int kMode>
__global__ void __launch_bounds__(kThreads, 1) ring_kernel(Shape p) {
  extern __shared__ __align__(128) uint4 st[];  // [3][16 tokens][4 streams][32 vectors]
  __shared__ __align__(8) uint64_t full[3];
  const int s = blockIdx.x % p.S, grp = blockIdx.x / p.S, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int tiles = p.T / 16, mine = grp < tiles ? (tiles - grp + p.G - 1) / p.G : 0;
  const size_t srow = 4 * (size_t)p.nvec;
  if (tid == 0) {
    for (int i = 0; i < 3; ++i)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(saddr(&full[i])), "r"(kMode == 0 ? 1 : kThreads));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int k) {
    const int row0 = (grp + k * p.G) * 16;
    uint4* const stage = st + (k % 3) * 2048;
    const uint32_t bar = saddr(&full[k % 3]);
    if (kMode == 0) {
      if (warp != 0) return;
      if (lane == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(32768) : "memory");
      __syncwarp();
      for (int c = lane; c < 64; c += 32)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 512, [%2];" ::"r"(
                         saddr(stage + c * 32)),
                     "l"(p.x + (row0 + c / 4) * srow + (c % 4) * p.nvec + s * 32), "r"(bar)
                     : "memory");
    } else {
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const int c = tid + r * kThreads;  // 16-byte piece: (token, stream) row c / 32, vector c % 32
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(saddr(stage + c)),
                     "l"(p.x + (row0 + c / 128) * srow + (c / 32 % 4) * p.nvec + s * 32 + c % 32)
                     : "memory");
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
    }
  };
  for (int k = 0; k < 3 && k < mine; ++k) issue(k);
  uint32_t acc = 0;
#pragma unroll 1
  for (int k = 0; k < mine; ++k) {
    uint32_t done = 0;
    while (!done)
      asm volatile(
          "{\n .reg .pred q;\n mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2;\n selp.u32 %0, 1, 0, q;\n}"
          : "=r"(done)
          : "r"(saddr(&full[k % 3])), "r"((k / 3) & 1)
          : "memory");
#pragma unroll
    for (int j = 0; j < 8; ++j) acc += fold(st[(k % 3) * 2048 + tid + j * kThreads]);
    __syncthreads();  // the stage is read: refill it
    if (k + 3 < mine) issue(k + 3);
  }
  p.out[blockIdx.x * kThreads + threadIdx.x] = acc;
}

template <typename K>
float time_us(K kernel, int grid, const Shape& p, int reps, size_t smem = 0) {
  if (smem > 0) CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) kernel<<<grid, kThreads, smem>>>(p);
  CHECK(cudaGetLastError());
  std::vector<float> ts;
  for (int i = 0; i < reps; ++i) {
    CHECK(cudaEventRecord(a));
    kernel<<<grid, kThreads, smem>>>(p);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1e3f);
  }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int ctas = 2 * sms;
  std::printf("# access_probe: %d SMs, %d CTAs of %d threads; median of 20 launches; GB/s = stream bytes read / time\n",
              sms, ctas, kThreads);
  std::printf("%-11s %6s %6s %9s %8s\n", "pattern", "T", "D", "us", "GB/s");
  for (int D : {4096, 7168}) {
    for (int T : {8192, 16384}) {
      const size_t bytes = (size_t)T * 4 * D * 2;
      Shape p{};
      uint4* x = nullptr;
      CHECK(cudaMalloc(&x, bytes));
      CHECK(cudaMemset(x, 1, bytes));
      CHECK(cudaMalloc(&p.out, (size_t)ctas * kThreads * 4));
      p.x = x, p.T = T, p.nvec = D / 8, p.S = D / 256, p.G = ctas / p.S;
      const int grid = p.S * p.G;
      auto row = [&](const char* name, float us) {
        std::printf("%-11s %6d %6d %9.1f %8.0f\n", name, T, D, us, bytes / us * 1e-3);
      };
      row("slice", time_us(slice_kernel<0>, grid, p, 20));
      row("slice_sync", time_us(slice_kernel<1>, grid, p, 20));
      row("slice_pf", time_us(slice_kernel<2>, grid, p, 20));
      row("warptile", time_us(warptile_kernel, grid, p, 20));
      Shape q = p;
      q.S = 16, q.G = ctas / 16;  // 16 slices of 2 KB (D = 4096) / 3.5 KB (D = 7168)
      row("slice2k", time_us(slice2k_kernel, q.S * q.G, q, 20));
      row("rows", time_us(rows_kernel, ctas, p, 20));
      row("lag0", time_us(lag_kernel<0>, grid, p, 20));
      row("lag1", time_us(lag_kernel<1>, grid, p, 20));
      row("lag2", time_us(lag_kernel<2>, grid, p, 20));
      row("lag4", time_us(lag_kernel<4>, grid, p, 20));
      row("sweep", time_us(sweep_kernel<>, ctas, p, 20));
      if (D == 4096) {  // the one-pass kernel's D: 16 slices of 512 bytes per stream
        Shape r = p;
        r.G = sms / r.S;  // one CTA per SM
        row("ring_bulk", time_us(ring_kernel<0>, r.S * r.G, r, 20, 3 * 32768));
        row("ring_cp16", time_us(ring_kernel<1>, r.S * r.G, r, 20, 3 * 32768));
      }
      void* y = nullptr;  // the copy bandwidth the bench measures: read + write
      CHECK(cudaMalloc(&y, bytes));
      cudaEvent_t a, b;
      CHECK(cudaEventCreate(&a));
      CHECK(cudaEventCreate(&b));
      CHECK(cudaMemcpy(y, x, bytes, cudaMemcpyDeviceToDevice));
      CHECK(cudaEventRecord(a));
      for (int i = 0; i < 10; ++i) CHECK(cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice));
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, a, b));
      std::printf("%-11s %6d %6d %9.1f %8.0f   (read + write)\n", "copy", T, D, ms * 100.f,
                  2.0 * bytes / (ms * 100.f) * 1e-3);
      CHECK(cudaFree(y));
      CHECK(cudaFree(x));
      CHECK(cudaFree(p.out));
    }
  }
  int l2 = 0;
  CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  std::printf("# l2sweep: L2 %d MB; GB/s = 8 sweeps of the buffer / time\n", l2 >> 20);
  for (int mb : {4, 8, 16, 24, 32}) {
    Shape p{};
    uint4* x = nullptr;
    const size_t bytes = (size_t)mb << 20;
    CHECK(cudaMalloc(&x, bytes));
    CHECK(cudaMemset(x, 1, bytes));
    CHECK(cudaMalloc(&p.out, (size_t)ctas * kThreads * 4));
    p.x = x, p.T = (int)(bytes / 64), p.nvec = 1;  // bytes / 16 vectors
    const float us = time_us(sweep_kernel<8, true>, ctas, p, 20);
    std::printf("%-11s %6d %6s %9.1f %8.0f\n", "l2sweep", mb, "MB", us, 8.0 * bytes / us * 1e-3);
    CHECK(cudaFree(x));
    CHECK(cudaFree(p.out));
  }
  return 0;
}
