// CUDA handlers of EP dispatch, cached dispatch, combine, the one-rank guard and row scatter (same target names, operands, results
// and attributes as the CPU handlers in cpu_ep.cc; the shape/dtype validation is shared: validate.h). Binding and
// validation only: the protocol lives in kernels/cuda/ep_dispatch.cu and ep_combine.cu (the guard's check in
// ep_guard.cu), the copy-engine rows and the host's call count in kernels/cuda/ep_copy_engine.cc. Each op is ONE
// kernel launch on XLA's stream, no host synchronisation; errors found on the device (timeouts, bad routing,
// inconsistent handles) are recorded in the member's error record and fail the next op of the context or
// ctx.check(). Sizes are kernel arguments (no recompilation per token count). Tuning comes as attributes
// (jax_engram.EPConfig, decided in Python at trace time, so identical on every rank): copy_pieces and stage_warps;
// this file only checks that the hardware can do them.
//
// Every op has two targets: "jax_engram_ep_<op>" and "jax_engram_ep_<op>_graph" (Context cuda_graphs=True), the
// same code, the latter marked command-buffer compatible so that XLA may capture it into a CUDA graph and replay it
// without running the handler. Graph-target dispatches therefore keep no per-call host state: they run in the
// graph sequence (ep_layout.h EpSequence::kGraph), whose sequence number lives on the device only, and never use
// copy-engine rows (the copy stream's inbox half and flag values come from the host's count of the stream
// sequence's calls). Errors a replayed kernel finds
// are recorded as always; with no handler run to report them they surface at ctx.check() or at the next op of the
// context that runs its handler.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <vector>

#include "handlers/common.h"
#include "handlers/cuda_common.h"
#include "handlers/cuda_ep.h"
#include "handlers/ep_bindings.h"
#include "handlers/validate.h"
#include "jax_engram/ep_layout.h"
#include "kernels/cuda/ep.h"
#include "kernels/cuda/ep_copy_engine.h"
#include "runtime/cuda_member.h"

