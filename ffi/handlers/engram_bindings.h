// The FFI signatures of the Engram ops after each backend's context arguments (CUDA: the stream; both: the device
// ordinal): one definition for the CPU and CUDA handlers, in the order jax_engram/engram.py binds.
#pragma once
#include <utility>

#include "handlers/common.h"

namespace jax_engram {

template <typename B>
auto bind_engram_write(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()  // token (any array; not read)
      .template Arg<ffi::AnyBuffer>()  // storage [num_entries, hidden]
      .template Arg<ffi::AnyBuffer>()  // sf [total, P] or empty
      .template Ret<ffi::AnyBuffer>()  // token
      .template Attr<int64_t>("ctx_id")
      .template Attr<int64_t>("alloc_id")
      .template Attr<int64_t>("offset")
      .template Attr<int64_t>("num_entries")
      .template Attr<int64_t>("row_bytes")
      .template Attr<int64_t>("sf_alloc_id")
      .template Attr<int64_t>("sf_offset")
      .template Attr<int64_t>("sf_bytes");
}

template <typename B>
auto bind_engram_fetch(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()  // indices int32 [T, E]
      .template Arg<ffi::AnyBuffer>()  // token (any array; not read)
      .template Ret<ffi::AnyBuffer>()  // data [T, E*hidden]
      .template Ret<ffi::AnyBuffer>()  // sf (layout) or empty
      .template Ret<ffi::AnyBuffer>()  // status int32
      .template Attr<int64_t>("ctx_id")
      .template Attr<int64_t>("alloc_id")
      .template Attr<int64_t>("offset")
      .template Attr<int64_t>("num_entries")
      .template Attr<int64_t>("row_bytes")
      .template Attr<int64_t>("mode")
      .template Attr<int64_t>("sf_alloc_id")
      .template Attr<int64_t>("sf_offset")
      .template Attr<int64_t>("num_sf_packs")
      .template Attr<int64_t>("sf_layout")
      .template Attr<int64_t>("overlap")
      // gather configuration (jax_engram/config.py EngramConfig.ffi_attrs; engram_layout.h Gather / Loads)
      .template Attr<int64_t>("gather")
      .template Attr<int64_t>("gather_sms")
      .template Attr<int64_t>("tma_smem_bytes")
      .template Attr<int64_t>("sm_loads")
      .template Attr<int64_t>("sm_blocks_per_sm");
}

template <typename B>
auto bind_engram_wait(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()  // data (pending)
      .template Arg<ffi::AnyBuffer>()  // sf (pending)
      .template Arg<ffi::AnyBuffer>()  // status (pending)
      .template Arg<ffi::AnyBuffer>()  // indices (kept alive until here)
      .template Arg<ffi::AnyBuffer>()  // token (any array; not read)
      .template Ret<ffi::AnyBuffer>()  // data (aliases operand 0)
      .template Ret<ffi::AnyBuffer>()  // sf (aliases operand 1)
      .template Attr<int64_t>("ctx_id")
      .template Attr<int64_t>("overlap");
}

}  // namespace jax_engram
