// Engram fetch over NCCL GIN (device-initiated RDMA gets from the owner's window), the inter-node leg of a
// hierarchical table when the cross-node communicator reports GIN. Compiled only against NCCL >= 2.30.4
// headers (the device API DeepEP V2 uses); with older headers the launch reports why and does nothing.
// No NCCL device types here: handlers and the module include this header.
#pragma once
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

#include "jax_engram/engram_gin_plan.h"

struct ncclDevComm;

namespace jax_engram {

inline constexpr int kEngramGinMinNccl = 23004;  // NCCL 2.30.4

struct EngramGinArgs {
  const int32_t* ids = nullptr;   // [n] global ids (device)
  int64_t n = 0;
  int32_t mode = 0;               // engram::Mode
  engram::GinGeometry geo;        // region_offset: the table's offset in every rank's window
  int32_t my_node = 0;            // rows owned by this node are not fetched (the intra-node path serves them)
  int64_t staging_offset = 0;     // byte offset in the local window of >= n rows of staging
  uint8_t* staging = nullptr;     // device pointer to those bytes
  uint8_t* out = nullptr;         // [n, row_bytes]: rows of other nodes are written, the rest left as is
  int32_t* status = nullptr;      // device word: set to 1 + peer of the first peer whose completion timed out
  uint64_t timeout_cycles = 0;    // bound of each per-peer completion wait (0: unbounded; headers whose wait
                                  // takes no bound: the communicator's abort flag ends it)
};

// True when the GIN kernel is compiled in.
bool engram_gin_compiled();
// "" when compiled in, else "GIN not compiled in (NCCL x.y.z headers)".
std::string engram_gin_absent_reason();

// One CTA per peer rank: issues the peer's gets (aggregated: one doorbell per peer), waits for the peer's
// completion, then scatters the staged rows to their flat positions. Same slot order as engram::gin_plan.
// Returns "" on success, else why nothing was launched or the launch error.
std::string launch_engram_gin_fetch(const ncclDevComm& dc, ncclWindow_t window, const EngramGinArgs& a,
                                    cudaStream_t stream);

}  // namespace jax_engram
