// Communicator lifetime: NCCL bootstrap from a unique id, symmetric window, device communicator.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "kernels/mhc_api.cuh"
#include "kernels/tp_push.cuh"
#include "ops/build_info.h"
#include "ops/checks.h"
#include "ops/comm.h"

namespace spk {
namespace {

std::mutex g_mu;
std::map<int64_t, std::unique_ptr<CommState>> g_comms;

// The heaviest fused kernel decides how many CTAs fit at once on this device.
int local_max_ctas(int hidden) {
  int n = 0;
  SPK_CUDA_CHECK(mhc_fused_max_ctas(hidden, &n));
  return n;
}

// The minimum of `val` over the ranks; a rank returns only after every rank has called it and
// everything it enqueued on `st` before has finished.
int rank_min(const CommState& s, int val, cudaStream_t st) {
  int* d_val = nullptr;
  SPK_CUDA_CHECK(cudaMallocAsync((void**)&d_val, sizeof(int), st));
  SPK_CUDA_CHECK(cudaMemcpyAsync(d_val, &val, sizeof(int), cudaMemcpyHostToDevice, st));
  SPK_NCCL_CHECK(ncclAllReduce(d_val, d_val, 1, ncclInt32, ncclMin, s.comm, st), s.comm);
  SPK_CUDA_CHECK(cudaMemcpyAsync(&val, d_val, sizeof(int), cudaMemcpyDeviceToHost, st));
  SPK_CUDA_CHECK(cudaFreeAsync(d_val, st));
  SPK_CUDA_CHECK(cudaStreamSynchronize(st));
  return val;
}

// Every 32-bit word of [p, p + n) = v.
__global__ void fill_words(uint32_t* p, size_t n, uint32_t v) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v;
}

}  // namespace

CommState& get_comm(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_comms.find(handle);
  SPK_CHECK(it != g_comms.end(), "comm ", handle,
            " is not an open CUDA spkernels.Communicator (closed, never created, or a gloo one)");
  return *it->second;
}

void check_barrier(const CommState& c) {
  const BarrierError* e = c.barrier_error;
  if (__atomic_load_n(&e->flag, __ATOMIC_ACQUIRE) == 0) return;  // pairs with the device's release
  char timeout[32];
  std::snprintf(timeout, sizeof(timeout), "%g", c.barrier_timeout_s);  // C stdio: no iostream facets
  SPK_CHECK(false, "spkernels: rank ", c.rank, "'s LSA barrier (", barrier_site_name(e->site), ", CTA ", e->cta,
            ") timed out after ", timeout, " s (barrier_timeout, default SPK_BARRIER_TIMEOUT) waiting for rank ",
            e->peer, ": a peer died or stopped calling the same ops. Communicator ", c.handle,
            " is unusable: close() aborts it; recreate the process group (exiting the process is the sure "
            "way out with a peer gone)");
}

std::vector<int64_t> nccl_unique_id() {
  ncclUniqueId id;
  SPK_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
  std::vector<int64_t> out(sizeof(id));
  for (size_t i = 0; i < sizeof(id); ++i) out[i] = (unsigned char)id.internal[i];
  return out;
}

