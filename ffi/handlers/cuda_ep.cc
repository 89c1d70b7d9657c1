// CUDA handlers of EP dispatch, cached dispatch and combine (same target names, operands, results and
// attributes as the CPU handlers in cpu_ep.cc, whose shape/dtype validation and messages are mirrored here).
// Binding and validation only: the protocol lives in kernels/cuda/ep_dispatch.cu and ep_combine.cu. Each op
// is ONE kernel launch on XLA's stream, no host synchronisation; errors found on the device (timeouts, bad
// routing, inconsistent handles) are recorded in the member's error record and fail the next op of the context
// or ctx.check(). Sizes are kernel arguments (no recompilation per token count).
//
// Tuning knobs (environment, read per call; identical on every rank of a context):
//   JAX_ENGRAM_EP_STAGE_WARPS   warps per CTA that push (defaults: dispatch 6, with copy-engine rows 4; combine 8,
//                               expand combine 14; swept on 2xH200); the other warps of the 16 pull.
//   JAX_ENGRAM_EP_DISPATCH_CE   copy-engine rows for dispatch (kernels/cuda/ep.h): unset or "auto" = the policy of
//                               ce_pieces_for below, 0 = never (SM stores), 1 = whenever the hardware allows it
//   JAX_ENGRAM_EP_CE_PIECES     pieces of the copy-engine rows (default 4, 1..32)
//   JAX_ENGRAM_EP_CE_STREAMS    copy streams the pieces go round (default 1, at most 4)
//   JAX_ENGRAM_EP_CE_TAPER      later pieces smaller (ep_layout.h ep_ce_piece_begin; default kEpCeTaper, 0 = equal)
// Knobs are read when the handler runs: for the graph targets below that is when XLA captures the call.
//
// Every op has two targets: "jax_engram_ep_<op>" and "jax_engram_ep_<op>_graph" (Context cuda_graphs=True), the
// same code, the latter marked command-buffer compatible so that XLA may capture it into a CUDA graph and replay it
// without running the handler. Graph-target dispatches therefore keep no per-call host state: they run in
// dispatch lane 1 (ep_layout.h), whose sequence lives on the device only, and never use copy-engine rows (the copy
// streams' inbox half and flag values come from the host's count of lane-0 calls). Errors a replayed kernel finds
// are recorded as always; with no handler run to report them they surface at ctx.check() or at the next op of the
// context that runs its handler.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "handlers/common.h"
#include "handlers/ep_bindings.h"
#include "handlers/cuda_ep.h"
#include "handlers/validate.h"
#include "jax_engram/ep_layout.h"
#include "kernels/cuda/ep.h"
#include "runtime/cuda_driver.h"
#include "runtime/cuda_member.h"
#include "runtime/env.h"

