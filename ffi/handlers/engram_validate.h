// Validation shared by the CPU and CUDA Engram handlers: what write and fetch accept (sizes of the operands and
// results, the static attributes) and the window regions they touch, with messages that name the argument.
#pragma once
#include <string>

#include "handlers/common.h"
#include "handlers/engram_bindings.h"
#include "jax_engram/engram_layout.h"

namespace jax_engram {
namespace engram_validate {

inline std::string num(int64_t v) { return std::to_string(v); }

// The scale-factor region (own memory only: the table is replicated). nullptr with success if none.
inline ffi::Error sf_region(Member& m, int64_t sf_alloc_id, int64_t sf_offset, uint64_t sf_bytes, int32_t op,
                            uint8_t** out) {
  *out = nullptr;
  if (sf_bytes == 0) return ffi::Error::Success();
  Allocation* a;
  if (auto e = check_region(m, sf_alloc_id, sf_offset, sf_bytes, op, &a); !e.success()) return e;
  *out = a->local + sf_offset;
  return ffi::Error::Success();
}

// write: the rows (storage), the row offset and the scale factors (sf) against the attributes; the own table region
// and the sf region. Where the rows go: engram::write_start_row (engram_layout.h).
struct WriteRegions {
  int64_t rows = 0;        // rows written of every rank's shard (n)
  uint64_t bytes = 0;      // of storage: rows * row_bytes
  uint64_t sf_bytes = 0;   // of sf: nranks * rows * sf_row_bytes (0: no scale factors)
  Allocation* a = nullptr;
  uint8_t* sf_dst = nullptr;  // the own replicated sf table [nranks * num_entries, P]
};
inline ffi::Error check_write(int32_t op, Member& m, const ffi::AnyBuffer& row_offset, const ffi::AnyBuffer& storage,
                              const ffi::AnyBuffer& sf, const EngramWriteAttrs& at, WriteRegions* w) {
  if (at.num_entries < 1 || at.row_bytes < 1 || at.sf_row_bytes < 0)
    return op_error(op, "bad table attributes: num_entries " + num(at.num_entries) + ", row_bytes " +
                            num(at.row_bytes) + ", sf_row_bytes " + num(at.sf_row_bytes));
  if (row_offset.element_type() != ffi::DataType::S32 || row_offset.element_count() != 1)
    return op_error(op, "row_offset must be one int32");
  const uint64_t rb = static_cast<uint64_t>(at.row_bytes);
  if (storage.size_bytes() % rb)
    return op_error(op, "storage has " + num(storage.size_bytes()) + " bytes, not a whole number of " + num(rb) +
                            "-byte rows");
  w->rows = static_cast<int64_t>(storage.size_bytes() / rb);
  if (w->rows < 1 || w->rows > at.num_entries)
    return op_error(op, "storage has " + num(w->rows) + " rows; a write takes 1 to num_entries = " +
                            num(at.num_entries) + " rows of the shard");
  w->bytes = static_cast<uint64_t>(w->rows) * rb;
  w->sf_bytes = static_cast<uint64_t>(m.nranks) * w->rows * at.sf_row_bytes;
  if (sf.size_bytes() != w->sf_bytes)
    return op_error(op, "sf has " + num(sf.size_bytes()) + " bytes, expected " + num(w->sf_bytes) + " (" +
                            num(m.nranks) + " ranks x " + num(w->rows) + " rows x " + num(at.sf_row_bytes) + " bytes)");
  const uint64_t region = static_cast<uint64_t>(at.num_entries) * rb;
  if (auto e = check_region(m, at.alloc_id, at.offset, region, op, &w->a); !e.success()) return e;
  return sf_region(m, at.sf_alloc_id, at.sf_offset, static_cast<uint64_t>(m.nranks) * at.num_entries * at.sf_row_bytes,
                   op, &w->sf_dst);
}

// fetch: the gather configuration (EngramConfig). Checked on every backend, used by CUDA only.
inline ffi::Error check_gather_config(int32_t op, const EngramFetchAttrs& at) {
  if (at.gather != engram::kGatherSm && at.gather != engram::kGatherTma && at.gather != engram::kGatherSmFew)
    return op_error(op, "bad gather " + num(at.gather) + " (0 = sm, 1 = tma, 2 = sm_few)");
  if (at.gather_sms < 1 || at.gather_sms > engram::kMaxGatherSms)
    return op_error(op, "gather_sms " + num(at.gather_sms) + " is not in [1, " + num(engram::kMaxGatherSms) + "]");
  if (at.tma_smem_bytes < engram::kTmaMinSmemBytes || at.tma_smem_bytes > (int64_t{1} << 30))
    return op_error(op, "tma_smem_bytes " + num(at.tma_smem_bytes) + " is not in [" +
                            num(engram::kTmaMinSmemBytes) + ", 2^30]");
  if (at.sm_loads < engram::kLoadsAuto || at.sm_loads > engram::kLoadsPlain)
    return op_error(op, "bad sm_loads " + num(at.sm_loads) + " (0 auto, 1 volatile, 2 cg, 3 plain)");
  if (at.sm_blocks_per_sm < 0 || at.sm_blocks_per_sm > engram::kMaxBlocksPerSm)
    return op_error(op, "sm_blocks_per_sm " + num(at.sm_blocks_per_sm) + " is not in [0, " +
                            num(engram::kMaxBlocksPerSm) + "]");
  if (at.host_gather != engram::kHostGatherGpu && at.host_gather != engram::kHostGatherCpu)
    return op_error(op, "bad host_gather " + num(at.host_gather) + " (0 = gpu, 1 = cpu)");
  if (at.host_threads < 0 || at.host_threads > engram::kMaxHostThreads)
    return op_error(op, "host_threads " + num(at.host_threads) + " is not in [0, " + num(engram::kMaxHostThreads) +
                            "]");
  if (at.slot < 0) return op_error(op, "bad slot " + num(at.slot));
  return ffi::Error::Success();
}

// fetch: the gather configuration, indices [T, E] int32, the data / sf / status results, mode and sf layout; the
// table region (every peer's) and the sf region.
struct FetchShapes {
  int64_t T = 0, E = 0;  // tokens, entries per token
  int64_t P = 0;         // scale-factor packs per row
  int64_t total = 0;     // rows of the whole table: num_ranks * num_entries
  Allocation* a = nullptr;
  uint8_t* sf_table = nullptr;
};
inline ffi::Error check_fetch(int32_t op, Member& m, const ffi::AnyBuffer& indices, const ffi::AnyBuffer& data,
                              const ffi::AnyBuffer& sf_out, const ffi::AnyBuffer& status, const EngramFetchAttrs& at,
                              FetchShapes* f) {
  if (auto e = check_gather_config(op, at); !e.success()) return e;
  if (indices.element_type() != ffi::DataType::S32 || indices.dimensions().size() != 2)
    return op_error(op, "indices must be an int32 [T, E] array");
  const int64_t T = indices.dimensions()[0], E = indices.dimensions()[1];
  f->T = T;
  f->E = E;
  if (at.mode < engram::kModeFill || at.mode > engram::kModeChecked) return op_error(op, "bad mode " + num(at.mode));
  if (at.sf_layout != engram::kSfRow && at.sf_layout != engram::kSfTmaColMajor)
    return op_error(op, "bad sf_layout " + num(at.sf_layout));
  if (data.size_bytes() != static_cast<uint64_t>(T * E * at.row_bytes))
    return op_error(op, "data result has " + num(data.size_bytes()) + " bytes, expected T*E*row_bytes = " +
                            num(T * E * at.row_bytes));
  const int64_t P = at.num_sf_packs;
  f->P = P;
  const int64_t sf_elems = P > 0 ? engram::sf_out_elems(T, E * P, static_cast<int32_t>(at.sf_layout)) : 0;
  if (sf_out.size_bytes() != static_cast<uint64_t>(sf_elems * engram::kSfWordBytes))
    return op_error(op, "sf result has " + num(sf_out.size_bytes()) + " bytes, expected " +
                            num(sf_elems * engram::kSfWordBytes));
  if (status.size_bytes() != sizeof(int32_t)) return op_error(op, "status result must be one int32");
  f->total = static_cast<int64_t>(m.nranks) * at.num_entries;
  if (auto e = check_region(m, at.alloc_id, at.offset, static_cast<uint64_t>(at.num_entries) * at.row_bytes, op,
                            &f->a);
      !e.success())
    return e;
  return sf_region(m, at.sf_alloc_id, at.sf_offset,
                   static_cast<uint64_t>(P > 0 ? f->total * P * engram::kSfWordBytes : 0), op, &f->sf_table);
}

// mode="checked": the refusal of a fetch whose flat position `pos` (of T*E, E entries per token) holds `id`, not in
// [0, total). The CPU fetch raises it by itself, the CUDA wait after reading the fetch's status: one message.
inline ffi::Error refuse_out_of_range(int32_t op, int32_t rank, int64_t id, int64_t pos, int64_t E, int64_t total) {
  const int64_t e = E > 0 ? E : 1;
  return op_error(op,
                  "index out of range in mode='checked': id " + num(id) + " at flat position " + num(pos) +
                      " (token " + num(pos / e) + ", entry " + num(pos % e) + ") on rank " + num(rank) +
                      " is not in [0, " + num(total) + ") = [0, num_ranks*num_entries)",
                  ffi::ErrorCode::kOutOfRange);
}

// The wait's checked-mode status (EngramWaitAttrs::check_total): int32 [1] (position) or [2] (position, rank).
inline ffi::Error check_wait_status(int32_t op, const ffi::AnyBuffer& status, const ffi::AnyBuffer& indices) {
  if (status.element_type() != ffi::DataType::S32 || status.element_count() < 1 || status.element_count() > 2)
    return op_error(op, "a checked wait's status must be int32 [1] or [2]");
  if (indices.element_type() != ffi::DataType::S32 || indices.dimensions().size() != 2)
    return op_error(op, "a checked wait's indices must be an int32 [T, E] array");
  return ffi::Error::Success();
}

}  // namespace engram_validate
}  // namespace jax_engram
