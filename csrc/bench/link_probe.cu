// The bench's link probe (built only with SPK_BENCH_PROBES=1): the LSA all-gather kernel alone
// (pull) or its push twin, on a communicator's gather region, for the peak link bandwidth that
// bench/sweep.py measures the collectives against. Not part of the library's ops: its schema is a
// fragment of this file's own.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/lsa_all_gather.cuh"
#include "kernels/mhc_api.cuh"
#include "ops/checks.h"
#include "ops/comm.h"

namespace spk {
namespace {

void lsa_link_probe(int64_t handle, int64_t bytes, bool push) {
  CommState& c = get_comm(handle);
  check_barrier(c);
  SPK_CHECK(c.lsa, "_lsa_link_probe needs the lsa backend, comm ", handle, " runs nccl");
  SPK_CHECK(bytes > 0 && bytes % 16 == 0 && (size_t)bytes * c.world <= c.region_bytes(),
            "bytes must be a positive multiple of 16 with tp * bytes <= the gather region (", c.region_bytes(),
            " bytes), got ", bytes);
  const c10::cuda::CUDAGuard guard(c.device);
  // Pull: the peers' blocks land here; push: this rank's block (any contents) goes out from here.
  at::Tensor scratch = at::empty({bytes * c.world}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, c.device));
  char* out = static_cast<char*>(scratch.data_ptr());
  cudaStream_t st = c10::cuda::getCurrentCUDAStream();
  if (!push) {  // the library's kernel, as sp_all_gather launches it
    SPK_CUDA_CHECK(
        launch_lsa_all_gather(c.window, c.gather_offset(), bytes, c.rank, c.world, c.barrier, out, c.max_ctas, st));
    return;
  }
  lsa_all_gather_kernel<true><<<lsa_all_gather_grid(bytes, c.max_ctas), kGatherThreads, 0, st>>>(
      c.window, c.gather_offset(), bytes, c.rank, c.world, c.barrier, out);
  SPK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace
}  // namespace spk

TORCH_LIBRARY_FRAGMENT(spkernels, m) {
  m.def("_lsa_link_probe(int handle, int bytes, bool push) -> ()", &spk::lsa_link_probe);
}
