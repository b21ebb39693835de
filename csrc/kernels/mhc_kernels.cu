// The one translation unit that compiles the mHC kernels (torch-free): each kernel is instantiated
// here once, and the ops launch them through mhc_api.cuh. The launch plan itself is the pure
// function mhc_plan (mhc_plan.h); this file queries the device's occupancy for it and launches it.
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

#include "kernels/lsa_all_gather.cuh"
#include "kernels/lsa_gather.cuh"
#include "kernels/mhc_api.cuh"
#include "kernels/mhc_collapse.cuh"
#include "kernels/mhc_pass1.cuh"
#include "kernels/mhc_post_row.cuh"

namespace spk {
namespace {

// SPK_DEBUG=1 prints every launch plan to stderr.
bool debug_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("SPK_DEBUG");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }();
  return on;
}

// CTAs of `kernel` (`threads` each, `smem` bytes of dynamic shared memory) that fit on the device
// at once, cached per device, kernel and smem size.
cudaError_t resident_ctas(const void* kernel, int threads, size_t smem, int* out) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, size_t>, int> cache;
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find({device, kernel, smem}); it != cache.end()) {
    *out = it->second;
    return cudaSuccess;
  }
  if ((e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)) != cudaSuccess ||
      (e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem)) != cudaSuccess ||
      (e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess)
    return e;
  cache[{device, kernel, smem}] = *out = per_sm * sms;
  return per_sm > 0 ? cudaSuccess : cudaErrorInvalidConfiguration;
}

using Kernel = void (*)(TileArgs);

// The kernels of one op variant: the tile kernel by fn source, the wide pass-1 kernel, and pass 2's
// two kernels by kV (1..5; null past D = 8960; the ops cap D at 8192), the loop kernel also by
// kLastReadFlag (mhc_plan.h).
template <MhcVariant kVariant>
struct VariantKernels {
  static constexpr MhcTraits kT = mhc_traits(kVariant);

  static Kernel rows(int fn_src) {
    if constexpr (kT.pre) {
      if (fn_src == (int)FnSrc::kShared) return mhc_rows_kernel<kT.src, kT.post, kT.pre, kT.head, FnSrc::kShared>;
      if constexpr (FnRows<kT.head>::kRows / 8 > 1)
        if (fn_src == (int)FnSrc::kParts) return mhc_rows_kernel<kT.src, kT.post, kT.pre, kT.head, FnSrc::kParts>;
    }
    return mhc_rows_kernel<kT.src, kT.post, kT.pre, kT.head, FnSrc::kGlobal>;
  }

  // The head's teams kernel or a pre's fn-in-registers kernel (pres without a post or peers only;
  // row_copies: MhcLaunch::variant).
  static constexpr bool kWide = kT.src == YSrc::kNone && !kT.post && kT.pre;
  static Kernel wide(int row_copies = 0) {
    return kT.head ? mhc_rows_teams_kernel : row_copies ? mhc_rows_fnreg_kernel<true> : mhc_rows_fnreg_kernel<false>;
  }
  static int wide_threads() { return kThreads * (kT.head ? kPreTeams : 1); }
  static size_t wide_smem(int hidden) { return kT.head ? fn_smem_bytes<true>(hidden) : kFnRegSmemBytes; }

  // The loop kernel at kV, evict-first from kLastReadMinVecs or where the plan asks (never a
  // gather's: collapse_last_read).
  template <int kV>
  static Kernel loop_kernel(bool last_read) {
    constexpr bool h = kT.head, g = kT.gather;
    if constexpr (kV >= kLastReadMinVecs)
      return mhc_collapse_loop_kernel<h, g, kV, true>;
    else if constexpr (g)
      return mhc_collapse_loop_kernel<h, g, kV, false>;
    else
      return last_read ? mhc_collapse_loop_kernel<h, g, kV, true> : mhc_collapse_loop_kernel<h, g, kV, false>;
  }

