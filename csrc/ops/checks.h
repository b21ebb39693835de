#pragma once
// Argument checks shared by the CUDA launchers: every bad input becomes a RuntimeError that names
// the argument and what was expected (never a crash or a silently wrong result).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <cmath>
#include <string>
#include <type_traits>

#include "kernels/mhc_math.cuh"

namespace spk {

// Error messages are built without iostreams: c10::str formats numbers through the libstdc++
// that this library was compiled against, and on the GPU machine that one's numeric facets
// crashed against the runtime's (SIGSEGV in ostream::_M_insert<long>). A single std::string
// passes through TORCH_CHECK untouched.
inline std::string fmt_arg(const char* s) { return s; }
inline std::string fmt_arg(const std::string& s) { return s; }
inline std::string fmt_arg(at::ScalarType t) { return c10::toString(t); }
inline std::string fmt_arg(const at::Device& d) { return d.str(); }
inline std::string fmt_arg(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    s += sizes[i] < 0 ? std::string("*") : std::to_string(sizes[i]);
  }
  return s + "]";
}
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
inline std::string fmt_arg(T v) {
  return std::to_string(v);
}
template <typename... Args>
inline std::string fmt(const Args&... args) {
  std::string out;
  (out += ... += fmt_arg(args));
  return out;
}

}  // namespace spk

#define SPK_CHECK(cond, ...)                                  \
  do {                                                        \
    if (!(cond)) TORCH_CHECK(false, ::spk::fmt(__VA_ARGS__)); \
  } while (0)

#define SPK_CUDA_CHECK(expr)                                                                                          \
  do {                                                                                                                \
    cudaError_t spk_err_ = (expr);                                                                                    \
    SPK_CHECK(spk_err_ == cudaSuccess, "CUDA error at ", __FILE__, ":", __LINE__, ": ", cudaGetErrorString(spk_err_), \
              " (", #expr, ")");                                                                                      \
  } while (0)

#define SPK_NCCL_CHECK(expr, comm)                                                                                    \
  do {                                                                                                                \
    ncclResult_t spk_res_ = (expr);                                                                                   \
    SPK_CHECK(spk_res_ == ncclSuccess, "NCCL error at ", __FILE__, ":", __LINE__, ": ", ncclGetErrorString(spk_res_), \
              " ", ncclGetLastError(comm), " (", #expr, ")");                                                         \
  } while (0)

namespace spk {

// sizes: expected sizes, -1 where any size goes. vec16: the kernels read it in 16-byte vectors, so it
// must start on a 16-byte boundary (every allocation does; a view with an odd storage offset may not).
inline void check_tensor(const char* name, const at::Tensor& t, at::ScalarType dtype, c10::IntArrayRef sizes,
                         const at::Device& device, bool vec16 = false) {
  SPK_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, " ", sizes, ", got ", t.scalar_type());
  bool ok = t.dim() == (int64_t)sizes.size();
  for (size_t i = 0; ok && i < sizes.size(); ++i) ok = sizes[i] < 0 || t.size(i) == sizes[i];
  SPK_CHECK(ok, name, " must have shape ", sizes, ", got ", t.sizes());
  SPK_CHECK(t.device() == device, name, " must be on ", device, " like the stream, got ", t.device());
  SPK_CHECK(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides());
  SPK_CHECK(!vec16 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
            " must start on a 16-byte boundary (the kernels read 16-byte vectors), got a view at storage offset ",
            t.storage_offset());
}

// The stream: bf16 [T, 4, D] on CUDA, D a multiple of 8 up to kMaxHidden.
inline void check_stream(const at::Tensor& stream) {
  SPK_CHECK(stream.is_cuda(), "stream must be a CUDA tensor, got ", stream.device());
  SPK_CHECK(stream.dim() == 3, "stream must be bf16 [T, 4, D], got shape ", stream.sizes());
  SPK_CHECK(stream.size(1) == kHC,
            "stream must be [T, 4, D]: the CUDA kernels support hc = 4 only, got hc = ", stream.size(1));
  const int64_t D = stream.size(2);
  SPK_CHECK(D > 0 && D % 8 == 0 && D <= kMaxHidden, "stream's hidden size D must be a multiple of 8 in [8, ",
            kMaxHidden, "] on CUDA, got D = ", D);
  check_tensor("stream", stream, at::kBFloat16, {-1, kHC, D}, stream.device(), true);
  SPK_CHECK(stream.size(0) <= (int64_t)INT32_MAX / kHC, "stream has too many tokens: ", stream.size(0));
}

inline void check_post_args(const at::Tensor& stream, const at::Tensor& post_mix, const at::Tensor& res_mix) {
  const int64_t T = stream.size(0);
  check_tensor("post_mix", post_mix, at::kFloat, {T, kHC}, stream.device());
  check_tensor("res_mix", res_mix, at::kFloat, {T, kHC, kHC}, stream.device());
}

// An eps: finite and > 0 where a zero row would otherwise divide by zero (the mean squares, the
// norm, the Sinkhorn's sums), else >= 0. The CPU kernels' rule too (python/spkernels/ops.py).
inline void check_eps(const char* name, double value, bool positive) {
  SPK_CHECK(std::isfinite(value) && (positive ? value > 0 : value >= 0), name, " must be a finite number ",
            positive ? ">" : ">=", " 0, got ", value);
}

inline void check_pre_args(const at::Tensor& stream, const at::Tensor& fn, const at::Tensor& scale,
                           const at::Tensor& base, const c10::optional<at::Tensor>& norm_weight,
                           const c10::optional<at::Tensor>& pre_mix_in, double rms_eps, double hc_eps,
                           double norm_eps, int64_t sinkhorn_iters, double post_alpha,
                           c10::optional<double> sinkhorn_eps) {
  const int64_t T = stream.size(0), D = stream.size(2);
  check_tensor("fn", fn, at::kFloat, {kMix, kHC * D}, stream.device(), true);
  check_tensor("scale", scale, at::kFloat, {3}, stream.device());
  check_tensor("base", base, at::kFloat, {kMix}, stream.device());
  if (norm_weight) check_tensor("norm_weight", *norm_weight, at::kBFloat16, {D}, stream.device(), true);
  if (pre_mix_in) check_tensor("pre_mix_in", *pre_mix_in, at::kFloat, {T, kHC}, stream.device());
  SPK_CHECK(sinkhorn_iters >= 1 && sinkhorn_iters <= 1000, "sinkhorn_iters must be in [1, 1000], got ", sinkhorn_iters);
  check_eps("rms_eps", rms_eps, true);
  check_eps("hc_eps", hc_eps, false);
  if (norm_weight) check_eps("norm_eps", norm_eps, true);
  if (sinkhorn_eps)
    check_eps("sinkhorn_eps", *sinkhorn_eps, true);
  else
    check_eps("sinkhorn_eps (None: hc_eps)", hc_eps, true);
  SPK_CHECK(std::isfinite(post_alpha), "post_alpha must be a finite number, got ", post_alpha);
}

// sinkhorn_eps: the schemas' optional trailing argument, None = hc_eps.
inline MhcEps make_eps(double rms_eps, double hc_eps, double norm_eps, int64_t sinkhorn_iters, double post_alpha,
                       c10::optional<double> sinkhorn_eps) {
  return MhcEps{(float)rms_eps,      (float)hc_eps,     (float)norm_eps,
                (int)sinkhorn_iters, (float)post_alpha, (float)sinkhorn_eps.value_or(hc_eps)};
}

}  // namespace spk
