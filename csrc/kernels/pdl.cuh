#pragma once
// Programmatic dependent launch (PDL, sm_90+; torch-free).
//
// A kernel launched with launch_dependent() may start while the previous kernel on its stream is
// still running: as soon as every CTA of that kernel has called pdl_launch_dependents() or
// exited. Only its launch latency and prologue overlap, never its memory accesses, because each
// of our dependent kernels obeys one rule:
//
//   every thread calls pdl_wait() first, before any global memory access and before any
//   LsaBarrier is constructed or synced.
//
// One exception: loads of the op's own inputs that no kernel of the op writes (a pre's stream
// and norm weight in pass 2). An op's first kernel lets its dependent launch only after its own
// wait, so when a dependent of it runs, every kernel before the op has completed and its writes
// are visible; and nothing of the op changes those bytes. Such loads only start earlier; the
// thread still waits before anything else.
//
// An op's first kernel (pass 1, or mhc_post's row kernel) is itself a dependent of
// whatever kernel precedes it on the stream, ours or the caller's. A kernel that never calls
// pdl_launch_dependents() (the caller's, or an op's last kernel) triggers when all of its CTAs
// have exited, so the next op's launch overlaps that kernel's teardown (its completion and memory
// flush).
//
// pdl_wait() (griddepcontrol.wait) returns once the previous grid has completed and all its
// memory operations are performed and visible to this grid (PTX ISA), so everything after it sees
// the same state as after a plain stream-ordered launch. Two consequences the LSA protocols use:
//  - Completion is transitive: a dependent kernel cannot complete before all of its threads have
//    passed pdl_wait(), i.e. before the kernel it depends on has completed. So "kernel K
//    completed" still implies "every kernel before K on this stream completed".
//  - A barrier reached after pdl_wait() in kernel K of a peer implies that the peer's kernels
//    before K have completed, exactly as for a plain launch. A barrier before the wait would not:
//    hence the rule. The LsaBarrier constructor reads the barrier's epoch, which the previous
//    kernel may still be writing (it uses the same barrier index), another reason for the rule.
//
// pdl_launch_dependents() is only a scheduling hint (no memory ordering). When it fires, every
// CTA of the calling grid is already resident (it fires once all of them have called it or
// exited), so the dependent's CTAs can only take resources that the caller no longer needs and
// cannot keep any CTA of the caller from running: no deadlock with the caller's barriers. We call
// it only in kernels whose dependent is our own next kernel (pass 1 of a pre, pass 2 of a gather),
// never in an op's last kernel, so a caller's kernel that follows ours keeps plain stream order
// (unless it is itself a PDL kernel, which then must wait before touching our outputs anyway).
//
// CUDA graphs: a launch with cudaLaunchAttributeProgrammaticStreamSerialization under stream
// capture becomes a programmatic edge (cudaGraphDependencyTypeProgrammatic) between the two kernel
// nodes (graph edge data, CUDA 12.3+), with the same semantics on replay. The
// kernels of one op are always captured together, back to back on one stream. Where the previous
// stream operation is not a kernel (or there is none in the graph), the launch is simply
// stream-ordered.
#include <cuda_runtime.h>

#include <utility>

namespace spk {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();  // griddepcontrol.wait, with a memory clobber
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();  // griddepcontrol.launch_dependents
#endif
}

// Launches `kernel` on `stream` (whose device is the current one) as a programmatic dependent of
// the previous kernel there. The kernel must follow the rule above. Below sm_90 (a build with
// another TORCH_CUDA_ARCH_LIST) the attribute is left out: a plain launch, and the device code
// above compiles to nothing.
template <typename... Params, typename... Args>
inline cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                    Args&&... args) {
  int device = 0, major = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e != cudaSuccess) return e;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = major >= 9 ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace spk
