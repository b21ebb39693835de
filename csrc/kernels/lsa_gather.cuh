#pragma once
// The pushed all-gather of the SP mhc ops (torch-free): lsa_copy_in_kernel. The peers have
// already pushed their rows into this rank's gather region; it copies them into the output. The
// protocol is below the kernel. (sp_all_gather's pulling kernel: lsa_all_gather.cuh.)
#include <nccl.h>
#include <nccl_device.h>

#include <cstdint>

#include "kernels/lsa_barrier.cuh"
#include "kernels/lsa_plan.h"
#include "kernels/pdl.cuh"

namespace spk {

// The last kernel of the SP mhc ops (mhc_pre_ag, mhc_post_pre_rs_ag on the lsa backend), launched
// as a programmatic dependent of pass 2 (pdl.cuh; grid lsa_all_gather_grid(bytes, max_ctas), so at
// most max_ctas CTAs, one barrier each, and the same grid on every rank). `bytes`: one rank's
// block (T_local rows of layer_input), a multiple of 16. Copies the peers' blocks of this rank's
// gather region, where their pass 2 pushed them, into `out` (local HBM only: ~2 * (tp - 1) *
// bytes of traffic, instead of pulling (tp - 1) * bytes over NVLink after pass 2).
//
// max_ctas is pass 1's occupancy, 2 CTAs per SM (128 registers x 256 threads); the bound of 2
// blocks per SM keeps that many copy-in CTAs co-resident, as the barrier wants.
__global__ void __launch_bounds__(kGatherThreads, 2)
    lsa_copy_in_kernel(ncclWindow_t window, size_t gather_offset, size_t bytes, int rank, int world,
                       const __grid_constant__ BarrierArgs barrier, char* out) {
  pdl_wait();  // before the barrier (its epoch, and fact F2 below) and before any memory access
  LsaBarrier bar(window, rank, world, barrier, blockIdx.x);
  bar.sync(BarrierSite::kGatherCopyIn);  // every peer's pass 2 has completed: its pushes landed
  const char* region = static_cast<const char*>(ncclGetLsaPointer(window, gather_offset, rank));
  const size_t n = bytes / 16, stride = (size_t)gridDim.x * blockDim.x;
  for (int p = 0; p < world; ++p) {
    if (p == rank) continue;
    // .cg loads: from L2, the point of coherence of this GPU's memory that the peers' NVLink
    // stores update; never an L1 line (none can be stale here, but nothing relies on that).
    const uint4* src = reinterpret_cast<const uint4*>(region + p * bytes);
    uint4* dst = reinterpret_cast<uint4*>(out + p * bytes);
    size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (; k + 3 * stride < n; k += 4 * stride) {  // four loads in flight per thread
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = __ldcg(src + k + u * stride);
#pragma unroll
      for (int u = 0; u < 4; ++u) dst[k + u * stride] = v[u];
    }
    for (; k < n; k += stride) dst[k] = __ldcg(src + k);
  }
  // No exit barrier: this kernel reads and writes only this rank's memory (see (D) below).
}

// ---- Protocol of the pushed all-gather. Kernels of one SP op on every rank r, in stream order:
//   P1  pass 1, PDL (waits first). mhc_post_pre_rs_ag: every CTA b syncs barrier b (kEntry) before
//       it pulls the peers' partial rows. mhc_pre_ag: CTA 0 syncs barrier 0 (kGatherPush).
//   P2  pass 2, PDL. Stores each finished layer_input row into r's output and, with plain remote
//       stores, into every peer's gather region at the row's global position r * T_local + row.
//   C   lsa_copy_in_kernel, PDL.
// Facts:
//   F1  A CTA passes a sync on barrier b only after CTA b of the same kernel of every peer has
//       arrived at that sync: each barrier index sees the same sequence of syncs on every rank
//       (same ops in the same order, grids functions of shapes and the rank-agreed max_ctas).
//   F2  A peer's kernel K arriving at a barrier implies that the peer's kernels before K on its
//       stream have completed: stream order for a plain launch; pdl_wait() before every barrier
//       for a PDL launch (pdl.cuh).
//   F3  A kernel completes only after all of its CTAs; a PDL kernel only after the kernel before
//       it (pdl.cuh: every thread waits first).
// (A) RAW, pushed rows -> C. CTA b of r's C passes its barrier only after CTA b of every peer q's
//     C arrived, hence (F2) after q's P2 completed with all its memory operations performed:
//     pdl_wait() returns only once they are "performed and made visible" to q's C (PTX ISA,
//     griddepcontrol), and a store to r's memory can only be visible to q once it has reached
//     r's memory (r's L2). q's C then arrives with a system-scope release (after __syncthreads),
//     r acquires it, and reads the rows from its L2 (.cg) after a __syncthreads:
//     the rows were in r's memory before the flag was even written. This is the argument every
//     LSA step of this project already rests on (written in an earlier kernel, read by a peer
//     after a barrier in a later kernel: the previous design staged pass 2's rows with plain
//     stores and a later kernel's barrier published them), with the writes remote instead of
//     local; a __threadfence_system() at the end of P2 would not add to it, as nothing pairs with
//     it but the kernel boundary itself.
// (B) WAR, q's P2 of op k -> r's gather region, which r's C of op k-1 reads (and earlier readers).
//     q's P2 pushes only after its pdl_wait(), i.e. after q's P1 of op k completed, and that P1
//     has a CTA that passed a barrier (kEntry or kGatherPush), so (F1) r's P1 of op k had arrived,
//     so (F2) r's C of op k-1 and everything before it on r's stream had completed. The other readers of
//     r's gather region are peers pulling r's staged block in sp_all_gather; r's lsa_all_gather_kernel passes a
//     kGatherExit barrier only after every peer finished pulling, and it completes before r's P1 of op k starts.
//     mhc_pre_ag needs its kGatherPush barrier for this alone: its pass 1 reads no peer memory. (Conversely, r's own
//     later writes into its region, sp_all_gather's staging copy, come after r's C, after every push landed (A).)
// (C) WAR, r's partial region (mhc_post_pre_rs_ag). After the op, r may overwrite its partial (the
//     next op's staging copy, or the caller writing comm.partial_buffer()); no peer may still be
//     in its P1. r's op completes after every CTA of r's C passed its barrier, so (F1, F2) every
//     peer's C had started, so every peer's P1 had completed (F3).
// (D) No exit barrier after C: C touches only r's memory, and the peers' next accesses to r's
//     window are ordered by (B) (pushes), (C) and the next ops' own entry barriers (pulls of r's
//     partial or staged block, written by r before those barriers).

}  // namespace spk