namespace jax_engram {
namespace {

using namespace validate;

// Graph targets: counts the calls XLA captures into a CUDA graph (CudaMemberState::graph_captures: the tests'
// proof that capture happened; the guard's are not counted). Other targets: refuses capture, which would replay the
// host's copy-engine decisions and counts (XLA never captures a target without the trait; this guards against
// anything else capturing).
enum CaptureKind { kCaptureGuard = -1, kCaptureDispatch = 0, kCaptureCached = 1, kCaptureCombine = 2 };
ffi::Error note_capture(Member& m, cudaStream_t stream, bool graph_target, int32_t op, CaptureKind kind) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(stream, &cs);
  if (e != cudaSuccess) return cuda_failure(op, "cudaStreamIsCapturing", e);
  if (cs != cudaStreamCaptureStatusActive) return ffi::Error::Success();
  if (!graph_target)
    return op_error(op, "this call is being captured into a CUDA graph, but only the graph targets (Context "
                        "cuda_graphs=True) may be", ffi::ErrorCode::kFailedPrecondition);
  if (kind != kCaptureGuard) cuda_state(m).graph_captures[kind].fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

constexpr int kDefaultSms = 24;  // the SM budget the kernels are tuned for (DeepEP's 24-SM configuration)

// Grid size and warp split. num_sms = 0: kDefaultSms; always capped at the device's SMs and kEpMaxCtas.
// stage_warps = 0: the path's default (validated in Python: 0 or [1, kEpMaxStageWarps]).
ffi::Error launch_shape(Member& m, int32_t op, int64_t num_sms, int64_t stage_warps, int default_stage_warps,
                        EpLaunch* l) {
  if (stage_warps < 0 || stage_warps > kEpMaxStageWarps)
    return op_error(op, "stage_warps=" + std::to_string(stage_warps) + " must be 0 (default) or in [1, " +
                            std::to_string(kEpMaxStageWarps) + "]");
  const int sms = m.backend_state ? cuda_state(m).sm_count : 0;
  int g = num_sms > 0 ? static_cast<int>(std::min<int64_t>(num_sms, 1 << 20)) : kDefaultSms;
  if (sms > 0) g = std::min(g, sms);
  l->num_ctas = std::max(1, std::min(g, kEpMaxCtas));
  l->stage_warps = stage_warps > 0 ? static_cast<int>(stage_warps) : default_stage_warps;
  return ffi::Error::Success();
}

// Window + staging region of the member; the device must be current (CudaDeviceGuard).
ffi::Error make_window(Member& m, Allocation& st, int64_t offset, int32_t op, EpWindow* w) {
  if (!m.backend_state) return op_error(op, "member has no CUDA state", ffi::ErrorCode::kFailedPrecondition);
  Allocation* win = m.alloc(0);
  if (!win || !win->peers_device || !st.peers_device)
    return op_error(op, "the context window is not connected on this device", ffi::ErrorCode::kFailedPrecondition);
  for (auto* p : win->peers)
    if (!p) return op_error(op, kPeerUnreachable, ffi::ErrorCode::kUnimplemented);
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

// Launches one dispatch-type kernel. Graph targets (the graph sequence): the launch alone (no count, no copy-engine
// rows). Other targets (the stream sequence): kernels/cuda/ep_copy_engine.cc counts the call and adds the
// copy-engine rows when p.ce_pieces > 0.
ffi::Error launch_dispatch(Member& m, const Allocation& sa, EpDispatchParams& p, const EpLaunch& l, cudaStream_t stream,
                           EpDispatchLauncher launch, const char* what, bool graph) {
  constexpr int32_t op = kOpEpDispatch;
  JE_CHECK(note_capture(m, stream, graph, op, p.h_meta ? kCaptureCached : kCaptureDispatch));
  if (graph) {
    p.sequence = EpSequence::kGraph;
    p.ce_seq = 0;
    const cudaError_t e = launch(p, l, stream);
    return e == cudaSuccess ? ffi::Error::Success() : cuda_failure(op, what, e);
  }
  const std::string err = ep_run_dispatch_stream(m, sa, p, l, stream, launch, what);
  return err.empty() ? ffi::Error::Success() : op_error(op, err, ffi::ErrorCode::kInternal);
}

// What the full and the cached dispatch share once their buffers are validated: the staging region, the copy-engine
// check and launch shape, the window, the config, and the operands / results both have. The caller fills the
// rest. `g` (the caller's, alive until the launch) has selected the device. `cached`: the cached dispatch.
// Default stage warps: 6 for SM stores. With copy-engine rows a full dispatch's stage warps push nothing (the
// receivers lay out the peers' tokens), so one of 16 (it writes dst_row and publishes ready) and the other 15 copy
// rows; the cached dispatch's still push the weights / scales rows (4).
struct DispatchLaunch {
  EpDispatchParams p;
  EpLaunch l;
  Allocation* a = nullptr;
};
ffi::Error prepare_dispatch(Member& m, int32_t op, const CudaDeviceGuard& g, const EpShapes& sh,
                            const EpDispatchAttrs& at, const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_scales,
                            const ffi::AnyBuffer& topk_weights, const ffi::AnyBuffer& token,
                            const ffi::AnyBuffer& recv_x, const ffi::AnyBuffer& recv_x_scales,
                            const ffi::AnyBuffer& recv_topk_weights, const ffi::AnyBuffer& token_out, bool cached,
                            bool graph, DispatchLaunch* d) {
  const Common& c = sh.c;
  const auto L = EpDispatchLayout::make(c.R, c.M, sh.K, c.E, sh.row_bytes, sh.P, /*push=*/true);
  JE_CHECK(check_region(m, at.alloc_id, at.offset, L.total_bytes(), op, &d->a));
  if (!m.backend_state) return op_error(op, "member has no CUDA state", ffi::ErrorCode::kFailedPrecondition);
  // The copy-engine choice was made in Python (ctx.dispatch_path): here only what the hardware and the target allow.
  const int64_t ce = at.copy_pieces;
  if (ce < 0 || ce > kEpCeMaxPieces)
    return op_error(op, "copy_pieces=" + std::to_string(ce) + " must be in [0, " + std::to_string(kEpCeMaxPieces) +
                            "]");
  if (ce > 0 && graph)
    return op_error(op, "copy-engine rows cannot run on a graph target (they need the handler on every call)",
                    ffi::ErrorCode::kFailedPrecondition);
  if (ce > 0 && !ep_ce_available(cuda_state(m), c.R, sh.K, c.E, sh.row_bytes))
    return op_error(op, "copy-engine rows were requested, but this device or config cannot use them (stream "
                        "memory operations, 16-byte rows, ranks + local experts)", ffi::ErrorCode::kFailedPrecondition);
  JE_CHECK(launch_shape(m, op, at.num_sms, at.stage_warps, ce ? (cached ? 4 : 1) : 6, &d->l));
  if (g.status() != cudaSuccess) return cuda_failure(op, "cudaSetDevice", g.status());
  EpDispatchParams& p = d->p;
  JE_CHECK(make_window(m, *d->a, at.offset, op, &p.w));
  p.L = L;
  p.M = static_cast<int32_t>(c.M);
  p.N = static_cast<int32_t>(sh.N);
  p.K = static_cast<int32_t>(sh.K);
  p.E = static_cast<int32_t>(c.E);
  p.A = static_cast<int32_t>(at.expert_alignment);
  p.expand = at.expand != 0;
  p.zero_padding = at.zero_padding != 0;
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
  p.ce_pieces = static_cast<int32_t>(ce);
  p.ce_taper = ep_ce_taper(p.ce_pieces);
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
                          EpDispatchAttrs at) {
  constexpr int32_t op = kOpEpDispatch;
  MemberScope s(at.ctx_id, ordinal, op);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  EpShapes sh;  // the kernel copies the token (CTA 0)
  JE_CHECK(check_dispatch(op, m, x, x_scales, topk_idx, topk_weights, token, *recv_x, *recv_x_scales, *recv_topk_idx,
                          *recv_topk_weights, *psum_rank, *psum_expert, *unaligned, *recv_src_metadata, *dst_row,
                          *num_recv_tokens, *group_sizes, *token_out, at, &sh));
  CudaDeviceGuard g(ordinal);
  DispatchLaunch d;
  JE_CHECK(prepare_dispatch(m, op, g, sh, at, x, x_scales, topk_weights, token, *recv_x, *recv_x_scales,
                            *recv_topk_weights, *token_out, false, kGraph, &d));
  if (ep_dispatch_smem_bytes(sh.c.R, sh.c.E, d.p.ce_pieces > 0, nullptr, nullptr) < 0)
    return op_error(op, "ranks + experts = " + std::to_string(sh.c.R + sh.c.E) +
                            " is too large for the layout kernel");
  EpDispatchParams& p = d.p;
  p.topk = static_cast<const int32_t*>(topk_idx.untyped_data());
  p.recv_topk = at.expand ? nullptr : static_cast<int32_t*>(recv_topk_idx->untyped_data());
  p.psum_rank = static_cast<int32_t*>(psum_rank->untyped_data());
  p.psum_expert = static_cast<int32_t*>(psum_expert->untyped_data());
  p.unaligned = static_cast<int32_t*>(unaligned->untyped_data());
  p.meta = static_cast<int32_t*>(recv_src_metadata->untyped_data());
  p.dst_row = static_cast<int32_t*>(dst_row->untyped_data());
  p.num_recv = static_cast<int32_t*>(num_recv_tokens->untyped_data());
  p.group_sizes = static_cast<int32_t*>(group_sizes->untyped_data());
  return launch_dispatch(m, *d.a, p, d.l, stream, launch_ep_dispatch, "launching the dispatch kernel", kGraph);
}

template <bool kGraph>
ffi::Error EpDispatchCachedCuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer x_scales,
                                ffi::AnyBuffer topk_weights, ffi::AnyBuffer recv_src_metadata,
                                ffi::AnyBuffer psum_rank, ffi::AnyBuffer psum_expert, ffi::AnyBuffer unaligned,
                                ffi::AnyBuffer dst_row, ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> recv_x,
                                ffi::Result<ffi::AnyBuffer> recv_x_scales,
                                ffi::Result<ffi::AnyBuffer> recv_topk_weights, ffi::Result<ffi::AnyBuffer> token_out,
                                EpDispatchAttrs at) {
  constexpr int32_t op = kOpEpDispatch;
  MemberScope s(at.ctx_id, ordinal, op);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  EpShapes sh;
  JE_CHECK(check_dispatch_cached(op, m, x, x_scales, topk_weights, recv_src_metadata, psum_rank, psum_expert,
                                 unaligned, dst_row, token, *recv_x, *recv_x_scales, *recv_topk_weights, *token_out,
                                 at, &sh));
  CudaDeviceGuard g(ordinal);
  DispatchLaunch d;
  JE_CHECK(prepare_dispatch(m, op, g, sh, at, x, x_scales, topk_weights, token, *recv_x, *recv_x_scales,
                            *recv_topk_weights, *token_out, true, kGraph, &d));
  EpDispatchParams& p = d.p;
  p.h_meta = static_cast<const int32_t*>(recv_src_metadata.untyped_data());
  p.h_psum_rank = static_cast<const int32_t*>(psum_rank.untyped_data());
  p.h_psum_expert = static_cast<const int32_t*>(psum_expert.untyped_data());
  p.h_unaligned = static_cast<const int32_t*>(unaligned.untyped_data());
  p.h_dst_row = static_cast<const int32_t*>(dst_row.untyped_data());
  return launch_dispatch(m, *d.a, p, d.l, stream, launch_ep_dispatch_cached, "launching the cached dispatch kernel",
                         kGraph);
}

template <bool kGraph>
ffi::Error EpCombineCuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y, ffi::AnyBuffer topk_weights,
                         ffi::AnyBuffer bias0, ffi::AnyBuffer bias1, ffi::AnyBuffer recv_src_metadata,
                         ffi::AnyBuffer dst_row, ffi::AnyBuffer topk_idx, ffi::AnyBuffer psum_rank,
                         ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> combined_x,
                         ffi::Result<ffi::AnyBuffer> combined_topk_weights, ffi::Result<ffi::AnyBuffer> token_out,
                         EpCombineAttrs at) {
  constexpr int32_t op = kOpEpCombine;
  MemberScope s(at.ctx_id, ordinal, op);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  EpShapes sh;
  JE_CHECK(check_combine(op, m, y, topk_weights, bias0, bias1, recv_src_metadata, dst_row, topk_idx, psum_rank, token,
                         *combined_x, *combined_topk_weights, *token_out, at, &sh));
  const Common& c = sh.c;
  const int64_t N = sh.N, H = sh.H, K = sh.K, rows = sh.rows, row_bytes = sh.row_bytes;
  const bool has_w = sh.has_w, has_b0 = sh.has_b0, has_b1 = sh.has_b1;
  const auto L = EpCombineLayout::make(c.R, c.M, K, row_bytes, /*push=*/true);
  Allocation* a;
  JE_CHECK(check_region(m, at.alloc_id, at.offset, L.total_bytes(), op, &a));
  // Default stage warps of 16: non-expand 8 (with fast source-side sums the pushes set the time); expand 14 (the
  // expert side sums several rows per pushed row, and that sets the time).
  EpLaunch l;
  JE_CHECK(launch_shape(m, op, at.num_sms, at.stage_warps, at.expand ? 14 : 8, &l));

  CudaDeviceGuard g(ordinal);
  if (g.status() != cudaSuccess) return cuda_failure(op, "cudaSetDevice", g.status());
  JE_CHECK(note_capture(m, stream, kGraph, op, kCaptureCombine));
  EpCombineParams p;
  JE_CHECK(make_window(m, *a, at.offset, op, &p.w));
  p.L = L;
  p.M = static_cast<int32_t>(c.M);
  p.N = static_cast<int32_t>(N);
  p.K = static_cast<int32_t>(K);
  p.E = static_cast<int32_t>(c.E);
  p.H = static_cast<int32_t>(H);
  p.expand = at.expand != 0;
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

// The one-rank local path's guard (jax_engram/_ep_local.py): refuses a closed or failed context as every EP handler
// does, and launches the dispatch's routing check (kernels/cuda/ep_guard.cu), which copies topk_idx to topk_out and
// records a bad entry as the dispatch kernel does (the next op or ctx.check() reports it). The token passes on: XLA
// aliases token_out to token, so a guard with no routing to check launches nothing (the graph target still launches
// the kernel, so that a capture always records a node).
template <bool kGraph>
ffi::Error EpGuardCuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer token, ffi::AnyBuffer topk_idx,
                       ffi::Result<ffi::AnyBuffer> token_out, ffi::Result<ffi::AnyBuffer> topk_out,
                       EpGuardAttrs at) {
  int32_t op;
  JE_CHECK(guard_op(at, &op));
  MemberScope s(at.ctx_id, ordinal, op);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  JE_CHECK(check_guard(op, token, topk_idx, *token_out, *topk_out, at));
  EpGuardParams p;
  p.topk = static_cast<const int32_t*>(topk_idx.untyped_data());
  p.topk_out = static_cast<int32_t*>(topk_out->untyped_data());
  p.N = topk_idx.dimensions()[0];
  p.K = static_cast<int32_t>(topk_idx.dimensions()[1]);
  p.E = static_cast<int32_t>(at.num_experts);
  p.token = static_cast<const int32_t*>(token.untyped_data());
  p.token_out = static_cast<int32_t*>(token_out->untyped_data());
  p.err = m.error_device;
  p.rank = m.rank;
  p.records = static_cast<int32_t>(at.records);
  CudaDeviceGuard g(ordinal);
  if (g.status() != cudaSuccess) return cuda_failure(op, "cudaSetDevice", g.status());
  JE_CHECK(note_capture(m, stream, kGraph, op, kCaptureGuard));
  if (at.records == 2) {  // validate_routing=True: the records are read back here (a host sync), then refused
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &cs) == cudaSuccess && cs == cudaStreamCaptureStatusActive)
      return op_error(op, "dispatch(validate_routing=True) reads the routing on the host before anything is sent, "
                          "which a captured CUDA graph cannot do: leave validate_routing off inside graphs",
                      ffi::ErrorCode::kFailedPrecondition);
    std::vector<int32_t> rec(static_cast<size_t>(p.N) * 3);
    cudaError_t e = cudaMemcpyAsync(rec.data(), p.topk, rec.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    if (e != cudaSuccess) return cuda_failure(op, "reading the routing records (validate_routing=True)", e);
    JE_CHECK(refuse_routing(m, rec.data(), p.N - 1, at.num_experts));
    p.records = 1;  // fine: the records kernel copies them (and finds nothing to record)
  }
  if (!kGraph && (p.N == 0 || p.K == 0) && p.token_out == p.token) return ffi::Error::Success();
  const cudaError_t e = launch_ep_guard(p, stream);
  if (e != cudaSuccess) return cuda_failure(op, "launching the guard kernel", e);
  return ffi::Error::Success();
}

