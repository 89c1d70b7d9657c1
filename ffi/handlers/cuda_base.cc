// CUDA handlers of the foundation ops: barrier and ring_exchange (same names, operands and attributes as the
// CPU handlers in cpu_base.cc). Everything is enqueued on XLA's stream; no host synchronisation. A timeout
// inside a kernel is recorded in the member's error record and fails the NEXT op of the context (MemberScope)
// or ctx.check(). Not command-buffer compatible: they read host state (peer tables, error record) per call.
#include <cuda_runtime_api.h>

#include "handlers/common.h"
#include "handlers/cuda_common.h"
#include "kernels/cuda/base.h"
#include "runtime/cuda_member.h"

namespace jax_engram {
namespace {

// The member's device must be current to launch on XLA's stream; XLA normally has it current already.
ffi::Error enter_device(Member& m, int32_t op, CudaDeviceGuard& g) {
  if (g.status() != cudaSuccess) return cuda_failure(op, "cudaSetDevice", g.status());
  if (!m.backend_state) return op_error(op, "member has no CUDA state", ffi::ErrorCode::kFailedPrecondition);
  Allocation* w = m.alloc(0);
  if (!w || !w->peers_device)
    return op_error(op, "the context window is not connected on this device", ffi::ErrorCode::kFailedPrecondition);
  for (auto* p : w->peers)
    if (!p) return op_error(op, kPeerUnreachable, ffi::ErrorCode::kUnimplemented);
  return ffi::Error::Success();
}

ffi::Error BarrierCuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> out,
                       int64_t ctx_id) {
  MemberScope s(ctx_id, ordinal, kOpBarrier);
  if (!s.ok()) return s.error();
  if (out->size_bytes() != token.size_bytes()) return op_error(kOpBarrier, "token result must match token input");
  Member& m = s.member();
  CudaDeviceGuard g(ordinal);
  if (auto e = enter_device(m, kOpBarrier, g); !e.success()) return e;
  cudaError_t ce = launch_barrier(m, stream, kOpBarrier);
  if (ce != cudaSuccess) return cuda_failure(kOpBarrier, "launching the barrier kernel", ce);
  if (token.size_bytes()) {
    ce = cudaMemcpyAsync(out->untyped_data(), token.untyped_data(), token.size_bytes(), cudaMemcpyDeviceToDevice,
                         stream);
    if (ce != cudaSuccess) return cuda_failure(kOpBarrier, "copying the token", ce);
  }
  return ffi::Error::Success();
}

// Each rank publishes x in its region, then reads its left neighbour's (two barriers: the first keeps a slow
// reader of the previous call from seeing new data, the second publishes the writes).
ffi::Error RingExchangeCuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                            int64_t ctx_id, int64_t alloc_id, int64_t offset) {
  MemberScope s(ctx_id, ordinal, kOpRingExchange);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  const uint64_t n = x.size_bytes();
  if (y->size_bytes() != n) return op_error(kOpRingExchange, "result must have the size of x");
  Allocation* a;
  if (auto e = check_region(m, alloc_id, offset, n, kOpRingExchange, &a); !e.success()) return e;
  CudaDeviceGuard g(ordinal);
  if (auto e = enter_device(m, kOpRingExchange, g); !e.success()) return e;
  const int left = (m.rank + m.nranks - 1) % m.nranks;
  const SyncArgs sync = make_sync_args(m, kOpRingExchange);
  cudaError_t ce = launch_barrier(sync, stream);
  if (ce != cudaSuccess) return cuda_failure(kOpRingExchange, "launching the barrier kernel", ce);
  ce = launch_copy(a->local + offset, x.untyped_data(), n, kCopyPublish, stream);
  if (ce != cudaSuccess) return cuda_failure(kOpRingExchange, "launching the copy into the window", ce);
  ce = launch_barrier(sync, stream);
  if (ce != cudaSuccess) return cuda_failure(kOpRingExchange, "launching the barrier kernel", ce);
  ce = launch_copy(y->untyped_data(), a->peers[left] + offset, n, kCopySrcRemote, stream);
  if (ce != cudaSuccess) return cuda_failure(kOpRingExchange, "launching the copy from the left neighbour", ce);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JeBarrierCuda, BarrierCuda,
                              cuda_context()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("ctx_id"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeRingExchangeCuda, RingExchangeCuda,
                              cuda_context()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("ctx_id")
                                  .Attr<int64_t>("alloc_id")
                                  .Attr<int64_t>("offset"));

static HandlerRegistrar reg_barrier("jax_engram_barrier", reinterpret_cast<void*>(JeBarrierCuda));
static HandlerRegistrar reg_ring("jax_engram_ring_exchange", reinterpret_cast<void*>(JeRingExchangeCuda));

}  // namespace jax_engram
