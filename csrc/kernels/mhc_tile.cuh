#pragma once
// The one mHC tile kernel behind every op, local or fused with a collective (torch-free).
//
// Work split: a cluster of `cs` CTAs owns a tile of 16 tokens; CTA c of the cluster owns a
// column slice of D (the same slice of all 4 streams). Per tile:
//   A. load the stream slice (and for a post: y, or the sum of every peer's partial rows in
//      rank order 0..tp-1 over NVLink), mix it, store the new stream; the new stream stays in
//      registers, laid out as mma A fragments.
//   B. m = fn · x on bf16 tensor cores, fn split into bf16 hi + lo (fp32-grade accuracy); each
//      warp sums its k-range, the CTA sums its warps, the cluster sums its CTAs through
//      distributed shared memory, all in a fixed order (replicated ranks stay bitwise equal).
//   C. per-token coefficients (sigmoids, 20-step Sinkhorn), one quad of lanes per token.
//   D. collapse (+ fused RMSNorm: a second cluster reduction) and store layer_input, pushing
//      it into every peer's gather buffer in SP mode.
// A CTA only ever talks over NVLink to the CTA with the same index on each peer (the grid and
// the tile -> CTA map are functions of the shapes only), so per-CTA LSA barriers suffice.
#include <cooperative_groups.h>
#include <nccl.h>
#include <nccl_device.h>

#include "kernels/lsa_barrier.cuh"
#include "kernels/mhc_math.cuh"