namespace jax_engram {
namespace {

using namespace validate;



ffi::Error cuda_failure(int32_t op, const char* what, cudaError_t e) {
  return op_error(op, std::string(what) + " failed: " + cuda_error_string(e), ffi::ErrorCode::kInternal);
}

// Graph targets: counts the calls XLA captures into a CUDA graph (CudaMemberState::graph_captures: the tests'
// proof that capture happened). Other targets: refuses capture, which would replay the host's copy-engine decisions
// and counts (XLA never captures a target without the trait; this guards against anything else capturing).
enum CaptureKind { kCaptureDispatch = 0, kCaptureCached = 1, kCaptureCombine = 2 };
ffi::Error note_capture(Member& m, cudaStream_t stream, bool graph_target, int32_t op, CaptureKind kind) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(stream, &cs);
  if (e != cudaSuccess) return cuda_failure(op, "cudaStreamIsCapturing", e);
  if (cs != cudaStreamCaptureStatusActive) return ffi::Error::Success();
  if (!graph_target)
    return op_error(op, "this call is being captured into a CUDA graph, but only the graph targets (Context "
                        "cuda_graphs=True) may be", ffi::ErrorCode::kFailedPrecondition);
  cuda_state(m).graph_captures[kind].fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

constexpr int kDefaultSms = 24;  // the SM budget the kernels are tuned for (DeepEP's 24-SM configuration)

// Grid size and warp split. num_sms = 0: kDefaultSms; always capped at the device's SMs and kEpMaxCtas.
EpLaunch launch_shape(Member& m, int64_t num_sms, int default_stage_warps) {
  EpLaunch l;
  const int sms = m.backend_state ? cuda_state(m).sm_count : 0;
  int g = num_sms > 0 ? static_cast<int>(std::min<int64_t>(num_sms, 1 << 20)) : kDefaultSms;
  if (sms > 0) g = std::min(g, sms);
  l.num_ctas = std::max(1, std::min(g, kEpMaxCtas));
  // at least one warp pushes and one receives
  l.stage_warps = env_int("JAX_ENGRAM_EP_STAGE_WARPS", default_stage_warps, 1, kEpThreads / 32 - 1);
  return l;
}

// Window + staging region of the member; the device must be current (CudaDeviceGuard).
ffi::Error make_window(Member& m, Allocation& st, int64_t offset, int32_t op, EpWindow* w) {
  if (!m.backend_state) return op_error(op, "member has no CUDA state", ffi::ErrorCode::kFailedPrecondition);
  Allocation* win = m.alloc(0);
  if (!win || !win->peers_device || !st.peers_device)
    return op_error(op, "the context window is not connected on this device", ffi::ErrorCode::kFailedPrecondition);
  for (auto* p : win->peers)
    if (!p) return op_error(op, "a peer on this axis is not reachable by loads/stores (another NVLink domain); "
                                "scale-out (GIN) support is not available yet", ffi::ErrorCode::kUnimplemented);
  w->ws_peers = static_cast<uint8_t* const*>(win->peers_device);
  w->ws_own = win->local;
  w->st_peers = static_cast<uint8_t* const*>(st.peers_device);
  w->st_own = st.local;
  w->st_offset = static_cast<uint64_t>(offset);
  w->err = m.error_device;
  w->timeout_ns = m.timeout_ns();
  w->rank = m.rank;
  w->nranks = m.nranks;
  return ffi::Error::Success();
}

// Copy-engine rows (kernels/cuda/ep.h): pieces for a dispatch of this config, 0 = SM stores. Identical on every rank:
// a function of the config (not of N, which may differ per rank), the environment and the hardware.
// Auto policy, from 2xH200 at 4096 tokens, hidden 7168, top-8 of 256 (benchmarks/RESULTS.md, session 7): since the
// receivers lay out the peers' tokens themselves the copy engine wins for every layout and dtype there (bf16
// non-expand 224 vs 272 us, FP8 175 vs 209, bf16 expand 441 vs 497, FP8 expand 294 vs 329). The whole x (N rows)
// goes to every peer, so only when a peer is expected to receive nearly all of a rank's tokens: share = 1 - P(none of
// a token's K distinct uniform experts is on that peer) >= 95 % (2 ranks: top-6 98.5 %, top-8 99.6 %; 4 ranks top-8:
// 90 %, not taken), and M x row >= 4 MiB (small calls are latency-bound: every copy and flag costs a few us).
int ce_pieces_for(const CudaMemberState& st, int64_t R, int64_t M, int64_t K, int64_t E, int64_t x_bytes) {
  if (R < 2 || !st.stream_mem_ops || !st.ep_copy_streams[0] || x_bytes % 16 != 0 || K < 1) return 0;
  // the receivers lay out each peer's tokens: per-CTA counts in scratch, per-warp counters in shared memory
  if ((R - 1) * (R + E / R) > kEpCePeerCounts || ep_dispatch_smem_bytes(R, E, true, nullptr, nullptr) < 0) return 0;
  const char* mode = std::getenv("JAX_ENGRAM_EP_DISPATCH_CE");
  const bool forced = mode && std::string(mode) == "1";
  if (mode && std::string(mode) == "0") return 0;
  if (!forced) {
    if (M * x_bytes < (int64_t{4} << 20)) return 0;
    const int64_t E_loc = E / R;
    double miss = 1.0;
    for (int64_t i = 0; i < K; ++i) miss *= E - E_loc - i > 0 ? static_cast<double>(E - E_loc - i) / (E - i) : 0.0;
    if (1.0 - miss < 0.95) return 0;
  }
  return env_int("JAX_ENGRAM_EP_CE_PIECES", 4, 1, kEpCeMaxPieces);
}

// Copy streams the pieces go round (JAX_ENGRAM_EP_CE_STREAMS, at most kEpCopyStreams). Default ONE: on 2xH200 at
// 4096 tokens (bf16, hidden 7168) one stream took 231 us per dispatch with 4 pieces and 235 with 8, two streams
// 255 (8 pieces) and three or four 293-327: copies on concurrent streams share the link and each lands later,
// while the receivers wait for whole pieces (results/ep_diagnosis_2xh200.log section 19).
int ce_streams() {
  return env_int("JAX_ENGRAM_EP_CE_STREAMS", 1, 1, CudaMemberState::kEpCopyStreams);
}

// Enqueues the copy-engine rows of one dispatch (p.ce_pieces > 0, p.ce_seq its sequence number) on the member's copy
// stream, forked from XLA's stream: piece j = offsets [b_j, b_j+1) of every CTA's token range of x (rows < N) into
// this rank's inbox slot of half ce_seq & 1 on every peer, one strided copy per piece and peer (plus one for the CTA
// range that N cuts), then inbox ce[j] = ce_seq on that peer. The caller joins the copy stream into XLA's stream
// after the kernel (x stays alive until the copies are done).
// Why the peer's half is free: this stream starts after the previous dispatch-type kernel on XLA's stream, which
// ended only once every peer had published ready for that call, i.e. had finished the call before it (the
// two-halves argument of ep_layout.h).
ffi::Error enqueue_ce_rows(CudaMemberState& st, const Allocation& sa, const EpDispatchParams& p, const EpLaunch& l,
                           cudaStream_t stream) {
  constexpr int32_t op = kOpEpDispatch;
  const int R = p.w.nranks, me = p.w.rank, P = p.ce_pieces, G = l.num_ctas;
  const int f = ep_first_token_cta(p.M, G), per = ep_tokens_per_cta(p.M, G), nct = G - f;
  const int64_t row = p.x_bytes;  // == L.x_row (ce_pieces_for: x_bytes % 16 == 0)
  const uint64_t hoff = p.w.st_offset + p.L.half(p.ce_seq);
  const int NS = ce_streams();
  cudaError_t e = cudaEventRecord(st.ep_fork, stream);
  for (int i = 0; i < NS && e == cudaSuccess; ++i) e = cudaStreamWaitEvent(st.ep_copy_streams[i], st.ep_fork, 0);
  if (e != cudaSuccess) return cuda_failure(op, "forking the copy streams", e);
  const CudaDriver* drv = cuda_driver(nullptr);
  const auto write_value = [&](cudaStream_t cs, uint8_t* word, uint64_t v, const char* what) -> ffi::Error {
    const CUresult r = drv->cuStreamWriteValue64(reinterpret_cast<CUstream>(cs), reinterpret_cast<CUdeviceptr>(word), v,
                                                 CU_STREAM_WRITE_VALUE_DEFAULT);
    if (r != CUDA_SUCCESS)
      return op_error(op, std::string("cuStreamWriteValue64 (") + what + ") failed: " + cu_error_string(r),
                      ffi::ErrorCode::kInternal);
    return ffi::Error::Success();
  };
  // Full dispatch: the routing rows first (N, topk, weights, scales; then flag = seq), ahead of piece 0: the
  // receivers lay out this rank's tokens themselves (kernels/cuda/ep.h "copy-engine rows").
  if (p.topk) {
    cudaStream_t cs = st.ep_copy_streams[0];
    const EpInbox I = p.L.inbox();
    for (int d = 0; d < R; ++d) {
      if (d == me) continue;
      uint8_t* slot = sa.peers[d] + hoff + p.L.inbox_at(ep_inbox_slot(me, d, R));
      JE_CHECK(write_value(cs, slot + EpInbox::kN, static_cast<uint64_t>(p.N), "copy-engine N"));
      const int64_t nk = static_cast<int64_t>(p.N) * p.K * 4;
      if (nk > 0) e = cudaMemcpyAsync(slot + I.topk_idx(), p.topk, nk, cudaMemcpyDeviceToDevice, cs);
      if (e == cudaSuccess && nk > 0 && p.weights)
        e = cudaMemcpyAsync(slot + I.weights(), p.weights, nk, cudaMemcpyDeviceToDevice, cs);
      if (e == cudaSuccess && p.N > 0 && p.sf_bytes)  // one plain copy when the rows are packed (56 scales: 224 B)
        e = p.L.sf_row == p.sf_bytes
                ? cudaMemcpyAsync(slot + I.scales(), p.sf, p.N * p.sf_bytes, cudaMemcpyDeviceToDevice, cs)
                : cudaMemcpy2DAsync(slot + I.scales(), p.L.sf_row, p.sf, p.sf_bytes, p.sf_bytes, p.N,
                                    cudaMemcpyDeviceToDevice, cs);
      if (e != cudaSuccess) return cuda_failure(op, "enqueueing the copy-engine routing rows", e);
      JE_CHECK(write_value(cs, slot + EpInbox::kFlag, p.ce_seq, "copy-engine routing flag"));
    }
  }
  for (int j = 0; j < P; ++j) {
    cudaStream_t cs = st.ep_copy_streams[j % NS];
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
        const int64_t lo = static_cast<int64_t>(full) * per + b0, hi = std::min<int64_t>(p.N, static_cast<int64_t>(full) * per + b1);
        if (hi > lo)
          e = cudaMemcpyAsync(dst + lo * row, p.x + lo * row, (hi - lo) * row, cudaMemcpyDeviceToDevice, cs);
      }
      if (e != cudaSuccess) return cuda_failure(op, "enqueueing the copy-engine rows", e);
      JE_CHECK(write_value(cs, slot + EpInbox::kCe + 8ull * j, p.ce_seq, "copy-engine piece flag"));
    }
  }
  for (int i = 0; i < NS && e == cudaSuccess; ++i) e = cudaEventRecord(st.ep_joins[i], st.ep_copy_streams[i]);
  if (e != cudaSuccess) return cuda_failure(op, "recording the copy streams' end", e);
  return ffi::Error::Success();
}

