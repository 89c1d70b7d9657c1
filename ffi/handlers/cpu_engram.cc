// CPU handlers of the Engram ops: write (barrier, copy the shard into the own window region, barrier), fetch
// (gather by global id from every peer's region, synchronously) and wait (identity; the buffers are aliased).
// Operands, results and attributes are the same as the CUDA handlers' (cuda_engram.cc).
#include <cstring>
#include <string>

#include "handlers/common.h"
#include "jax_engram/engram_layout.h"
#include "kernels/cpu/engram.h"
#include "kernels/cpu/sync.h"

namespace jax_engram {
namespace {

std::string num(int64_t v) { return std::to_string(v); }

// The scale-factor region (own memory only: the table is replicated). nullptr with success if none.
ffi::Error sf_region(Member& m, int64_t sf_alloc_id, int64_t sf_offset, uint64_t sf_bytes, int32_t op, uint8_t** out) {
  *out = nullptr;
  if (sf_bytes == 0) return ffi::Error::Success();
  Allocation* a;
  if (auto e = check_region(m, sf_alloc_id, sf_offset, sf_bytes, op, &a); !e.success()) return e;
  *out = a->local + sf_offset;
  return ffi::Error::Success();
}

ffi::Error EngramWriteCpu(int32_t ordinal, ffi::AnyBuffer token, ffi::AnyBuffer storage, ffi::AnyBuffer sf,
                          ffi::Result<ffi::AnyBuffer> token_out, int64_t ctx_id, int64_t alloc_id, int64_t offset,
                          int64_t num_entries, int64_t row_bytes, int64_t sf_alloc_id, int64_t sf_offset,
                          int64_t sf_bytes) {
  (void)token;
  MemberScope s(ctx_id, ordinal, kOpEngramWrite);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  const uint64_t n = static_cast<uint64_t>(num_entries) * row_bytes;
  if (storage.size_bytes() != n)
    return op_error(kOpEngramWrite, "storage has " + num(storage.size_bytes()) + " bytes, the table shard needs " +
                                        num(n) + " (num_entries " + num(num_entries) + " x " + num(row_bytes) +
                                        " bytes per row)");
  if (sf.size_bytes() != static_cast<uint64_t>(sf_bytes))
    return op_error(kOpEngramWrite, "sf has " + num(sf.size_bytes()) + " bytes, expected " + num(sf_bytes));
  Allocation* a;
  if (auto e = check_region(m, alloc_id, offset, n, kOpEngramWrite, &a); !e.success()) return e;
  uint8_t* sf_dst;
  if (auto e = sf_region(m, sf_alloc_id, sf_offset, sf_bytes, kOpEngramWrite, &sf_dst); !e.success()) return e;
  // No peer may still read the old table (fetches on CPU are synchronous, so a peer past this barrier is done).
  if (!cpu::barrier(m, kOpEngramWrite)) return s.check_recorded();
  if (n) std::memcpy(a->local + offset, storage.untyped_data(), n);
  if (sf_bytes) std::memcpy(sf_dst, sf.untyped_data(), sf_bytes);
  if (!cpu::barrier(m, kOpEngramWrite)) return s.check_recorded();
  if (token_out->size_bytes()) std::memset(token_out->untyped_data(), 0, token_out->size_bytes());
  return s.check_recorded();
}

ffi::Error EngramFetchCpu(int32_t ordinal, ffi::AnyBuffer indices, ffi::AnyBuffer token,
                          ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> sf_out,
                          ffi::Result<ffi::AnyBuffer> status, int64_t ctx_id, int64_t alloc_id, int64_t offset,
                          int64_t num_entries, int64_t row_bytes, int64_t mode, int64_t sf_alloc_id,
                          int64_t sf_offset, int64_t num_sf_packs, int64_t sf_layout, int64_t overlap) {
  (void)token;
  (void)overlap;  // CPU: the gather runs here and now
  MemberScope s(ctx_id, ordinal, kOpEngramFetch);
  if (!s.ok()) return s.error();
  Member& m = s.member();
  if (indices.element_type() != ffi::DataType::S32 || indices.dimensions().size() != 2)
    return op_error(kOpEngramFetch, "indices must be an int32 [T, E] array");
  const int64_t T = indices.dimensions()[0], E = indices.dimensions()[1];
  if (mode < engram::kModeFill || mode > engram::kModeChecked) return op_error(kOpEngramFetch, "bad mode " + num(mode));
  if (sf_layout != engram::kSfRow && sf_layout != engram::kSfTmaColMajor)
    return op_error(kOpEngramFetch, "bad sf_layout " + num(sf_layout));
  if (data->size_bytes() != static_cast<uint64_t>(T * E * row_bytes))
    return op_error(kOpEngramFetch, "data result has " + num(data->size_bytes()) + " bytes, expected T*E*row_bytes = " +
                                        num(T * E * row_bytes));
  const int64_t P = num_sf_packs;
  const int64_t sf_elems = P > 0 ? engram::sf_out_elems(T, E * P, static_cast<int32_t>(sf_layout)) : 0;
  if (sf_out->size_bytes() != static_cast<uint64_t>(sf_elems * engram::kSfWordBytes))
    return op_error(kOpEngramFetch, "sf result has " + num(sf_out->size_bytes()) + " bytes, expected " +
                                        num(sf_elems * engram::kSfWordBytes));
  if (status->size_bytes() != sizeof(int32_t)) return op_error(kOpEngramFetch, "status result must be one int32");
  const int64_t total = static_cast<int64_t>(m.nranks) * num_entries;
  Allocation* a;
  if (auto e = check_region(m, alloc_id, offset, static_cast<uint64_t>(num_entries) * row_bytes, kOpEngramFetch, &a);
      !e.success())
    return e;
  uint8_t* sf_table;
  if (auto e = sf_region(m, sf_alloc_id, sf_offset, static_cast<uint64_t>(P > 0 ? total * P * engram::kSfWordBytes : 0),
                         kOpEngramFetch, &sf_table);
      !e.success())
    return e;
  const auto* ids = static_cast<const int32_t*>(indices.untyped_data());
  int32_t* st = static_cast<int32_t*>(status->untyped_data());
  *st = mode == engram::kModeChecked ? engram::kNoBadPosition : 0;
  if (mode == engram::kModeChecked) {
    const int64_t bad = cpu::engram_first_out_of_range(ids, T * E, total);
    if (bad >= 0) {
      *st = static_cast<int32_t>(bad);
      // Synchronous on CPU: this op fails; the context stays usable (no error record).
      return op_error(kOpEngramFetch,
                      "index out of range in mode='checked': id " + num(ids[bad]) + " at flat position " + num(bad) +
                          " (token " + num(bad / E) + ", entry " + num(bad % E) + ") on rank " + num(m.rank) +
                          " is not in [0, " + num(total) + ") = [0, num_ranks*num_entries)",
                      ffi::ErrorCode::kOutOfRange);
    }
  }
  cpu::EngramGather g;
  g.ids = ids;
  g.T = T;
  g.E = E;
  g.num_entries = num_entries;
  g.nranks = m.nranks;
  g.peers = a->peers.data();
  g.offset = offset;
  g.row_bytes = row_bytes;
  g.mode = static_cast<int32_t>(mode);
  g.out = static_cast<uint8_t*>(data->untyped_data());
  g.sf_table = reinterpret_cast<const uint32_t*>(sf_table);
  g.P = P;
  g.sf_layout = static_cast<int32_t>(sf_layout);
  g.sf_out = static_cast<uint32_t*>(sf_out->untyped_data());
  cpu::engram_gather(g);
  return ffi::Error::Success();
}

// data / sf results alias the data / sf operands (input_output_aliases): nothing to do unless XLA copied.
ffi::Error EngramWaitCpu(int32_t ordinal, ffi::AnyBuffer data, ffi::AnyBuffer sf, ffi::AnyBuffer status,
                         ffi::AnyBuffer indices, ffi::AnyBuffer token, ffi::Result<ffi::AnyBuffer> data_out,
                         ffi::Result<ffi::AnyBuffer> sf_out, int64_t ctx_id, int64_t overlap) {
  (void)overlap;
  (void)status;
  (void)indices;
  (void)token;
  MemberScope s(ctx_id, ordinal, kOpEngramWait);
  if (!s.ok()) return s.error();
  if (data_out->size_bytes() != data.size_bytes() || sf_out->size_bytes() != sf.size_bytes())
    return op_error(kOpEngramWait, "results must have the sizes of the pending data and sf");
  if (data_out->untyped_data() != data.untyped_data() && data.size_bytes())
    std::memcpy(data_out->untyped_data(), data.untyped_data(), data.size_bytes());
  if (sf_out->untyped_data() != sf.untyped_data() && sf.size_bytes())
    std::memcpy(sf_out->untyped_data(), sf.untyped_data(), sf.size_bytes());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEngramWriteCpu, EngramWriteCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // token (any array; not read)
                                  .Arg<ffi::AnyBuffer>()  // storage [num_entries, hidden]
                                  .Arg<ffi::AnyBuffer>()  // sf [total, P] or empty
                                  .Ret<ffi::AnyBuffer>()  // token
                                  .Attr<int64_t>("ctx_id")
                                  .Attr<int64_t>("alloc_id")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("num_entries")
                                  .Attr<int64_t>("row_bytes")
                                  .Attr<int64_t>("sf_alloc_id")
                                  .Attr<int64_t>("sf_offset")
                                  .Attr<int64_t>("sf_bytes"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEngramFetchCpu, EngramFetchCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // indices int32 [T, E]
                                  .Arg<ffi::AnyBuffer>()  // token (any array; not read)
                                  .Ret<ffi::AnyBuffer>()  // data [T, E*hidden]
                                  .Ret<ffi::AnyBuffer>()  // sf (layout) or empty
                                  .Ret<ffi::AnyBuffer>()  // status int32: 0, or checked: first bad position
                                  .Attr<int64_t>("ctx_id")
                                  .Attr<int64_t>("alloc_id")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("num_entries")
                                  .Attr<int64_t>("row_bytes")
                                  .Attr<int64_t>("mode")
                                  .Attr<int64_t>("sf_alloc_id")
                                  .Attr<int64_t>("sf_offset")
                                  .Attr<int64_t>("num_sf_packs")
                                  .Attr<int64_t>("sf_layout")
                                  .Attr<int64_t>("overlap"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JeEngramWaitCpu, EngramWaitCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // data (pending)
                                  .Arg<ffi::AnyBuffer>()  // sf (pending)
                                  .Arg<ffi::AnyBuffer>()  // status (pending)
                                  .Arg<ffi::AnyBuffer>()  // indices (kept alive until here)
                                  .Arg<ffi::AnyBuffer>()  // token (any array; not read)
                                  .Ret<ffi::AnyBuffer>()  // data (aliases operand 0)
                                  .Ret<ffi::AnyBuffer>()  // sf (aliases operand 1)
                                  .Attr<int64_t>("ctx_id")
                                  .Attr<int64_t>("overlap"));

static HandlerRegistrar reg_write("jax_engram_engram_write", reinterpret_cast<void*>(JeEngramWriteCpu));
static HandlerRegistrar reg_fetch("jax_engram_engram_fetch", reinterpret_cast<void*>(JeEngramFetchCpu));
static HandlerRegistrar reg_wait("jax_engram_engram_wait", reinterpret_cast<void*>(JeEngramWaitCpu));

}  // namespace jax_engram