namespace spk {

namespace cg = cooperative_groups;

enum class YSrc : int { kNone, kLocal, kPeers };

struct LsaArgs {
  ncclWindow_t window;
  size_t partial_offset;  // bytes: this rank's [max_tokens, D] partial region of the window
  size_t gather_offset;   // bytes: this rank's [max_tokens, D] gather region of the window
  int rank, world;
  int partial_row0;  // first partial row this rank reduces (SP: rank * T_local; TP: 0)
  BarrierArgs barrier;
};

struct TileArgs {
  int num_tokens;  // rows this rank mixes: T_local in SP mode, T otherwise
  int hidden;
  const __nv_bfloat16* stream;  // [num_tokens, 4, D]
  const __nv_bfloat16* y;       // [num_tokens, D] (YSrc::kLocal)
  const float* post_mix_in;     // [num_tokens, 4]
  const float* res_mix_in;      // [num_tokens, 4, 4]
  const float* fn;              // [24, 4D] ([4, 4D] for the head)
  const float* scale;
  const float* base;
  const __nv_bfloat16* norm_weight;  // [D] or null
  const float* pre_mix_in;           // [num_tokens, 4] or null
  MhcEps eps;
  __nv_bfloat16* new_stream;   // [num_tokens, 4, D]
  __nv_bfloat16* layer_input;  // [tp * num_tokens, D] in gather mode (rank-major), else [num_tokens, D]
  float* post_mix;             // [num_tokens, 4]
  float* res_mix;              // [num_tokens, 4, 4]
  float* pre_mix;              // [num_tokens, 4]
  LsaArgs lsa;
};

// fn rows padded to whole mma n-tiles: 24 for pre, 4 -> 8 for the head.
template <bool kHead>
struct FnRows {
  static constexpr int kRows = kHead ? 8 : kMix;
  static constexpr int kValid = kHead ? kHC : kMix;
};

__host__ __device__ inline int tile_groups(int hidden, int cs) {
  const int nvec = hidden / 8;
  return ((nvec + cs - 1) / cs + 3) / 4;  // groups of 4 16-byte vectors in the widest slice
}

template <bool kHead>
__host__ __device__ inline size_t tile_fn_smem_bytes(int hidden, int cs) {
  return (size_t)kHC * tile_groups(hidden, cs) * 2 * FnRows<kHead>::kRows * 4 * sizeof(uint4);
}

// The CTA's fn slice as mma B fragments in shared memory, split into bf16 hi and lo. Entry
// (((i * gmax + grp) * 2 + s) * kRows + n) * 4 + t holds, for fn row n and stream i, elements
// 4s..4s+3 of vector (grp * 4 + t) of the slice as {hi01, hi23, lo01, lo23}. The k order inside
// a 16-wide mma step is permuted (thread t owns 4 contiguous elements) identically for A and B,
// so the product is unchanged and both operands load as plain vectors. Loaded once per kernel,
// before the entry barrier, so that its latency hides behind the peers' arrival.
template <bool kHead>
__device__ __forceinline__ void stage_fn_slice(const TileArgs& a) {
  constexpr int kRows = FnRows<kHead>::kRows;
  extern __shared__ __align__(16) uint4 s_fn[];
  cg::cluster_group cluster = cg::this_cluster();
  const int cs = (int)cluster.num_blocks(), crank = (int)cluster.block_rank();
  const int nvec = a.hidden >> 3, v0 = crank * nvec / cs, W = (crank + 1) * nvec / cs - v0;
  const int gmax = tile_groups(a.hidden, cs);
  const int entries = kHC * gmax * 2 * kRows * 4;
#pragma unroll 8
  for (int e = threadIdx.x; e < entries; e += kThreads) {
    const int t = e & 3, n = (e >> 2) % kRows, rest = (e >> 2) / kRows;
    const int s = rest & 1, grp = (rest >> 1) % gmax, i = (rest >> 1) / gmax;
    const int vec = grp * 4 + t;
    float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
    if (n < FnRows<kHead>::kValid && vec < W)
      f = *reinterpret_cast<const float4*>(a.fn + (size_t)n * kHC * a.hidden + (size_t)i * a.hidden +
                                           (size_t)(v0 + vec) * 8 + 4 * s);
    uint4 q;
    split_bf16x2(f.x, f.y, q.x, q.z);
    split_bf16x2(f.z, f.w, q.y, q.w);
    s_fn[e] = q;
  }
  __syncthreads();
}

// Sum of `v` over the cluster's CTAs in rank order (every CTA gets the same bits). The remote
// loads are independent and issued together: one distributed-shared-memory latency, not cs.
__device__ __forceinline__ float cluster_sum(cg::cluster_group& cluster, float* local, int idx, int cs) {
  float v[kMaxCluster];
#pragma unroll
  for (int r = 0; r < kMaxCluster; ++r) v[r] = r < cs ? cluster.map_shared_rank(local, r)[idx] : 0.f;
  float acc = 0.f;
#pragma unroll
  for (int r = 0; r < kMaxCluster; ++r) acc += v[r];
  return acc;
}

template <YSrc kSrc, bool kPost, bool kPre, bool kHead, bool kGather, int kGPW>
__device__ __forceinline__ void mhc_tiles(const TileArgs& a) {
  constexpr int kRows = FnRows<kHead>::kRows;
  constexpr int kNT = kRows / 8;
  extern __shared__ __align__(16) uint4 s_fn[];
  __shared__ float s_red[kWarps / 2][kTileTokens][kRows];  // warp partial products, in two rounds
  __shared__ float s_redsq[kWarps][kTileTokens];           // per-warp partial sums of squares
  __shared__ float s_cta[2][kTileTokens][kRows + 1];       // CTA partials, read by the whole cluster
  __shared__ float s_ycta[2][kTileTokens];                 // CTA partial sum of y^2 (fused norm)
  __shared__ float s_m[kTileTokens][kRows + 1];            // cluster totals: m | sum x^2
  __shared__ float s_coef[kTileTokens][kMix];              // pre | post | res, or the head weights
  __shared__ float s_mixin[kTileTokens][kMix - kHC];       // incoming post | res of the tile
  __shared__ float s_pmi[kTileTokens][kHC];                // pre_mix_in of the tile
  __shared__ float s_rnorm[kTileTokens];
  __shared__ float s_scale[3], s_base[kMix];  // read by every tile's coefficients: keep them close

  cg::cluster_group cluster = cg::this_cluster();
  const int cs = (int)cluster.num_blocks(), crank = (int)cluster.block_rank();
  const int cluster_id = blockIdx.x / cs, num_clusters = gridDim.x / cs;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int D = a.hidden, nvec = D >> 3, T = a.num_tokens;
  const int v0 = crank * nvec / cs, W = (crank + 1) * nvec / cs - v0;
  const int gmax = tile_groups(D, cs);
  const int num_tiles = (T + kTileTokens - 1) / kTileTokens;
  const size_t srow = (size_t)kHC * D;
  if constexpr (kPre) {
    if (tid < FnRows<kHead>::kValid) s_base[tid] = a.base[tid];
    if (tid < (kHead ? 1 : 3)) s_scale[tid] = a.scale[tid];
  }  // published by the __syncthreads at the top of the first tile

  for (int tile = cluster_id, it = 0; tile < num_tiles; tile += num_clusters, ++it) {
    const int buf = it & 1, row_base = tile * kTileTokens;

    // ---- A: issue every stream load of the tile first; x[gi][h][i] = token g + 8h, stream i.
    uint4 x[kGPW][2][kHC];
#pragma unroll
    for (int gi = 0; gi < kGPW; ++gi) {
      const int vec = (warp + gi * kWarps) * 4 + t;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row_base + g + 8 * h;
        const bool valid = vec < W && row < T;
#pragma unroll
        for (int i = 0; i < kHC; ++i)
          x[gi][h][i] =
              valid ? *reinterpret_cast<const uint4*>(a.stream + row * srow + (size_t)i * D + (size_t)(v0 + vec) * 8)
                    : make_uint4(0, 0, 0, 0);
      }
    }
    __syncthreads();  // the previous tile's readers of s_coef / s_mixin / s_pmi are done
    if constexpr (kPost) {
      for (int idx = tid; idx < kTileTokens * (kMix - kHC); idx += kThreads) {
        const int tok = idx / (kMix - kHC), c = idx % (kMix - kHC), row = row_base + tok;
        float v = 0.f;
        if (row < T) v = c < kHC ? a.post_mix_in[row * kHC + c] : a.res_mix_in[row * kHC * kHC + c - kHC];
        s_mixin[tok][c] = v;
      }
    }
    if constexpr (kPre) {
      if (a.pre_mix_in != nullptr && tid < kTileTokens * kHC) {
        const int row = row_base + tid / kHC;
        s_pmi[tid / kHC][tid % kHC] = row < T ? a.pre_mix_in[row * kHC + tid % kHC] : 0.f;
      }
    }
    __syncthreads();

    if constexpr (kPost) {
#pragma unroll
      for (int gi = 0; gi < kGPW; ++gi) {
        const int vec = (warp + gi * kWarps) * 4 + t;
        const size_t col = (size_t)(v0 + vec) * 8;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int tok = g + 8 * h, row = row_base + tok;
          const bool valid = vec < W && row < T;
          float yv[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
          if (valid) {
            if constexpr (kSrc == YSrc::kPeers) {
              // Sum every rank's partial row in rank order 0..tp-1 (the same order on every
              // rank), round to bf16 like the reference reduction, then mix.
              const size_t off = a.lsa.partial_offset + ((size_t)(a.lsa.partial_row0 + row) * D + col) * 2;
              // Four peers' loads in flight at a time (fewer registers than all kMaxPeers).
#pragma unroll
              for (int p0 = 0; p0 < kMaxPeers; p0 += 4) {
                if (p0 >= a.lsa.world) break;
                uint4 pv[4];
#pragma unroll
                for (int k = 0; k < 4; ++k)
                  if (p0 + k < a.lsa.world)
                    pv[k] = *reinterpret_cast<const uint4*>(ncclGetLsaPointer(a.lsa.window, off, p0 + k));
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                  if (p0 + k >= a.lsa.world) break;
                  float f[8];
                  bf16x8_to_float(pv[k], f);
#pragma unroll
                  for (int e = 0; e < 8; ++e) yv[e] += f[e];
                }
              }
              bf16x8_to_float(float_to_bf16x8(yv), yv);
            } else {
              bf16x8_to_float(*reinterpret_cast<const uint4*>(a.y + (size_t)row * D + col), yv);
            }
          }
          float xf[kHC][8];
#pragma unroll
          for (int i = 0; i < kHC; ++i) bf16x8_to_float(x[gi][h][i], xf[i]);
          const float* mix = s_mixin[tok];  // post[j] | res[i][j] at kHC + i * kHC + j
#pragma unroll
          for (int j = 0; j < kHC; ++j) {
            float nv[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              float acc = 0.f;
#pragma unroll
              for (int i = 0; i < kHC; ++i) acc += mix[kHC + i * kHC + j] * xf[i][e];
              nv[e] = mix[j] * yv[e] + acc;
            }
            x[gi][h][j] = float_to_bf16x8(nv);
            if (valid) *reinterpret_cast<uint4*>(a.new_stream + row * srow + (size_t)j * D + col) = x[gi][h][j];
          }
        }
      }
    }