// Diagnosis of the copy-engine dispatch (JAX_ENGRAM_EP_TRACE >= 1): per call, timing events on XLA's stream at the
// fork, after the kernel and after the join, and on the copy stream after its last piece; printed (EPHOST lines)
// once complete, with the handler's own host time. A ring, because the host usually runs calls ahead.
struct CeTrace {
  static constexpr int kRing = 16;
  cudaEvent_t ev[kRing][5] = {};  // fork, copies end, kernel end, join, kernel launch
  double host_us[kRing] = {};
  uint64_t seq[kRing] = {};
  int head = 0, tail = 0;  // calls [tail, head) recorded, not yet printed
  bool ok = false;
};

CeTrace& ce_trace(const Member& m) {
  static std::mutex mu;
  static auto* table = new std::map<std::pair<int64_t, int32_t>, std::unique_ptr<CeTrace>>();  // leaked
  std::lock_guard<std::mutex> lock(mu);
  auto& t = (*table)[{m.ctx_id, m.ordinal}];
  if (!t) {
    t = std::make_unique<CeTrace>();
    t->ok = true;
    for (auto& row : t->ev)
      for (auto& e : row) t->ok = t->ok && cudaEventCreate(&e) == cudaSuccess;
  }
  return *t;
}

void ce_trace_drain(CeTrace& t, const Member& m) {
  while (t.tail < t.head) {
    const int i = t.tail % CeTrace::kRing;
    if (cudaEventQuery(t.ev[i][3]) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    float ce = 0, kern = 0, total = 0, launch = 0;
    cudaEventElapsedTime(&launch, t.ev[i][0], t.ev[i][4]);
    cudaEventElapsedTime(&ce, t.ev[i][0], t.ev[i][1]);
    cudaEventElapsedTime(&kern, t.ev[i][0], t.ev[i][2]);
    cudaEventElapsedTime(&total, t.ev[i][0], t.ev[i][3]);
    std::printf("EPHOST dispatch rank %d seq %llu: kernel launched %.1f us, copies end %.1f us, kernel end %.1f us, "
                "op end %.1f us (from the fork); handler host time %.1f us\n", m.rank,
                static_cast<unsigned long long>(t.seq[i]), launch * 1e3, ce * 1e3, kern * 1e3, total * 1e3, t.host_us[i]);
    std::fflush(stdout);
    ++t.tail;
  }
}

// Launches one dispatch-type kernel, with copy-engine rows when p.ce_pieces > 0, and counts it (the host's count is
// the device's lane-0 sequence number: see CudaMemberState::ep_dispatch_calls).
// Graph targets (lane 1): no count, no copy-engine rows; the launch alone.
template <typename Launch>
ffi::Error launch_dispatch_counted(Member& m, const Allocation& sa, EpDispatchParams& p, const EpLaunch& l,
                                   cudaStream_t stream, Launch launch, const char* what, bool graph) {
  constexpr int32_t op = kOpEpDispatch;
  CudaMemberState& st = cuda_state(m);
  JE_CHECK(note_capture(m, stream, graph, op, p.h_meta ? kCaptureCached : kCaptureDispatch));
  if (graph) {
    p.lane = 1;
    p.ce_pieces = 0;
    p.ce_seq = 0;
    const cudaError_t e = launch(p, l, stream);
    return e == cudaSuccess ? ffi::Error::Success() : cuda_failure(op, what, e);
  }
  std::lock_guard<std::mutex> lock(st.ep_mu);
  const auto h0 = std::chrono::steady_clock::now();
  CeTrace* tr = p.ce_pieces > 0 && ep_trace_level() >= 1 ? &ce_trace(m) : nullptr;
  if (tr && (!tr->ok || tr->head - tr->tail >= CeTrace::kRing)) {
    if (tr->ok) ce_trace_drain(*tr, m);
    if (!tr->ok || tr->head - tr->tail >= CeTrace::kRing) tr = nullptr;
  }
  const int ti = tr ? tr->head % CeTrace::kRing : 0;
  p.ce_seq = st.ep_dispatch_calls + 1;
  if (tr) cudaEventRecord(tr->ev[ti][0], stream);
  if (p.ce_pieces > 0)
    if (auto err = enqueue_ce_rows(st, sa, p, l, stream); !err.success()) return err;
  if (tr) cudaEventRecord(tr->ev[ti][1], st.ep_copy_streams[(p.ce_pieces - 1) % ce_streams()]);
  if (tr) cudaEventRecord(tr->ev[ti][4], stream);
  cudaError_t e = launch(p, l, stream);
  if (e != cudaSuccess) return cuda_failure(op, what, e);
  ++st.ep_dispatch_calls;
  if (tr) cudaEventRecord(tr->ev[ti][2], stream);
  for (int i = 0; i < ce_streams() && p.ce_pieces > 0; ++i)
    if ((e = cudaStreamWaitEvent(stream, st.ep_joins[i], 0)) != cudaSuccess)
      return cuda_failure(op, "joining the copy streams", e);
  if (tr) {
    cudaEventRecord(tr->ev[ti][3], stream);
    tr->host_us[ti] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count();
    tr->seq[ti] = p.ce_seq;
    ++tr->head;
    ce_trace_drain(*tr, m);
  }
  return ffi::Error::Success();
}

// What the full and the cached dispatch share once their buffers are validated: the staging region, the copy-engine
// choice and launch shape, the window, the config, and the operands / results both have. The caller fills the
// rest. `g` (the caller's, alive until the launch) has selected the device. `cached`: the cached dispatch.
// Stage warps: with copy-engine rows a full dispatch's stage warps push nothing (the receivers lay out the peers'
// tokens), so one of 16 (it writes dst_row and publishes ready) and the other 15 copy rows; the cached dispatch's
// still push the weights / scales rows (4).
struct DispatchLaunch {
  EpDispatchParams p;
  EpLaunch l;
  Allocation* a = nullptr;
};
ffi::Error prepare_dispatch(Member& m, int32_t op, const CudaDeviceGuard& g, const EpShapes& sh, int64_t alloc_id,
                            int64_t offset, int64_t num_sms, int64_t expand, int64_t A, int64_t zero_padding,
                            const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_scales,
                            const ffi::AnyBuffer& topk_weights, const ffi::AnyBuffer& token,
                            const ffi::AnyBuffer& recv_x, const ffi::AnyBuffer& recv_x_scales,
                            const ffi::AnyBuffer& recv_topk_weights, const ffi::AnyBuffer& token_out, bool cached,
                            bool graph, DispatchLaunch* d) {
  const Common& c = sh.c;
  const auto L = EpDispatchLayout::make(c.R, c.M, sh.K, c.E, sh.row_bytes, sh.P, /*push=*/true);
  JE_CHECK(check_region(m, alloc_id, offset, L.total_bytes(), op, &d->a));
  const int ce = m.backend_state && !graph ? ce_pieces_for(cuda_state(m), c.R, c.M, sh.K, c.E, sh.row_bytes) : 0;
  d->l = launch_shape(m, num_sms, ce ? (cached ? 4 : 1) : 6);
  if (g.status() != cudaSuccess) return cuda_failure(op, "cudaSetDevice", g.status());
  EpDispatchParams& p = d->p;
  JE_CHECK(make_window(m, *d->a, offset, op, &p.w));
  p.L = L;
  p.M = static_cast<int32_t>(c.M);
  p.N = static_cast<int32_t>(sh.N);
  p.K = static_cast<int32_t>(sh.K);
  p.E = static_cast<int32_t>(c.E);
  p.A = static_cast<int32_t>(A);
  p.expand = expand != 0;
  p.zero_padding = zero_padding != 0;
  p.rows = c.rows;
  p.x_bytes = sh.row_bytes;
  p.sf_bytes = sh.P * 4;
  p.x = static_cast<const uint8_t*>(x.untyped_data());
  p.sf = static_cast<const uint8_t*>(x_scales.untyped_data());
  p.weights = sh.has_w ? static_cast<const float*>(topk_weights.untyped_data()) : nullptr;
  p.token = static_cast<const int32_t*>(token.untyped_data());
  p.recv_x = static_cast<uint8_t*>(recv_x.untyped_data());
  p.recv_sf = static_cast<uint8_t*>(recv_x_scales.untyped_data());
  p.recv_w = sh.has_w ? static_cast<float*>(recv_topk_weights.untyped_data()) : nullptr;
  p.token_out = static_cast<int32_t*>(token_out.untyped_data());
  p.ce_pieces = ce;
  // shrinking pieces; tau (P - 1) <= 99 keeps every share positive (tests/test_ep.py)
  p.ce_taper = ce > 1 ? env_int("JAX_ENGRAM_EP_CE_TAPER", std::min(kEpCeTaper, 99 / (ce - 1)), 0, 99 / (ce - 1)) : 0;
  return ffi::Error::Success();
}

template <bool kGraph>
ffi::Error EpDispatchCuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer x_scales,
                          ffi::AnyBuffer topk_idx, ffi::AnyBuffer topk_weights, ffi::AnyBuffer token,
                          ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_x_scales,
                          ffi::Result<ffi::AnyBuffer> recv_topk_idx, ffi::Result<ffi::AnyBuffer> recv_topk_weights,
                          ffi::Result<ffi::AnyBuffer> psum_rank, ffi::Result<ffi::AnyBuffer> psum_expert,
                          ffi::Result<ffi::AnyBuffer> unaligned, ffi::Result<ffi::AnyBuffer> recv_src_metadata,
                          ffi::Result<ffi::AnyBuffer> dst_row, ffi::Result<ffi::AnyBuffer> num_recv_tokens,
                          ffi::Result<ffi::AnyBuffer> group_sizes, ffi::Result<ffi::AnyBuffer> token_out,
                          int64_t ctx_id, int64_t alloc_id, int64_t offset, int64_t num_experts,
                          int64_t max_tokens_per_rank, int64_t expand, int64_t expert_alignment, int64_t zero_padding,
                          int64_t num_sms) {
  constexpr int32_t op = kOpEpDispatch;
  MemberScope s(ctx_id, ordinal, op);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  EpShapes sh;  // the kernel copies the token (CTA 0)
  JE_CHECK(check_dispatch(op, m, x, x_scales, topk_idx, topk_weights, token, *recv_x, *recv_x_scales, *recv_topk_idx,
                          *recv_topk_weights, *psum_rank, *psum_expert, *unaligned, *recv_src_metadata, *dst_row,
                          *num_recv_tokens, *group_sizes, *token_out, num_experts, max_tokens_per_rank, expand,
                          expert_alignment, zero_padding, &sh));
  CudaDeviceGuard g(ordinal);
  DispatchLaunch d;
  JE_CHECK(prepare_dispatch(m, op, g, sh, alloc_id, offset, num_sms, expand, expert_alignment, zero_padding, x,
                            x_scales, topk_weights, token, *recv_x, *recv_x_scales, *recv_topk_weights, *token_out,
                            false, kGraph, &d));
  if (ep_dispatch_smem_bytes(sh.c.R, sh.c.E, d.p.ce_pieces > 0, nullptr, nullptr) < 0)
    return op_error(op, "ranks + experts = " + std::to_string(sh.c.R + sh.c.E) +
                            " is too large for the layout kernel");
  EpDispatchParams& p = d.p;
  p.topk = static_cast<const int32_t*>(topk_idx.untyped_data());
  p.recv_topk = expand ? nullptr : static_cast<int32_t*>(recv_topk_idx->untyped_data());
  p.psum_rank = static_cast<int32_t*>(psum_rank->untyped_data());
  p.psum_expert = static_cast<int32_t*>(psum_expert->untyped_data());
  p.unaligned = static_cast<int32_t*>(unaligned->untyped_data());
  p.meta = static_cast<int32_t*>(recv_src_metadata->untyped_data());
  p.dst_row = static_cast<int32_t*>(dst_row->untyped_data());
  p.num_recv = static_cast<int32_t*>(num_recv_tokens->untyped_data());
  p.group_sizes = static_cast<int32_t*>(group_sizes->untyped_data());
  return launch_dispatch_counted(m, *d.a, p, d.l, stream, launch_ep_dispatch, "launching the dispatch kernel", kGraph);
}

