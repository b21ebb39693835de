#pragma once
// The CUDA side of spkernels.Communicator: an NCCL communicator, one symmetric window holding
// this rank's partial region, gather region and barrier inboxes, the barriers' local state, and an
// ncclDevComm. Owned by a registry keyed by the Python handle.
#include <nccl.h>
#include <nccl_device.h>

#include <cstdint>

#include "kernels/lsa_barrier.cuh"

namespace spk {

// mhc_post_ar pushes its partial rows up to this T (decode; above, the entry barrier and pulls).
// Communicator(tp_push=False) on any rank turns it off.
constexpr int kPushMaxTokens = 128;

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
  double barrier_timeout_s = 0;  // Communicator(barrier_timeout); 0: the barriers wait forever
  BarrierArgs barrier = {};      // epochs, `failed`, push_calls and push_ticket: one device allocation
  int push_rows = 0;             // the pushed mhc_post_ar up to this T (0: off; PushArgs)
  uint32_t *push_calls = nullptr, *push_ticket = nullptr;
  BarrierError* barrier_error = nullptr;  // host side of barrier.error (pinned, mapped)

  size_t region_bytes() const { return (size_t)max_tokens * hidden * 2; }
  size_t partial_offset() const { return 0; }
  // The SP mhc ops' peers push their layer_input rows into the gather region; sp_all_gather
  // stages this rank's block there for the peers to pull (protocol: kernels/lsa_gather.cuh; kernel:
  // kernels/lsa_all_gather.cuh).
  size_t gather_offset() const { return region_bytes(); }
  size_t inbox_offset() const { return 2 * region_bytes(); }
  size_t inbox_bytes() const { return (size_t)max_ctas * kMaxPeers * sizeof(uint32_t); }
  // The pushed mhc_post_ar's two slots of every sender's rows (PushArgs; protocol in kernels/tp_push.cuh).
  size_t push_offset() const { return (inbox_offset() + inbox_bytes() + 15) / 16 * 16; }
  size_t push_bytes() const { return (size_t)2 * world * push_rows * hidden * 2; }
};

// Throws a RuntimeError naming the handle if it is not an open CUDA communicator.
CommState& get_comm(int64_t handle);

// Throws the RuntimeError of the first barrier timeout on `c`, if one happened.
void check_barrier(const CommState& c);

}  // namespace spk
