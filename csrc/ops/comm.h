#pragma once
// The CUDA side of spkernels.Communicator: an NCCL communicator, one symmetric window holding
// this rank's partial region and gather region, and an ncclDevComm with one LSA barrier per
// CTA of the largest fused grid. Owned by a registry keyed by the Python handle.
#include <nccl.h>
#include <nccl_device.h>

#include <cstdint>

namespace spk {

struct CommState {
  int64_t handle = 0;
  int rank = 0, world = 1, device = 0;
  int64_t max_tokens = 0, hidden = 0;
  bool lsa = false;  // backend: fused LSA kernels (true) or NCCL host collectives + local kernels
  int max_ctas = 1;  // rank-agreed cap on the fused grids (same grids everywhere) = LSA barriers
  ncclComm_t comm = nullptr;
  void* buffer = nullptr;
  size_t buffer_bytes = 0;
  ncclWindow_t window = nullptr;
  ncclDevComm dev_comm = {};
  bool has_dev_comm = false;

  size_t region_bytes() const { return (size_t)max_tokens * hidden * 2; }
  size_t partial_offset() const { return 0; }
  size_t gather_offset() const { return region_bytes(); }
};

// Throws a RuntimeError naming the handle if it is not an open CUDA communicator.
CommState& get_comm(int64_t handle);

}  // namespace spk
