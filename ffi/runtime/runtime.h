// Host singleton runtime: contexts, their members (one per local device on the context axis) and the
// symmetric allocations every member can address on every peer. One Registry per native module
// (_engram_cpu, _engram_cuda), each with its platform Backend. Python drives the collective parts
// (exchanging export records through jax.distributed's key-value store); this layer only creates,
// imports and frees memory and answers lookups from the FFI handlers.
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "jax_engram/workspace.h"

namespace jax_engram {

// Empty string = success. The runtime never throws across the FFI boundary.
using Status = std::string;

enum class SegmentKind : int { kDevice = 0, kHost = 1 };

struct SegmentSpec {
  uint64_t bytes = 0;  // multiple of kSegmentAlignment (Python aligns)
  SegmentKind kind = SegmentKind::kDevice;
};

// What a member publishes so that peers can map its memory: the owning process and one shareable handle
// (a file descriptor in that process) per segment. Same-process peers use the owner's address directly.
struct Export {
  int64_t pid = 0;
  std::string host_id;           // boot id + hostname: peers on other hosts cannot map this
  std::vector<int64_t> fds;      // one per segment, valid in process `pid` until the owner closes them
  std::vector<uint64_t> sizes;
  int64_t device = -1;           // owner's device ordinal (CUDA), for diagnostics
};

struct Member;
class HostGatherPool;

// One member's view of one symmetric allocation: its own memory and a pointer to every peer's.
struct Allocation {
  int64_t id = 0;
  std::vector<SegmentSpec> segments;
  uint64_t total_bytes = 0;
  uint8_t* local = nullptr;              // own memory, segments back to back
  std::vector<uint8_t*> peers;           // peers[r]: rank r's memory as mapped in this member's view
                                         // (nullptr: not reachable by loads/stores, e.g. another host)
  void* peers_device = nullptr;          // device-readable array of `peers` (CUDA); peers.data() on CPU
  bool cpu_readable = true;              // this process's CPU threads may read every peer's host segments through
                                         // `peers` (CUDA: granted at mapping; false if the driver refused)
  Export exported;                       // what we published (fds closed by close_exports)
  std::shared_ptr<void> backend_state;   // handles, imported mappings: released by Backend::free_alloc
};

// True if [off, off + bytes) of the allocation lies in segments of `kind` only.
inline bool region_in_segments(const Allocation& a, uint64_t off, uint64_t bytes, SegmentKind kind) {
  uint64_t base = 0;
  for (const SegmentSpec& seg : a.segments) {
    const uint64_t end = base + seg.bytes;
    if (off < end && off + bytes > base && seg.kind != kind) return false;
    base = end;
  }
  return true;
}
// ... in device (HBM) segments only.
inline bool region_in_device_segments(const Allocation& a, uint64_t off, uint64_t bytes) {
  return region_in_segments(a, off, bytes, SegmentKind::kDevice);
}
// ... in host segments only (CPU-readable where Allocation::cpu_readable).
inline bool region_in_host_segments(const Allocation& a, uint64_t off, uint64_t bytes) {
  return region_in_segments(a, off, bytes, SegmentKind::kHost);
}

struct Member {
  int64_t ctx_id = 0;
  int32_t ordinal = 0;       // FFI DeviceOrdinal: XLA:CPU global device id, XLA:GPU local CUDA ordinal
  int32_t group = 0;         // which group of devices along the axis (one per position on other axes)
  int32_t rank = 0;          // position on the context axis
  int32_t nranks = 0;
  double timeout_s = 100.0;
  std::string label;         // for messages, e.g. "context 3 (axis 'ep', group 0)"
  ErrorRecord* error_host = nullptr;    // host-readable error record
  ErrorRecord* error_device = nullptr;  // same record as seen by kernels
  std::map<int64_t, std::unique_ptr<Allocation>> allocs;  // id 0 = the context window; guarded by allocs_mu
  // Allocations being freed: out of `allocs` (no new handler finds them) until the handlers and device work that
  // may still read them are done (Registry::free_alloc).
  std::map<int64_t, std::unique_ptr<Allocation>> retired;
  mutable std::mutex allocs_mu;
  std::atomic<int> inflight{0};         // handlers currently executing on this member
  std::atomic<bool> closing{false};
  std::shared_ptr<void> backend_state;  // streams, NCCL communicator, ...
  // Worker threads of host-table Engram gathers (runtime/host_gather.h): created at first use, joined by
  // destroy_member after the backend's quiesce.
  std::mutex host_gather_mu;
  std::shared_ptr<HostGatherPool> host_gather;
  std::atomic<bool> host_gather_fail_next{false};  // test hook: the next host gather job fails in its worker
  std::atomic<bool> host_enqueue_fail_next{false};  // test hook: the next queued host-path fetch fails to enqueue

