// The side NCCL communicator of a context (one per group of the context axis, not XLA's), its window over
// the device part of the context window, and an LSA-only device communicator. No NCCL types here: the
// nanobind module includes this header.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "runtime/runtime.h"

namespace jax_engram {

// 128 bytes of ncclUniqueId (fresh per communicator).
Status nccl_unique_id(std::string* out);

// Collective over the `nranks` ranks of a group: creates the communicator of every local member given as
// (device ordinal, rank), in one ncclGroupStart/End. Non-blocking communicators: waits until every rank has
// joined, at most the members' timeout_s; then aborts them and fails naming the ranks of other processes.
Status nccl_comm_init(Registry& reg, int64_t ctx, const std::vector<std::pair<int32_t, int32_t>>& members,
                      int32_t nranks, const std::string& uid);

// Collective: registers segment 0 of allocation 0 (workspace + device segment; never host memory) of each
// given local member as an NCCL window, then creates the device communicator. Failures to get a window or
// devcomm are recorded (topology() says why), not raised: our own peer mappings are what the kernels use.
Status nccl_window_register(Registry& reg, int64_t ctx, const std::vector<int32_t>& ordinals);

struct TopologyInfo {
  int nccl_runtime_version = 0;
  int nccl_build_version = 0;
  int nccl_rank = -1, nranks = 0;
  int lsa_size = -1, lsa_rank = -1;
  bool window_registered = false;
  std::string window_reason;
  bool devcomm = false;
  std::string devcomm_reason;
  int device_api_support = -1;   // ncclCommQueryProperties (NCCL >= 2.29), -1 when unknown
  int device = -1;
  std::string device_name;
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;
  std::map<int, bool> p2p;       // same-process peer GPUs of the context -> cudaDeviceCanAccessPeer
  int host_numa_id = -1;
  bool host_numa_vmm = false;
  bool gdr_vmm = false;
};

Status nccl_topology(Registry& reg, int64_t ctx, int32_t ordinal, TopologyInfo* out);

// Loaded libnccl's version (ncclGetVersion) and the headers' NCCL_VERSION_CODE.
int nccl_runtime_version();
int nccl_build_version();

}  // namespace jax_engram
