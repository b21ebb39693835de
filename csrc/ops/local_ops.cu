// CUDA implementations of the local ops: mhc_pre, mhc_post, mhc_post_pre, mhc_head.
#include <torch/library.h>

#include "ops/mhc_ops.h"

namespace spk {

PreOut mhc_pre_cuda(const Tensor& stream, const Tensor& fn, const Tensor& scale, const Tensor& base,
                    const OptTensor& norm_weight, const OptTensor& pre_mix_in, double rms_eps, double hc_eps,
                    double norm_eps, int64_t sinkhorn_iters, double post_alpha, c10::optional<double> sinkhorn_eps) {
  check_stream(stream);
  check_pre_args(stream, fn, scale, base, norm_weight, pre_mix_in, rms_eps, hc_eps, norm_eps, sinkhorn_iters,
                 post_alpha, sinkhorn_eps);
  const c10::cuda::CUDAGuard guard(stream.device());
  TileArgs a = base_tile_args(stream);
  PreOut out = set_pre_args(a, stream, fn, scale, base, norm_weight, pre_mix_in,
                            make_eps(rms_eps, hc_eps, norm_eps, sinkhorn_iters, post_alpha, sinkhorn_eps), stream.size(0));
  run_mhc(MhcVariant::kPre, a, 0);
  return out;
}

Tensor mhc_post_cuda(const Tensor& y, const Tensor& stream, const Tensor& post_mix, const Tensor& res_mix) {
  check_stream(stream);
  check_tensor("y", y, at::kBFloat16, {stream.size(0), stream.size(2)}, stream.device(), true);
  check_post_args(stream, post_mix, res_mix);
  const c10::cuda::CUDAGuard guard(stream.device());
  Tensor new_stream = at::empty_like(stream);
  TileArgs a = base_tile_args(stream);
  a.y = cptr<__nv_bfloat16>(y);
  set_post_args(a, post_mix, res_mix, new_stream);
  run_mhc(MhcVariant::kPost, a, 0);
  return new_stream;
}

PostPreOut mhc_post_pre_cuda(const Tensor& y, const Tensor& stream, const Tensor& post_mix, const Tensor& res_mix,
                             const Tensor& fn, const Tensor& scale, const Tensor& base, const OptTensor& norm_weight,
                             const OptTensor& pre_mix_in, double rms_eps, double hc_eps, double norm_eps,
                             int64_t sinkhorn_iters, double post_alpha, c10::optional<double> sinkhorn_eps) {
  check_stream(stream);
  check_tensor("y", y, at::kBFloat16, {stream.size(0), stream.size(2)}, stream.device(), true);
  check_post_args(stream, post_mix, res_mix);
  check_pre_args(stream, fn, scale, base, norm_weight, pre_mix_in, rms_eps, hc_eps, norm_eps, sinkhorn_iters,
                 post_alpha, sinkhorn_eps);
  const c10::cuda::CUDAGuard guard(stream.device());
  Tensor new_stream = at::empty_like(stream);
  TileArgs a = base_tile_args(stream);
  a.y = cptr<__nv_bfloat16>(y);
  set_post_args(a, post_mix, res_mix, new_stream);
  auto [layer_input, post, res, pre] =
      set_pre_args(a, stream, fn, scale, base, norm_weight, pre_mix_in,
                   make_eps(rms_eps, hc_eps, norm_eps, sinkhorn_iters, post_alpha, sinkhorn_eps), stream.size(0));
  run_mhc(MhcVariant::kPostPre, a, 0);
  return {new_stream, layer_input, post, res, pre};
}

Tensor mhc_head_cuda(const Tensor& stream, const Tensor& fn, const Tensor& scale, const Tensor& base, double rms_eps,
                     double hc_eps) {
  check_stream(stream);
  const int64_t D = stream.size(2);
  check_tensor("fn", fn, at::kFloat, {kHC, kHC * D}, stream.device(), true);
  check_tensor("scale", scale, at::kFloat, {1}, stream.device());
  check_tensor("base", base, at::kFloat, {kHC}, stream.device());
  check_eps("rms_eps", rms_eps, true);
  check_eps("hc_eps", hc_eps, false);
  const c10::cuda::CUDAGuard guard(stream.device());
  Tensor out = at::empty({stream.size(0), D}, stream.options());
  TileArgs a = base_tile_args(stream);
  a.fn = cptr<float>(fn);
  a.scale = cptr<float>(scale);
  a.base = cptr<float>(base);
  a.eps = make_eps(rms_eps, hc_eps, 0.0, 1, 0.0, c10::nullopt);
  a.layer_input = ptr<__nv_bfloat16>(out);
  run_mhc(MhcVariant::kHead, a, 0);
  return out;
}

}  // namespace spk

TORCH_LIBRARY_IMPL(spkernels, CUDA, m) {
  m.impl("mhc_pre", &spk::mhc_pre_cuda);
  m.impl("mhc_post", &spk::mhc_post_cuda);
  m.impl("mhc_post_pre", &spk::mhc_post_pre_cuda);
  m.impl("mhc_head", &spk::mhc_head_cuda);
}