template <bool kGraph>
ffi::Error EpDispatchCachedCuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer x_scales,
                                ffi::AnyBuffer topk_weights, ffi::AnyBuffer recv_src_metadata,
                                ffi::AnyBuffer psum_rank, ffi::AnyBuffer psum_expert, ffi::AnyBuffer unaligned,
                                ffi::AnyBuffer dst_row, ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> recv_x,
                                ffi::Result<ffi::AnyBuffer> recv_x_scales,
                                ffi::Result<ffi::AnyBuffer> recv_topk_weights, ffi::Result<ffi::AnyBuffer> token_out,
                                int64_t ctx_id, int64_t alloc_id, int64_t offset, int64_t num_experts,
                                int64_t max_tokens_per_rank, int64_t expand, int64_t expert_alignment,
                                int64_t zero_padding, int64_t num_sms) {
  constexpr int32_t op = kOpEpDispatch;
  MemberScope s(ctx_id, ordinal, op);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  EpShapes sh;
  JE_CHECK(check_dispatch_cached(op, m, x, x_scales, topk_weights, recv_src_metadata, psum_rank, psum_expert,
                                 unaligned, dst_row, token, *recv_x, *recv_x_scales, *recv_topk_weights, *token_out,
                                 num_experts, max_tokens_per_rank, expand, expert_alignment, zero_padding, &sh));
  CudaDeviceGuard g(ordinal);
  DispatchLaunch d;
  JE_CHECK(prepare_dispatch(m, op, g, sh, alloc_id, offset, num_sms, expand, expert_alignment, zero_padding, x,
                            x_scales, topk_weights, token, *recv_x, *recv_x_scales, *recv_topk_weights, *token_out,
                            true, kGraph, &d));
  EpDispatchParams& p = d.p;
  p.h_meta = static_cast<const int32_t*>(recv_src_metadata.untyped_data());
  p.h_psum_rank = static_cast<const int32_t*>(psum_rank.untyped_data());
  p.h_psum_expert = static_cast<const int32_t*>(psum_expert.untyped_data());
  p.h_unaligned = static_cast<const int32_t*>(unaligned.untyped_data());
  p.h_dst_row = static_cast<const int32_t*>(dst_row.untyped_data());
  return launch_dispatch_counted(m, *d.a, p, d.l, stream, launch_ep_dispatch_cached,
                                 "launching the cached dispatch kernel", kGraph);
}

