// The one TORCH_LIBRARY(spkernels): every schema lives here (docs/contract.md). CPU kernels are the
// reference math in python/spkernels/ops.py (gloo collectives need torch.distributed); CUDA
// kernels are registered next to their launchers in csrc/ops/*.cu.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include "kernels/mhc_plan.h"
#include "ops/build_info.h"

#ifdef SPK_WITH_CUDA
#include <nccl.h>
#endif

namespace spk {
std::vector<int64_t> build_info() {
#ifdef SPK_WITH_CUDA
  return {NCCL_VERSION_CODE, 1};
#else
  return {0, 0};
#endif
}

// The launch plan of an op variant (kernels/mhc_plan.h), flattened for the CPU tests:
// [slices, groups, parts, exit_barrier, push_barrier, launches, then per launch: kernel, variant,
// grid_x, grid_y, block, smem]. occupancy: CTAs per device of the tile, wide, collapse-row and
// collapse-loop kernels (MhcOccupancy).
std::vector<int64_t> launch_plan(int64_t variant, int64_t num_tokens, int64_t hidden, int64_t max_ctas,
                                 std::vector<int64_t> occupancy) {
  TORCH_CHECK(variant >= 0 && variant < kNumMhcVariants, "variant must be in [0, ", kNumMhcVariants, "), got ",
              variant);
  TORCH_CHECK(occupancy.size() == 4, "occupancy must have 4 values, got ", occupancy.size());
  const MhcOccupancy occ = {(int)occupancy[0], (int)occupancy[1], (int)occupancy[2], (int)occupancy[3]};
  const MhcPlan p = mhc_plan((MhcVariant)variant, (int)num_tokens, (int)hidden, (int)max_ctas, occ);
  std::vector<int64_t> out = {p.slices, p.groups, p.parts, p.exit_barrier, p.push_barrier, p.num_launches};
  for (int i = 0; i < p.num_launches; ++i) {
    const MhcLaunch& l = p.launches[i];
    out.insert(out.end(), {(int64_t)l.kernel, l.variant, l.grid_x, l.grid_y, l.block, (int64_t)l.smem});
  }
  return out;
}
}  // namespace spk

// EPS = the five trailing mixing scalars, always in this order.
#define SPK_EPS "float rms_eps, float hc_eps, float norm_eps, int sinkhorn_iters, float post_alpha"
#define SPK_EPS_DEFAULTS \
  "float rms_eps=1e-6, float hc_eps=1e-6, float norm_eps=1e-6, int sinkhorn_iters=20, float post_alpha=2.0"
// The Sinkhorn's eps (vLLM's hc_sinkhorn_eps): None = hc_eps. Last in every schema that takes EPS,
// after comm where there is one, so that calls written before it existed keep working.
#define SPK_SINKHORN_EPS "float? sinkhorn_eps=None"
#define SPK_PRE_ARGS "Tensor fn, Tensor scale, Tensor base, Tensor? norm_weight, Tensor? pre_mix_in"
#define SPK_POST_ARGS "Tensor stream, Tensor post_mix, Tensor res_mix"