// The one-rank local path's row scatter (expand layout; kernels/cuda/ep_local.cu): stateless (no context state, no
// host state per call: the same code serves capture), after the guard that checked the context and the routing.
ffi::Error EpLocalScatterCuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer dest,
                              ffi::AnyBuffer src, ffi::Result<ffi::AnyBuffer> out, int64_t ctx_id) {
  (void)ctx_id;
  JE_CHECK(check_local_scatter(kOpEpDispatch, x, dest, src, *out));
  EpLocalScatterParams p;
  p.x = static_cast<const uint8_t*>(x.untyped_data());
  p.dest = static_cast<const int32_t*>(dest.untyped_data());
  p.src = static_cast<const int32_t*>(src.untyped_data());
  p.out = static_cast<uint8_t*>(out->untyped_data());
  p.N = x.dimensions()[0];
  p.K = static_cast<int32_t>(dest.dimensions()[1]);
  p.rows = src.dimensions()[0];
  p.row_bytes = x.dimensions()[1] * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  CudaDeviceGuard g(ordinal);
  if (g.status() != cudaSuccess) return cuda_failure(kOpEpDispatch, "cudaSetDevice", g.status());
  const cudaError_t e = launch_ep_local_scatter(p, stream);
  if (e != cudaSuccess) return cuda_failure(kOpEpDispatch, "launching the local row scatter", e);
  return ffi::Error::Success();
}