    if constexpr (kPre) {
      // ---- B: m = fn · x on tensor cores, reduced warp -> CTA -> cluster in fixed order.
      float sq[2] = {0.f, 0.f};
#pragma unroll
      for (int gi = 0; gi < kGPW; ++gi)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int i = 0; i < kHC; ++i) {
            float f[8];
            bf16x8_to_float(x[gi][h][i], f);
#pragma unroll
            for (int e = 0; e < 8; ++e) sq[h] += f[e] * f[e];
          }
      float acc[kNT][4];
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
      for (int gi = 0; gi < kGPW; ++gi) {
        const int grp = warp + gi * kWarps;
        if (grp >= gmax) continue;  // warp-uniform
#pragma unroll
        for (int i = 0; i < kHC; ++i) {
          uint4 q[2][kNT];
#pragma unroll
          for (int s = 0; s < 2; ++s)
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) q[s][nt] = s_fn[(((i * gmax + grp) * 2 + s) * kRows + nt * 8 + g) * 4 + t];
#pragma unroll
          for (int s = 0; s < 2; ++s) {
            const uint32_t a0 = word_of(x[gi][0][i], 2 * s), a1 = word_of(x[gi][1][i], 2 * s);
            const uint32_t a2 = word_of(x[gi][0][i], 2 * s + 1), a3 = word_of(x[gi][1][i], 2 * s + 1);
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
              mma_bf16_16816(acc[nt], a0, a1, a2, a3, q[s][nt].x, q[s][nt].y);  // hi
              mma_bf16_16816(acc[nt], a0, a1, a2, a3, q[s][nt].z, q[s][nt].w);  // lo
            }
          }
        }
      }
      // Warps 4..7 write, then warps 0..3 add: half the buffer (two CTAs fit on an SM at D=4096).
      if (warp >= kWarps / 2) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          s_red[warp - kWarps / 2][g][nt * 8 + 2 * t] = acc[nt][0];
          s_red[warp - kWarps / 2][g][nt * 8 + 2 * t + 1] = acc[nt][1];
          s_red[warp - kWarps / 2][g + 8][nt * 8 + 2 * t] = acc[nt][2];
          s_red[warp - kWarps / 2][g + 8][nt * 8 + 2 * t + 1] = acc[nt][3];
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float q = quad_sum(sq[h]);
        if (t == 0) s_redsq[warp][g + 8 * h] = q;
      }
      __syncthreads();
      if (warp < kWarps / 2) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          s_red[warp][g][nt * 8 + 2 * t] += acc[nt][0];
          s_red[warp][g][nt * 8 + 2 * t + 1] += acc[nt][1];
          s_red[warp][g + 8][nt * 8 + 2 * t] += acc[nt][2];
          s_red[warp][g + 8][nt * 8 + 2 * t + 1] += acc[nt][3];
        }
      }
      __syncthreads();
      for (int idx = tid; idx < kTileTokens * (kRows + 1); idx += kThreads) {
        const int tok = idx / (kRows + 1), n = idx % (kRows + 1);
        float v = 0.f;
        if (n < kRows) {
#pragma unroll
          for (int w = 0; w < kWarps / 2; ++w) v += s_red[w][tok][n];
        } else {
#pragma unroll
          for (int w = 0; w < kWarps; ++w) v += s_redsq[w][tok];
        }
        s_cta[buf][tok][n] = v;
      }
      cluster.sync();  // release this CTA's partials to the cluster, acquire the others'
      for (int idx = tid; idx < kTileTokens * (kRows + 1); idx += kThreads)
        (&s_m[0][0])[idx] = cluster_sum(cluster, &s_cta[buf][0][0], idx, cs);
      __syncthreads();

      // ---- C: coefficients, a quad of lanes per token.
      if (tid < kTileTokens * kHC) {
        const int tok = tid >> 2, i = tid & 3, row = row_base + tok;
        const float r = 1.0f / sqrtf(s_m[tok][kRows] / (float)(kHC * D) + a.eps.rms_eps);
        if constexpr (kHead) {
          s_coef[tok][i] = sigmoidf(s_m[tok][i] * r * s_scale[0] + s_base[i]) + a.eps.hc_eps;
        } else {
          mhc_coefficients_quad(s_m[tok], r, s_scale, s_base, a.eps, i, s_coef[tok]);
          if (crank == 0 && row < T) {
            a.pre_mix[row * kHC + i] = s_coef[tok][i];
            a.post_mix[row * kHC + i] = s_coef[tok][kHC + i];
#pragma unroll
            for (int j = 0; j < kHC; ++j) a.res_mix[(row * kHC + i) * kHC + j] = s_coef[tok][2 * kHC + i * kHC + j];
          }
        }
      }
      __syncthreads();

      // ---- D: collapse with pre (or the carried-in pre_mix_in), fused RMSNorm, store.
      uint4 yb[kGPW][2];
      float ysq[2] = {0.f, 0.f};
