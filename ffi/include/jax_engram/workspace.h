// Window and workspace layout: the one source of truth for where control words live in every rank's
// symmetric window, shared by the CPU backend and the CUDA kernels.
//
// A context's window (allocation 0) is, on every rank, [workspace | device segment | host segment]:
// the workspace holds the control words peers write into (barrier arrivals, EP flags), the segments are
// optional reservations from which tables and EP buffers are carved. Peers address each other's window by
// the same offsets, so every offset here is a compile-time constant independent of the configuration.
#pragma once
#include "jax_engram/hd.h"

namespace jax_engram {

inline constexpr int kMaxRanks = 1024;                      // ranks on one context axis
inline constexpr uint64_t kSegmentAlignment = 2ull << 20;    // cuMem granularity on H200; memfd uses the same
inline constexpr uint64_t kWorkspaceBytes = 8ull << 20;      // fixed: offsets below must fit

// Operations, for error records and messages (names in op_name()).
enum OpCode : int32_t {
  kOpNone = 0,
  kOpBarrier = 1,
  kOpRingExchange = 2,
  kOpEngramWrite = 3,
  kOpEngramFetch = 4,
  kOpEngramWait = 5,
  kOpEpDispatch = 6,
  kOpEpCombine = 7,
  kOpInit = 8,
};

JE_HD const char* op_name(int32_t op) {
  switch (op) {
    case kOpBarrier: return "barrier";
    case kOpRingExchange: return "ring_exchange";
    case kOpEngramWrite: return "engram write";
    case kOpEngramFetch: return "engram fetch";
    case kOpEngramWait: return "engram wait";
    case kOpEpDispatch: return "ep dispatch";
    case kOpEpCombine: return "ep combine";
    case kOpInit: return "init";
    default: return "op";
  }
}

// What went wrong inside a kernel (device or CPU). Lives in host-visible memory of each rank; the first
// error wins (compare-and-swap on `code`), and every later op on the context fails with it.
enum ErrorCode : int32_t {
  kErrNone = 0,
  kErrTimeout = 1,        // a wait on `peer` did not complete within the context timeout
  kErrBadInput = 2,       // invalid data found on the device (duplicate expert id, bad token count, ...)
  kErrIdOutOfRange = 3,   // Engram "checked" mode: first out-of-range id in `detail`
  kErrSequence = 4,       // EP copy-engine dispatch: the host's call count (expected) differs from the device's
  kErrHostGather = 5,     // Engram host path (CUDA): a worker of the host gather pool failed (detail: work items)
};

struct ErrorRecord {
  int32_t code;        // ErrorCode; 0 = none
  int32_t op;          // OpCode
  int32_t rank;        // rank that observed the error
  int32_t peer;        // rank that did not arrive, or -1
  int64_t expected;    // value waited for
  int64_t observed;    // value seen at the deadline
  int64_t elapsed_ns;  // how long it waited
  int64_t detail;      // op-specific (bad id, token index, ...)
};

// Workspace offsets (bytes from the window base). Everything is 64-bit and zero at creation.
//   barrier_epoch            own count of completed barriers (written only by the owner)
//   barrier_arrivals[r]      how many barriers rank r has arrived at, counted in THIS rank's window
// Barrier protocol (all backends): epoch = ++own.barrier_epoch; for every rank r (self included)
// atomically add 1 with release semantics to window_r.barrier_arrivals[my_rank]; then wait with acquire
// loads until own.barrier_arrivals[r] >= epoch for every r. Counters only grow, so no reset is needed
// and back-to-back barriers cannot alias. The first r still short at the deadline is the peer reported.
struct WorkspaceLayout {
  static constexpr uint64_t kBarrierEpoch = 0;
  static constexpr uint64_t kBarrierArrivals = 64;                          // uint64[kMaxRanks]
  static constexpr uint64_t kBarrierEnd = kBarrierArrivals + 8ull * kMaxRanks;
  // Engram: per-rank generation of the last write, for diagnostics.
  static constexpr uint64_t kEngram = align_up(kBarrierEnd, 4096);
  static constexpr uint64_t kEngramEnd = kEngram + 4096;
  // Expert-parallel control block (flags and counters owned by ep_layout.h), fixed-size region.
  static constexpr uint64_t kEp = align_up(kEngramEnd, 65536);
  static constexpr uint64_t kEpBytes = 4ull << 20;
  static constexpr uint64_t kEnd = kEp + kEpBytes;
};
static_assert(WorkspaceLayout::kEnd <= kWorkspaceBytes, "workspace layout overflows kWorkspaceBytes");

// Window layout: offsets of the three parts for given reservation sizes (identical on every rank).
struct WindowLayout {
  uint64_t device_bytes;  // reservation for the device segment (HBM on GPU)
  uint64_t host_bytes;    // reservation for the host segment (host NUMA memory on GPU)
  JE_HD uint64_t workspace_offset() const { return 0; }
  JE_HD uint64_t device_offset() const { return kWorkspaceBytes; }
  JE_HD uint64_t device_segment_bytes() const { return align_up(device_bytes, kSegmentAlignment); }
  JE_HD uint64_t host_offset() const { return device_offset() + device_segment_bytes(); }
  JE_HD uint64_t host_segment_bytes() const { return align_up(host_bytes, kSegmentAlignment); }
  JE_HD uint64_t total_bytes() const { return host_offset() + host_segment_bytes(); }
};

template <typename T>
JE_HD T* at(void* base, uint64_t offset) { return reinterpret_cast<T*>(static_cast<char*>(base) + offset); }
template <typename T>
JE_HD const T* at(const void* base, uint64_t offset) {
  return reinterpret_cast<const T*>(static_cast<const char*>(base) + offset);
}

}  // namespace jax_engram