  uint64_t timeout_ns() const { return static_cast<uint64_t>(timeout_s * 1e9); }
  Allocation* alloc(int64_t id) {
    std::lock_guard<std::mutex> lk(allocs_mu);
    auto it = allocs.find(id);
    return it == allocs.end() ? nullptr : it->second.get();
  }
  uint8_t* window() { Allocation* a = alloc(0); return a ? a->local : nullptr; }
};

class Registry;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* platform() const = 0;
  // Member-level resources (error record, streams). Called once per member.
  virtual Status init_member(Member& m) = 0;
  virtual void destroy_member(Member& m) = 0;
  // Create this member's memory for `a.segments` (a.local, a.total_bytes, a.exported; zero-filled).
  virtual Status create_alloc(Member& m, Allocation& a) = 0;
  // Fill a.peers / a.peers_device from the peers' exports (index = rank). Same-process peers are found
  // through the registry (their Allocation with the same ctx and id); others are imported.
  virtual Status connect_alloc(Registry& reg, Member& m, Allocation& a, const std::vector<Export>& peers) = 0;
  // Close the exported handles (after every peer has imported them).
  virtual void close_exports(Member& m, Allocation& a) = 0;
  virtual void free_alloc(Member& m, Allocation& a) = 0;
  // Wait until work already enqueued for this member has finished (before freeing its memory).
  virtual Status quiesce(Member& m) = 0;
};

// Thread-safe registry of members, keyed by (context id, device ordinal).
class Registry {
 public:
  explicit Registry(std::unique_ptr<Backend> backend) : backend_(std::move(backend)) {}
  Backend& backend() { return *backend_; }

  Status create_member(int64_t ctx, int32_t ordinal, int32_t group, int32_t rank, int32_t nranks, double timeout_s,
                       const std::string& label);
  Status destroy_member(int64_t ctx, int32_t ordinal);
  Status create_alloc(int64_t ctx, int32_t ordinal, int64_t alloc_id, const std::vector<SegmentSpec>& segs,
                      Export* out);
  Status connect_alloc(int64_t ctx, int32_t ordinal, int64_t alloc_id, const std::vector<Export>& peers);
  Status close_exports(int64_t ctx, int32_t ordinal, int64_t alloc_id);
  Status free_alloc(int64_t ctx, int32_t ordinal, int64_t alloc_id);

  // Lookup (shared lock). nullptr if absent.
  Member* find(int64_t ctx, int32_t ordinal);
  // Lookup for handlers: counts the member in flight under the lock so destroy_member waits for it.
  // nullptr if absent or closing (*closing tells which). Pair with release().
  Member* acquire(int64_t ctx, int32_t ordinal, bool* closing);
  static void release(Member* m) { if (m) m->inflight.fetch_sub(1); }
  // Same-process peer: the member of context `ctx`, group `group` with `rank` (nullptr if not local).
  Member* find_rank(int64_t ctx, int32_t group, int32_t rank);
  std::vector<Member*> members();

  std::shared_mutex& mutex() { return mu_; }

 private:
  // Waits (bounded) until no handler executes on any of `same` (members of one context in this process: their
  // handlers read each other's allocations), then for the work they queued; `stop_gathers`: also joins their host
  // gather pools. Returns `report`'s quiesce status.
  Status drain(const std::vector<Member*>& same, const Member* report, bool stop_gathers);

  std::unique_ptr<Backend> backend_;
  std::shared_mutex mu_;
  std::map<std::pair<int64_t, int32_t>, std::unique_ptr<Member>> members_;
};

// Formats the error record of a member as a user-facing message ("" if none). num_experts, when known,
// makes EP range errors name the bound.
std::string describe_error(const Member& m, const ErrorRecord& e, int64_t num_experts = -1);

// The message of a dispatch that validate_routing=True refuses (nothing recorded): rank `rank` of m's context saw
// global rank `peer`'s first bad entry (token, EpBadKind kind, id) in the group's gathered routing records.
std::string describe_routing_refusal(const Member& m, int32_t rank, int32_t peer, int64_t token, int32_t kind,
                                     int64_t id, int64_t num_experts);

// First error wins. Safe from several host threads (device code uses its own atomics on the same layout).
void record_error(ErrorRecord* rec, int32_t code, int32_t op, int32_t rank, int32_t peer, int64_t expected,
                  int64_t observed, int64_t elapsed_ns, int64_t detail);

// Host id used to decide whether a peer's memory can be mapped (same boot + same hostname).
std::string host_id();

}  // namespace jax_engram
