#pragma once
// The pushed TP post's protocol (torch-free; YSrc::kPushed, PushArgs).
//
// The pushed TP op (YSrc::kPushed: mhc_post_ar at T <= PushArgs::rows): no barrier. Push region
// of rank r: [2 slots][world senders][rows][D] bf16, every element the sentinel 0x8000 (-0.0)
// unless a value is in flight. A call uses slot `calls & 1`. Each CTA loads its rows of this
// rank's partial, turns -0.0 into +0.0 (the sum starts at +0.0, so its bits do not change) and
// stores them at [slot][rank] in every peer's region; it then polls [slot][peer] of its own
// region until no lane is the sentinel, sums the rows in rank order as kPeers does, and puts the
// sentinel back at once (it is the vector's only reader). The own partial is read where the caller
// has it (TileArgs::y), not from the window: no staging copy. Each CTA then takes a ticket; the
// last one resets it and increments `calls` (every CTA has read it by then). A peer writes a slot
// again two pushed calls later, after it read this rank's rows of the call in between, which this
// rank pushed only after this call's kernel completed: so the slot is clear by then. Nobody reads
// this rank's partial region remotely, so there is no exit barrier either. mhc_post_pre_ar stays
// pulled: pushed, it was slower (docs/performance.md).
#include <cuda/atomic>

#include "kernels/mhc_args.cuh"

namespace spk {

// Pushed rows (PushArgs): the sentinel in both bf16 lanes of a word, -0.0 -> +0.0, and the poll.
constexpr uint32_t kPushSentinel = 0x80008000u;

__device__ __forceinline__ uint32_t no_neg_zero(uint32_t w) {
  if ((w & 0xffffu) == 0x8000u) w &= 0xffff0000u;
  if ((w >> 16) == 0x8000u) w &= 0x0000ffffu;
  return w;
}

__device__ __forceinline__ bool has_sentinel(uint32_t w) { return (w & 0xffffu) == 0x8000u || (w >> 16) == 0x8000u; }

__device__ __forceinline__ bool has_sentinel(const uint4& v) {
  return has_sentinel(v.x) || has_sentinel(v.y) || has_sentinel(v.z) || has_sentinel(v.w);
}

// The end of a pushed post (PushArgs): the last CTA to take a ticket, when every CTA has read
// `calls`, moves the next call to the other slot.
__device__ __forceinline__ void push_ticket(const TileArgs& a) {
  __syncthreads();  // every thread of the CTA has read `calls`
  if (threadIdx.x != 0) return;
  cuda::atomic_ref<uint32_t, cuda::thread_scope_device> ticket(*a.lsa.push.ticket);
  if (ticket.fetch_add(1, cuda::memory_order_acq_rel) != gridDim.x - 1) return;
  ticket.store(0, cuda::memory_order_relaxed);
  *a.lsa.push.calls += 1;
}

}  // namespace spk
