// Device side of the window protocol (workspace.h): system-scope acquire/release primitives, bounded waits
// that record timeouts in the member's ErrorRecord (same first-writer-wins protocol as record_error on the
// host), and the barrier done by one CTA. Nothing here traps: a failed wait returns false, the context stays
// usable, and the recorded error is reported by the next op's handler or ctx.check().
//
// Publishing data to peers: a barrier's release (red.release.sys by the arriving thread) covers that thread's
// own earlier writes. Data written by an EARLIER kernel of the stream must be performed system-wide before
// that kernel ends: its writers end with __threadfence_system() (launch_copy's kCopyPublish). Readers of a
// peer's or host memory use volatile/relaxed.sys loads (kCopySrcRemote) after the acquiring barrier.
#pragma once
#include <climits>
#include <cstdint>

#include "jax_engram/workspace.h"
#include "kernels/cuda/base.h"

namespace jax_engram::cuda {

// How often a waiting thread looks at its error record (mapped host memory: a PCIe round trip) to give up
// early when another wait of the member already failed.
inline constexpr uint64_t kErrorPollIntervalNs = 200000;

JE_DEVICE uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

JE_DEVICE uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

JE_DEVICE void red_add_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

JE_DEVICE void st_release_sys(int32_t* p, int32_t v) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

JE_DEVICE int32_t ld_volatile(const int32_t* p) { return *reinterpret_cast<const volatile int32_t*>(p); }

// First error wins: claim the record (code 0 -> -1), fill it, then publish the code.
JE_DEVICE void record_error_device(ErrorRecord* rec, int32_t code, int32_t op, int32_t rank, int32_t peer,
                                   int64_t expected, int64_t observed, int64_t elapsed_ns, int64_t detail) {
  if (!rec) return;
  if (atomicCAS(reinterpret_cast<int*>(&rec->code), 0, -1) != 0) return;
  volatile ErrorRecord* v = rec;
  v->op = op;
  v->rank = rank;
  v->peer = peer;
  v->expected = expected;
  v->observed = observed;
  v->elapsed_ns = elapsed_ns;
  v->detail = detail;
  __threadfence_system();
  st_release_sys(&rec->code, code);
}

enum class WaitResult : int { kOk = 0, kTimeout = 1, kAborted = 2 };

// Polls `*p >= target` with acquire loads until `start_ns + timeout_ns` (%globaltimer). kAborted: the member's
// record already holds an error (an earlier wait failed), so this one gives up without recording.
JE_DEVICE WaitResult poll_at_least(const uint64_t* p, uint64_t target, uint64_t start_ns, uint64_t timeout_ns,
                                   const ErrorRecord* err, uint64_t* observed) {
  uint64_t v = ld_acquire_sys(p);
  uint64_t next_check = start_ns + kErrorPollIntervalNs;
  while (v < target) {
    const uint64_t now = globaltimer_ns();
    if (now - start_ns > timeout_ns) {
      *observed = v;
      return WaitResult::kTimeout;
    }
    if (err && now >= next_check) {
      next_check = now + kErrorPollIntervalNs;
      if (ld_volatile(&err->code) != 0) {
        *observed = v;
        return WaitResult::kAborted;
      }
    }
    v = ld_acquire_sys(p);
  }
  *observed = v;
  return WaitResult::kOk;
}

// Bounded wait for `*p >= target` by one thread; records a timeout against `peer` and returns false.
JE_DEVICE bool wait_at_least(const uint64_t* p, uint64_t target, const SyncArgs& s, int32_t peer) {
  const uint64_t start = globaltimer_ns();
  uint64_t observed = 0;
  WaitResult w = poll_at_least(p, target, start, s.timeout_ns, s.err, &observed);
  if (w == WaitResult::kOk) return true;
  if (w == WaitResult::kTimeout)
    record_error_device(s.err, kErrTimeout, s.op, s.rank, peer, static_cast<int64_t>(target),
                        static_cast<int64_t>(observed), static_cast<int64_t>(globaltimer_ns() - start), 0);
  return false;
}

JE_DEVICE uint64_t* arrivals(uint8_t* window, int32_t from_rank) {
  return at<uint64_t>(window, WorkspaceLayout::kBarrierArrivals + 8ull * static_cast<uint64_t>(from_rank));
}

// The workspace.h barrier, executed by every thread of ONE CTA (any block size): thread t handles ranks
// t, t + blockDim.x, ... The epoch counter lives in the own window (device memory), so consecutive barriers
// are ordered by the stream and the kernel is safe to replay in a graph. Returns false on timeout/abort
// (recorded: the lowest rank still short at the deadline). All threads get the same result.
JE_DEVICE bool barrier_block(const SyncArgs& s) {
  __shared__ uint64_t sh_epoch;
  __shared__ int sh_first_late;
  __shared__ int sh_failed;
  if (threadIdx.x == 0) {
    uint64_t* ep = at<uint64_t>(s.own, WorkspaceLayout::kBarrierEpoch);
    const uint64_t e = *ep + 1;
    *ep = e;
    sh_epoch = e;
    sh_first_late = INT_MAX;
    sh_failed = 0;
  }
  __syncthreads();
  const uint64_t epoch = sh_epoch;
  // Arrive: release covers every write this rank made before the barrier (earlier work of the stream too).
  for (int r = threadIdx.x; r < s.nranks; r += blockDim.x) red_add_release_sys(arrivals(s.peers[r], s.rank), 1);
  const uint64_t start = globaltimer_ns();
  int my_late = INT_MAX;
  uint64_t my_observed = 0;
  for (int r = threadIdx.x; r < s.nranks; r += blockDim.x) {
    uint64_t observed = 0;
    WaitResult w = poll_at_least(arrivals(s.own, r), epoch, start, s.timeout_ns, s.err, &observed);
    if (w == WaitResult::kOk) continue;
    if (w == WaitResult::kTimeout) {
      my_late = r;
      my_observed = observed;
      atomicMin(&sh_first_late, r);
    }
    atomicOr(&sh_failed, 1);
    break;
  }
  __syncthreads();
  const int first_late = sh_first_late;
  const bool ok = sh_failed == 0;
  if (first_late != INT_MAX && my_late == first_late)
    record_error_device(s.err, kErrTimeout, s.op, s.rank, first_late, static_cast<int64_t>(epoch),
                        static_cast<int64_t>(my_observed), static_cast<int64_t>(globaltimer_ns() - start), 0);
  __syncthreads();  // shared state may be reused by a following barrier_block in the same kernel
  return ok;
}

}  // namespace jax_engram::cuda
