// The FFI signatures of the Engram ops after each backend's context arguments (CUDA: the stream; both: the device
// ordinal): one definition for the CPU and CUDA handlers, in the operand / result order that jax_engram/engram.py
// binds. The attributes of each op decode into one struct (XLA FFI struct attribute decoding: every attribute of
// the call, by name), the same struct on both backends; fields a backend does not use are still part of the call,
// so both backends accept the same calls.
#pragma once
#include <cstdint>
#include <utility>

#include "handlers/common.h"

namespace jax_engram {

// Static attributes of a write (jax_engram/engram.py EngramTable._write_attrs).
struct EngramWriteAttrs {
  int64_t ctx_id;
  int64_t alloc_id, offset, num_entries, row_bytes;  // the table region: this rank's shard
  int64_t sf_alloc_id, sf_offset, sf_row_bytes;      // the replicated scale-factor table, bytes per row (0: none)
};

// Static attributes of a fetch (EngramTable._fetch_attrs).
struct EngramFetchAttrs {
  int64_t ctx_id;
  int64_t alloc_id, offset, num_entries, row_bytes;  // the table region, the same on every rank
  int64_t mode;                                      // engram::Mode
  int64_t sf_alloc_id, sf_offset, num_sf_packs;      // the scale-factor table (num_sf_packs 0: none)
  int64_t sf_layout;                                 // engram::SfLayout of the sf result
  int64_t overlap;                                   // CUDA: gather on the member's side stream; CPU: unused
  // The gather configuration (jax_engram/config.py EngramConfig.ffi_attrs; engram_layout.h Gather / Loads):
  // checked on both backends, used by CUDA only.
  int64_t gather, gather_sms, tma_smem_bytes, sm_loads, sm_blocks_per_sm;
  // Host-table path (EngramTable.host_path, resolved in Python): 1 = CPU worker threads gather into pinned staging
  // and the copy engine moves it (no SMs); 0 = the GPU gather above. CUDA uses it for host-placed tables only; the
  // CPU backend always gathers on its pool. host_threads: pool workers (0 = the backend's default).
  int64_t host_gather, host_threads;
  int64_t slot;  // the fetch call site (unique per traced fetch): CUDA orders its wait after this fetch only
};

// Static attributes of a wait (EngramTable.wait).
struct EngramWaitAttrs {
  int64_t ctx_id;
  int64_t overlap;  // the fetch's: CUDA joins the side stream back into XLA's; CPU: unused
  int64_t slot;     // the fetch's slot: CUDA waits for that fetch's work only (not for later fetches)
  // mode="checked" where the fetch cannot fail by itself (the CUDA gather; the ("node", "gpu") lookup): `status`
  // holds the first bad flat position of `indices` (kNoBadPosition if none), optionally followed by the rank to
  // name (int32 [2]; else the member's own). The wait reads it (on CUDA a host sync: checked mode is for
  // debugging) and fails the call naming that position, its id and [0, check_total). 0: no check.
  int64_t check_total;
};

// Static attributes of the GIN leg of a hierarchical lookup (CUDA only: cuda_engram_gin.cc;
// jax_engram/_scaleout_gin.py fetch): the table's GIN window and engram::GinGeometry (engram_gin_plan.h).
struct EngramGinFetchAttrs {
  int64_t ctx_id;
  int64_t window_id;
  int64_t num_entries, ranks_per_node, nodes, row_bytes, region_offset, local_stride;
  int64_t mode;  // engram::Mode
};

}  // namespace jax_engram

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::jax_engram::EngramWriteAttrs, ::xla::ffi::StructMember<int64_t>("ctx_id"),
    ::xla::ffi::StructMember<int64_t>("alloc_id"), ::xla::ffi::StructMember<int64_t>("offset"),
    ::xla::ffi::StructMember<int64_t>("num_entries"), ::xla::ffi::StructMember<int64_t>("row_bytes"),
    ::xla::ffi::StructMember<int64_t>("sf_alloc_id"), ::xla::ffi::StructMember<int64_t>("sf_offset"),
    ::xla::ffi::StructMember<int64_t>("sf_row_bytes"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::jax_engram::EngramFetchAttrs, ::xla::ffi::StructMember<int64_t>("ctx_id"),
    ::xla::ffi::StructMember<int64_t>("alloc_id"), ::xla::ffi::StructMember<int64_t>("offset"),
    ::xla::ffi::StructMember<int64_t>("num_entries"), ::xla::ffi::StructMember<int64_t>("row_bytes"),
    ::xla::ffi::StructMember<int64_t>("mode"), ::xla::ffi::StructMember<int64_t>("sf_alloc_id"),
    ::xla::ffi::StructMember<int64_t>("sf_offset"), ::xla::ffi::StructMember<int64_t>("num_sf_packs"),
    ::xla::ffi::StructMember<int64_t>("sf_layout"), ::xla::ffi::StructMember<int64_t>("overlap"),
    ::xla::ffi::StructMember<int64_t>("gather"), ::xla::ffi::StructMember<int64_t>("gather_sms"),
    ::xla::ffi::StructMember<int64_t>("tma_smem_bytes"), ::xla::ffi::StructMember<int64_t>("sm_loads"),
    ::xla::ffi::StructMember<int64_t>("sm_blocks_per_sm"), ::xla::ffi::StructMember<int64_t>("host_gather"),
    ::xla::ffi::StructMember<int64_t>("host_threads"), ::xla::ffi::StructMember<int64_t>("slot"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jax_engram::EngramWaitAttrs, ::xla::ffi::StructMember<int64_t>("ctx_id"),
                                      ::xla::ffi::StructMember<int64_t>("overlap"),
                                      ::xla::ffi::StructMember<int64_t>("slot"),
                                      ::xla::ffi::StructMember<int64_t>("check_total"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::jax_engram::EngramGinFetchAttrs, ::xla::ffi::StructMember<int64_t>("ctx_id"),
    ::xla::ffi::StructMember<int64_t>("window_id"), ::xla::ffi::StructMember<int64_t>("num_entries"),
    ::xla::ffi::StructMember<int64_t>("ranks_per_node"), ::xla::ffi::StructMember<int64_t>("nodes"),
    ::xla::ffi::StructMember<int64_t>("row_bytes"), ::xla::ffi::StructMember<int64_t>("region_offset"),
    ::xla::ffi::StructMember<int64_t>("local_stride"), ::xla::ffi::StructMember<int64_t>("mode"));

namespace jax_engram {

template <typename B>
auto bind_engram_write(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()  // token (any array; not read)
      .template Arg<ffi::AnyBuffer>()  // row_offset int32 []: the first shard row written (engram::write_start_row)
      .template Arg<ffi::AnyBuffer>()  // storage [n, hidden], 1 <= n <= num_entries
      .template Arg<ffi::AnyBuffer>()  // sf [nranks * n, P] (every rank's slice, rank-major) or empty
      .template Ret<ffi::AnyBuffer>()  // token
      .template Attrs<EngramWriteAttrs>();
}

template <typename B>
auto bind_engram_fetch(B&& b) {
  return std::forward<B>(b)
      .template Arg<ffi::AnyBuffer>()  // indices int32 [T, E]
      .template Arg<ffi::AnyBuffer>()  // token (any array; not read)
      .template Ret<ffi::AnyBuffer>()  // data [T, E*hidden]
      .template Ret<ffi::AnyBuffer>()  // sf (layout) or empty
      .template Ret<ffi::AnyBuffer>()  // status int32
      .template Attrs<EngramFetchAttrs>();
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
      .template Attrs<EngramWaitAttrs>();
}

}  // namespace jax_engram