TORCH_LIBRARY(spkernels, m) {
  // Local ops.
  m.def("mhc_pre(Tensor stream, " SPK_PRE_ARGS ", " SPK_EPS_DEFAULTS ", " SPK_SINKHORN_EPS
        ") -> (Tensor layer_input, Tensor post_mix, Tensor res_mix, Tensor pre_mix)");
  m.def("mhc_post(Tensor y, " SPK_POST_ARGS ") -> Tensor");
  m.def("mhc_post_pre(Tensor y, " SPK_POST_ARGS ", " SPK_PRE_ARGS ", " SPK_EPS_DEFAULTS ", " SPK_SINKHORN_EPS
        ") -> (Tensor new_stream, Tensor layer_input, Tensor post_mix, Tensor res_mix, Tensor pre_mix)");
  m.def(
      "mhc_head(Tensor stream, Tensor fn, Tensor scale, Tensor base, float rms_eps=1e-6, "
      "float hc_eps=1e-6) -> Tensor");
  // SP mode: the stream is this rank's token shard; partial is [T, D] with T the padded total.
  m.def("mhc_post_rs(Tensor partial, " SPK_POST_ARGS ", int comm) -> Tensor");
  m.def("mhc_pre_ag(Tensor stream, " SPK_PRE_ARGS ", " SPK_EPS ", int comm, " SPK_SINKHORN_EPS
        ") -> (Tensor layer_input, Tensor post_mix, Tensor res_mix, Tensor pre_mix)");
  m.def("mhc_post_pre_rs_ag(Tensor partial, " SPK_POST_ARGS ", " SPK_PRE_ARGS ", " SPK_EPS
        ", int comm, " SPK_SINKHORN_EPS
        ") -> (Tensor new_stream, Tensor layer_input, Tensor post_mix, Tensor res_mix, "
        "Tensor pre_mix)");
  m.def("sp_all_gather(Tensor x_local, int num_tokens, int comm) -> Tensor");
  m.def("sp_shard(Tensor x, int comm) -> Tensor");
  // TP mode: the stream is replicated on every rank.
  m.def("mhc_post_ar(Tensor partial, " SPK_POST_ARGS ", int comm) -> Tensor");
  m.def("mhc_post_pre_ar(Tensor partial, " SPK_POST_ARGS ", " SPK_PRE_ARGS ", " SPK_EPS ", int comm, " SPK_SINKHORN_EPS
        ") -> (Tensor new_stream, Tensor layer_input, Tensor post_mix, Tensor res_mix, "
        "Tensor pre_mix)");

  // Private: build facts and the CUDA communicator's lifetime (python/spkernels/comm.py).
  m.def("_build_info() -> int[]", &spk::build_info);
  // The kernels' launch plan, a pure host function: unit-tested on CPU (tests/test_launch_plan.py).
  m.def("_launch_plan(int variant, int num_tokens, int hidden, int max_ctas, int[] occupancy) -> int[]",
        &spk::launch_plan);
  // Raises if a fused kernel's barrier timed out (lsa_barrier.cuh); kernel in csrc/ops/comm.cu.
  m.def("_comm_check(int comm) -> ()");
  // The model runner's glue (python/spkernels/runner/glue.py; CUDA kernels in csrc/ops/runner_ops.cu):
  // rotary embedding of q (in place) and k with k and v stored into a layer's KV cache at (row,
  // position); bf16(silu(gate) * up).
  m.def(
      "_rope_kv_cache(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) kv_cache, Tensor rows, "
      "Tensor positions) -> ()");
  m.def("_silu_mul(Tensor gate_up) -> Tensor");
#ifdef SPK_WITH_CUDA
  m.def("_nccl_unique_id() -> int[]", &spk::nccl_unique_id);
  m.def(
      "_comm_create(int handle, int[] unique_id, int rank, int world_size, int device, int max_tokens, "
      "int hidden_size, int hc, bool fused, bool tp_push, float barrier_timeout_s) -> int",
      &spk::comm_create);
  m.def("_comm_destroy(int handle) -> ()", &spk::comm_destroy);
  m.def("_comm_partial_buffer(int handle, int num_tokens) -> Tensor", &spk::comm_partial_buffer);
#endif
}

// The ops are inference-only. Without an Autograd kernel, torch's default fallback lets a backward
// through them return zero gradients with a warning; this one makes it raise "derivative for
// spkernels::<op> is not implemented". A forward with grad-requiring inputs still runs.
TORCH_LIBRARY_IMPL(spkernels, Autograd, m) {
  for (const char* op : {"mhc_pre", "mhc_post", "mhc_post_pre", "mhc_head", "mhc_post_rs", "mhc_pre_ag",
                         "mhc_post_pre_rs_ag", "sp_all_gather", "sp_shard", "mhc_post_ar", "mhc_post_pre_ar"}) {
    m.impl(op, torch::autograd::autogradNotImplementedFallback());
  }
}
