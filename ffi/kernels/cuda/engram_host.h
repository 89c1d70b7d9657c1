// Engram host path on a GPU (no SMs for the rows): CPU worker threads of the member's host gather pool
// (runtime/host_gather.h) gather the rows of a host-placed table into pinned staging, and the copy engine moves
// each finished chunk into the result, gated in stream order by a flag in mapped pinned memory. Plain C++ header
// (the handler includes it); the launcher is in engram_host.cu.
//
// On `stream`, per fetch:
//   1. copy of the ids into pinned memory (device -> host);
//   2. cuStreamWriteValue32 of the start flag; the member's enqueue thread (CudaMemberState::enqueuer), which spins
//      on it (an OrderedWorker watch), queues the job on the pool (no CUDA call) and gathers items of the first
//      chunk itself while the workers wake (the stream would wait for that chunk next anyway). A host function
//      would start the job too, but the driver wakes its thread late (up to hundreds of microseconds in a VM);
//   3. the scale factors (a few bytes per row): a small GPU kernel reads them from the replicated sf table, wherever
//      it lives, while the CPU gathers the rows; only it uses SMs, the rows never do;
//   4. per chunk (engram::host_gather_plan): cuStreamWaitValue32(flag[c] == seq), then the chunk's host -> device
//      copy; the last chunk's flag is set once every item and the status word are done;
//   5. the status word (after the last chunk's copy, so no wait of its own).
// That is 2 * chunks + 3 stream calls (+ 2 with scale factors); an overlapped fetch makes them on the enqueue thread
// (enqueue_engram_host_fetch below), a fetch on XLA's stream on the launching thread.
// Without stream memory operations a host function runs the whole gather synchronously and one copy follows.
// Staging (rows, ids, flags, status) is pinned memory per (member, stream), grown on demand without a sync (the
// outgrown buffers are kept until the member is destroyed). One job at a time per stream is safe by stream order:
// the next fetch's start flag is written only after this fetch's copies out of the staging. Workers set every flag
// even when they fail (the failure goes to the member's error record: the next op / ctx.check() raises), and a
// start flag the stream never writes is given up at the context timeout (the job is failed, its flags set), so
// the stream never waits forever.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "runtime/runtime.h"

namespace jax_engram {

struct CudaMemberState;

struct EngramHostFetchArgs {
  Member* member = nullptr;
  CudaMemberState* state = nullptr;
  const int32_t* ids = nullptr;          // [T, E] (device)
  int64_t T = 0, E = 0;
  int64_t num_entries = 0;
  const Allocation* table = nullptr;     // its `peers` are host-readable (Allocation::cpu_readable)
  int64_t offset = 0, row_bytes = 0;
  int32_t mode = 0;
  uint8_t* out = nullptr;                // [T*E, row_bytes] (device)
  const uint32_t* sf_table = nullptr;    // own replicated sf table (nullptr: none), read by a small GPU gather
  int64_t P = 0;
  int32_t sf_layout = 0;
  uint32_t* sf_out = nullptr;            // (device)
  int32_t* status = nullptr;             // one int32 (device)
  int threads = 0;                       // pool workers (0: default)
};

// Enqueues the host path on `stream`. On failure returns the CUDA error and names the step in *what.
cudaError_t launch_engram_host_fetch(const EngramHostFetchArgs& a, cudaStream_t stream, std::string* what);

// The overlapped form, off XLA's launch thread. The 2 * chunks + 3 stream calls above cost tens of microseconds of
// the launching thread, and a step enqueues its prefetches before its first layer, while the GPU waits for work.
// So the handler only records a fork event on `stream` (XLA's) and queues the rest on the member's enqueue thread
// (CudaMemberState::enqueuer): the side stream's wait for the fork, launch_engram_host_fetch on the side stream,
// and the slot's event (slot > 0; engram_order.h). Returns "" or why the fetch could not be queued.
std::string enqueue_engram_host_fetch(const EngramHostFetchArgs& a, cudaStream_t stream, int64_t slot);

// For the wait (and anything else that orders after the side stream): blocks, bounded by the member's timeout, until the
// enqueue thread has enqueued the queued fetches of `slot` (0: every queued fetch), so that the slot's event or the
// side stream covers them. Returns "" or the failure to report: a timeout, or (take_errors) the first enqueue
// failure of those fetches not reported yet (reported once; the member stays usable).
std::string engram_host_enqueued(Member& m, CudaMemberState& st, int64_t slot, bool take_errors);

}  // namespace jax_engram
