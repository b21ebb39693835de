#pragma once
// Host side of the tile kernel (torch-free): the launch plan, a function of the shapes (and of
// a rank-agreed cluster cap for the fused ops) only, so every rank launches the same grid.
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

#include "kernels/mhc_tile.cuh"

namespace spk {

// SPK_DEBUG=1 prints every tile-kernel launch plan to stderr.
inline bool debug_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("SPK_DEBUG");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }();
  return on;
}

// CTAs per cluster: each owns hidden / cs columns; 16 (non-portable, Hopper) at DeepSeek sizes.
inline int tile_cluster_size(int hidden) {
  const int cs = hidden / 8 / 32;
  return cs < 1 ? 1 : cs > kMaxCluster ? kMaxCluster : cs;
}

struct TilePlan {
  int cs = 1, gpw = 1, clusters = 0;
  size_t smem = 0;
  const void* kernel = nullptr;
};

template <YSrc kSrc, bool kPost, bool kPre, bool kHead, bool kGather>
inline const void* tile_kernel_ptr(int gpw) {
  switch (gpw) {
    case 1:
      return (const void*)mhc_tile_kernel<kSrc, kPost, kPre, kHead, kGather, 1>;
    default:
      return (const void*)mhc_tile_kernel<kSrc, kPost, kPre, kHead, kGather, 2>;
  }
}

inline cudaLaunchConfig_t tile_config(const TilePlan& p, int clusters, cudaStream_t stream, cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(clusters * p.cs);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = p.smem;
  cfg.stream = stream;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = p.cs;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

inline cudaError_t prepare_tile_kernel(const TilePlan& p) {
  cudaError_t e = cudaFuncSetAttribute(p.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)p.smem);
  if (e == cudaSuccess && p.cs > 8)
    e = cudaFuncSetAttribute(p.kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  return e;
}

// How many clusters of this plan fit on the device at once (0: the cluster cannot be scheduled).
inline cudaError_t tile_max_clusters(const TilePlan& p, int* out) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, size_t>, int> cache;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  const auto key = std::make_tuple(device, p.kernel, p.smem);
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(key); it != cache.end()) {
    *out = it->second;
    return cudaSuccess;
  }
  if ((e = prepare_tile_kernel(p)) != cudaSuccess) return e;
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t cfg = tile_config(p, 1, nullptr, &attr);
  if ((e = cudaOccupancyMaxActiveClusters(out, p.kernel, &cfg)) != cudaSuccess) return e;
  cache[key] = *out;
  return cudaSuccess;
}

// The plan for `num_tokens` rows at `hidden`. max_clusters <= 0: use the device's own limit
// (local ops); the fused ops pass the cap every rank agreed on at Communicator creation.
template <YSrc kSrc, bool kPost, bool kPre, bool kHead, bool kGather>
inline cudaError_t plan_tiles(int num_tokens, int hidden, int max_clusters, TilePlan* plan) {
  TilePlan p;
  p.cs = tile_cluster_size(hidden);
  const int gmax = tile_groups(hidden, p.cs);
  // D <= kMaxHidden keeps every slice within 2 groups per warp.
  p.gpw = gmax <= kWarps ? 1 : 2;
  p.kernel = tile_kernel_ptr<kSrc, kPost, kPre, kHead, kGather>(p.gpw);
  p.smem = kPre ? tile_fn_smem_bytes<kHead>(hidden, p.cs) : 0;
  if (max_clusters <= 0) {
    cudaError_t e = tile_max_clusters(p, &max_clusters);
    if (e != cudaSuccess) return e;
    if (max_clusters <= 0) return cudaErrorInvalidConfiguration;
  }
  const int num_tiles = (num_tokens + kTileTokens - 1) / kTileTokens;
  p.clusters = num_tiles < max_clusters ? num_tiles : max_clusters;
  *plan = p;
  return cudaSuccess;
}

inline cudaError_t launch_tiles(const TilePlan& p, const TileArgs& args, cudaStream_t stream) {
  if (p.clusters == 0) return cudaSuccess;
  cudaError_t e = prepare_tile_kernel(p);
  if (e != cudaSuccess) return e;
  if (debug_enabled())
    std::fprintf(stderr, "spkernels: tile kernel %p T=%d D=%d cs=%d gpw=%d clusters=%d smem=%zu\n", p.kernel,
                 args.num_tokens, args.hidden, p.cs, p.gpw, p.clusters, p.smem);
  TileArgs a = args;
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t cfg = tile_config(p, p.clusters, stream, &attr);
  void* params[] = {&a};
  e = cudaLaunchKernelExC(&cfg, p.kernel, params);
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace spk
