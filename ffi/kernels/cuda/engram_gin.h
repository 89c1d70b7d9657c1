// Engram fetch over NCCL GIN (device-initiated RDMA gets from the owner's window), the inter-node leg of a
// hierarchical table when the cross-node communicator reports GIN. Compiled only against NCCL >= 2.30.4
// headers (the device API DeepEP V2 uses); with older headers the launch reports why and does nothing.
// No NCCL device types here: handlers and the module include this header.
#pragma once
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

#include "jax_engram/engram_gin_plan.h"
#include "runtime/runtime.h"

struct ncclDevComm;

namespace jax_engram {

inline constexpr int kEngramGinMinNccl = 23004;  // NCCL 2.30.4

// Segment tags of ncclGin::get (ncclGin_SegmentMixed for a table window in host memory): in every header version
// that has ncclGin::get (2.30.4 and 2.32.3 checked); kept as a switch so a header without them serves device
// tables only.
#define JE_GIN_SEGMENT_TAGS (NCCL_VERSION_CODE >= 23004)

struct EngramGinArgs {
  const int32_t* ids = nullptr;   // [n] global ids (device)
  int64_t n = 0;
  int32_t mode = 0;               // engram::Mode
  engram::GinGeometry geo;        // region_offset / local_stride: where rows sit in every rank's table window
  bool table_host = false;        // the table window is host memory (HOST_NUMA segment)
  int32_t my_node = 0;            // rows owned by this node are not fetched (the intra-node path serves them)
  int32_t rank = 0;               // this member's global rank (error reports)
  int64_t staging_rows = 0;       // rows per peer slice of the staging window (engram::gin_staging_rows)
  uint8_t* staging = nullptr;     // device pointer to the staging window (offset 0)
  uint8_t* out = nullptr;         // [n, row_bytes]: rows of other nodes are written, the rest left as is
  ErrorRecord* err = nullptr;     // member's error record: a per-peer completion that timed out is recorded here
  uint64_t timeout_cycles = 0;    // bound of each per-peer completion wait (0: unbounded; headers whose wait
                                  // takes no bound: the communicator's abort flag ends it)
};

// True when the GIN kernel is compiled in.
bool engram_gin_compiled();
// "" when compiled in, else "GIN not compiled in (NCCL x.y.z headers)".
std::string engram_gin_absent_reason();

// One CTA per peer rank, in rounds of staging_rows requests: issues the round's gets from the peer's table
// window into its staging slice (aggregated: one doorbell per round), waits for the peer's completion, then
// scatters the staged rows to their flat positions. Same accounting as engram::gin_plan.
// Returns "" on success, else why nothing was launched or the launch error.
std::string launch_engram_gin_fetch(const ncclDevComm& dc, ncclWindow_t table, ncclWindow_t staging,
                                    const EngramGinArgs& a, cudaStream_t stream);

}  // namespace jax_engram
