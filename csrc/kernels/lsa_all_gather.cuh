#pragma once
// sp_all_gather's all-gather over LSA (torch-free).
//
// lsa_all_gather_kernel: every rank has staged its own rows at [rank * bytes, (rank + 1) * bytes)
// of its gather buffer; each CTA pulls its share of every peer's block into the output. Rows of
// any dtype and width: 16-byte vectors where bytes is a multiple of 16, else byte by byte.
// <kPush = true> (the bench's link probe only, csrc/bench/link_probe.cu): each CTA stores its
// share of this rank's block of `out` into every peer's gather region at [rank * bytes,
// (rank + 1) * bytes).
#include <nccl.h>
#include <nccl_device.h>

#include <cstdint>

#include "kernels/lsa_barrier.cuh"
#include "kernels/lsa_plan.h"

namespace spk {

template <bool kPush = false>
__global__ void __launch_bounds__(kGatherThreads)
    lsa_all_gather_kernel(ncclWindow_t window, size_t gather_offset, size_t bytes, int rank, int world,
                          const __grid_constant__ BarrierArgs barrier, char* out) {
  LsaBarrier bar(window, rank, world, barrier, blockIdx.x);
  bar.sync(BarrierSite::kGatherEntry);  // every rank's block is staged (push: the peers' readers are done)
  const bool vec = bytes % 16 == 0;
  const size_t n = vec ? bytes / 16 : bytes;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for (int p = 0; p < world; ++p) {
    if (p == rank) continue;
    const char* src =
        kPush ? out + rank * bytes : static_cast<const char*>(ncclGetLsaPointer(window, gather_offset + p * bytes, p));
    char* dst =
        kPush ? static_cast<char*>(ncclGetLsaPointer(window, gather_offset + rank * bytes, p)) : out + p * bytes;
    for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < n; k += stride) {
      if (vec)
        reinterpret_cast<uint4*>(dst)[k] = reinterpret_cast<const uint4*>(src)[k];
      else
        dst[k] = src[k];
    }
  }
  bar.sync(BarrierSite::kGatherExit);  // nobody reads our block any more (push: every block landed)
}

}  // namespace spk
