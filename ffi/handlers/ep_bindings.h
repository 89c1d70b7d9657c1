// The FFI signatures of the EP ops after each backend's context arguments (CUDA: the stream; both: the device
// ordinal): one definition for the CPU and CUDA handlers, in the operand / result order that jax_engram/ep.py
// binds. The attributes of each op decode into one struct (XLA FFI struct attribute decoding: every attribute of
// the call, by name), the same struct on both backends; fields a backend does not use are still part of the call,
// so both backends accept the same calls.
#pragma once
#include <cstdint>
#include <utility>

#include "handlers/common.h"

namespace jax_engram {

// Static attributes of a dispatch and of a cached dispatch (jax_engram/ep.py _Config.attrs).
struct EpDispatchAttrs {
  int64_t ctx_id;
  int64_t alloc_id, offset;  // staging region
  int64_t num_experts, max_tokens_per_rank, expand, expert_alignment, zero_padding;
  int64_t num_sms;           // CUDA: CTAs (0 = the default); CPU: unused
  int64_t copy_pieces;       // CUDA: copy-engine pieces decided at trace time (0 = SM stores); CPU: 0
  int64_t stage_warps;       // CUDA: push warps per CTA (0 = the default of the path); CPU: unused
};

// Static attributes of a combine.
struct EpCombineAttrs {
  int64_t ctx_id;
  int64_t alloc_id, offset;
  int64_t num_experts, max_tokens_per_rank, expand;
  int64_t num_sms, stage_warps;  // CUDA only (0 = the defaults)
};

// Static attributes of the guard (jax_engram/_ep_local.py, _ep_hier.py): the op it stands for (combine 0: a
// dispatch, 1: a combine; the op its errors name), the experts of the routing it checks, and what its topk_idx
// operand holds: records 0: the routing [N, K] itself (the one-rank local path); records 1: the routing records of
// a ("node", "gpu") group, [R + 1, 3]: row r = (kind, token, id) of global rank r's first bad entry (kind 0: none,
// else an EpBadKind), the last row = (this rank's global rank, 0, 0) -- every rank then reports the same first
// offender in the group's global numbers, as the flat dispatch kernel does; records 2: the same records, and the
// guard refuses the call with the first offender's message without recording anything (validate_routing=True:
// the context stays usable; on CUDA the handler reads the records back, a host sync).
struct EpGuardAttrs {
  int64_t ctx_id;
  int64_t combine;
  int64_t num_experts;
  int64_t records;
};

}  // namespace jax_engram

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::jax_engram::EpGuardAttrs, ::xla::ffi::StructMember<int64_t>("ctx_id"),
    ::xla::ffi::StructMember<int64_t>("combine"), ::xla::ffi::StructMember<int64_t>("num_experts"),
    ::xla::ffi::StructMember<int64_t>("records"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::jax_engram::EpDispatchAttrs, ::xla::ffi::StructMember<int64_t>("ctx_id"),
    ::xla::ffi::StructMember<int64_t>("alloc_id"), ::xla::ffi::StructMember<int64_t>("offset"),
    ::xla::ffi::StructMember<int64_t>("num_experts"), ::xla::ffi::StructMember<int64_t>("max_tokens_per_rank"),
    ::xla::ffi::StructMember<int64_t>("expand"), ::xla::ffi::StructMember<int64_t>("expert_alignment"),
    ::xla::ffi::StructMember<int64_t>("zero_padding"), ::xla::ffi::StructMember<int64_t>("num_sms"),
    ::xla::ffi::StructMember<int64_t>("copy_pieces"), ::xla::ffi::StructMember<int64_t>("stage_warps"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::jax_engram::EpCombineAttrs, ::xla::ffi::StructMember<int64_t>("ctx_id"),
    ::xla::ffi::StructMember<int64_t>("alloc_id"), ::xla::ffi::StructMember<int64_t>("offset"),
    ::xla::ffi::StructMember<int64_t>("num_experts"), ::xla::ffi::StructMember<int64_t>("max_tokens_per_rank"),
    ::xla::ffi::StructMember<int64_t>("expand"), ::xla::ffi::StructMember<int64_t>("num_sms"),
    ::xla::ffi::StructMember<int64_t>("stage_warps"));

namespace jax_engram {

template <typename B>
auto bind_ep_dispatch(B&& b) {
  auto ops = std::forward<B>(b)
                 .template Arg<ffi::AnyBuffer>()  // x
                 .template Arg<ffi::AnyBuffer>()  // x_scales
                 .template Arg<ffi::AnyBuffer>()  // topk_idx
                 .template Arg<ffi::AnyBuffer>()  // topk_weights
                 .template Arg<ffi::AnyBuffer>()  // token
                 .template Ret<ffi::AnyBuffer>()  // recv_x
                 .template Ret<ffi::AnyBuffer>()  // recv_x_scales
                 .template Ret<ffi::AnyBuffer>()  // recv_topk_idx
                 .template Ret<ffi::AnyBuffer>()  // recv_topk_weights
                 .template Ret<ffi::AnyBuffer>()  // psum_rank
                 .template Ret<ffi::AnyBuffer>()  // psum_expert
                 .template Ret<ffi::AnyBuffer>()  // unaligned
                 .template Ret<ffi::AnyBuffer>()  // recv_src_metadata
                 .template Ret<ffi::AnyBuffer>()  // dst_row
                 .template Ret<ffi::AnyBuffer>()  // num_recv_tokens
                 .template Ret<ffi::AnyBuffer>()  // group_sizes
                 .template Ret<ffi::AnyBuffer>();  // token_out
  return std::move(ops).template Attrs<EpDispatchAttrs>();
}

template <typename B>
auto bind_ep_dispatch_cached(B&& b) {
  auto ops = std::forward<B>(b)
                 .template Arg<ffi::AnyBuffer>()  // x
                 .template Arg<ffi::AnyBuffer>()  // x_scales
                 .template Arg<ffi::AnyBuffer>()  // topk_weights
                 .template Arg<ffi::AnyBuffer>()  // recv_src_metadata
                 .template Arg<ffi::AnyBuffer>()  // psum_rank
                 .template Arg<ffi::AnyBuffer>()  // psum_expert
                 .template Arg<ffi::AnyBuffer>()  // unaligned
                 .template Arg<ffi::AnyBuffer>()  // dst_row
                 .template Arg<ffi::AnyBuffer>()  // token
                 .template Ret<ffi::AnyBuffer>()  // recv_x
                 .template Ret<ffi::AnyBuffer>()  // recv_x_scales
                 .template Ret<ffi::AnyBuffer>()  // recv_topk_weights
                 .template Ret<ffi::AnyBuffer>();  // token_out
  return std::move(ops).template Attrs<EpDispatchAttrs>();
}

template <typename B>
auto bind_ep_combine(B&& b) {
  auto ops = std::forward<B>(b)
                 .template Arg<ffi::AnyBuffer>()  // y
                 .template Arg<ffi::AnyBuffer>()  // topk_weights
                 .template Arg<ffi::AnyBuffer>()  // bias0
                 .template Arg<ffi::AnyBuffer>()  // bias1
                 .template Arg<ffi::AnyBuffer>()  // recv_src_metadata
                 .template Arg<ffi::AnyBuffer>()  // dst_row
                 .template Arg<ffi::AnyBuffer>()  // topk_idx
                 .template Arg<ffi::AnyBuffer>()  // psum_rank
                 .template Arg<ffi::AnyBuffer>()  // token
                 .template Ret<ffi::AnyBuffer>()  // combined_x
                 .template Ret<ffi::AnyBuffer>()  // combined_topk_weights
                 .template Ret<ffi::AnyBuffer>();  // token_out
  return std::move(ops).template Attrs<EpCombineAttrs>();
}

// The guard: the token passes through (token_out; Python aliases it to token), topk_idx [N, K] is the routing to check
// ([0, 0] for the ops that route nothing) and topk_out its copy, written by the check (what the local path computes
// the layout from, so that nothing of it runs before the check).
template <typename B>
auto bind_ep_guard(B&& b) {
  auto ops = std::forward<B>(b)
                 .template Arg<ffi::AnyBuffer>()  // token
                 .template Arg<ffi::AnyBuffer>()  // topk_idx
                 .template Ret<ffi::AnyBuffer>()  // token_out
                 .template Ret<ffi::AnyBuffer>();  // topk_out
  return std::move(ops).template Attrs<EpGuardAttrs>();
}

// The one-rank local path's row scatter (expand layout): x [N, H], dest [N, K] (the receive row of every entry, -1:
// none), src [rows] (the source token of every receive row, N: none) -> out [rows, H], x's dtype. Stateless: the
// context (ctx_id) only names the call's group; the guard before it has checked the context and the routing.
template <typename B>
auto bind_ep_local_scatter(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()  // dest
      .template Arg<ffi::AnyBuffer>()  // src
      .template Ret<ffi::AnyBuffer>()  // out
      .template Attr<int64_t>("ctx_id");
}


// The one-rank local path's expand dispatch, which is also its own guard (kernels ep_local_dispatch): token, topk
// [N, K], x [N, H], w [N * K] float32 or [0] (no weights) -> token_out (aliased to token), recv_x [rows, H] of x's
// dtype, recv_w [rows] float32 or [0], then the layout: exp_row [N, K], src_entry [rows], src_tok [rows], count [E],
// aligned [E], psum_expert [E], meta [M, K + 2], dst_row [N, 1], num_recv [1], and the CUDA kernels' scratch
// [ep_local_dispatch_scratch_words(N, K, E)], all int32 (E from count's shape). Like the guard it refuses a closed or failed context and checks the
// routing as a dispatch does (an id outside [-1, E), a duplicate expert), recording a bad entry in context ctx_id;
// an id outside [0, E) is no entry of the layout.
template <typename B>
auto bind_ep_local_dispatch(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()  // token
      .template Arg<ffi::AnyBuffer>()  // topk
      .template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()  // w
      .template Ret<ffi::AnyBuffer>()  // token_out
      .template Ret<ffi::AnyBuffer>()  // recv_x
      .template Ret<ffi::AnyBuffer>()  // recv_w
      .template Ret<ffi::AnyBuffer>()  // exp_row
      .template Ret<ffi::AnyBuffer>()  // src_entry
      .template Ret<ffi::AnyBuffer>()  // src_tok
      .template Ret<ffi::AnyBuffer>()  // count
      .template Ret<ffi::AnyBuffer>()  // aligned
      .template Ret<ffi::AnyBuffer>()  // psum_expert
      .template Ret<ffi::AnyBuffer>()  // meta
      .template Ret<ffi::AnyBuffer>()  // dst_row
      .template Ret<ffi::AnyBuffer>()  // num_recv
      .template Ret<ffi::AnyBuffer>()  // scratch
      .template Attr<int64_t>("ctx_id")
      .template Attr<int64_t>("expert_alignment");
}

}  // namespace jax_engram
