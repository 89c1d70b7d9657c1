// Diagnosis switches of the CUDA EP kernels and the host-side trace of copy-engine dispatches. The only EP settings
// read from the environment: they change what is printed, never what is computed.
//   JAX_ENGRAM_EP_TRACE      1: one printf line per kernel with its span (and, for copy-engine dispatches, the
//                            EPHOST line below); 2: also the phase times of CTA 0 and one more CTA
//                            (tools/ep_trace.py). Any value launches the kernels' traced instantiations.
//   JAX_ENGRAM_EP_TRACE_CTA  with JAX_ENGRAM_EP_TRACE=2: the CTA traced beside CTA 0 (default: the last)
// Both are read once per process (the kernels' printf buffers are sized at the first launch).
#pragma once
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>

#include "runtime/runtime.h"

namespace jax_engram {

int ep_trace_level();  // JAX_ENGRAM_EP_TRACE, 0..2 (0 when unset)
int ep_trace_cta();    // JAX_ENGRAM_EP_TRACE_CTA (-1 when unset: the last CTA)

// Timing of one copy-engine dispatch (JAX_ENGRAM_EP_TRACE >= 1): events on XLA's stream at the fork, at the kernel's
// launch, after the kernel and after the join, and on the copy stream after its last piece; printed as one EPHOST line
// per call once its events completed, with the handler's own host time. Calls are kept in a ring per member, because
// the host usually runs calls ahead of the device. A default-constructed (or full-ring) trace records nothing.
class EpCeTrace {
 public:
  enum Mark { kFork = 0, kCopiesEnd = 1, kKernelEnd = 2, kJoin = 3, kKernelLaunch = 4 };
  EpCeTrace() = default;
  // The trace of the next copy-engine dispatch of member m, or an inactive one (tracing off, events unavailable,
  // ring full of calls whose events are still pending).
  static EpCeTrace begin(const Member& m);
  bool active() const { return ring_ != nullptr; }
  void mark(Mark which, cudaStream_t stream);
  // Records the call's end (after the join) and prints the completed calls of the ring.
  void end(const Member& m, cudaStream_t stream, uint64_t seq);

 private:
  struct Ring;
  Ring* ring_ = nullptr;
  int slot_ = 0;
  std::chrono::steady_clock::time_point h0_{};
};

}  // namespace jax_engram
