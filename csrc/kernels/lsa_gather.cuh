#pragma once
// All-gather of opaque rows over LSA (torch-free): every rank has staged its own rows at
// [rank * bytes, (rank + 1) * bytes) of its gather buffer; each CTA pulls its share of every
// peer's block into the output. Rows of any dtype and width: 16-byte vectors, then a byte tail.
#include <nccl.h>
#include <nccl_device.h>

#include <cstdint>

#include "kernels/lsa_barrier.cuh"

namespace spk {

constexpr int kGatherThreads = 512;

// static: internal linkage, as every translation unit that launches it includes this header.
static __global__ void __launch_bounds__(kGatherThreads)
    lsa_all_gather_kernel(ncclWindow_t window, size_t gather_offset, size_t bytes, int rank, int world,
                          const __grid_constant__ BarrierArgs barrier, char* out) {
  LsaBarrier bar(window, rank, world, barrier, blockIdx.x);
  bar.sync(BarrierSite::kGatherEntry);  // every rank's block is staged
  const bool vec = bytes % 16 == 0;
  const size_t n = vec ? bytes / 16 : bytes;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for (int p = 0; p < world; ++p) {
    if (p == rank) continue;
    const char* src = static_cast<const char*>(ncclGetLsaPointer(window, gather_offset + p * bytes, p));
    char* dst = out + p * bytes;
    for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < n; k += stride) {
      if (vec)
        reinterpret_cast<uint4*>(dst)[k] = reinterpret_cast<const uint4*>(src)[k];
      else
        dst[k] = src[k];
    }
  }
  bar.sync(BarrierSite::kGatherExit);  // nobody reads our block any more
}

// Grid: a function of the byte count only (identical on every rank), at most max_ctas.
inline int lsa_all_gather_grid(size_t bytes, int max_ctas) {
  const size_t per_cta = 64 * 1024;
  size_t g = (bytes + per_cta - 1) / per_cta;
  if (g < 1) g = 1;
  return (int)(g < (size_t)max_ctas ? g : (size_t)max_ctas);
}

}  // namespace spk
