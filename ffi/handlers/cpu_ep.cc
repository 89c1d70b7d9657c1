// CPU handlers of EP dispatch, cached dispatch, combine, the one-rank guard and row scatter: FFI binding and validation only; the
// protocol lives in kernels/cpu/ep.cc. Every shape/dtype error names the argument.
#include <cstring>
#include <initializer_list>
#include <string>

#include "handlers/common.h"
#include "handlers/ep_bindings.h"
#include "handlers/validate.h"
#include "jax_engram/ep_layout.h"
#include "kernels/cpu/ep.h"

namespace jax_engram {
namespace {

using namespace validate;

// After a kernel failed: EP input errors get a message naming the rank, token and value.
ffi::Error finish(MemberScope& s, int64_t num_experts) {
  const ErrorRecord& e = *s->error_host;
  if (e.code == kErrBadInput)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, describe_error(s.member(), e, num_experts));
  return s.check_recorded();
}

// The backends copy the token's 4 bytes (validate.h check_token); here, on the host. A call that aliases token_out
// to token (the guard's) has nothing to copy.
void copy_token(const ffi::AnyBuffer& token, ffi::AnyBuffer token_out) {
  if (token_out.untyped_data() != token.untyped_data())
    std::memcpy(token_out.untyped_data(), token.untyped_data(), 4);
}

// Copy-engine rows are a CUDA path: Python never asks for them on CPU.
ffi::Error check_no_copy_engine(int32_t op, const EpDispatchAttrs& at) {
  if (at.copy_pieces != 0)
    return op_error(op, "copy_pieces=" + std::to_string(at.copy_pieces) + ": the CPU backend has no copy-engine path");
  return ffi::Error::Success();
}

// The staging region of a dispatch (full or cached) of these sizes.
ffi::Error dispatch_region(Member& m, int32_t op, const EpShapes& sh, int64_t alloc_id, int64_t offset,
                           Allocation** a) {
  const auto L = EpDispatchLayout::make(sh.c.R, sh.c.M, sh.K, sh.c.E, sh.row_bytes, sh.P);
  return check_region(m, alloc_id, offset, L.total_bytes(), op, a);
}

// The fields the full and the cached dispatch's arguments share (cpu::EpDispatchArgs, cpu::EpCachedArgs).
template <typename Args>
void dispatch_args(const EpShapes& sh, int64_t A, int64_t expand, const ffi::AnyBuffer& x,
                   const ffi::AnyBuffer& x_scales, const ffi::AnyBuffer& topk_weights, ffi::AnyBuffer recv_x,
                   ffi::AnyBuffer recv_x_scales, ffi::AnyBuffer recv_topk_weights, Args* args) {
  args->c = cpu::EpConfig{sh.c.M, sh.N, sh.K, sh.c.E, A, expand != 0, sh.c.rows};
  args->x = static_cast<const uint8_t*>(x.untyped_data());
  args->x_bytes = sh.row_bytes;
  args->sf = static_cast<const uint8_t*>(x_scales.untyped_data());
  args->sf_bytes = sh.P * 4;
  args->w = sh.has_w ? static_cast<const float*>(topk_weights.untyped_data()) : nullptr;
  args->recv_x = static_cast<uint8_t*>(recv_x.untyped_data());
  args->recv_sf = static_cast<uint8_t*>(recv_x_scales.untyped_data());
  args->recv_w = sh.has_w ? static_cast<float*>(recv_topk_weights.untyped_data()) : nullptr;
}

ffi::Error EpDispatchCpu(int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer x_scales, ffi::AnyBuffer topk_idx,
                         ffi::AnyBuffer topk_weights, ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> recv_x,
                         ffi::Result<ffi::AnyBuffer> recv_x_scales, ffi::Result<ffi::AnyBuffer> recv_topk_idx,
                         ffi::Result<ffi::AnyBuffer> recv_topk_weights, ffi::Result<ffi::AnyBuffer> psum_rank,
                         ffi::Result<ffi::AnyBuffer> psum_expert, ffi::Result<ffi::AnyBuffer> unaligned,
                         ffi::Result<ffi::AnyBuffer> recv_src_metadata, ffi::Result<ffi::AnyBuffer> dst_row,
                         ffi::Result<ffi::AnyBuffer> num_recv_tokens, ffi::Result<ffi::AnyBuffer> group_sizes,
                         ffi::Result<ffi::AnyBuffer> token_out, EpDispatchAttrs at) {
  constexpr int32_t op = kOpEpDispatch;
  const int64_t alloc_id = at.alloc_id, offset = at.offset, num_experts = at.num_experts, expand = at.expand,
                expert_alignment = at.expert_alignment;
  MemberScope s(at.ctx_id, ordinal, op);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  JE_CHECK(check_no_copy_engine(op, at));
  EpShapes sh;
  JE_CHECK(check_dispatch(op, m, x, x_scales, topk_idx, topk_weights, token, *recv_x, *recv_x_scales, *recv_topk_idx,
                          *recv_topk_weights, *psum_rank, *psum_expert, *unaligned, *recv_src_metadata, *dst_row,
                          *num_recv_tokens, *group_sizes, *token_out, at, &sh));
  copy_token(token, *token_out);
  Allocation* a;
  JE_CHECK(dispatch_region(m, op, sh, alloc_id, offset, &a));
  cpu::EpDispatchArgs args;
  dispatch_args(sh, expert_alignment, expand, x, x_scales, topk_weights, *recv_x, *recv_x_scales, *recv_topk_weights,
                &args);
  args.topk = static_cast<const int32_t*>(topk_idx.untyped_data());
  args.recv_topk = expand ? nullptr : static_cast<int32_t*>(recv_topk_idx->untyped_data());
  args.psum_rank = static_cast<int32_t*>(psum_rank->untyped_data());
  args.psum_expert = static_cast<int32_t*>(psum_expert->untyped_data());
  args.unaligned = static_cast<int32_t*>(unaligned->untyped_data());
  args.meta = static_cast<int32_t*>(recv_src_metadata->untyped_data());
  args.dst_row = static_cast<int32_t*>(dst_row->untyped_data());
  args.num_recv = static_cast<int32_t*>(num_recv_tokens->untyped_data());
  args.group_sizes = static_cast<int32_t*>(group_sizes->untyped_data());
  if (!cpu::ep_dispatch(m, *a, static_cast<uint64_t>(offset), args)) return finish(s, num_experts);
  return s.check_recorded();
}

ffi::Error EpDispatchCachedCpu(int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer x_scales,
                               ffi::AnyBuffer topk_weights, ffi::AnyBuffer recv_src_metadata, ffi::AnyBuffer psum_rank,
                               ffi::AnyBuffer psum_expert, ffi::AnyBuffer unaligned, ffi::AnyBuffer dst_row,
                               ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> recv_x,
                               ffi::Result<ffi::AnyBuffer> recv_x_scales,
                               ffi::Result<ffi::AnyBuffer> recv_topk_weights, ffi::Result<ffi::AnyBuffer> token_out,
                               EpDispatchAttrs at) {
  constexpr int32_t op = kOpEpDispatch;  // zero_padding: the CPU backend zeroes every row it does not write
  const int64_t alloc_id = at.alloc_id, offset = at.offset, num_experts = at.num_experts, expand = at.expand,
                expert_alignment = at.expert_alignment;
  MemberScope s(at.ctx_id, ordinal, op);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  JE_CHECK(check_no_copy_engine(op, at));
  EpShapes sh;
  JE_CHECK(check_dispatch_cached(op, m, x, x_scales, topk_weights, recv_src_metadata, psum_rank, psum_expert,
                                 unaligned, dst_row, token, *recv_x, *recv_x_scales, *recv_topk_weights, *token_out,
                                 at, &sh));
  copy_token(token, *token_out);
  Allocation* a;
  JE_CHECK(dispatch_region(m, op, sh, alloc_id, offset, &a));
  cpu::EpCachedArgs args;
  dispatch_args(sh, expert_alignment, expand, x, x_scales, topk_weights, *recv_x, *recv_x_scales, *recv_topk_weights,
                &args);
  args.meta = static_cast<const int32_t*>(recv_src_metadata.untyped_data());
  args.psum_rank = static_cast<const int32_t*>(psum_rank.untyped_data());
  args.psum_expert = static_cast<const int32_t*>(psum_expert.untyped_data());
  args.unaligned = static_cast<const int32_t*>(unaligned.untyped_data());
  if (!cpu::ep_dispatch_cached(m, *a, static_cast<uint64_t>(offset), args)) return finish(s, num_experts);
  return s.check_recorded();
}

ffi::Error EpCombineCpu(int32_t ordinal, ffi::AnyBuffer y, ffi::AnyBuffer topk_weights, ffi::AnyBuffer bias0,
                        ffi::AnyBuffer bias1, ffi::AnyBuffer recv_src_metadata, ffi::AnyBuffer dst_row,
                        ffi::AnyBuffer topk_idx, ffi::AnyBuffer psum_rank, ffi::AnyBuffer token,
                        ffi::Result<ffi::AnyBuffer> combined_x, ffi::Result<ffi::AnyBuffer> combined_topk_weights,
                        ffi::Result<ffi::AnyBuffer> token_out, EpCombineAttrs at) {
  constexpr int32_t op = kOpEpCombine;
  const int64_t num_experts = at.num_experts, expand = at.expand;
  MemberScope s(at.ctx_id, ordinal, op);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  EpShapes sh;
  JE_CHECK(check_combine(op, m, y, topk_weights, bias0, bias1, recv_src_metadata, dst_row, topk_idx, psum_rank, token,
                         *combined_x, *combined_topk_weights, *token_out, at, &sh));
  copy_token(token, *token_out);
  const Common& c = sh.c;
  const int64_t N = sh.N, H = sh.H, K = sh.K, rows = sh.rows, row_bytes = sh.row_bytes;
  const bool has_w = sh.has_w, has_b0 = sh.has_b0, has_b1 = sh.has_b1;
  const auto L = EpCombineLayout::make(c.R, c.M, K, row_bytes);
  Allocation* a;
  JE_CHECK(check_region(m, at.alloc_id, at.offset, L.total_bytes(), op, &a));

  cpu::EpCombineArgs args;
  args.c = cpu::EpConfig{c.M, N, K, c.E, 1, expand != 0, rows};
  args.dtype = y.element_type() == DT::BF16 ? cpu::EpFloat::kBF16 : cpu::EpFloat::kF32;
  args.H = H;
  args.y = static_cast<const uint8_t*>(y.untyped_data());
  args.w = has_w ? static_cast<const float*>(topk_weights.untyped_data()) : nullptr;
  args.bias0 = has_b0 ? static_cast<const uint8_t*>(bias0.untyped_data()) : nullptr;
  args.bias1 = has_b1 ? static_cast<const uint8_t*>(bias1.untyped_data()) : nullptr;
  args.meta = static_cast<const int32_t*>(recv_src_metadata.untyped_data());
  args.dst_row = static_cast<const int32_t*>(dst_row.untyped_data());
  args.topk = static_cast<const int32_t*>(topk_idx.untyped_data());
  args.psum_rank = static_cast<const int32_t*>(psum_rank.untyped_data());
  args.out = static_cast<uint8_t*>(combined_x->untyped_data());
  args.out_w = has_w ? static_cast<float*>(combined_topk_weights->untyped_data()) : nullptr;
  if (!cpu::ep_combine(m, *a, static_cast<uint64_t>(at.offset), args)) return finish(s, num_experts);
  return s.check_recorded();
}

// The one-rank local path's guard (jax_engram/_ep_local.py): refuses a closed or failed context as every EP handler
// does, copies topk_idx to topk_out and checks it as the dispatch does, failing with the dispatch's error (recorded
// the same way: the context is then unusable), and passes the token on.
ffi::Error EpGuardCpu(int32_t ordinal, ffi::AnyBuffer token, ffi::AnyBuffer topk_idx,
                      ffi::Result<ffi::AnyBuffer> token_out, ffi::Result<ffi::AnyBuffer> topk_out,
                      EpGuardAttrs at) {
  int32_t op;
  JE_CHECK(guard_op(at, &op));
  MemberScope s(at.ctx_id, ordinal, op);
  if (!s.ok()) return s.error();
  JE_CHECK(check_guard(op, token, topk_idx, *token_out, *topk_out, at));
  copy_token(token, *token_out);
  const int64_t N = topk_idx.dimensions()[0], K = topk_idx.dimensions()[1];
  if (N * K) std::memcpy(topk_out->untyped_data(), topk_idx.untyped_data(), sizeof(int32_t) * N * K);
  const auto* topk = static_cast<const int32_t*>(topk_idx.untyped_data());
  if (at.records == 2) return refuse_routing(s.member(), topk, N - 1, at.num_experts);
  if (at.records ? !cpu::ep_guard_records(s.member(), topk, N - 1) : !cpu::ep_guard(s.member(), topk, N, K, at.num_experts))
    return finish(s, at.num_experts);
  return s.check_recorded();
}

// The one-rank local path's row scatter (expand layout; kernels/cpu/ep.cc ep_local_scatter): stateless, after the
// guard that checked the context and the routing.
ffi::Error EpLocalScatterCpu(int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer dest, ffi::AnyBuffer src,
                             ffi::Result<ffi::AnyBuffer> out, int64_t ctx_id) {
  (void)ordinal;
  (void)ctx_id;
  JE_CHECK(check_local_scatter(kOpEpDispatch, x, dest, src, *out));
  const int64_t N = x.dimensions()[0], K = dest.dimensions()[1], rows = src.dimensions()[0];
  const int64_t row_bytes = x.dimensions()[1] * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  cpu::ep_local_scatter(static_cast<const uint8_t*>(x.untyped_data()), static_cast<const int32_t*>(dest.untyped_data()),
                        static_cast<const int32_t*>(src.untyped_data()), static_cast<uint8_t*>(out->untyped_data()), N,
                        K, rows, row_bytes);
  return ffi::Error::Success();
}

// The one-rank local path's expand dispatch, which is also its own guard (the scratch is CUDA's alone):
// refuses a closed or failed context, checks the routing as the guard does (failing with the dispatch's error,
// recorded the same way), then computes the layout (kernels/cpu/ep.cc ep_local_layout), moves the rows
// (ep_local_scatter) and gathers the weights, and passes the token on.
ffi::Error EpLocalDispatchCpu(int32_t ordinal, ffi::AnyBuffer token, ffi::AnyBuffer topk, ffi::AnyBuffer x,
                              ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> token_out,
                              ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_w,
                              ffi::Result<ffi::AnyBuffer> exp_row, ffi::Result<ffi::AnyBuffer> src_entry,
                              ffi::Result<ffi::AnyBuffer> src_tok, ffi::Result<ffi::AnyBuffer> count,
                              ffi::Result<ffi::AnyBuffer> aligned, ffi::Result<ffi::AnyBuffer> psum_expert,
                              ffi::Result<ffi::AnyBuffer> meta, ffi::Result<ffi::AnyBuffer> dst_row,
                              ffi::Result<ffi::AnyBuffer> num_recv, ffi::Result<ffi::AnyBuffer> scratch, int64_t ctx_id,
                               int64_t alignment) {
  MemberScope s(ctx_id, ordinal, kOpEpDispatch);
  if (!s.ok()) return s.error();
  LocalLayoutShape sh;
  JE_CHECK(check_local_dispatch(kOpEpDispatch, token, *token_out, topk, x, w, *recv_x, *recv_w, *exp_row, *src_entry,
                                *src_tok, *count, *aligned, *psum_expert, *meta, *dst_row, *num_recv, *scratch,
                                alignment, &sh));
  copy_token(token, *token_out);
  const auto* ids = static_cast<const int32_t*>(topk.untyped_data());
  if (!cpu::ep_guard(s.member(), ids, sh.N, sh.K, sh.E)) return finish(s, sh.E);
  const auto i32 = [](ffi::Result<ffi::AnyBuffer>& b) { return static_cast<int32_t*>(b->untyped_data()); };
  cpu::EpLocalLayoutArgs a;
  a.topk = ids;
  a.N = sh.N, a.K = sh.K, a.E = sh.E, a.A = alignment, a.M = sh.M, a.rows = sh.rows;
  a.exp_row = i32(exp_row), a.src_entry = i32(src_entry), a.src_tok = i32(src_tok), a.count = i32(count);
  a.aligned = i32(aligned), a.psum_expert = i32(psum_expert), a.meta = i32(meta), a.dst_row = i32(dst_row);
  a.num_recv = i32(num_recv);
  cpu::ep_local_layout(a);
  const int64_t row_bytes = x.dimensions()[1] * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  if (row_bytes > 0)  // zero-byte rows: nothing to move (and the buffers may have no address)
    cpu::ep_local_scatter(static_cast<const uint8_t*>(x.untyped_data()), a.exp_row, a.src_tok,
                          static_cast<uint8_t*>(recv_x->untyped_data()), sh.N, sh.K, sh.rows, row_bytes);
  if (w.element_count() != 0) {  // the weight of each row's entry, as bits; +0.0 without one
    const auto* wb = static_cast<const uint32_t*>(w.untyped_data());
    auto* out = static_cast<uint32_t*>(recv_w->untyped_data());
    const int64_t n = sh.N * sh.K;
    for (int64_t r = 0; r < sh.rows; ++r) out[r] = a.src_entry[r] < n ? wb[a.src_entry[r]] : 0u;
  }
  return s.check_recorded();
}

}  // namespace