#pragma unroll
      for (int gi = 0; gi < kGPW; ++gi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int tok = g + 8 * h;
          const float* w = (!kHead && a.pre_mix_in != nullptr) ? s_pmi[tok] : s_coef[tok];
          float y[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int i = 0; i < kHC; ++i) {
            float f[8];
            bf16x8_to_float(x[gi][h][i], f);
#pragma unroll
            for (int e = 0; e < 8; ++e) y[e] += w[i] * f[e];
          }
          yb[gi][h] = float_to_bf16x8(y);
          if (!kHead && a.norm_weight != nullptr) {
            bf16x8_to_float(yb[gi][h], y);
#pragma unroll
            for (int e = 0; e < 8; ++e) ysq[h] += y[e] * y[e];
          }
        }
      }
      if (!kHead && a.norm_weight != nullptr) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float q = quad_sum(ysq[h]);
          if (t == 0) s_redsq[warp][g + 8 * h] = q;
        }
        __syncthreads();
        if (tid < kTileTokens) {
          float v = 0.f;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) v += s_redsq[w][tid];
          s_ycta[buf][tid] = v;
        }
        cluster.sync();
        if (tid < kTileTokens) {
          const float v = cluster_sum(cluster, &s_ycta[buf][0], tid, cs);
          s_rnorm[tid] = 1.0f / sqrtf(v / (float)D + a.eps.norm_eps);
        }
        __syncthreads();
      }
