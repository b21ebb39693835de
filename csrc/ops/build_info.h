#pragma once
// Host-side entry points that are not tensor ops: build facts and the communicator's lifetime.
#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

namespace spk {

// [compiled NCCL version code (0 without CUDA), has CUDA kernels].
std::vector<int64_t> build_info();

#ifdef SPK_WITH_CUDA
std::vector<int64_t> nccl_unique_id();
// Returns the backend chosen: 0 = lsa (fused kernels), 1 = nccl (host collectives + local kernels).
int64_t comm_create(int64_t handle, std::vector<int64_t> unique_id, int64_t rank, int64_t world_size, int64_t device,
                    int64_t max_tokens, int64_t hidden_size, int64_t hc, bool fused, bool tp_push,
                    double barrier_timeout_s);
void comm_destroy(int64_t handle);
at::Tensor comm_partial_buffer(int64_t handle, int64_t num_tokens);
#endif

}  // namespace spk
