// Whether the inter-node leg of a hierarchical Engram lookup can run on NCCL GIN: compiled in (NCCL >= 2.30.4
// headers), a new enough libnccl, and a communicator whose properties report a GIN backend. Never fails when GIN
// is absent: every answer says why not. No NCCL types here: the nanobind module includes this header.
#pragma once
#include <cstdint>
#include <string>

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

// What the GIN fetch of a member needs: a device communicator over every rank of the hierarchical group (global
// rank = node * ranks_per_node + local) with GIN resources, its window over the member's context window, and
// staging rows in that window. Set up only where gin_query reports GIN; absent (nullptr) everywhere else.
struct GinState {
  const void* devcomm = nullptr;   // ncclDevComm (NCCL >= 2.30.4)
  void* window = nullptr;          // ncclWindow_t over allocation 0 of the member
  int32_t node = -1;               // this member's node index
  int64_t staging_offset = 0;      // window offset of the staging rows
  uint8_t* staging = nullptr;      // device pointer to them
  int64_t staging_bytes = 0;
  uint64_t timeout_cycles = 0;     // per-peer completion bound (context timeout in cycles)
};
GinState* gin_state(int64_t ctx, int32_t ordinal);  // nullptr: no GIN path on this member

}  // namespace jax_engram
