// CUDA implementations of the communicating ops. Backend `lsa`: one fused kernel per op on the
// symmetric window. Backend `nccl`: NCCL host collectives on the current stream + the local kernels.
#include <torch/library.h>

#include "ops/build_info.h"
#include "ops/comm.h"
#include "ops/mhc_ops.h"

namespace spk {
namespace {

// rows: this rank's rows; in SP mode the op's T is tp * rows.
CommState& comm_for(int64_t handle, const Tensor& t, int64_t rows, bool sp) {
  CommState& c = get_comm(handle);
  check_barrier(c);
  const int64_t num_tokens = sp ? rows * c.world : rows;
  SPK_CHECK(t.is_cuda() && t.get_device() == c.device, "comm ", handle, " lives on cuda:", c.device,
            ", got tensors on ", t.device());
  SPK_CHECK(num_tokens <= c.max_tokens, "T = ", num_tokens,
            " tokens is above the communicator's capacity max_tokens = ", c.max_tokens);
  return c;
}

CommState& comm_for_stream(int64_t handle, const Tensor& stream, bool sp) {
  CommState& c = comm_for(handle, stream, stream.size(0), sp);
  SPK_CHECK(stream.size(2) == c.hidden, "stream's hidden size ", stream.size(2),
            " differs from the communicator's hidden_size ", c.hidden);
  return c;
}

// SP partial: [tp * T_local, D] bf16.
void check_sp_partial(const CommState& c, const Tensor& partial, const Tensor& stream) {
  const int64_t T = stream.size(0) * c.world;
  check_tensor("partial", partial, at::kBFloat16, {-1, stream.size(2)}, stream.device(), true);
  SPK_CHECK(partial.size(0) == T, "partial must be [T, D] with T = tp * T_local = ", c.world, " * ", stream.size(0),
            " = ", T, " (pad T to a multiple of tp), got ", partial.sizes());
}

// The fused kernels read peers' partial rows from the window: stage the input there unless
// the caller already wrote it into comm.partial_buffer().
void stage_partial(const CommState& c, const Tensor& partial) {
  char* dst = static_cast<char*>(c.buffer) + c.partial_offset();
  if (partial.data_ptr() == dst) return;
  SPK_CUDA_CHECK(cudaMemcpyAsync(dst, partial.data_ptr(), partial.nbytes(), cudaMemcpyDeviceToDevice,
                                 c10::cuda::getCurrentCUDAStream()));
}

void set_lsa(TileArgs& a, const CommState& c, int partial_row0) {
  a.lsa.window = c.window;
  a.lsa.partial_offset = c.partial_offset();
  a.lsa.gather_offset = c.gather_offset();
  a.lsa.rank = c.rank;
  a.lsa.world = c.world;
  a.lsa.partial_row0 = partial_row0;
  a.lsa.barrier = c.barrier;
}

// The lsa path of a boundary that starts with a post: stage the partial, sum rows from
// `partial_row0` of every peer's partial, mix them into `new_stream`.
TileArgs lsa_post_args(const CommState& c, const Tensor& partial, const Tensor& stream, const Tensor& post_mix,
                       const Tensor& res_mix, const Tensor& new_stream, int partial_row0) {
  stage_partial(c, partial);
  TileArgs a = base_tile_args(stream);
  set_post_args(a, post_mix, res_mix, new_stream);
  set_lsa(a, c, partial_row0);
  return a;
}

// nccl backend: NCCL's reduce-scatter / all-reduce of the partial into y.
Tensor nccl_reduce(const CommState& c, const Tensor& partial, int64_t rows, bool scatter) {
  Tensor y = at::empty({rows, partial.size(1)}, partial.options());
  cudaStream_t st = c10::cuda::getCurrentCUDAStream();
  if (scatter)
    SPK_NCCL_CHECK(ncclReduceScatter(partial.data_ptr(), y.data_ptr(), y.numel(), ncclBfloat16, ncclSum, c.comm, st),
                   c.comm);
  else
    SPK_NCCL_CHECK(ncclAllReduce(partial.data_ptr(), y.data_ptr(), y.numel(), ncclBfloat16, ncclSum, c.comm, st),
                   c.comm);
  return y;
}

// nccl backend: all-gather rows [T_local, ...] (in place: this rank's rows already sit at
// their offset of `full`).
void nccl_gather_in_place(const CommState& c, Tensor& full) {
  const size_t bytes = full.nbytes() / c.world;
  char* base = static_cast<char*>(full.data_ptr());
  SPK_NCCL_CHECK(
      ncclAllGather(base + c.rank * bytes, base, bytes, ncclUint8, c.comm, c10::cuda::getCurrentCUDAStream()), c.comm);
}

}  // namespace

Tensor mhc_post_rs_cuda(const Tensor& partial, const Tensor& stream, const Tensor& post_mix, const Tensor& res_mix,
                        int64_t comm) {
  check_stream(stream);
  CommState& c = comm_for_stream(comm, stream, true);
  check_sp_partial(c, partial, stream);
  check_post_args(stream, post_mix, res_mix);
  const c10::cuda::CUDAGuard guard(stream.device());
  if (!c.lsa) return mhc_post_cuda(nccl_reduce(c, partial, stream.size(0), true), stream, post_mix, res_mix);
  Tensor new_stream = at::empty_like(stream);
  const TileArgs a = lsa_post_args(c, partial, stream, post_mix, res_mix, new_stream, c.rank * (int)stream.size(0));
  run_mhc(MhcVariant::kPostPeers, a, c.max_ctas);
  return new_stream;
}

PreOut mhc_pre_ag_cuda(const Tensor& stream, const Tensor& fn, const Tensor& scale, const Tensor& base,
                       const OptTensor& norm_weight, const OptTensor& pre_mix_in, double rms_eps, double hc_eps,
                       double norm_eps, int64_t sinkhorn_iters, double post_alpha, int64_t comm,
                       c10::optional<double> sinkhorn_eps) {
  check_stream(stream);
  CommState& c = comm_for_stream(comm, stream, true);
  check_pre_args(stream, fn, scale, base, norm_weight, pre_mix_in, rms_eps, hc_eps, norm_eps, sinkhorn_iters,
                 post_alpha, sinkhorn_eps);
  const c10::cuda::CUDAGuard guard(stream.device());
  const MhcEps eps = make_eps(rms_eps, hc_eps, norm_eps, sinkhorn_iters, post_alpha, sinkhorn_eps);
  TileArgs a = base_tile_args(stream);
  PreOut out = set_pre_args(a, stream, fn, scale, base, norm_weight, pre_mix_in, eps, stream.size(0) * c.world);
  if (!c.lsa) {
    a.layer_input += (size_t)c.rank * stream.size(0) * stream.size(2);  // my rows, then gather in place
    run_mhc(MhcVariant::kPre, a, 0);
    nccl_gather_in_place(c, std::get<0>(out));
    return out;
  }
  set_lsa(a, c, 0);
  run_mhc(MhcVariant::kPreGather, a, c.max_ctas);
  return out;
}

PostPreOut mhc_post_pre_rs_ag_cuda(const Tensor& partial, const Tensor& stream, const Tensor& post_mix,
                                   const Tensor& res_mix, const Tensor& fn, const Tensor& scale, const Tensor& base,
                                   const OptTensor& norm_weight, const OptTensor& pre_mix_in, double rms_eps,
                                   double hc_eps, double norm_eps, int64_t sinkhorn_iters, double post_alpha,
                                   int64_t comm, c10::optional<double> sinkhorn_eps) {
  check_stream(stream);
  CommState& c = comm_for_stream(comm, stream, true);
  check_sp_partial(c, partial, stream);
  check_post_args(stream, post_mix, res_mix);
  check_pre_args(stream, fn, scale, base, norm_weight, pre_mix_in, rms_eps, hc_eps, norm_eps, sinkhorn_iters,
                 post_alpha, sinkhorn_eps);
  const c10::cuda::CUDAGuard guard(stream.device());
  if (!c.lsa) {
    Tensor new_stream = mhc_post_cuda(nccl_reduce(c, partial, stream.size(0), true), stream, post_mix, res_mix);
    auto [li, post, res, pre] = mhc_pre_ag_cuda(new_stream, fn, scale, base, norm_weight, pre_mix_in, rms_eps, hc_eps,
                                                norm_eps, sinkhorn_iters, post_alpha, comm, sinkhorn_eps);
    return {new_stream, li, post, res, pre};
  }
  Tensor new_stream = at::empty_like(stream);
  TileArgs a = lsa_post_args(c, partial, stream, post_mix, res_mix, new_stream, c.rank * (int)stream.size(0));
  auto [li, post, res, pre] =
      set_pre_args(a, stream, fn, scale, base, norm_weight, pre_mix_in,
                   make_eps(rms_eps, hc_eps, norm_eps, sinkhorn_iters, post_alpha, sinkhorn_eps), stream.size(0) * c.world);
  run_mhc(MhcVariant::kPostPrePeersGather, a, c.max_ctas);
  return {new_stream, li, post, res, pre};
}

Tensor sp_all_gather_cuda(const Tensor& x_local, int64_t num_tokens, int64_t comm) {
  SPK_CHECK(x_local.is_cuda() && x_local.dim() >= 1, "x_local must be a CUDA tensor [T_local, ...], got ",
            x_local.sizes(), " on ", x_local.device());
  SPK_CHECK(x_local.is_contiguous(), "x_local must be contiguous, got strides ", x_local.strides());
  CommState& c = comm_for(comm, x_local, x_local.size(0), true);
  const int64_t T = x_local.size(0) * c.world;
  SPK_CHECK(num_tokens >= 0 && num_tokens <= T, "num_tokens must be in [0, tp * T_local = ", T, "], got ", num_tokens);
  const c10::cuda::CUDAGuard guard(x_local.device());
  std::vector<int64_t> sizes = x_local.sizes().vec();
  sizes[0] = T;
  Tensor full = at::empty(sizes, x_local.options());
  const size_t bytes = x_local.nbytes();
  cudaStream_t st = c10::cuda::getCurrentCUDAStream();
  if (bytes == 0) return full.narrow(0, 0, num_tokens);  // every rank has T_local = 0: nothing to move
  char* mine = static_cast<char*>(full.data_ptr()) + c.rank * bytes;
  SPK_CUDA_CHECK(cudaMemcpyAsync(mine, x_local.data_ptr(), bytes, cudaMemcpyDeviceToDevice, st));
  if (c.lsa && bytes * c.world <= c.region_bytes()) {
    char* staged = static_cast<char*>(c.buffer) + c.gather_offset() + c.rank * bytes;
    SPK_CUDA_CHECK(cudaMemcpyAsync(staged, x_local.data_ptr(), bytes, cudaMemcpyDeviceToDevice, st));
    SPK_CUDA_CHECK(launch_lsa_all_gather(c.window, c.gather_offset(), bytes, c.rank, c.world, c.barrier,
                                         static_cast<char*>(full.data_ptr()), c.max_ctas, st));
  } else {
    // Larger than the symmetric gather region (e.g. the whole stream at a pipeline boundary), or
    // the nccl backend: NCCL's all-gather, in place.
    nccl_gather_in_place(c, full);
  }
  return full.narrow(0, 0, num_tokens);
}

Tensor mhc_post_ar_cuda(const Tensor& partial, const Tensor& stream, const Tensor& post_mix, const Tensor& res_mix,
                        int64_t comm) {
  check_stream(stream);
  CommState& c = comm_for_stream(comm, stream, false);
  check_tensor("partial", partial, at::kBFloat16, {stream.size(0), stream.size(2)}, stream.device(), true);
  check_post_args(stream, post_mix, res_mix);
  const c10::cuda::CUDAGuard guard(stream.device());
  if (!c.lsa) return mhc_post_cuda(nccl_reduce(c, partial, stream.size(0), false), stream, post_mix, res_mix);
  Tensor new_stream = at::empty_like(stream);
  if (stream.size(0) <= c.push_rows) {  // decode sizes: pushed (PushArgs; protocol in kernels/tp_push.cuh)
    TileArgs a = base_tile_args(stream);
    set_post_args(a, post_mix, res_mix, new_stream);
    set_lsa(a, c, 0);
    a.y = cptr<__nv_bfloat16>(partial);  // read where it is: no staging copy
    a.lsa.push = {c.push_offset(), c.push_rows, c.push_calls, c.push_ticket};
    run_mhc(MhcVariant::kPostPushed, a, c.max_ctas);
    return new_stream;
  }
  const TileArgs a = lsa_post_args(c, partial, stream, post_mix, res_mix, new_stream, 0);
  run_mhc(MhcVariant::kPostPeers, a, c.max_ctas);
  return new_stream;
}

PostPreOut mhc_post_pre_ar_cuda(const Tensor& partial, const Tensor& stream, const Tensor& post_mix,
                                const Tensor& res_mix, const Tensor& fn, const Tensor& scale, const Tensor& base,
                                const OptTensor& norm_weight, const OptTensor& pre_mix_in, double rms_eps,
                                double hc_eps, double norm_eps, int64_t sinkhorn_iters, double post_alpha, int64_t comm,
                                c10::optional<double> sinkhorn_eps) {
  check_stream(stream);
  CommState& c = comm_for_stream(comm, stream, false);
  check_tensor("partial", partial, at::kBFloat16, {stream.size(0), stream.size(2)}, stream.device(), true);
  check_post_args(stream, post_mix, res_mix);
  check_pre_args(stream, fn, scale, base, norm_weight, pre_mix_in, rms_eps, hc_eps, norm_eps, sinkhorn_iters,
                 post_alpha, sinkhorn_eps);
  const c10::cuda::CUDAGuard guard(stream.device());
  if (!c.lsa)
    return mhc_post_pre_cuda(nccl_reduce(c, partial, stream.size(0), false), stream, post_mix, res_mix, fn, scale, base,
                             norm_weight, pre_mix_in, rms_eps, hc_eps, norm_eps, sinkhorn_iters, post_alpha,
                             sinkhorn_eps);
  Tensor new_stream = at::empty_like(stream);
  TileArgs a = lsa_post_args(c, partial, stream, post_mix, res_mix, new_stream, 0);
  auto [li, post, res, pre] =
      set_pre_args(a, stream, fn, scale, base, norm_weight, pre_mix_in,
                   make_eps(rms_eps, hc_eps, norm_eps, sinkhorn_iters, post_alpha, sinkhorn_eps), stream.size(0));
  run_mhc(MhcVariant::kPostPrePeers, a, c.max_ctas);
  return {new_stream, li, post, res, pre};
}

}  // namespace spk

TORCH_LIBRARY_IMPL(spkernels, CUDA, m) {
  m.impl("mhc_post_rs", &spk::mhc_post_rs_cuda);
  m.impl("mhc_pre_ag", &spk::mhc_pre_ag_cuda);
  m.impl("mhc_post_pre_rs_ag", &spk::mhc_post_pre_rs_ag_cuda);
  m.impl("sp_all_gather", &spk::sp_all_gather_cuda);
  m.impl("mhc_post_ar", &spk::mhc_post_ar_cuda);
  m.impl("mhc_post_pre_ar", &spk::mhc_post_pre_ar_cuda);
}
