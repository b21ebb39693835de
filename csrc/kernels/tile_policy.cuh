#pragma once
// The compile-time choices of pass 1's tile loop (mhc_rows.cuh) for one kernel variant, each with
// its reason: a variant is this type, and the loop reads each decision by name.
#include "kernels/mhc_args.cuh"

namespace spk {

template <YSrc kSrc, bool kPost, bool kPre, bool kHead, FnSrc kFn, bool kRowCopy = false>
struct TilePolicy {
  static_assert(!(kHead && kPost), "the head is a pre without a post");
  static constexpr int kRows = FnRows<kHead>::kRows;  // fn rows, padded to whole m-tiles
  static constexpr int kVals = FnRows<kHead>::kVals;  // workspace values per (row, slice)
  static constexpr int kNT = kRows / 8;               // m-tiles of fn rows

  // The tiles come as runs (TileRun) of mhc_rows_fnreg_kernel, fn loaded once per run; every
  // other kernel's CTA (g, s) takes tiles g, g + G, ...
  static constexpr bool kRuns = kFn == FnSrc::kRegs;

  // Fn in registers (a pre's mhc_rows_fnreg_kernel): the tile's x comes by 16-byte cp.async
  // through a ring of kFnRegRing tiles in shared memory, this thread's own 8 slots per tile (slot k
  // of thread t at k * kThreads + t: no bank conflicts). A tile's copies are issued right after
  // the mma of the tile kFnRegRing before it has read that slot, and are one commit group (an
  // empty one past the last tile), so tile j waits with wait_group<kFnRegRing - 1>. No L2
  // prefetch: the copy is the only read, so each byte crosses the L2 partitions' fabric once.
  // With the fragments in registers, pass 1 no longer fills the shared-memory pipe with their
  // loads every tile. Only a pre's: run this way (old stream and y through the ring, one CTA
  // per SM), the local post_pre and the fused boundaries are slower.
  static constexpr int kRing = kFn == FnSrc::kRegs ? kFnRegRing : 0;
  static constexpr bool kStageX = kRing > 0;
  static_assert(!kStageX || (kSrc == YSrc::kNone && !kPost && !kHead), "the ring: a pre's x");

  // Row copies (large T, kRowCopiesMinTiles): the ring's slot is the tile's [token][stream][vector]
  // and warp w copies the 512 contiguous bytes of (token 2r + w / 4, stream w % 4) per step r:
  // whole lines, where each thread's own 8 tokens x 64 bytes per warp and step read at ~0.93 of
  // the rate. A thread then reads copies of the others: each tile is waited for before the last
  // barrier of the tile before it, and a slot refilled after the first barrier of its tile.
  static constexpr bool kRowCopies = kRowCopy;
  static_assert(!kRowCopies || kStageX, "row copies: the ring's");

  // A local post's y rows go out with the tile's stream loads (yr[h]), not after the barrier
  // that stages the tile's mixes: at decode sizes that would be a second HBM round trip per call.
  // Not for a post_pre: its pass 1 has no registers to spare. Not for a pushed post either: its
  // own rows there are slower than loaded after the pushes (`mine`).
  static constexpr bool kEarlyY = kPost && !kPre && kSrc == YSrc::kLocal;

  // The next tile's loads go out right after this tile's mma, into the same registers, and are
  // in flight through this tile's CTA sums and workspace stores: the head (it reads x only in the
  // mma phase) and the local post_pre (its x is dead once the mma has read the new stream).
  // mhc_pre and mhc_pre_ag are faster with the L2 prefetch (kPrefetchNext) instead; the fused
  // post_pres (kPeers) keep the prefetch too.
  static constexpr bool kPipe = kHead || (kPost && kPre && kSrc == YSrc::kLocal);

  // The piped post_pre loads the next tile's incoming mixes right after the mma, and the tile's
  // top only stores them (loaded at the top, its one-tile FnSrc::kGlobal form spills).
  static constexpr bool kMixAhead = kPipe && kPost;

  // Token g + 8's y is fetched before token g's stores: a store may alias y, so the compiler keeps
  // a later load after it, and token g + 8's loads would wait for them (one more round trip from
  // T = 9 on, over NVLink for the peers' partials). Where registers allow, both before token g's
  // mix; a local post_pre only after it (it spills otherwise).
  static constexpr bool kYFirst = kSrc == YSrc::kPeers || kSrc == YSrc::kPushed || kEarlyY;

  // The CTA's next tile into L2 while this one computes, so the next loads wait on L2, not HBM: one
  // bulk prefetch per (token, stream) slice row (and y's), the ranges dealt round the warps (the
  // bulk prefetch takes uniform operands, so a warp runs its lanes' ranges one after another; on
  // the first threads alone, two warps would run 32 steps while the others wait at the next
  // barrier). A pre's, but not the head's (kPipe) nor the ring's (kStageX).
  static constexpr bool kPrefetchNext = kPre && !kHead && !kStageX;
  static constexpr int kPrefetchRanges = kHC + (kSrc == YSrc::kLocal ? 1 : 0);  // per token: streams, y

  // Stream reads that go to HBM themselves (no bulk prefetch ahead of them) and cover 64 bytes of 8
  // rows per warp, the other warps reading the rest of each row's 512 bytes soon after, ask the L2
  // to fetch 256 bytes at a miss (.L2::256B): the piped loads and the ring's copies without row
  // copies (those read whole lines); the local post_pre's y loads too. On one H100
  // (docs/performance.md, "fetch256"): the head up to 4% faster from T = 512, the local post_pre
  // 1-5% from T = 256, mhc_pre 1-2% below T = 1024; y's loads another 1% (one H200).
  static constexpr bool kFetch256 = kPipe || (kStageX && !kRowCopies);
};

}  // namespace spk
