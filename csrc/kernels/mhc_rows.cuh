#pragma once
// Pass 1's tile loop (torch-free), shared by every pass-1 kernel (mhc_pass1.cuh): per 16-token tile
// of one column slice, A. the post (stream mix with y from its source: local, peers, pushed) and
// B. a pre's fn · x products and sums of squares into the workspace.
#include "kernels/fn_source.cuh"
#include "kernels/tile_mma.cuh"
#include "kernels/tile_policy.cuh"
#include "kernels/y_source.cuh"

namespace spk {

// The barrier of a team of kThreads threads: the CTA's when it is one team, else named barrier
// 1 + team.
template <int kTeams>
__device__ __forceinline__ void team_sync(int team) {
  if constexpr (kTeams == 1)
    __syncthreads();
  else
    bar_sync(1 + team, kThreads);
}

// The tiles a CTA runs: `run`'s (fn in registers), else CTA (g, s)'s tiles g, g + G, ... below
// num_tiles; each read where it is used (held in registers through the loop, they cost the fused
// post_pre's pass 1 spills).
template <bool kRuns>
struct Tiles {
  const TileRun& run;
  const TileArgs& a;
  int cta, S, num_tiles;
  __device__ __forceinline__ int first() const {
    if constexpr (kRuns)
      return run.first;
    else
      return cta / S;
  }
  __device__ __forceinline__ int step() const {
    if constexpr (kRuns)
      return run.step;
    else
      return a.groups;
  }
  __device__ __forceinline__ int end() const {
    if constexpr (kRuns)
      return run.end;
    else
      return num_tiles;
  }
};

// A post's incoming mix c of `row`: post_mix_in[row][c] for c < 4, else res_mix_in[row][c - 4].
__device__ __forceinline__ float incoming_mix(const TileArgs& a, int row, int c) {
  return c < kHC ? a.post_mix_in[row * kHC + c] : a.res_mix_in[row * kHC * kHC + c - kHC];
}

// kTeams > 1 (mhc_rows_teams_kernel, the head): the CTA is kTeams teams of kThreads threads on one staged fn
// slice, team k of CTA b acting as CTA ((b / S) * kTeams + k) * S + b % S of the one-team grid; each
// team has its own reduction buffers and syncs on named barrier 1 + k.
//
// kFn == FnSrc::kRegs runs the tiles of `run`; every other kernel CTA (g, s)'s tiles g, g + G, ...
template <YSrc kSrc, bool kPost, bool kPre, bool kHead, FnSrc kFn, int kTeams = 1, bool kRowCopies = false>
__device__ __forceinline__ void mhc_rows(const TileArgs& a, const TileRun& run = {}) {
  using P = TilePolicy<kSrc, kPost, kPre, kHead, kFn, kRowCopies>;
  constexpr int kRows = P::kRows, kVals = P::kVals, kNT = P::kNT;
  extern __shared__ __align__(16) uint4 s_fn[];
  // Warp partial products (in two rounds) and sums of squares, double-buffered by tile parity:
  // a tile's writes and the previous tile's workspace reads are then apart without a barrier.
  __shared__ float s_red_team[kTeams][2][kWarps / 2][kTileTokens][kRows];
  __shared__ float s_redsq_team[kTeams][2][kWarps][kTileTokens];
  __shared__ float s_mixin_team[kTeams][kTileTokens][kMix - kHC];  // incoming post | res of the tile
  static_assert(kTeams == 1 || (kHead && kFn == FnSrc::kShared), "teams: the staged head");
  const int team = kTeams == 1 ? 0 : threadIdx.x / kThreads;
  auto& s_red = s_red_team[team];
  auto& s_redsq = s_redsq_team[team];
  auto& s_mixin = s_mixin_team[team];

  const int parts = a.parts, part = blockIdx.x % parts;
  const int cta =
      kTeams == 1 ? blockIdx.x / parts : ((blockIdx.x / a.slices) * kTeams + team) * a.slices + blockIdx.x % a.slices;
  const int S = a.slices, slice = P::kRuns ? run.slice : cta % S;
  const int tid = kTeams == 1 ? threadIdx.x : threadIdx.x % kThreads;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int D = a.hidden, nvec = D >> 3, T = a.num_tokens;
  const int v0 = slice * nvec / S, W = (slice + 1) * nvec / S - v0;
  const int gmax = slice_groups(D, S);
  const int num_tiles = (T + kTileTokens - 1) / kTileTokens;
  const Tiles<P::kRuns> tiles{run, a, cta, S, num_tiles};
  const size_t srow = (size_t)kHC * D;
  const int vec = warp * 4 + t;  // this thread's vector of the slice (per stream)
  const size_t col = (size_t)(v0 + vec) * 8;
  // kPushed: this call's slot (the call before incremented `calls` and has completed).
  const uint32_t pslot = kSrc == YSrc::kPushed ? __ldcg(a.lsa.push.calls) & 1u : 0u;

  // ---- A: every stream load of a tile issued at once; x[h][i] = token g + 8h, stream i (with a
  // local post's y rows, P::kEarlyY; through the cp.async ring with fn in registers, P::kStageX).
  uint4* const x_stage = s_fn;  // the fn-in-registers kernel's dynamic shared memory: the ring
  // Row copies' slot layout (P::kRowCopies): [token][stream][vector], the vector XOR 4 on odd
  // tokens, so that a quarter warp's 16-byte reads (tokens g and g + 1) hit every bank once.
  auto row_unit = [](int slot, int tok, int i, int v) {
    return ((slot * kTileTokens + tok) * kHC + i) * 32 + (v ^ ((tok & 1) << 2));
  };
  static_assert(!P::kRowCopies || (kThreads == 2 * kHC * 32 && kTileTokens == 16), "a warp per (token, stream)");
  auto issue_tile = [&](int tile, int slot) {  // a tile's copies into `slot`, then the commit (alone past the end)
    if (tile < tiles.end()) {
      if constexpr (P::kRowCopies) {
        const int i = (tid >> 5) % kHC, v = tid & 31;
#pragma unroll
        for (int r = 0; r < kTileTokens / 2; ++r) {
          const int tok = 2 * r + tid / (kHC * 32), row = tile * kTileTokens + tok;
          const bool valid = v < W && row < T;
          cp_async16(x_stage + row_unit(slot, tok, i, v),
                     valid ? a.stream + row * srow + (size_t)i * D + (size_t)(v0 + v) * 8 : a.stream, valid ? 16 : 0);
        }
      } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = tile * kTileTokens + g + 8 * h;
          const bool valid = vec < W && row < T;
#pragma unroll
          for (int i = 0; i < kHC; ++i) {
            const __nv_bfloat16* src = valid ? a.stream + row * srow + (size_t)i * D + col : a.stream;
            cp_async16<P::kFetch256>(x_stage + ((slot * 2 + h) * kHC + i) * kThreads + tid, src, valid ? 16 : 0);
          }
        }
      }
    }
    cp_async_commit();
  };
  uint4 x[2][kHC], yr[2];
  auto load_tile = [&](int row_base, int slot) {
    if constexpr (P::kRowCopies) {  // landed: waited for before the previous tile's last barrier
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < kHC; ++i) x[h][i] = x_stage[row_unit(slot, g + 8 * h, i, vec)];
    } else if constexpr (P::kStageX) {
      cp_async_wait<P::kRing - 1>();
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < kHC; ++i) x[h][i] = x_stage[((slot * 2 + h) * kHC + i) * kThreads + tid];
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row_base + g + 8 * h;
        const bool valid = vec < W && row < T;
