// CPU side of the window protocol (workspace.h): bounded waits and the barrier, on memory shared by the
// devices of a process and the processes of a host. Every wait records a timeout in the member's error
// record and returns false instead of hanging.
#pragma once
#include <chrono>
#include <cstdint>
#include <thread>

#include "runtime/runtime.h"

namespace jax_engram::cpu {

inline uint64_t load_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store_release(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline void add_release(uint64_t* p, uint64_t v) { __atomic_fetch_add(p, v, __ATOMIC_RELEASE); }

// Waits until *p >= target. Spins briefly, then yields, then sleeps (several CPU devices share few cores).
inline bool wait_at_least(Member& m, int32_t op, int32_t peer, const uint64_t* p, uint64_t target) {
  if (load_acquire(p) >= target) return true;
  auto start = std::chrono::steady_clock::now();
  const auto budget = std::chrono::nanoseconds(m.timeout_ns());
  for (uint64_t it = 0;; ++it) {
    uint64_t v = load_acquire(p);
    if (v >= target) return true;
    if (m.error_host->code > 0) return false;  // another wait of this member already failed
    if (it < 64) continue;
    if (it < 4096) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if ((it & 63) == 0) {
      auto el = std::chrono::steady_clock::now() - start;
      if (el > budget) {
        record_error(m.error_host, kErrTimeout, op, m.rank, peer, static_cast<int64_t>(target),
                     static_cast<int64_t>(v), std::chrono::duration_cast<std::chrono::nanoseconds>(el).count(), 0);
        return false;
      }
    }
  }
}

// Barrier over all ranks of the member's context (protocol in workspace.h).
inline bool barrier(Member& m, int32_t op) {
  Allocation* w = m.alloc(0);
  uint8_t* own = w->local;
  uint64_t* epoch_p = at<uint64_t>(own, WorkspaceLayout::kBarrierEpoch);
  const uint64_t epoch = *epoch_p + 1;
  *epoch_p = epoch;
  for (int r = 0; r < m.nranks; ++r)
    add_release(at<uint64_t>(w->peers[r], WorkspaceLayout::kBarrierArrivals + 8ull * m.rank), 1);
  for (int r = 0; r < m.nranks; ++r)
    if (!wait_at_least(m, op, r, at<uint64_t>(own, WorkspaceLayout::kBarrierArrivals + 8ull * r), epoch))
      return false;
  return true;
}

}  // namespace jax_engram::cpu