#pragma unroll
      for (int gi = 0; gi < kGPW; ++gi) {
        const int vec = (warp + gi * kWarps) * 4 + t;
        const size_t col = (size_t)(v0 + vec) * 8;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int tok = g + 8 * h, row = row_base + tok;
          if (vec >= W || row >= T) continue;
          uint4 out = yb[gi][h];
          if (!kHead && a.norm_weight != nullptr) {
            float y[8], nw[8];
            bf16x8_to_float(out, y);
            bf16x8_to_float(*reinterpret_cast<const uint4*>(a.norm_weight + col), nw);
#pragma unroll
            for (int e = 0; e < 8; ++e) y[e] = y[e] * s_rnorm[tok] * nw[e];
            out = float_to_bf16x8(y);
          }
          if constexpr (kGather) {
            // My rows go to rows [rank * T_local, ...) of the full output and of every peer's
            // gather buffer (remote stores; released by the barrier that follows the tiles).
            const size_t grow = (size_t)a.lsa.rank * T + row;
            *reinterpret_cast<uint4*>(a.layer_input + grow * D + col) = out;
            for (int p = 0; p < a.lsa.world; ++p) {
              if (p == a.lsa.rank) continue;
              *reinterpret_cast<uint4*>(
                  ncclGetLsaPointer(a.lsa.window, a.lsa.gather_offset + (grow * D + col) * 2, p)) = out;
            }
          } else {
            *reinterpret_cast<uint4*>(a.layer_input + (size_t)row * D + col) = out;
          }
        }
      }
    }
  }
  // Peers of the cluster may still read this CTA's shared memory: keep it alive until they are done.
  if constexpr (kPre) cluster.sync();
}