// The one-rank local path's expand dispatch (kernels/cuda/ep_local.cu),
// which is also its own guard: refuses a closed or failed context as the guard's handler does, and its kernel
// records the routing's first bad entry as the guard's kernel does (the next op or ctx.check() reports it). kGraph:
// the target XLA may capture in a CUDA graph (cuda_graphs=True), as the guard's.
template <bool kGraph>
ffi::Error EpLocalDispatchCuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer token, ffi::AnyBuffer topk,
                               ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> token_out,
                               ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_w,
                               ffi::Result<ffi::AnyBuffer> exp_row, ffi::Result<ffi::AnyBuffer> src_entry,
                               ffi::Result<ffi::AnyBuffer> src_tok, ffi::Result<ffi::AnyBuffer> count,
                               ffi::Result<ffi::AnyBuffer> aligned, ffi::Result<ffi::AnyBuffer> psum_expert,
                               ffi::Result<ffi::AnyBuffer> meta, ffi::Result<ffi::AnyBuffer> dst_row,
                               ffi::Result<ffi::AnyBuffer> num_recv, ffi::Result<ffi::AnyBuffer> scratch, int64_t ctx_id,
                               int64_t alignment) {
  MemberScope s(ctx_id, ordinal, kOpEpDispatch);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  LocalLayoutShape sh;
  JE_CHECK(check_local_dispatch(kOpEpDispatch, token, *token_out, topk, x, w, *recv_x, *recv_w, *exp_row, *src_entry,
                                *src_tok, *count, *aligned, *psum_expert, *meta, *dst_row, *num_recv, *scratch,
                                alignment, &sh));
  const auto i32 = [](ffi::Result<ffi::AnyBuffer>& b) { return static_cast<int32_t*>(b->untyped_data()); };
  EpLocalDispatchParams p;
  p.topk = static_cast<const int32_t*>(topk.untyped_data());
  p.token = static_cast<const int32_t*>(token.untyped_data());
  p.token_out = i32(token_out);
  p.err = m.error_device;
  p.rank = m.rank;
  p.N = static_cast<int32_t>(sh.N), p.K = static_cast<int32_t>(sh.K), p.E = static_cast<int32_t>(sh.E);
  p.A = static_cast<int32_t>(alignment), p.M = static_cast<int32_t>(sh.M), p.rows = static_cast<int32_t>(sh.rows);
  p.row_bytes = x.dimensions()[1] * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  p.x = static_cast<const uint8_t*>(x.untyped_data());
  p.recv_x = static_cast<uint8_t*>(recv_x->untyped_data());
  if (w.element_count() != 0) {
    p.w = static_cast<const uint32_t*>(w.untyped_data());
    p.recv_w = static_cast<uint32_t*>(recv_w->untyped_data());
  }
  p.exp_row = i32(exp_row), p.src_entry = i32(src_entry), p.src_tok = i32(src_tok), p.count = i32(count);
  p.aligned = i32(aligned), p.psum_expert = i32(psum_expert), p.meta = i32(meta), p.dst_row = i32(dst_row);
  p.num_recv = i32(num_recv);
  p.scratch = i32(scratch);
  p.scratch_words = scratch->element_count();
  CudaDeviceGuard g(ordinal);
  if (g.status() != cudaSuccess) return cuda_failure(kOpEpDispatch, "cudaSetDevice", g.status());
  JE_CHECK(note_capture(m, stream, kGraph, kOpEpDispatch, kCaptureGuard));
  const cudaError_t e = launch_ep_local_dispatch(p, stream);
  if (e != cudaSuccess) return cuda_failure(kOpEpDispatch, "launching the local dispatch kernel", e);
  return ffi::Error::Success();
}

}  // namespace

