#pragma once
// The host entry points of the mHC and LSA gather kernels (torch-free). All are defined in
// mhc_kernels.cu, the one translation unit that compiles the kernels; the ops (csrc/ops/) fill a
// TileArgs and call these.
//
// Source map, one hop each: an op's variant (MhcVariant) and its plan are in mhc_plan.h; pass 1's
// kernels in mhc_pass1.cuh (their tile loop: mhc_rows.cuh, its choices per variant:
// tile_policy.cuh; fn's source: fn_source.cuh; y's: y_source.cuh); pass 2 in mhc_collapse.cuh;
// mhc_post's row kernel in mhc_post_row.cuh; the protocols in lsa_barrier.cuh (entry / exit
// barriers), lsa_gather.cuh (SP gather push + copy-in), lsa_all_gather.cuh (sp_all_gather) and
// tp_push.cuh (the pushed TP post); the per-token math in mhc_math.cuh.
//
// The mHC kernels behind every op, local or fused with a collective. Two passes:
//
// 1. mhc_rows_kernel. CTA (g, s) owns column slice s of D (at most 256 columns of each of the
//    4 streams) and the 16-token tiles g, g + G, ... For each tile it
//    A. loads the stream slice (and for a post: y, or the sum of every peer's partial rows in
//       rank order 0..tp-1 over NVLink), mixes it and stores the new stream;
//    B. for a pre: m = fn · x on bf16 tensor cores, fn split into bf16 hi + lo (fp32-grade
//       accuracy), and the sum of x^2, summed warp -> CTA in a fixed order and written to a
//       workspace ws[T][S][rows + 1]. No CTA ever waits for another: the pass streams at HBM
//       (and NVLink) speed. At decode sizes (tiles x slices x 3 CTAs fit one per SM) CTA (g, s, p)
//       computes only fn rows 8p..8p+7 (a.parts = 3): three times the CTAs, each loading a third
//       of fn, with every sum bitwise unchanged (each row's mma chain is the same).
// 2. mhc_collapse_loop_kernel / mhc_collapse_row_kernel (pres only; a CTA per SM slot looping over
//    rows, or for a fused pre a CTA per row while the rows' CTAs fit on the GPU in two waves): sums each
//    row's S partials in slice order, computes the coefficients on a coefficient warp (sigmoids,
//    Sinkhorn; one quad of lanes per row; the collapse starts once the pre weights are out),
//    collapses the stream (+ fused RMSNorm) and writes layer_input; in SP mode it also stores
//    each row straight into every peer's gather region (NVLink pushes overlapping the pass's HBM
//    work), and
//    lsa_copy_in_kernel moves the peers' rows into layer_input (protocol in lsa_gather.cuh).
//    Pass 2 is a programmatic dependent launch of pass 1 (pdl.cuh).
// Every summation has a fixed order: replicated ranks compute bitwise-identical results, and a
// row's result does not depend on T (SP rows equal TP rows).
#include <cuda_runtime.h>

#include "kernels/mhc_args.cuh"
#include "kernels/mhc_plan.h"

namespace spk {

// The whole op on `stream`: its plan (mhc_plan) launched, each kernel a programmatic dependent of
// the one before (pdl.cuh). `a.ws` must hold mhc_ws_floats(v, num_tokens, hidden) floats for a
// pre. max_ctas <= 0: the device's own limit (local ops); the fused ops pass the cap every rank
// agreed on. Barriers: pass 1 uses indices below its grid size (<= max_ctas), pass 2 index
// 0 (its last CTA), the copy-in kernel [0, grid) <= max_ctas; a pushed post none (its CTAs, all
// resident, wait for the peers' rows).
cudaError_t launch_mhc(MhcVariant v, TileArgs a, int max_ctas, cudaStream_t stream);

// The fused ops' CTA cap on this device: pass-1 CTAs of the heaviest fused kernel that fit at once.
cudaError_t mhc_fused_max_ctas(int hidden, int* out);

// sp_all_gather on the lsa backend: every rank has staged its `bytes` at [rank * bytes, ...) of its
// gather region; pulls the peers' blocks into `out` (lsa_all_gather.cuh). A plain stream-ordered launch.
cudaError_t launch_lsa_all_gather(ncclWindow_t window, size_t gather_offset, size_t bytes, int rank, int world,
                                  const BarrierArgs& barrier, char* out, int max_ctas, cudaStream_t stream);

}  // namespace spk
