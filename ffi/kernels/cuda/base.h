// Host-side interface of the foundation kernels (kernels/cuda/base.cu): what handlers and the runtime call.
// Plain C++ (no device code), so .cc files compiled by the host compiler can include it.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "runtime/runtime.h"

namespace jax_engram {

// Everything a kernel needs for the window protocol (workspace.h), passed by value.
struct SyncArgs {
  uint8_t* const* peers = nullptr;  // device array: window (allocation 0) of every rank in our view
  uint8_t* own = nullptr;           // own window
  ErrorRecord* err = nullptr;       // member's error record (mapped host memory)
  uint64_t timeout_ns = 0;          // bound of every wait
  int32_t rank = 0, nranks = 0, op = 0;
};

// SyncArgs of a member for op `op`; peers == nullptr if the context window is not connected.
inline SyncArgs make_sync_args(Member& m, int32_t op) {
  SyncArgs s;
  Allocation* w = m.alloc(0);
  s.peers = w ? static_cast<uint8_t* const*>(w->peers_device) : nullptr;
  s.own = w ? w->local : nullptr;
  s.err = m.error_device;
  s.timeout_ns = m.timeout_ns();
  s.rank = m.rank;
  s.nranks = m.nranks;
  s.op = op;
  return s;
}

// Launches the 1-CTA barrier kernel over all ranks of the member's context on `stream`. A timeout is
// recorded in the member's error record (reported by the next op or ctx.check()), never trapped.
cudaError_t launch_barrier(Member& m, cudaStream_t stream, int32_t op);
cudaError_t launch_barrier(const SyncArgs& s, cudaStream_t stream);

// dst[0:n) = src[0:n) by a kernel on the current device.
//   kCopySrcRemote: src is written by another GPU or lies in host memory; loads are volatile (relaxed.sys),
//                   never served from a stale cache line.
//   kCopyPublish:   dst will be read by other GPUs after the next barrier; every thread ends with a system
//                   fence, so the data is performed system-wide (host memory included) before the kernel
//                   completes and the stream-ordered barrier's release announces it.
enum CopyFlags : unsigned { kCopyPlain = 0, kCopySrcRemote = 1, kCopyPublish = 2 };
cudaError_t launch_copy(void* dst, const void* src, uint64_t n, unsigned flags, cudaStream_t stream);

// cudaSuccess if this module has a kernel image for `device` (else cudaErrorNoKernelImageForDevice, ...).
cudaError_t kernels_loadable(int device);

}  // namespace jax_engram
