#pragma once
// Where a post's y rows come from besides a local tensor (torch-free): the sum of every peer's
// partial rows, pulled over NVLink after the entry barrier (YSrc::kPeers), or pushed by the peers
// into this rank's push region (YSrc::kPushed, protocol in tp_push.cuh). Both sum the partials in
// rank order 0..tp-1, the same order on every rank, and round like the reference reduction.
#include "kernels/tp_push.cuh"

namespace spk {

// kPeers: vector `col` (a column offset) of partial row `row` summed over the peers, four peers'
// loads in flight at a time (fewer registers than all kMaxPeers).
__device__ __forceinline__ uint4 peers_sum(const TileArgs& a, int row, int D, size_t col) {
  const size_t off = a.lsa.partial_offset + ((size_t)(a.lsa.partial_row0 + row) * D + col) * 2;
  float yv[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int p0 = 0; p0 < kMaxPeers; p0 += 4) {
    if (p0 >= a.lsa.world) break;
    uint4 pv[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (p0 + k < a.lsa.world) pv[k] = *reinterpret_cast<const uint4*>(ncclGetLsaPointer(a.lsa.window, off, p0 + k));
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (p0 + k >= a.lsa.world) break;
      float f[8];
      bf16x8_to_float(pv[k], f);
#pragma unroll
      for (int e = 0; e < 8; ++e) yv[e] += f[e];
    }
  }
  return float_to_bf16x8(yv);
}

// kPushed: this call's slot of the push regions (PushArgs), for one CTA's column slice.
struct PushSlot {
  const TileArgs& a;
  uint32_t slot;
  int D, v0;  // hidden size; the slice's first vector
  // This rank's vector `v` of the slice of row `row`, in `sender`'s place of a push region.
  __device__ __forceinline__ size_t offset(int sender, int row, int v) const {
    return a.lsa.push.offset +
           ((((size_t)slot * a.lsa.world + sender) * a.lsa.push.rows + row) * D + (size_t)(v0 + v) * 8) * 2;
  }
};

// kPushed: the rows [row_base, row_base + rows) of this rank's partial (slice columns, W vectors)
// into every peer's push region, a warp per run of 32 vectors of a row: whole 128-byte lines over
// NVLink, where the tile layout would store 64-byte pieces of 8 rows. -0.0 is sent as +0.0
// (-0.0 is the sentinel).
__device__ __forceinline__ void push_rows(const TileArgs& a, const PushSlot& push, int row_base, int rows, int W,
                                          int tid) {
  for (int i = tid; i < rows * W; i += kThreads) {
    const int row = row_base + i / W, v = i % W;
    uint4 y = *reinterpret_cast<const uint4*>(a.y + (size_t)row * push.D + (size_t)(push.v0 + v) * 8);
    y = make_uint4(no_neg_zero(y.x), no_neg_zero(y.y), no_neg_zero(y.z), no_neg_zero(y.w));
    for (int k = 0; k < a.lsa.world - 1; ++k)
      *static_cast<uint4*>(ncclGetLsaPointer(a.lsa.window, push.offset(a.lsa.rank, row, v), k + (k >= a.lsa.rank))) = y;
  }
}

// kPushed: vector `vec` of the slice of row `row` summed over the ranks: `mine` (this rank's own
// partial vector) in its place, each peer's polled from this rank's push region until it is not
// the sentinel, four peers' polls in flight at a time, and the sentinel put back at once (the
// vector's only reader: PushArgs).
__device__ __forceinline__ uint4 pushed_sum(const TileArgs& a, const PushSlot& push, int row, int vec,
                                            const uint4& mine) {
  float yv[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int p0 = 0; p0 < kMaxPeers; p0 += 4) {
    if (p0 >= a.lsa.world) break;
    const uint4* src[4];
    uint4 pv[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int p = p0 + k;
      if (p < a.lsa.world && p != a.lsa.rank) {
        src[k] = static_cast<const uint4*>(ncclGetLsaPointer(a.lsa.window, push.offset(p, row, vec), a.lsa.rank));
        pv[k] = ld_volatile(src[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int p = p0 + k;
      if (p >= a.lsa.world) break;
      if (p == a.lsa.rank) {
        pv[k] = mine;
      } else {
        if (has_sentinel(pv[k]))
          spin_until([&] { return !has_sentinel(pv[k] = ld_volatile(src[k])); }, a.lsa.barrier, blockIdx.x, p,
                     BarrierSite::kPushedRows);
        *const_cast<uint4*>(src[k]) = make_uint4(kPushSentinel, kPushSentinel, kPushSentinel, kPushSentinel);
      }
      float f[8];
      bf16x8_to_float(pv[k], f);
#pragma unroll
      for (int e = 0; e < 8; ++e) yv[e] += f[e];
    }
  }
  return float_to_bf16x8(yv);
}

}  // namespace spk
