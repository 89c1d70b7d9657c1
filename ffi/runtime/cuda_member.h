// Per-member CUDA state (Member::backend_state of the CUDA backend): the device, a side stream for work
// that overlaps XLA's stream (Engram prefetch), the side NCCL communicator with its window and device
// communicator, and the device properties that decide what the member can do.
#pragma once
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/ordered_worker.h"
#include "runtime/runtime.h"

struct ncclDevComm;  // nccl_device headers: only the NCCL runtime file and kernels include them

namespace jax_engram {

struct CudaMemberState {
  int device = -1;                       // CUDA device ordinal (== Member::ordinal)
  cudaStream_t side_stream = nullptr;    // non-blocking, highest priority (Engram fetches); allocation zero-fill
  // Engram's stream ordering (kernels/cuda/engram_order.h): the fork (XLA's stream -> side stream) and join events,
  // and one event per overlapped fetch call site (EngramFetchAttrs::slot). Created at first use under engram_mu,
  // destroyed with the member.
  std::mutex engram_mu;
  cudaEvent_t engram_fork = nullptr, engram_join = nullptr;
  std::map<int64_t, cudaEvent_t> engram_slots;
  // The thread that enqueues overlapped host-path fetches on the side stream, off XLA's launch thread
  // (kernels/cuda/engram_host.h): created at the first such fetch (under enqueuer_mu), drained by the backend's
  // quiesce, joined by destroy_member. Named "je-enqueue".
  std::mutex enqueuer_mu;
  std::unique_ptr<OrderedWorker> enqueuer;
  // EP copy-engine dispatch (kernels/cuda/ep_copy_engine.cc): its copy stream (one: pieces on concurrent streams
  // share the link and each lands later, while the receivers wait for whole pieces), the fork (XLA's stream -> copy
  // stream) and join events, and the host's count of the stream sequence's dispatch-type calls on this member
  // (ep_layout.h "dispatch sequences"; the device's sequence number of the next one is ep_dispatch_calls + 1 as
  // long as every such call launches its kernel: the kernel checks). Graph-target calls (the graph sequence) are
  // not counted: XLA replays them without the handler.
  static constexpr int kEpCopyStreams = 1;
  cudaStream_t ep_copy_streams[kEpCopyStreams] = {};
  cudaEvent_t ep_fork = nullptr;
  cudaEvent_t ep_joins[kEpCopyStreams] = {};
  uint64_t ep_dispatch_calls = 0;
  std::mutex ep_mu;                      // one dispatch handler at a time on a member: counter, events, copies
  // EP graph-target calls captured into a CUDA graph (handlers/cuda_ep.cc), per op: dispatch, cached dispatch, combine
  std::atomic<uint64_t> graph_captures[3] = {};
  bool stream_mem_ops = false;           // CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS and the entry point
  bool stream_wait_value = false;        // cuStreamWaitValue32 resolved and stream memory operations supported
  // Engram host path (kernels/cuda/engram_host.h): pinned staging per stream, freed by destroy_member (after the
  // registry joined the host gather pool).
  std::shared_ptr<void> host_fetch;
  void* error_alloc = nullptr;           // cudaHostAlloc(Mapped) block holding the ErrorRecord

  // Device properties, read once at init.
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;
  std::string name;
  bool vmm = false;                      // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
  bool posix_fd = false;                 // ..._HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
  bool gdr_vmm = false;                  // ..._GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
  bool host_numa_vmm = false;            // ..._HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
  int host_numa_id = -1;                 // ..._HOST_NUMA_ID (-1: no NUMA)

  // Side NCCL communicator (not XLA's): comm_init / window_register in cuda_nccl.cc.
  ncclComm_t comm = nullptr;
  int nccl_rank = -1;
  double nccl_timeout_s = 100.0;         // the context timeout: bounds every wait on the (non-blocking) communicator;
                                         // 0 once a wait on it expired (teardown then aborts it at once)
  ncclWindow_t window = nullptr;         // window over the pure-device part of allocation 0 (segment 0)
  std::string window_reason;             // why there is no window ("" when registered)
  ncclDevComm* devcomm = nullptr;        // LSA-only device communicator (heap, NCCL's struct)
  std::string devcomm_reason;            // why there is no devcomm
  int lsa_size = -1, lsa_rank = -1;      // from the devcomm
};

inline CudaMemberState& cuda_state(Member& m) { return *static_cast<CudaMemberState*>(m.backend_state.get()); }

// Makes `device` current for this thread and restores the previous device on exit. When the thread had
// no current context it is left on `device` (restoring "device 0" would create a context on a GPU that
// this process may not own).
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device);
  ~CudaDeviceGuard();
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;
  // cudaSetDevice's result (check before using the device).
  cudaError_t status() const { return status_; }

 private:
  int prev_ = -1;
  cudaError_t status_ = cudaSuccess;
};

// "cudaErrorX (description)" and clears the thread's last runtime error.
std::string cuda_error_string(cudaError_t e);

// Waits, bounded by timeout_s, until no non-blocking communicator of `comms` is in progress (cuda_nccl.cc);
// (*states)[i] is each one's state. False when one is still busy at the deadline.
bool nccl_settle(const std::vector<ncclComm_t>& comms, double timeout_s, std::vector<ncclResult_t>* states);
// "what failed: <NCCL error> [<NCCL's last error>]".
std::string nccl_error_string(ncclResult_t r, const std::string& what);

// NCCL teardown of a member (cuda_nccl.cc): device communicator, window, communicator. Local calls only.
void nccl_release_window(CudaMemberState& st);
void nccl_release_comm(CudaMemberState& st);

}  // namespace jax_engram
