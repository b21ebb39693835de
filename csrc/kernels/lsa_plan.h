#pragma once
// The LSA all-gather kernels' launch geometry (plain C++: the host plan uses it on CPU too).
#include <cstddef>

namespace spk {

constexpr int kGatherThreads = 512;

// Grid: a function of the byte count only (identical on every rank), at most max_ctas.
inline int lsa_all_gather_grid(size_t bytes, int max_ctas) {
  const size_t per_cta = 64 * 1024;
  size_t g = (bytes + per_cta - 1) / per_cta;
  if (g < 1) g = 1;
  return (int)(g < (size_t)max_ctas ? g : (size_t)max_ctas);
}

}  // namespace spk