int64_t comm_create(int64_t handle, std::vector<int64_t> unique_id, int64_t rank, int64_t world_size, int64_t device,
                    int64_t max_tokens, int64_t hidden_size, int64_t hc, bool fused, bool tp_push,
                    double barrier_timeout_s) {
  ncclUniqueId id;
  SPK_CHECK(unique_id.size() == sizeof(id), "unique_id must have ", sizeof(id), " bytes, got ", unique_id.size());
  SPK_CHECK(hc == kHC, "hc must be 4 for a CUDA Communicator (the kernels specialise hc = 4), got ", hc);
  SPK_CHECK(hidden_size > 0 && hidden_size % 8 == 0 && hidden_size <= kMaxHidden,
            "hidden_size must be a multiple of 8 in [8, ", kMaxHidden, "], got ", hidden_size);
  SPK_CHECK(max_tokens > 0 && max_tokens <= (1 << 24), "max_tokens must be in [1, 2^24], got ", max_tokens);
  SPK_CHECK(barrier_timeout_s >= 0 && barrier_timeout_s <= 1e9, "barrier_timeout_s must be in [0, 1e9], got ",
            barrier_timeout_s);
  for (size_t i = 0; i < sizeof(id); ++i) id.internal[i] = (char)unique_id[i];
  {
    std::lock_guard<std::mutex> lock(g_mu);
    SPK_CHECK(!g_comms.count(handle), "comm handle ", handle, " already exists");
  }
  int version = 0;
  SPK_NCCL_CHECK(ncclGetVersion(&version), nullptr);
  SPK_CHECK(version >= 22800, "spkernels needs NCCL >= 2.28 at run time (device API), got ", version);

  const c10::cuda::CUDAGuard guard((c10::DeviceIndex)device);
  auto s = std::make_unique<CommState>();
  s->handle = handle;
  s->rank = (int)rank;
  s->world = (int)world_size;
  s->device = (int)device;
  s->max_tokens = max_tokens;
  s->hidden = hidden_size;
  SPK_NCCL_CHECK(ncclCommInitRank(&s->comm, s->world, id, s->rank), nullptr);
  cudaStream_t st = c10::cuda::getCurrentCUDAStream();

  // Every rank must launch the same fused grids (the LSA barriers pair CTAs by index), so the
  // CTA cap is the minimum over ranks.
  s->max_ctas = rank_min(*s, local_max_ctas((int)hidden_size), st);
  // The pushed mhc_post_ar only if every rank has it (the ranks must run the same protocol).
  s->push_rows = rank_min(*s, tp_push ? (int)std::min<int64_t>(max_tokens, kPushMaxTokens) : 0, st);

  s->buffer_bytes = s->push_offset() + s->push_bytes();
  SPK_NCCL_CHECK(ncclMemAlloc(&s->buffer, s->buffer_bytes), s->comm);
  SPK_NCCL_CHECK(ncclCommWindowRegister(s->comm, s->buffer, s->buffer_bytes, &s->window, NCCL_WIN_COLL_SYMMETRIC),
                 s->comm);
  // Barrier state (lsa_barrier.cuh). ncclMemAlloc does not zero: a stale inbox word would let a
  // wait pass early, as a stale push-region value would a poll. No rank may arrive or push before
  // every rank has zeroed its inbox and filled its push region, hence the collective after them.
  BarrierArgs& b = s->barrier;
  b.inbox_offset = s->inbox_offset();
  b.timeout_ns = (uint64_t)std::ceil(barrier_timeout_s * 1e9);
  s->barrier_timeout_s = barrier_timeout_s;
  SPK_CUDA_CHECK(cudaMalloc((void**)&b.epochs, (s->max_ctas + 3) * sizeof(uint32_t)));
  b.failed = b.epochs + s->max_ctas;
  s->push_calls = b.epochs + s->max_ctas + 1;
  s->push_ticket = b.epochs + s->max_ctas + 2;
  SPK_CUDA_CHECK(cudaHostAlloc((void**)&s->barrier_error, sizeof(BarrierError), cudaHostAllocMapped));
  std::memset(s->barrier_error, 0, sizeof(BarrierError));
  SPK_CUDA_CHECK(cudaHostGetDevicePointer((void**)&b.error, s->barrier_error, 0));
  SPK_CUDA_CHECK(cudaMemsetAsync(b.epochs, 0, (s->max_ctas + 3) * sizeof(uint32_t), st));
  SPK_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(s->buffer) + s->inbox_offset(), 0, s->inbox_bytes(), st));
  if (s->push_rows > 0) {  // every element of the push region the sentinel (PushArgs)
    fill_words<<<256, 256, 0, st>>>(reinterpret_cast<uint32_t*>(static_cast<char*>(s->buffer) + s->push_offset()),
                                    s->push_bytes() / 4, kPushSentinel);
    SPK_CUDA_CHECK(cudaGetLastError());
  }
  rank_min(*s, 0, st);

  ncclDevCommRequirements reqs;
  std::memset(&reqs, 0, sizeof(reqs));
  SPK_NCCL_CHECK(ncclDevCommCreate(s->comm, &reqs, &s->dev_comm), s->comm);
  s->has_dev_comm = true;
  // Fused kernels need every peer reachable by load/store (one node, NVLink or P2P) and sum at
  // most kMaxPeers partials; anything else takes NCCL's host collectives.
  s->lsa = fused && s->dev_comm.lsaSize == s->world && s->world <= kMaxPeers;
  const int64_t backend = s->lsa ? 0 : 1;
  std::lock_guard<std::mutex> lock(g_mu);
  g_comms[handle] = std::move(s);
  return backend;
}

void comm_destroy(int64_t handle) {
  std::unique_ptr<CommState> s;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_comms.find(handle);
    SPK_CHECK(it != g_comms.end(), "comm ", handle, " is not an open CUDA spkernels.Communicator");
    s = std::move(it->second);
    g_comms.erase(it);
  }
  const c10::cuda::CUDAGuard guard((c10::DeviceIndex)s->device);
  if (__atomic_load_n(&s->barrier_error->flag, __ATOMIC_ACQUIRE) != 0) {
    // A barrier timed out: a peer is gone, and the collective teardown below (window
    // deregistration, finalize) would wait for it. Abort the NCCL communicator, which releases its
    // resources locally. The window memory, the barrier state and the error record stay
    // allocated: a kernel of ours that is still giving up may touch them, and the process is
    // expected to exit (the error message says so).
    SPK_NCCL_CHECK(ncclCommAbort(s->comm), nullptr);
    return;
  }
  // Order: no kernel may still use the window; then device comm, window, memory, communicator.
  SPK_CUDA_CHECK(cudaDeviceSynchronize());
  if (s->has_dev_comm) SPK_NCCL_CHECK(ncclDevCommDestroy(s->comm, &s->dev_comm), s->comm);
  SPK_NCCL_CHECK(ncclCommWindowDeregister(s->comm, s->window), s->comm);
  SPK_NCCL_CHECK(ncclMemFree(s->buffer), s->comm);
  SPK_CUDA_CHECK(cudaFree(s->barrier.epochs));
  SPK_CUDA_CHECK(cudaFreeHost(s->barrier_error));
  SPK_NCCL_CHECK(ncclCommFinalize(s->comm), s->comm);
  SPK_NCCL_CHECK(ncclCommDestroy(s->comm), nullptr);
}

at::Tensor comm_partial_buffer(int64_t handle, int64_t num_tokens) {
  CommState& s = get_comm(handle);
  SPK_CHECK(num_tokens > 0 && num_tokens <= s.max_tokens, "num_tokens must be in [1, max_tokens = ", s.max_tokens,
            "], got ", num_tokens);
  auto opts = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA, s.device);
  return at::from_blob(s.buffer, {num_tokens, s.hidden}, opts);
}

}  // namespace spk

// The op has no tensor arguments, so its kernel sits under the key that such calls dispatch to.
TORCH_LIBRARY_IMPL(spkernels, CompositeExplicitAutograd, m) {
  m.impl("_comm_check", [](int64_t comm) { spk::check_barrier(spk::get_comm(comm)); });
}