// After the barrier that follows mhc_tiles: copy the rows that every peer pushed into this
// rank's gather buffer (the same tiles and slice as this CTA's, so the per-CTA barrier covers them).
__device__ __forceinline__ void copy_gathered_rows(const TileArgs& a) {
  cg::cluster_group cluster = cg::this_cluster();
  const int cs = (int)cluster.num_blocks(), crank = (int)cluster.block_rank();
  const int cluster_id = blockIdx.x / cs, num_clusters = gridDim.x / cs;
  const int D = a.hidden, nvec = D >> 3, T = a.num_tokens;
  const int v0 = crank * nvec / cs, W = (crank + 1) * nvec / cs - v0;
  const int num_tiles = (T + kTileTokens - 1) / kTileTokens;
  const char* gather = static_cast<const char*>(ncclGetLsaPointer(a.lsa.window, a.lsa.gather_offset, a.lsa.rank));
  for (int tile = cluster_id; tile < num_tiles; tile += num_clusters) {
    for (int p = 0; p < a.lsa.world; ++p) {
      if (p == a.lsa.rank) continue;
      for (int idx = threadIdx.x; idx < kTileTokens * W; idx += kThreads) {
        const int row = tile * kTileTokens + idx / W, vec = idx % W;
        if (row >= T) continue;
        const size_t off = ((size_t)p * T + row) * D + (size_t)(v0 + vec) * 8;
        *reinterpret_cast<uint4*>(a.layer_input + off) = *reinterpret_cast<const uint4*>(gather + off * 2);
      }
    }
  }
}

// Two CTAs per SM where one group of vectors per warp suffices (D <= 4096): one CTA's loads
// overlap the other's reductions and Sinkhorn.
template <YSrc kSrc, bool kPost, bool kPre, bool kHead, bool kGather, int kGPW>
__global__ void __launch_bounds__(kThreads, kGPW == 1 ? 2 : 1) mhc_tile_kernel(const __grid_constant__ TileArgs a) {
  if constexpr (kPre) stage_fn_slice<kHead>(a);
  if constexpr (kSrc == YSrc::kPeers || kGather) {
    LsaBarrier bar(a.lsa.window, a.lsa.rank, a.lsa.world, a.lsa.barrier, blockIdx.x);
    // Entry: every peer's partial is written and nobody still reads the buffers we will write.
    // A wait that timed out returns too: the CTA still runs every tile (and cluster sync).
    bar.sync(BarrierSite::kEntry);
    mhc_tiles<kSrc, kPost, kPre, kHead, kGather, kGPW>(a);
    // Exit: our pushes are visible to the peers, theirs to us, and nobody reads our partial
    // any more (so the caller may overwrite it after this kernel).
    bar.sync(BarrierSite::kExit);
    if constexpr (kGather) copy_gathered_rows(a);
  } else {
    mhc_tiles<kSrc, kPost, kPre, kHead, kGather, kGPW>(a);
  }
}

}  // namespace spk