#pragma unroll
        for (int i = 0; i < kHC; ++i)
          x[h][i] = valid ? ld16<P::kFetch256>(a.stream + row * srow + (size_t)i * D + col) : make_uint4(0, 0, 0, 0);
        if constexpr (P::kEarlyY)
          yr[h] = valid ? *reinterpret_cast<const uint4*>(a.y + (size_t)row * D + col) : make_uint4(0, 0, 0, 0);
      }
    }
  };
  if (P::kPipe && tiles.first() < tiles.end()) load_tile(tiles.first() * kTileTokens, 0);
  // A post's incoming mixes (post | res, kMixIn per token); P::kMixAhead: the next tile's, this
  // thread's idx = tid + k * kThreads.
  constexpr int kMixIn = kMix - kHC, kMixPer = (kTileTokens * kMixIn + kThreads - 1) / kThreads;
  float mix_next[P::kMixAhead ? kMixPer : 1];
  auto load_mix = [&](int row_base, int k) {
    const int idx = tid + k * kThreads, row = row_base + idx / kMixIn;
    return idx < kTileTokens * kMixIn && row < T ? incoming_mix(a, row, idx % kMixIn) : 0.f;
  };
  if constexpr (P::kMixAhead)
    if (tiles.first() < tiles.end())
#pragma unroll
      for (int k = 0; k < kMixPer; ++k) mix_next[k] = load_mix(tiles.first() * kTileTokens, k);
  // kRegs: this thread's fn fragments, loaded once (a warp past the slice's columns adds zeros).
  uint4 fq[kFn == FnSrc::kRegs ? kHC : 1][kNT][2];
  if constexpr (kFn == FnSrc::kRegs)
    if (warp < gmax)
