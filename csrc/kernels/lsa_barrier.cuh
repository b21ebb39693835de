#pragma once
// A per-CTA barrier over the LSA team whose wait gives up after a timeout (torch-free).
//
// The protocol is NCCL's ncclLsaBarrierSession (2.28) without multimem, which has no timeout: a
// peer that never arrives (dead, or calling other ops) spins the GPU forever. Barrier `index`
// keeps an epoch in local memory across launches; arriving release-stores epoch + 1 into slot
// [index][me] of every peer's inbox (a region of the communicator's symmetric window); waiting
// acquire-spins on slots [index][peer] of this rank's inbox until each reaches epoch + 1.
//
// A wait that exceeds the timeout records who it waited for in a host-visible BarrierError and
// returns as if the peer had arrived: the CTA runs on through its kernel (every CTA-wide sync
// still pairs up) and computes garbage, which the host reports before the next op. From then on every wait on the
// communicator gives up at once.
#include <nccl.h>
#include <nccl_device.h>

#include <cstdint>
#include <cuda/atomic>

#include "kernels/mhc_math.cuh"

namespace spk {

// Where a barrier sits (for the timeout message). kGatherPush and kGatherCopyIn: the pushed
// all-gather of layer_input (mhc_pass1.cuh, lsa_gather.cuh). kPushedRows: not a barrier,
// mhc_post_ar's wait for a peer's pushed partial rows at decode sizes (spin_until in y_source.cuh,
// PushArgs).
enum class BarrierSite : int32_t { kEntry, kExit, kGatherEntry, kGatherExit, kGatherPush, kGatherCopyIn, kPushedRows };

inline const char* barrier_site_name(int32_t site) {
  switch ((BarrierSite)site) {
    case BarrierSite::kEntry:
      return "entry";
    case BarrierSite::kExit:
      return "exit";
    case BarrierSite::kGatherEntry:
      return "gather entry";
    case BarrierSite::kGatherExit:
      return "gather exit";
    case BarrierSite::kGatherPush:
      return "gather push";
    case BarrierSite::kGatherCopyIn:
      return "gather copy-in";
    case BarrierSite::kPushedRows:
      return "pushed rows";
  }
  return "unknown";
}

// The first timeout on a communicator, in pinned host memory mapped into the device, so that the
// host reads it without synchronising the device. `flag` is stored last, with release order.
struct BarrierError {
  uint32_t flag;
  int32_t peer;  // the rank that did not arrive
  int32_t cta;   // the barrier index (blockIdx.x; 0 for the exit and gather-push barriers)
  int32_t site;  // BarrierSite
};

struct BarrierArgs {
  size_t inbox_offset;  // bytes: this rank's [max_ctas][kMaxPeers] uint32 inbox region of the window
  uint32_t* epochs;     // [max_ctas] local: each barrier's epoch between launches
  uint32_t* failed;     // local: nonzero once a wait on this communicator timed out
  BarrierError* error;  // device alias of the host record
  uint64_t timeout_ns;  // 0: wait forever
};

// The clock is read every this many unsuccessful polls: a poll that succeeds pays nothing extra.
constexpr uint32_t kSpinsPerClockRead = 64;

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The first timeout wins the device word (atomics on device memory, unlike on mapped host
// memory, are atomic on every platform) and fills in the host record.
__device__ __forceinline__ void record_timeout(const BarrierArgs& args, uint32_t index, int peer, BarrierSite site) {
  cuda::atomic_ref<uint32_t, cuda::thread_scope_device> failed(*args.failed);
  if (failed.exchange(1, cuda::memory_order_relaxed) != 0) return;
  BarrierError* e = args.error;
  e->peer = peer;
  e->cta = (int32_t)index;
  e->site = (int32_t)site;
  cuda::atomic_ref<uint32_t, cuda::thread_scope_system>(e->flag).store(1, cuda::memory_order_release);
}

// Polls until done() (a wait that succeeds at once reads no clock), giving up like a barrier wait:
// at once if a wait on the communicator already timed out, else after args.timeout_ns (recorded
// against `peer`, `index`, `site`). Returns whether done() held.
template <class Done>
__device__ __forceinline__ bool spin_until(Done done, const BarrierArgs& args, uint32_t index, int peer,
                                           BarrierSite site) {
  if (done()) return true;
  const uint64_t start = globaltimer_ns();
  for (uint32_t spin = 1;; ++spin) {
    if (done()) return true;
    if (spin % kSpinsPerClockRead != 0) continue;
    if (cuda::atomic_ref<uint32_t, cuda::thread_scope_device>(*args.failed).load(cuda::memory_order_relaxed))
      return false;  // another wait already timed out: this communicator is done for
    if (args.timeout_ns != 0 && globaltimer_ns() - start > args.timeout_ns) {
      record_timeout(args, index, peer, site);
      return false;
    }
  }
}

// One CTA's session on barrier `index`, like ncclLsaBarrierSession<ncclCoopCta>: every thread of
// the CTA constructs it and calls sync(); the epoch goes back to memory when it ends.
class LsaBarrier {
 public:
  __device__ LsaBarrier(ncclWindow_t window, int rank, int world, const BarrierArgs& args, uint32_t index)
      : window_(window), rank_(rank), world_(world), args_(args), index_(index), epoch_(args.epochs[index]) {}

  // The next launch reads the epoch after this kernel has ended: no sync needed.
  __device__ ~LsaBarrier() {
    if (threadIdx.x == 0) args_.epochs[index_] = epoch_;
  }

  // acq_rel: every write of this CTA before the barrier (local or pushed to peers) is visible to
  // the peers' CTA `index` after it, and theirs to us. As in NCCL, the __syncthreads orders the
  // whole CTA's writes before the one thread's release store (causality is transitive).
  __device__ void sync(BarrierSite site) {
    __syncthreads();
    for (int i = threadIdx.x; i < world_ - 1; i += blockDim.x) {
      cuda::atomic_ref<uint32_t, cuda::thread_scope_system> slot(*inbox(other(i), rank_));
      slot.store(epoch_ + 1, cuda::memory_order_release);
    }
    for (int i = threadIdx.x; i < world_ - 1; i += blockDim.x) wait_for(other(i), site);
    epoch_ += 1;
    __syncthreads();
  }

 private:
  // The i-th peer other than this rank.
  __device__ int other(int i) const { return i + (i >= rank_ ? 1 : 0); }

  // Slot [index_][slot] of `owner`'s inbox.
  __device__ uint32_t* inbox(int owner, int slot) const {
    const size_t off = args_.inbox_offset + ((size_t)index_ * kMaxPeers + slot) * sizeof(uint32_t);
    return static_cast<uint32_t*>(ncclGetLsaPointer(window_, off, owner));
  }

  __device__ void wait_for(int peer, BarrierSite site) const {
    cuda::atomic_ref<uint32_t, cuda::thread_scope_system> slot(*inbox(rank_, peer));
    const uint32_t target = epoch_ + 1;
    // Arrived once the slot is at or past the target, modulo 2^32 (epochs wrap around).
    spin_until([&] { return slot.load(cuda::memory_order_acquire) - target <= UINT32_MAX >> 1; }, args_, index_, peer,
               site);
  }

  ncclWindow_t window_;
  int rank_, world_;
  BarrierArgs args_;
  uint32_t index_;
  uint32_t epoch_;
};

}  // namespace spk
