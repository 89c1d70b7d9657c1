// The FFI signatures of the EP ops after each backend's context arguments (CUDA: the stream; both: the device
// ordinal): one definition for the CPU and CUDA handlers, in the operand / result / attribute order that
// jax_engram/ep.py binds.
#pragma once
#include <utility>

#include "handlers/common.h"

namespace jax_engram {

// The attributes every EP op starts with.
template <typename B>
auto bind_ep_attrs(B&& b) {
  return std::forward<B>(b)
      .template Attr<int64_t>("ctx_id")
      .template Attr<int64_t>("alloc_id")
      .template Attr<int64_t>("offset")
      .template Attr<int64_t>("num_experts")
      .template Attr<int64_t>("max_tokens_per_rank")
      .template Attr<int64_t>("expand");
}

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
  return bind_ep_attrs(std::move(ops))
      .template Attr<int64_t>("expert_alignment")
      .template Attr<int64_t>("zero_padding")
      .template Attr<int64_t>("num_sms");
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
  return bind_ep_attrs(std::move(ops))
      .template Attr<int64_t>("expert_alignment")
      .template Attr<int64_t>("zero_padding")
      .template Attr<int64_t>("num_sms");
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
  return bind_ep_attrs(std::move(ops))
      .template Attr<int64_t>("num_sms");
}

}  // namespace jax_engram
