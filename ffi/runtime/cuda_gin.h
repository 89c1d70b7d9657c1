// Whether the inter-node leg of a hierarchical Engram lookup can run on NCCL GIN: compiled in (NCCL >= 2.30.4
// headers), a new enough libnccl, and a communicator whose properties report a GIN backend. Never fails when GIN
// is absent: every answer says why not. No NCCL types here: the nanobind module includes this header.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "runtime/runtime.h"

namespace jax_engram {

struct GinSupport {
  bool compiled = false;       // the GIN kernel is in this build
  int build_version = 0;       // NCCL_VERSION_CODE of the headers
  int runtime_version = 0;     // loaded libnccl
  std::string reason;          // "" when compiled in and the library is new enough
};
GinSupport gin_support();

struct GinQuery {
  int gin_type = -1;           // ncclCommProperties_t::ginType (0: none; -1: not asked)
  int railed_gin_type = -1;    // ::railedGinType (same-rail GIN)
  std::string reason;          // why GIN is not available ("" when gin_type or railed_gin_type > 0)
};
// Asks the member's side NCCL communicator (ncclCommQueryProperties). No communicator yet, or GIN not compiled
// in: gin_type -1 and the reason; never an error for an absent GIN.
Status gin_query(Registry& reg, int64_t ctx, int32_t ordinal, GinQuery* out);

// What the GIN fetch of a member needs (gin_init, where gin_query reported GIN on every node): a cross-node NCCL
// communicator over every rank of the hierarchical group (global rank = node * ranks_per_node + local), a device
// communicator on it with GIN resources (FULL connections: a rank reads from every rank of the other nodes), a
// staging window of its own, and one GIN window per table region (gin_register_window). Absent everywhere else.
struct GinWindow {
  void* win = nullptr;             // ncclWindow_t over the segment holding the region
  int64_t alloc_id = -1;           // allocation of that segment (freeing it deregisters the window first)
  bool host = false;               // the segment is host memory (HOST_NUMA)
};
struct GinState {
  void* comm = nullptr;            // ncclComm_t (cross-node, non-blocking)
  const void* devcomm = nullptr;   // ncclDevComm (NCCL >= 2.30.4), heap
  void* staging_window = nullptr;  // ncclWindow_t over `staging`
  uint8_t* staging = nullptr;      // ncclMemAlloc'ed device memory
  int64_t staging_bytes = 0;
  int32_t node = -1, rank = -1, nranks = 0;
  int device = -1;
  double timeout_s = 0;            // 0 once a wait on the communicator expired (teardown then aborts at once)
  uint64_t timeout_cycles = 0;     // per-peer completion bound of the kernel (context timeout in SM cycles)
  std::map<int64_t, GinWindow> windows;  // by window id
};
// The handler's view: a copy (taken under the lock, as tables may be registered while lookups run) of the
// member's GIN state without its window map, and of window `window_id`. 0: ok; 1: no GIN state on this member;
// 2: no such window.
int gin_launch_state(int64_t ctx, int32_t ordinal, int64_t window_id, GinState* state, GinWindow* window);

struct GinMember {
  int32_t ordinal = -1, rank = -1, node = -1;  // device ordinal, global rank, node index
};
// Collective over the `nranks` ranks: creates the communicator (non-blocking, bounded by the members' timeout_s),
// checks that it reports GIN, then the staging window (`staging_bytes`) and the GIN device communicator of every
// local member. On any failure everything created is released and the reason returned.
Status gin_init(Registry& reg, int64_t ctx, const std::vector<GinMember>& members, int32_t nranks,
                const std::string& uid, int64_t staging_bytes);
// Collective: registers, on the cross-node communicator, the segment of allocation `alloc_id` that holds
// [offset, offset + bytes) as GIN window `window_id`; *region_offset = offset within that window.
Status gin_register_window(Registry& reg, int64_t ctx, const std::vector<int32_t>& ordinals, int64_t window_id,
                           int64_t alloc_id, int64_t offset, int64_t bytes, int64_t* region_offset);
// Local: deregisters one window, every window in one allocation, or everything (communicator included).
void gin_release_window(int64_t ctx, int32_t ordinal, int64_t window_id);
void gin_release_alloc(int64_t ctx, int32_t ordinal, int64_t alloc_id);
void gin_release(int64_t ctx, int32_t ordinal);

}  // namespace jax_engram
