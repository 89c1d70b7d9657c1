#include "kernels/cuda/ep_trace.h"

#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "kernels/cuda/ep.h"
#include "runtime/env.h"

namespace jax_engram {

int ep_trace_level() {
  static const int v = env_int("JAX_ENGRAM_EP_TRACE", 0, 0, 2);
  return v;
}

int ep_trace_cta() {
  static const int v = env_int("JAX_ENGRAM_EP_TRACE_CTA", -1, -1, kEpMaxCtas - 1);
  return v;
}

struct EpCeTrace::Ring {
  static constexpr int kSize = 16;
  cudaEvent_t ev[kSize][5] = {};  // indexed by Mark
  double host_us[kSize] = {};
  uint64_t seq[kSize] = {};
  int head = 0, tail = 0;  // calls [tail, head) recorded, not yet printed
  bool ok = false;

  // Prints the calls whose events completed, oldest first; stops at the first pending one.
  void drain(const Member& m) {
    while (tail < head) {
      const int i = tail % kSize;
      if (cudaEventQuery(ev[i][kJoin]) != cudaSuccess) {
        cudaGetLastError();
        return;
      }
      float ce = 0, kern = 0, total = 0, launch = 0;
      cudaEventElapsedTime(&launch, ev[i][kFork], ev[i][kKernelLaunch]);
      cudaEventElapsedTime(&ce, ev[i][kFork], ev[i][kCopiesEnd]);
      cudaEventElapsedTime(&kern, ev[i][kFork], ev[i][kKernelEnd]);
      cudaEventElapsedTime(&total, ev[i][kFork], ev[i][kJoin]);
      std::printf("EPHOST dispatch rank %d seq %llu: kernel launched %.1f us, copies end %.1f us, kernel end %.1f us, "
                  "op end %.1f us (from the fork); handler host time %.1f us\n", m.rank,
                  static_cast<unsigned long long>(seq[i]), launch * 1e3, ce * 1e3, kern * 1e3, total * 1e3, host_us[i]);
      std::fflush(stdout);
      ++tail;
    }
  }
};

EpCeTrace EpCeTrace::begin(const Member& m) {
  EpCeTrace t;
  if (ep_trace_level() < 1) return t;
  static std::mutex mu;
  static auto* table = new std::map<std::pair<int64_t, int32_t>, std::unique_ptr<Ring>>();  // leaked: diagnosis only
  Ring* r;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto& slot = (*table)[{m.ctx_id, m.ordinal}];
    if (!slot) {
      slot = std::make_unique<Ring>();
      slot->ok = true;
      for (auto& row : slot->ev)
        for (auto& e : row) slot->ok = slot->ok && cudaEventCreate(&e) == cudaSuccess;
    }
    r = slot.get();
  }
  if (!r->ok) return t;
  if (r->head - r->tail >= Ring::kSize) r->drain(m);
  if (r->head - r->tail >= Ring::kSize) return t;
  t.ring_ = r;
  t.slot_ = r->head % Ring::kSize;
  t.h0_ = std::chrono::steady_clock::now();
  return t;
}

void EpCeTrace::mark(Mark which, cudaStream_t stream) {
  if (ring_) cudaEventRecord(ring_->ev[slot_][which], stream);
}

void EpCeTrace::end(const Member& m, cudaStream_t stream, uint64_t seq) {
  if (!ring_) return;
  cudaEventRecord(ring_->ev[slot_][kJoin], stream);
  ring_->host_us[slot_] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0_).count();
  ring_->seq[slot_] = seq;
  ++ring_->head;
  ring_->drain(m);
}

}  // namespace jax_engram
