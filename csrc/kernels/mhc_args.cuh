#pragma once
// What the mHC kernels are given (torch-free): the argument block of every launch, and the enums
// that select a kernel variant.
#include <nccl.h>
#include <nccl_device.h>

#include "kernels/lsa_barrier.cuh"
#include "kernels/mhc_math.cuh"
#include "kernels/mhc_plan.h"

namespace spk {

// Where pass 1 of a pre takes its fn fragments, chosen at launch: global memory (one tile per CTA),
// shared memory (several tiles per CTA: staged once), global memory for one part of 8 fn rows
// (decode: a.parts > 1), or registers (a pre's tile loop on mhc_rows_fnreg_kernel: each thread's
// fragments loaded once). Each its own kernel: one kernel with every path costs each of them
// registers, and a select per fragment compiles to a branch around each load.
enum class FnSrc : int { kGlobal, kShared, kParts, kRegs };

// The pushed TP post (YSrc::kPushed): this rank's push region and call counters (protocol in
// tp_push.cuh).
struct PushArgs {
  size_t offset;     // bytes: this rank's push region of the window
  int rows;          // rows per (slot, sender)
  uint32_t* calls;   // local: pushed calls so far
  uint32_t* ticket;  // local: CTAs done reading `calls` in this call
};

struct LsaArgs {
  ncclWindow_t window;
  size_t partial_offset;  // bytes: this rank's [max_tokens, D] partial region of the window
  size_t gather_offset;   // bytes: this rank's [max_tokens, D] gather region of the window
  int rank, world;
  int partial_row0;  // first partial row this rank reduces (SP: rank * T_local; TP: 0)
  BarrierArgs barrier;
  PushArgs push;
};

struct TileArgs {
  int num_tokens;  // rows this rank mixes: T_local in SP mode, T otherwise
  int hidden;
  const __nv_bfloat16* stream;  // [num_tokens, 4, D]
  const __nv_bfloat16* y;       // [num_tokens, D]: YSrc::kLocal's y, YSrc::kPushed's own partial
  const float* post_mix_in;     // [num_tokens, 4]
  const float* res_mix_in;      // [num_tokens, 4, 4]
  const float* fn;              // [24, 4D] ([4, 4D] for the head)
  const float* scale;
  const float* base;
  const __nv_bfloat16* norm_weight;  // [D] or null
  const float* pre_mix_in;           // [num_tokens, 4] or null
  MhcEps eps;
  __nv_bfloat16* new_stream;   // [num_tokens, 4, D] (posts; null otherwise)
  __nv_bfloat16* layer_input;  // [tp * num_tokens, D] in gather mode (rank-major), else [num_tokens, D]
  float* post_mix;             // [num_tokens, 4]
  float* res_mix;              // [num_tokens, 4, 4]
  float* pre_mix;              // [num_tokens, 4]
  float* ws;                   // [num_tokens, slices, rows + 1]: pass 1 -> pass 2 (pres)
  int slices;                  // S: column slices of D, a function of D only
  int groups;                  // G: CTAs per slice in pass 1
  int parts;                   // pass 1 CTAs per (tile, slice): 1, or one per 8 fn rows at decode sizes
  bool exit_barrier;           // pass 2: an extra last CTA syncs with the peers' (peers done reading partials)
  bool push_barrier;           // pass 1 without an entry barrier: CTA 0 syncs before pass 2 pushes (SP)
  LsaArgs lsa;
};

// The tiles of one column slice that a CTA of mhc_rows_fnreg_kernel runs in one pass of its tile
// loop: first, first + step, ... below end (its fn fragments loaded once per run).
struct TileRun {
  int slice, first, step, end;
};

// Pass 2's named barriers (0 is __syncthreads); kBarFull / kBarEmpty + parity:
// mhc_collapse_loop_kernel's ring.
enum : int { kBarCoef = 1, kBarNorm = 2, kBarFull = 3, kBarEmpty = 5 };

}  // namespace spk