template <bool kGraph>
ffi::Error EpCombineCuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y, ffi::AnyBuffer topk_weights,
                         ffi::AnyBuffer bias0, ffi::AnyBuffer bias1, ffi::AnyBuffer recv_src_metadata,
                         ffi::AnyBuffer dst_row, ffi::AnyBuffer topk_idx, ffi::AnyBuffer psum_rank,
                         ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> combined_x,
                         ffi::Result<ffi::AnyBuffer> combined_topk_weights, ffi::Result<ffi::AnyBuffer> token_out,
                         int64_t ctx_id, int64_t alloc_id, int64_t offset, int64_t num_experts,
                         int64_t max_tokens_per_rank, int64_t expand, int64_t num_sms) {
  constexpr int32_t op = kOpEpCombine;
  MemberScope s(ctx_id, ordinal, op);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  EpShapes sh;
  JE_CHECK(check_combine(op, m, y, topk_weights, bias0, bias1, recv_src_metadata, dst_row, topk_idx, psum_rank, token,
                         *combined_x, *combined_topk_weights, *token_out, num_experts, max_tokens_per_rank, expand,
                         &sh));
  const Common& c = sh.c;
  const int64_t N = sh.N, H = sh.H, K = sh.K, rows = sh.rows, row_bytes = sh.row_bytes;
  const bool has_w = sh.has_w, has_b0 = sh.has_b0, has_b1 = sh.has_b1;
  const auto L = EpCombineLayout::make(c.R, c.M, K, row_bytes, /*push=*/true);
  Allocation* a;
  JE_CHECK(check_region(m, alloc_id, offset, L.total_bytes(), op, &a));
  // Stage warps of 16, measured on 2xH200 at 4096 tokens: non-expand 8 (275 us; 291 at 6, 279 at 10: with fast
  // source-side sums the pushes set the time); expand 14 (720 us; 939 at 10, 804 at 12: the expert side sums ~4
  // rows per pushed row, and that sets the time)
  const EpLaunch l = launch_shape(m, num_sms, expand ? 14 : 8);

  CudaDeviceGuard g(ordinal);
  if (g.status() != cudaSuccess) return cuda_failure(op, "cudaSetDevice", g.status());
  JE_CHECK(note_capture(m, stream, kGraph, op, kCaptureCombine));
  EpCombineParams p;
  JE_CHECK(make_window(m, *a, offset, op, &p.w));
  p.L = L;
  p.M = static_cast<int32_t>(c.M);
  p.N = static_cast<int32_t>(N);
  p.K = static_cast<int32_t>(K);
  p.E = static_cast<int32_t>(c.E);
  p.H = static_cast<int32_t>(H);
  p.expand = expand != 0;
  p.rows = rows;
  p.dtype = y.element_type() == DT::BF16 ? EpDtype::kBF16 : EpDtype::kF32;
  p.y = static_cast<const uint8_t*>(y.untyped_data());
  p.weights = has_w ? static_cast<const float*>(topk_weights.untyped_data()) : nullptr;
  p.bias0 = has_b0 ? static_cast<const uint8_t*>(bias0.untyped_data()) : nullptr;
  p.bias1 = has_b1 ? static_cast<const uint8_t*>(bias1.untyped_data()) : nullptr;
  p.meta = static_cast<const int32_t*>(recv_src_metadata.untyped_data());
  p.dst_row = static_cast<const int32_t*>(dst_row.untyped_data());
  p.topk = static_cast<const int32_t*>(topk_idx.untyped_data());
  p.psum_rank = static_cast<const int32_t*>(psum_rank.untyped_data());
  p.token = static_cast<const int32_t*>(token.untyped_data());
  p.out = static_cast<uint8_t*>(combined_x->untyped_data());
  p.out_w = has_w ? static_cast<float*>(combined_topk_weights->untyped_data()) : nullptr;
  p.token_out = static_cast<int32_t*>(token_out->untyped_data());
  const cudaError_t ce = launch_ep_combine(p, l, stream);
  if (ce != cudaSuccess) return cuda_failure(op, "launching the combine kernel", ce);
  return ffi::Error::Success();
}

}  // namespace