int ep_dispatch_copy_pieces(int64_t ctx_id, int32_t ordinal, int64_t M, int64_t K, int64_t E, int64_t x_bytes,
                            int32_t mode, int32_t pieces) {
  MemberScope s(ctx_id, ordinal, kOpEpDispatch);
  if (!s.ok() || !s->backend_state) return -1;
  return ep_ce_policy(cuda_state(s.member()), s->nranks, M, K, E, x_bytes, mode, pieces);
}

std::vector<int64_t> ep_graph_captures(int64_t ctx_id, int32_t ordinal) {
  MemberScope s(ctx_id, ordinal, kOpEpDispatch);
  if (!s.ok() || !s->backend_state) return {};
  std::vector<int64_t> v;
  for (const auto& c : cuda_state(s.member()).graph_captures) v.push_back(static_cast<int64_t>(c.load(std::memory_order_relaxed)));
  return v;
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEpGuardCuda, EpGuardCuda<false>,
                              bind_ep_guard(cuda_context()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEpGuardGraphCuda, EpGuardCuda<true>,
                              bind_ep_guard(cuda_context()), {ffi::Traits::kCmdBufferCompatible});
// One target: the scatter keeps no state, so XLA may capture it in a CUDA graph whatever the context's setting.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEpLocalScatterCuda, EpLocalScatterCuda,
                              bind_ep_local_scatter(cuda_context()), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEpLocalDispatchCuda, EpLocalDispatchCuda<false>,
                              bind_ep_local_dispatch(cuda_context()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEpLocalDispatchGraphCuda, EpLocalDispatchCuda<true>,
                              bind_ep_local_dispatch(cuda_context()), {ffi::Traits::kCmdBufferCompatible});

static HandlerRegistrar reg_dispatch("jax_engram_ep_dispatch", reinterpret_cast<void*>(JeEpDispatchCuda));
static HandlerRegistrar reg_cached("jax_engram_ep_dispatch_cached", reinterpret_cast<void*>(JeEpDispatchCachedCuda));
static HandlerRegistrar reg_combine("jax_engram_ep_combine", reinterpret_cast<void*>(JeEpCombineCuda));
static HandlerRegistrar reg_dispatch_g("jax_engram_ep_dispatch_graph", reinterpret_cast<void*>(JeEpDispatchGraphCuda));
static HandlerRegistrar reg_cached_g("jax_engram_ep_dispatch_cached_graph",
                                     reinterpret_cast<void*>(JeEpDispatchCachedGraphCuda));
static HandlerRegistrar reg_combine_g("jax_engram_ep_combine_graph", reinterpret_cast<void*>(JeEpCombineGraphCuda));
static HandlerRegistrar reg_guard("jax_engram_ep_guard", reinterpret_cast<void*>(JeEpGuardCuda));
static HandlerRegistrar reg_guard_g("jax_engram_ep_guard_graph", reinterpret_cast<void*>(JeEpGuardGraphCuda));
static HandlerRegistrar reg_local_scatter("jax_engram_ep_local_scatter", reinterpret_cast<void*>(JeEpLocalScatterCuda));
static HandlerRegistrar reg_local_dispatch("jax_engram_ep_local_dispatch",
                                           reinterpret_cast<void*>(JeEpLocalDispatchCuda));
static HandlerRegistrar reg_local_dispatch_g("jax_engram_ep_local_dispatch_graph",
                                             reinterpret_cast<void*>(JeEpLocalDispatchGraphCuda));

}  // namespace jax_engram
