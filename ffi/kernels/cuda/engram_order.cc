// Engram stream ordering (see engram_order.h).
#include "kernels/cuda/engram_order.h"

#include <mutex>

#include "runtime/cuda_member.h"

namespace jax_engram {
namespace {

cudaError_t ensure(cudaEvent_t* ev) {
  if (*ev) return cudaSuccess;
  cudaError_t e = cudaEventCreateWithFlags(ev, cudaEventDisableTiming);
  if (e != cudaSuccess) *ev = nullptr;
  return e;
}

}  // namespace

cudaError_t engram_order_after(CudaMemberState& st, cudaStream_t from, cudaStream_t to, bool fork, std::string* what) {
  std::lock_guard<std::mutex> lk(st.engram_mu);
  cudaEvent_t* x = fork ? &st.engram_fork : &st.engram_join;
  cudaError_t e = ensure(x);
  if (e != cudaSuccess) {
    *what = "creating the stream-ordering events";
    return e;
  }
  e = cudaEventRecord(*x, from);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(to, *x, 0);
  if (e != cudaSuccess) *what = "ordering XLA's stream and the side stream";
  return e;
}

cudaError_t engram_slot_record(CudaMemberState& st, int64_t slot, cudaStream_t side, std::string* what) {
  std::lock_guard<std::mutex> lk(st.engram_mu);
  cudaEvent_t* x = &st.engram_slots[slot];
  cudaError_t e = ensure(x);
  if (e != cudaSuccess) {
    *what = "creating the fetch's slot event";
    return e;
  }
  if ((e = cudaEventRecord(*x, side)) != cudaSuccess) *what = "recording the fetch's slot event";
  return e;
}

cudaError_t engram_slot_wait(CudaMemberState& st, int64_t slot, cudaStream_t stream, std::string* what) {
  std::lock_guard<std::mutex> lk(st.engram_mu);
  cudaEvent_t* x = &st.engram_slots[slot];
  cudaError_t e = ensure(x);  // never recorded (the fetch failed before): an unrecorded event is complete
  if (e != cudaSuccess) {
    *what = "creating the fetch's slot event";
    return e;
  }
  if ((e = cudaStreamWaitEvent(stream, *x, 0)) != cudaSuccess) *what = "ordering the wait after its fetch (slot event)";
  return e;
}

}  // namespace jax_engram
