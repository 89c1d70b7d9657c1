// Stream ordering of the Engram ops on a GPU: XLA's stream and the member's side stream, where overlapped fetches
// run (CudaMemberState::engram_*). Plain C++ header.
//
// fork / join: `to` waits for the work enqueued on `from` so far (one event each per member, recorded and waited
// for under CudaMemberState::engram_mu, so another op never re-records it in between).
// slots: an overlapped fetch records its call site's event (EngramFetchAttrs::slot > 0) after its work on the side
// stream, and its wait makes XLA's stream wait for that event only, so a wait never waits for a later fetch.
// cudaStreamWaitEvent takes the event's state at the call, so the next step re-recording the slot is harmless.
// Every event is created at first use and destroyed with the member.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace jax_engram {

struct CudaMemberState;

// `to` waits for the work enqueued on `from` so far (fork: the fork event, else the join event).
cudaError_t engram_order_after(CudaMemberState& st, cudaStream_t from, cudaStream_t to, bool fork, std::string* what);
// Records the slot's event on `side`, after the fetch's work.
cudaError_t engram_slot_record(CudaMemberState& st, int64_t slot, cudaStream_t side, std::string* what);
// Makes `stream` wait for the slot's event.
cudaError_t engram_slot_wait(CudaMemberState& st, int64_t slot, cudaStream_t stream, std::string* what);

}  // namespace jax_engram