// Context arguments of every handler here: the device ordinal.
inline auto cpu_context() { return ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEpDispatchCpu, EpDispatchCpu,
                              bind_ep_dispatch(cpu_context()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEpDispatchCachedCpu, EpDispatchCachedCpu,
                              bind_ep_dispatch_cached(cpu_context()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEpCombineCpu, EpCombineCpu,
                              bind_ep_combine(cpu_context()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEpGuardCpu, EpGuardCpu,
                              bind_ep_guard(cpu_context()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEpLocalScatterCpu, EpLocalScatterCpu,
                              bind_ep_local_scatter(cpu_context()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEpLocalDispatchCpu, EpLocalDispatchCpu,
                              bind_ep_local_dispatch(cpu_context()));

static HandlerRegistrar reg_dispatch("jax_engram_ep_dispatch", reinterpret_cast<void*>(JeEpDispatchCpu));
static HandlerRegistrar reg_cached("jax_engram_ep_dispatch_cached", reinterpret_cast<void*>(JeEpDispatchCachedCpu));
static HandlerRegistrar reg_combine("jax_engram_ep_combine", reinterpret_cast<void*>(JeEpCombineCpu));
static HandlerRegistrar reg_guard("jax_engram_ep_guard", reinterpret_cast<void*>(JeEpGuardCpu));
static HandlerRegistrar reg_local_scatter("jax_engram_ep_local_scatter", reinterpret_cast<void*>(JeEpLocalScatterCpu));
static HandlerRegistrar reg_local_dispatch("jax_engram_ep_local_dispatch",
                                           reinterpret_cast<void*>(JeEpLocalDispatchCpu));

}  // namespace jax_engram