  static Kernel collapse(bool loop, int variant) {
    constexpr bool h = kT.head, g = kT.gather;
    const int kv = variant & (kLastReadFlag - 1);
    if (kv < 1 || kv > 5) return nullptr;
    if constexpr (collapse_row_used(kT)) {
      const Kernel row[5] = {mhc_collapse_row_kernel<h, g, 1>, mhc_collapse_row_kernel<h, g, 2>,
                             mhc_collapse_row_kernel<h, g, 3>, mhc_collapse_row_kernel<h, g, 4>,
                             mhc_collapse_row_kernel<h, g, 5>};
      if (!loop) return row[kv - 1];
    }
    const bool lr = variant & kLastReadFlag;
    const Kernel loops[5] = {loop_kernel<1>(lr), loop_kernel<2>(lr), loop_kernel<3>(lr), loop_kernel<4>(lr),
                             loop_kernel<5>(lr)};
    return loop ? loops[kv - 1] : nullptr;
  }

  // The occupancy mhc_plan reads for this variant (max_ctas > 0: the fused cap replaces `rows`).
  static cudaError_t occupancy(int hidden, int max_ctas, MhcOccupancy* o) {
    *o = {};
    cudaError_t e;
    if (max_ctas <= 0 && (e = resident_ctas((const void*)rows(kT.pre ? (int)FnSrc::kShared : (int)FnSrc::kGlobal),
                                            kThreads, rows_smem_bytes(kT, hidden), &o->rows)) != cudaSuccess)
      return e;
    if constexpr (kWide)
      if ((e = resident_ctas((const void*)wide(), wide_threads(), wide_smem(hidden), &o->wide)) != cudaSuccess)
        return e;
    if constexpr (kT.pre) {
      const Kernel loop = collapse(true, collapse_vectors(hidden));
      if (loop == nullptr) return cudaErrorInvalidValue;
      if ((e = resident_ctas((const void*)loop, kThreads, 0, &o->collapse_loop)) != cudaSuccess) return e;
    }
    if constexpr (collapse_row_used(kT)) {
      const Kernel row = collapse(false, collapse_vectors(hidden));
      if ((e = resident_ctas((const void*)row, kThreads, 0, &o->collapse_row)) != cudaSuccess) return e;
    }
    return cudaSuccess;
  }

  static cudaError_t launch(TileArgs a, int max_ctas, cudaStream_t stream) {
    const int T = a.num_tokens, D = a.hidden;
    if (T == 0) return cudaSuccess;
    MhcOccupancy occ = {};
    cudaError_t e;
    if (!mhc_post_row_only(kVariant, T) && (e = occupancy(D, max_ctas, &occ)) != cudaSuccess) return e;
    const MhcPlan p = mhc_plan(kVariant, T, D, max_ctas, occ);
    a.slices = p.slices;
    a.groups = p.groups;
    a.parts = p.parts;
    a.exit_barrier = p.exit_barrier;
    a.push_barrier = p.push_barrier;
    for (int i = 0; i < p.num_launches; ++i) {
      const MhcLaunch& l = p.launches[i];
      switch (l.kernel) {
        case MhcKernel::kPostRow:
          if (debug_enabled()) std::fprintf(stderr, "spkernels: post row kernel T=%d D=%d\n", T, D);
          e = launch_dependent(mhc_post_row_kernel, dim3(l.grid_x, l.grid_y), l.block, 0, stream, a);
          break;
        case MhcKernel::kRows:
        case MhcKernel::kRowsTeams:
        case MhcKernel::kRowsFnReg: {
          Kernel k = l.kernel == MhcKernel::kRows ? rows(l.variant) : nullptr;
          if constexpr (kWide)
            if (l.kernel != MhcKernel::kRows) k = wide(l.variant);
          if ((e = cudaFuncSetAttribute((const void*)k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)l.smem)) !=
              cudaSuccess)
            return e;
          if (debug_enabled()) {
            const char* wide_kind = l.kernel == MhcKernel::kRowsTeams ? " (teams)"
                                    : l.variant                       ? " (fn in registers, row copies)"
                                                                      : " (fn in registers)";
            std::fprintf(stderr, "spkernels: rows kernel T=%d D=%d slices=%d groups=%d parts=%d smem=%zu%s%s\n", T, D,
                         p.slices, p.groups, p.parts, l.smem,
                         l.variant == (int)FnSrc::kShared || l.kernel != MhcKernel::kRows ? " (fn staged)" : "",
                         l.kernel == MhcKernel::kRows ? "" : wide_kind);
          }
          e = launch_dependent(k, l.grid_x, l.block, l.smem, stream, a);
          break;
        }
        case MhcKernel::kCollapseRow:
        case MhcKernel::kCollapseLoop: {
          const bool loop = l.kernel == MhcKernel::kCollapseLoop;
          if (debug_enabled())
            std::fprintf(stderr, "spkernels: collapse T=%d: %s\n", T, loop ? "looping row CTAs" : "a CTA per row");
          e = launch_dependent(collapse(loop, l.variant), l.grid_x, l.block, 0, stream, a);
          break;
        }
        case MhcKernel::kCopyIn:
          e = launch_dependent(lsa_copy_in_kernel, l.grid_x, l.block, 0, stream, a.lsa.window, a.lsa.gather_offset,
                               (size_t)T * D * 2, a.lsa.rank, a.lsa.world, a.lsa.barrier,
                               reinterpret_cast<char*>(a.layer_input));
          break;
      }
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  }
};

}  // namespace

