#pragma once
// Torch-aware launch helpers shared by the local ops and the fused (communicating) ops.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <tuple>

#include "kernels/mhc_api.cuh"
#include "ops/checks.h"

namespace spk {

using Tensor = at::Tensor;
using OptTensor = c10::optional<at::Tensor>;
using PreOut = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using PostPreOut = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

template <typename T>
inline T* ptr(const Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}
template <typename T>
inline const T* cptr(const Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}
template <typename T>
inline const T* cptr(const OptTensor& t) {
  return t ? reinterpret_cast<const T*>(t->data_ptr()) : nullptr;
}

inline TileArgs base_tile_args(const Tensor& stream) {
  TileArgs a = {};
  a.num_tokens = (int)stream.size(0);
  a.hidden = (int)stream.size(2);
  a.stream = cptr<__nv_bfloat16>(stream);
  return a;
}

inline void set_post_args(TileArgs& a, const Tensor& post_mix, const Tensor& res_mix, const Tensor& new_stream) {
  a.post_mix_in = cptr<float>(post_mix);
  a.res_mix_in = cptr<float>(res_mix);
  a.new_stream = ptr<__nv_bfloat16>(new_stream);
}

// Pre outputs: layer_input rows [T, D] (or [tp * T, D] when gathering), post/res/pre mixes.
inline PreOut set_pre_args(TileArgs& a, const Tensor& stream, const Tensor& fn, const Tensor& scale, const Tensor& base,
                           const OptTensor& norm_weight, const OptTensor& pre_mix_in, MhcEps eps,
                           int64_t layer_input_rows) {
  const int64_t T = stream.size(0), D = stream.size(2);
  auto f32 = stream.options().dtype(at::kFloat);
  PreOut out{at::empty({layer_input_rows, D}, stream.options()), at::empty({T, kHC}, f32),
             at::empty({T, kHC, kHC}, f32), at::empty({T, kHC}, f32)};
  a.fn = cptr<float>(fn);
  a.scale = cptr<float>(scale);
  a.base = cptr<float>(base);
  a.norm_weight = cptr<__nv_bfloat16>(norm_weight);
  a.pre_mix_in = cptr<float>(pre_mix_in);
  a.eps = eps;
  a.layer_input = ptr<__nv_bfloat16>(std::get<0>(out));
  a.post_mix = ptr<float>(std::get<1>(out));
  a.res_mix = ptr<float>(std::get<2>(out));
  a.pre_mix = ptr<float>(std::get<3>(out));
  return out;
}

// One op on the current stream; max_ctas: see launch_mhc (kernels/mhc_api.cuh). The pass-1 ->
// pass-2 workspace comes from torch's caching allocator (stream-ordered, and from the graph's pool
// under capture).
inline void run_mhc(MhcVariant v, TileArgs a, int max_ctas) {
  Tensor ws;
  if (mhc_traits(v).pre) {
    ws = at::empty({(int64_t)mhc_ws_floats(v, a.num_tokens, a.hidden)},
                   at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, c10::cuda::current_device()));
    a.ws = ptr<float>(ws);
  }
  SPK_CUDA_CHECK(launch_mhc(v, a, max_ctas, c10::cuda::getCurrentCUDAStream()));
}

// Local ops, also the compute half of the `nccl` backend.
PreOut mhc_pre_cuda(const Tensor& stream, const Tensor& fn, const Tensor& scale, const Tensor& base,
                    const OptTensor& norm_weight, const OptTensor& pre_mix_in, double rms_eps, double hc_eps,
                    double norm_eps, int64_t sinkhorn_iters, double post_alpha, c10::optional<double> sinkhorn_eps);
Tensor mhc_post_cuda(const Tensor& y, const Tensor& stream, const Tensor& post_mix, const Tensor& res_mix);
PostPreOut mhc_post_pre_cuda(const Tensor& y, const Tensor& stream, const Tensor& post_mix, const Tensor& res_mix,
                             const Tensor& fn, const Tensor& scale, const Tensor& base, const OptTensor& norm_weight,
                             const OptTensor& pre_mix_in, double rms_eps, double hc_eps, double norm_eps,
                             int64_t sinkhorn_iters, double post_alpha, c10::optional<double> sinkhorn_eps);

}  // namespace spk
