#include "kernels/cuda/ep_copy_engine.h"

#include <algorithm>
#include <mutex>

#include "jax_engram/ep_layout.h"
#include "kernels/cuda/ep_trace.h"
#include "runtime/cuda_driver.h"

namespace jax_engram {
namespace {

std::string failed(const char* what, cudaError_t e) { return std::string(what) + " failed: " + cuda_error_string(e); }

// Enqueues the copy-engine rows of one dispatch (p.ce_pieces > 0, p.ce_seq its sequence number) on the member's copy
// stream, forked from XLA's stream: piece j = offsets [b_j, b_j+1) of every CTA's token range of x (rows < N) into
// this rank's inbox slot of half ce_seq & 1 on every peer, one strided copy per piece and peer (plus one for the CTA
// range that N cuts), then inbox ce[j] = ce_seq on that peer.
// Why the peer's half is free: this stream starts after the previous dispatch-type kernel on XLA's stream, which
// ended only once every peer had published ready for that call, i.e. had finished the call before it (the
// two-halves argument of ep_layout.h).
std::string enqueue_ce_rows(CudaMemberState& st, const Allocation& sa, const EpDispatchParams& p, const EpLaunch& l,
                            cudaStream_t stream) {
  const int R = p.w.nranks, me = p.w.rank, P = p.ce_pieces, G = l.num_ctas;
  const int f = ep_first_token_cta(p.M, G), per = ep_tokens_per_cta(p.M, G), nct = G - f;
  const int64_t row = p.x_bytes;  // == L.x_row (ep_ce_available: x_bytes % 16 == 0)
  const uint64_t hoff = p.w.st_offset + p.L.half(p.ce_seq);
  cudaStream_t cs = st.ep_copy_streams[0];
  cudaError_t e = cudaEventRecord(st.ep_fork, stream);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(cs, st.ep_fork, 0);
  if (e != cudaSuccess) return failed("forking the copy stream", e);
  const CudaDriver* drv = cuda_driver(nullptr);
  const auto write_value = [&](uint8_t* word, uint64_t v, const char* what) -> std::string {
    const CUresult r = drv->cuStreamWriteValue64(reinterpret_cast<CUstream>(cs), reinterpret_cast<CUdeviceptr>(word), v,
                                                 CU_STREAM_WRITE_VALUE_DEFAULT);
    if (r != CUDA_SUCCESS) return std::string("cuStreamWriteValue64 (") + what + ") failed: " + cu_error_string(r);
    return {};
  };
  // Full dispatch: the routing rows first (N, topk, weights, scales; then flag = seq), ahead of piece 0: the
  // receivers lay out this rank's tokens themselves (kernels/cuda/ep.h "copy-engine rows").
  if (p.topk) {
    const EpInbox I = p.L.inbox();
    for (int d = 0; d < R; ++d) {
      if (d == me) continue;
      uint8_t* slot = sa.peers[d] + hoff + p.L.inbox_at(ep_inbox_slot(me, d, R));
      if (auto err = write_value(slot + EpInbox::kN, static_cast<uint64_t>(p.N), "copy-engine N"); !err.empty())
        return err;
      const int64_t nk = static_cast<int64_t>(p.N) * p.K * 4;
      if (nk > 0) e = cudaMemcpyAsync(slot + I.topk_idx(), p.topk, nk, cudaMemcpyDeviceToDevice, cs);
      if (e == cudaSuccess && nk > 0 && p.weights)
        e = cudaMemcpyAsync(slot + I.weights(), p.weights, nk, cudaMemcpyDeviceToDevice, cs);
      if (e == cudaSuccess && p.N > 0 && p.sf_bytes)  // one plain copy when the rows are packed
        e = p.L.sf_row == p.sf_bytes
                ? cudaMemcpyAsync(slot + I.scales(), p.sf, p.N * p.sf_bytes, cudaMemcpyDeviceToDevice, cs)
                : cudaMemcpy2DAsync(slot + I.scales(), p.L.sf_row, p.sf, p.sf_bytes, p.sf_bytes, p.N,
                                    cudaMemcpyDeviceToDevice, cs);
      if (e != cudaSuccess) return failed("enqueueing the copy-engine routing rows", e);
      if (auto err = write_value(slot + EpInbox::kFlag, p.ce_seq, "copy-engine routing flag"); !err.empty()) return err;
    }
  }
  for (int j = 0; j < P; ++j) {
    const int b0 = ep_ce_piece_begin(per, P, j, p.ce_taper), b1 = ep_ce_piece_begin(per, P, j + 1, p.ce_taper);
    // CTAs whose piece lies wholly below N (a prefix), then the one that N cuts
    const int full = p.N >= b1 ? std::min<int64_t>(nct, (p.N - b1) / per + 1) : 0;
    for (int d = 0; d < R; ++d) {
      if (d == me) continue;
      uint8_t* slot = sa.peers[d] + hoff + p.L.inbox_at(ep_inbox_slot(me, d, R));
      uint8_t* dst = slot + p.L.inbox().x();
      if (b1 > b0 && full > 0)
        e = cudaMemcpy2DAsync(dst + b0 * row, per * row, p.x + b0 * row, per * row, (b1 - b0) * row, full,
                              cudaMemcpyDeviceToDevice, cs);
      if (e == cudaSuccess && b1 > b0 && full < nct) {
        const int64_t lo = static_cast<int64_t>(full) * per + b0,
                      hi = std::min<int64_t>(p.N, static_cast<int64_t>(full) * per + b1);
        if (hi > lo)
          e = cudaMemcpyAsync(dst + lo * row, p.x + lo * row, (hi - lo) * row, cudaMemcpyDeviceToDevice, cs);
      }
      if (e != cudaSuccess) return failed("enqueueing the copy-engine rows", e);
      if (auto err = write_value(slot + EpInbox::kCe + 8ull * j, p.ce_seq, "copy-engine piece flag"); !err.empty())
        return err;
    }
  }
  if ((e = cudaEventRecord(st.ep_joins[0], cs)) != cudaSuccess) return failed("recording the copy stream's end", e);
  return {};
}

}  // namespace

bool ep_ce_available(const CudaMemberState& st, int64_t R, int64_t K, int64_t E, int64_t x_bytes) {
  if (R < 2 || !st.stream_mem_ops || !st.ep_copy_streams[0] || x_bytes % 16 != 0 || K < 1) return false;
  // the receivers lay out each peer's tokens: per-CTA counts in scratch, per-warp counters in shared memory
  return (R - 1) * (R + E / R) <= kEpCePeerCounts && ep_dispatch_smem_bytes(R, E, true, nullptr, nullptr) >= 0;
}

int ep_ce_policy(const CudaMemberState& st, int64_t R, int64_t M, int64_t K, int64_t E, int64_t x_bytes,
                 int32_t mode, int32_t pieces) {
  if (mode == kEpCopyNever || !ep_ce_available(st, R, K, E, x_bytes)) return 0;
  if (mode != kEpCopyAlways) {
    if (M * x_bytes < (int64_t{4} << 20)) return 0;
    const int64_t E_loc = E / R;
    double miss = 1.0;
    for (int64_t i = 0; i < K; ++i) miss *= E - E_loc - i > 0 ? static_cast<double>(E - E_loc - i) / (E - i) : 0.0;
    if (1.0 - miss < 0.95) return 0;
  }
  return std::clamp(pieces, 1, kEpCeMaxPieces);
}

int ep_ce_taper(int pieces) { return pieces > 1 ? std::min(kEpCeTaper, 99 / (pieces - 1)) : 0; }

std::string ep_run_dispatch_stream(Member& m, const Allocation& sa, EpDispatchParams& p, const EpLaunch& l,
                                   cudaStream_t stream, EpDispatchLauncher launch, const char* what) {
  CudaMemberState& st = cuda_state(m);
  std::lock_guard<std::mutex> lock(st.ep_mu);
  p.sequence = EpSequence::kStream;
  p.ce_seq = st.ep_dispatch_calls + 1;
  EpCeTrace tr = p.ce_pieces > 0 ? EpCeTrace::begin(m) : EpCeTrace();
  tr.mark(EpCeTrace::kFork, stream);
  if (p.ce_pieces > 0)
    if (auto err = enqueue_ce_rows(st, sa, p, l, stream); !err.empty()) return err;
  tr.mark(EpCeTrace::kCopiesEnd, st.ep_copy_streams[0]);
  tr.mark(EpCeTrace::kKernelLaunch, stream);
  cudaError_t e = launch(p, l, stream);
  if (e != cudaSuccess) return failed(what, e);
  ++st.ep_dispatch_calls;
  tr.mark(EpCeTrace::kKernelEnd, stream);
  if (p.ce_pieces > 0 && (e = cudaStreamWaitEvent(stream, st.ep_joins[0], 0)) != cudaSuccess)
    return failed("joining the copy stream", e);
  tr.end(m, stream, p.ce_seq);
  return {};
}

}  // namespace jax_engram