int ep_dispatch_copy_pieces(int64_t ctx_id, int32_t ordinal, int64_t M, int64_t K, int64_t E, int64_t x_bytes,
                            bool /*expand: the policy no longer depends on the layout*/) {
  MemberScope s(ctx_id, ordinal, kOpEpDispatch);
  if (!s.ok() || !s->backend_state) return -1;
  return ce_pieces_for(cuda_state(s.member()), s->nranks, M, K, E, x_bytes);
}

std::vector<int64_t> ep_graph_captures(int64_t ctx_id, int32_t ordinal) {
  MemberScope s(ctx_id, ordinal, kOpEpDispatch);
  if (!s.ok() || !s->backend_state) return {};
  std::vector<int64_t> v;
  for (const auto& c : cuda_state(s.member()).graph_captures) v.push_back(static_cast<int64_t>(c.load(std::memory_order_relaxed)));
  return v;
}

// Context arguments of every handler here: XLA's stream and the device ordinal.
inline auto cuda_context() {
  return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEpDispatchCuda, EpDispatchCuda<false>,
                              bind_ep_dispatch(cuda_context()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEpDispatchCachedCuda, EpDispatchCachedCuda<false>,
                              bind_ep_dispatch_cached(cuda_context()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEpCombineCuda, EpCombineCuda<false>,
                              bind_ep_combine(cuda_context()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEpDispatchGraphCuda, EpDispatchCuda<true>,
                              bind_ep_dispatch(cuda_context()), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEpDispatchCachedGraphCuda, EpDispatchCachedCuda<true>,
                              bind_ep_dispatch_cached(cuda_context()), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEpCombineGraphCuda, EpCombineCuda<true>,
                              bind_ep_combine(cuda_context()), {ffi::Traits::kCmdBufferCompatible});

static HandlerRegistrar reg_dispatch("jax_engram_ep_dispatch", reinterpret_cast<void*>(JeEpDispatchCuda));
static HandlerRegistrar reg_cached("jax_engram_ep_dispatch_cached", reinterpret_cast<void*>(JeEpDispatchCachedCuda));
static HandlerRegistrar reg_combine("jax_engram_ep_combine", reinterpret_cast<void*>(JeEpCombineCuda));
static HandlerRegistrar reg_dispatch_g("jax_engram_ep_dispatch_graph", reinterpret_cast<void*>(JeEpDispatchGraphCuda));
static HandlerRegistrar reg_cached_g("jax_engram_ep_dispatch_cached_graph",
                                     reinterpret_cast<void*>(JeEpDispatchCachedGraphCuda));
static HandlerRegistrar reg_combine_g("jax_engram_ep_combine_graph", reinterpret_cast<void*>(JeEpCombineGraphCuda));

}  // namespace jax_engram