cudaError_t launch_mhc(MhcVariant v, TileArgs a, int max_ctas, cudaStream_t stream) {
  switch (v) {
    case MhcVariant::kPre:
      return VariantKernels<MhcVariant::kPre>::launch(a, max_ctas, stream);
    case MhcVariant::kPost:
      return VariantKernels<MhcVariant::kPost>::launch(a, max_ctas, stream);
    case MhcVariant::kPostPre:
      return VariantKernels<MhcVariant::kPostPre>::launch(a, max_ctas, stream);
    case MhcVariant::kHead:
      return VariantKernels<MhcVariant::kHead>::launch(a, max_ctas, stream);
    case MhcVariant::kPostPeers:
      return VariantKernels<MhcVariant::kPostPeers>::launch(a, max_ctas, stream);
    case MhcVariant::kPostPushed:
      return VariantKernels<MhcVariant::kPostPushed>::launch(a, max_ctas, stream);
    case MhcVariant::kPreGather:
      return VariantKernels<MhcVariant::kPreGather>::launch(a, max_ctas, stream);
    case MhcVariant::kPostPrePeers:
      return VariantKernels<MhcVariant::kPostPrePeers>::launch(a, max_ctas, stream);
    case MhcVariant::kPostPrePeersGather:
      return VariantKernels<MhcVariant::kPostPrePeersGather>::launch(a, max_ctas, stream);
  }
  return cudaErrorInvalidValue;
}

// The heaviest fused kernel: the fused post_pre's tile kernel with fn staged.
cudaError_t mhc_fused_max_ctas(int hidden, int* out) {
  using K = VariantKernels<MhcVariant::kPostPrePeers>;
  return resident_ctas((const void*)K::rows((int)FnSrc::kShared), kThreads, rows_smem_bytes(K::kT, hidden), out);
}

cudaError_t launch_lsa_all_gather(ncclWindow_t window, size_t gather_offset, size_t bytes, int rank, int world,
                                  const BarrierArgs& barrier, char* out, int max_ctas, cudaStream_t stream) {
  lsa_all_gather_kernel<false><<<lsa_all_gather_grid(bytes, max_ctas), kGatherThreads, 0, stream>>>(
      window, gather_offset, bytes, rank, world, barrier, out);
  return cudaGetLastError();
}

}  // namespace spk