#pragma unroll
      for (int i = 0; i < kHC; ++i)
#pragma unroll
        for (int p = 0; p < kNT; ++p)
#pragma unroll
          for (int s = 0; s < 2; ++s) fq[i][p][s] = fn_fragment<kHead>(a, i, p * 8 + g, vec, s, v0, W);
  // The ring's first tiles go out after the fn loads: the first mma needs both, and fn's loads
  // queued behind the tiles' copies arrive later (up to 2% at D = 7168, docs/performance.md).
  if constexpr (P::kStageX)
#pragma unroll
    for (int r = 0; r < P::kRing; ++r) issue_tile(tiles.first() + r * tiles.step(), r);
  if constexpr (P::kRowCopies) {  // the first tile landed, for every thread
    cp_async_wait<P::kRing - 1>();
    team_sync<kTeams>(team);
  }

  for (int tile = tiles.first(), buf = 0, slot = 0; tile < tiles.end();
       tile += tiles.step(), buf ^= 1, slot = slot + 1 < P::kRing ? slot + 1 : 0) {
    const int row_base = tile * kTileTokens;
    if constexpr (!P::kPipe) load_tile(row_base, slot);
    // The CTA's next tile into L2 while this one computes (P::kPrefetchNext), the ranges dealt
    // round the warps.
    static_assert(kTileTokens * P::kPrefetchRanges % kWarps == 0, "whole shares per warp");
    if (const int next = row_base + tiles.step() * kTileTokens;
        P::kPrefetchNext && next < T && lane < kTileTokens * P::kPrefetchRanges / kWarps) {
      const int k = lane * kWarps + warp, row = next + k / P::kPrefetchRanges, i = k % P::kPrefetchRanges;
      if (row < T && i < kHC)
        prefetch_l2(a.stream + row * srow + (size_t)i * D + (size_t)v0 * 8, W * 16);
      else if (row < T)
        prefetch_l2(a.y + (size_t)row * D + (size_t)v0 * 8, W * 16);
    }
    // The previous tile's readers of s_mixin are done: a post alone has no later barrier; with a
    // pre they read before its sums' barriers (and s_red is the other buffer).
    if constexpr (!kPre) team_sync<kTeams>(team);
    if constexpr (kPost) {
      const PushSlot push{a, pslot, D, v0};   // kPushed
      uint4 mine[2];                          // kPushed: this rank's own partial vectors of tokens g and g + 8
      if constexpr (kSrc == YSrc::kPushed) {  // the rows out first, before the mixes' barrier
        // The (tile, slice)'s rows of this rank's partial into every peer's push region, a warp
        // per run of 32 vectors of a row: whole 128-byte lines over NVLink, where the tile layout
        // would store 64-byte pieces of 8 rows.
        push_rows(a, push, row_base, min(kTileTokens, T - row_base), W, tid);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = row_base + g + 8 * h;
          mine[h] = vec < W && row < T ? *reinterpret_cast<const uint4*>(a.y + (size_t)row * D + col)
                                       : make_uint4(0, 0, 0, 0);
        }
      }
      if constexpr (P::kMixAhead) {
#pragma unroll
        for (int k = 0; k < kMixPer; ++k)
          if (const int idx = tid + k * kThreads; idx < kTileTokens * kMixIn)
            s_mixin[idx / kMixIn][idx % kMixIn] = mix_next[k];
      } else {  // a strided loop straight into s_mixin (through load_mix, the fused posts need more registers)
        for (int idx = tid; idx < kTileTokens * kMixIn; idx += kThreads) {
          const int tok = idx / kMixIn, c = idx % kMixIn, row = row_base + tok;
          s_mixin[tok][c] = row < T ? incoming_mix(a, row, c) : 0.f;
        }
      }
      team_sync<kTeams>(team);
      // y of token g + 8h in bf16 from its source (y_source.cuh); zeros outside the tile.
      auto fetch_y = [&](int h) {
        const int row = row_base + g + 8 * h;
        uint4 y = make_uint4(0, 0, 0, 0);
        if (vec < W && row < T) {
          if constexpr (kSrc == YSrc::kPeers)
            y = peers_sum(a, row, D, col);
          else if constexpr (kSrc == YSrc::kPushed)
            y = pushed_sum(a, push, row, vec, mine[h]);
          else if constexpr (P::kEarlyY)
            y = yr[h];
          else
            y = ld16<P::kFetch256>(a.y + (size_t)row * D + col);
        }
        return y;
      };
      // Token g + 8's y before token g's stores where P::kYFirst, else after token g's mix.
      uint4 yb[2];
      yb[0] = fetch_y(0);
      if constexpr (P::kYFirst) yb[1] = fetch_y(1);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int tok = g + 8 * h, row = row_base + tok;
        const bool valid = vec < W && row < T;
        float yv[8];
        bf16x8_to_float(yb[h], yv);
        float xf[kHC][8];
#pragma unroll
        for (int i = 0; i < kHC; ++i) bf16x8_to_float(x[h][i], xf[i]);
#pragma unroll
        for (int j = 0; j < kHC; ++j) x[h][j] = post_mix_vector(s_mixin[tok], xf, yv, j);
        if constexpr (!P::kYFirst)
          if (h == 0) yb[1] = fetch_y(1);
        if (valid && part == 0)
#pragma unroll
          for (int j = 0; j < kHC; ++j)
            *reinterpret_cast<uint4*>(a.new_stream + row * srow + (size_t)j * D + col) = x[h][j];
      }
    }

    if constexpr (kPre) {
      // ---- B: m = fn · x on tensor cores and sum x^2 (tile_mma.cuh), reduced warp -> CTA in a
      // fixed order. At decode a CTA has its part's m-tile only, in v[0].
      float sq[2] = {0.f, 0.f};
      const int p0 = kFn == FnSrc::kParts ? part : 0;
      constexpr int np = kFn == FnSrc::kParts ? 1 : kNT;
      float v[kNT][2][2];
      static_assert(kFn != FnSrc::kParts || kNT > 1, "parts split the fn rows");
      if (warp >= gmax) {  // warp-uniform: a warp past the slice's columns adds zeros
        const float zero[2][4] = {};
#pragma unroll
        for (int p = 0; p < np; ++p) fold_hi_lo(zero, v[p]);
      } else if constexpr (kFn == FnSrc::kParts) {  // decode: this CTA's 8 fn rows (m-tile `part`)
        uint4 q[kHC][2];                            // every fragment in flight at once
#pragma unroll
        for (int i = 0; i < kHC; ++i)
#pragma unroll
          for (int s = 0; s < 2; ++s) q[i][s] = fn_fragment<kHead>(a, i, part * 8 + g, vec, s, v0, W);
        float acc[2][4] = {}, sqa[2][4] = {}, sqb[2][4] = {};
#pragma unroll
        for (int i = 0; i < kHC; ++i) mma_products(acc, q[i][0], q[i][1], x, i);  // the same mma order as below
        fold_hi_lo(acc, v[0]);
#pragma unroll
        for (int i = 0; i < kHC; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) mma_squares(sqa[h], sqb[h], x[h][i]);
        diagonal_squares(sqa, sqb, g, sq);
      } else {
        float acc[kNT][2][4] = {}, sqa[2][4] = {}, sqb[2][4] = {};
#pragma unroll
        for (int i = 0; i < kHC; ++i) {
#pragma unroll
          for (int p = 0; p < kNT; ++p) {
            uint4 q[2];
#pragma unroll
            for (int s = 0; s < 2; ++s) {
              if constexpr (kFn == FnSrc::kShared)
                q[s] = s_fn[(((i * gmax + warp) * 2 + s) * kRows + p * 8 + g) * 4 + t];
              else if constexpr (kFn == FnSrc::kRegs)
                q[s] = fq[i][p][s];
              else
                q[s] = fn_fragment<kHead>(a, i, p * 8 + g, vec, s, v0, W);
            }
            mma_products(acc[p], q[0], q[1], x, i);
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) mma_squares(sqa[h], sqb[h], x[h][i]);
        }
#pragma unroll
        for (int p = 0; p < kNT; ++p) fold_hi_lo(acc[p], v[p]);
        diagonal_squares(sqa, sqb, g, sq);
      }
      if constexpr (P::kPipe)
        if (tile + tiles.step() < tiles.end()) load_tile(row_base + tiles.step() * kTileTokens, 0);
      if constexpr (P::kStageX && !P::kRowCopies)  // every mma has read its x from the registers: the slot is free
        issue_tile(tile + P::kRing * tiles.step(), slot);
      if constexpr (P::kMixAhead)
        if (tile + tiles.step() < tiles.end())
#pragma unroll
          for (int k = 0; k < kMixPer; ++k) mix_next[k] = load_mix(row_base + tiles.step() * kTileTokens, k);
      // Warps 4..7 write, then warps 0..3 add: half the buffer. Then warp w < kNT completes rows
      // 8w..8w+7 (0 + p0 + p1 + p2 + p3, p_w = a_{w+4} + a_w) in its own mma layout and warp kNT
      // the sums of squares: a few instructions on 4 warps per tile, where a loop over the 400
      // values on all 8 warps takes several times more on each.
      if (warp >= kWarps / 2) {
#pragma unroll
        for (int p = 0; p < np; ++p) {
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 2; ++e) s_red[buf][warp - kWarps / 2][8 * h + 2 * t + e][(p + p0) * 8 + g] = v[p][h][e];
        }
      }
      if (t == g >> 1) {
#pragma unroll
        for (int h = 0; h < 2; ++h) s_redsq[buf][warp][8 * h + g] = sq[h];
      }
      team_sync<kTeams>(team);
      if constexpr (P::kRowCopies)  // every thread's mma has read its x from the slot: refill it
        issue_tile(tile + P::kRing * tiles.step(), slot);
      if (warp < kWarps / 2) {
#pragma unroll
        for (int p = 0; p < np; ++p) {
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 2; ++e) s_red[buf][warp][8 * h + 2 * t + e][(p + p0) * 8 + g] += v[p][h][e];
        }
      }
      if constexpr (P::kRowCopies) cp_async_wait<P::kRing - 1>();  // the next tile landed: read after this barrier
      team_sync<kTeams>(team);
      static_assert(kNT < kWarps, "a warp per m-tile and one for the squares");
      if (warp < kNT && (parts == 1 || warp == part)) {  // warp-uniform; decode: this part's m-tile
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = 8 * (e >> 1) + 2 * t + (e & 1), n = warp * 8 + g, row = row_base + tok;
          float v = 0.f;
#pragma unroll
          for (int w = 0; w < kWarps / 2; ++w) v += s_red[buf][w][tok][n];
          if (row < T) a.ws[((size_t)row * S + slice) * kVals + n] = v;
        }
      } else if (const int row = row_base + lane; warp == kNT && lane < kTileTokens && row < T && part == 0) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) v += s_redsq[buf][w][lane];
        a.ws[((size_t)row * S + slice) * kVals + kRows] = v;
      }
    }
  }
}

}  // namespace spk
