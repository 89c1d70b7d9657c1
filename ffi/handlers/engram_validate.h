// Validation shared by the CPU and CUDA Engram handlers: what write and fetch accept (sizes of the operands and
// results, the static attributes) and the window regions they touch, with messages that name the argument.
#pragma once
#include <string>

#include "handlers/common.h"
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

// write: the shard (storage) and the scale-factor table (sf) against the attributes; the own table region and the
// sf region.
struct WriteRegions {
  uint64_t n = 0;  // bytes of the shard
  Allocation* a = nullptr;
  uint8_t* sf_dst = nullptr;
};
inline ffi::Error check_write(int32_t op, Member& m, const ffi::AnyBuffer& storage, const ffi::AnyBuffer& sf,
                              int64_t alloc_id, int64_t offset, int64_t num_entries, int64_t row_bytes,
                              int64_t sf_alloc_id, int64_t sf_offset, int64_t sf_bytes, WriteRegions* w) {
  w->n = static_cast<uint64_t>(num_entries) * row_bytes;
  if (storage.size_bytes() != w->n)
    return op_error(op, "storage has " + num(storage.size_bytes()) + " bytes, the table shard needs " + num(w->n) +
                            " (num_entries " + num(num_entries) + " x " + num(row_bytes) + " bytes per row)");
  if (sf.size_bytes() != static_cast<uint64_t>(sf_bytes))
    return op_error(op, "sf has " + num(sf.size_bytes()) + " bytes, expected " + num(sf_bytes));
  if (auto e = check_region(m, alloc_id, offset, w->n, op, &w->a); !e.success()) return e;
  return sf_region(m, sf_alloc_id, sf_offset, sf_bytes, op, &w->sf_dst);
}

// fetch: indices [T, E] int32, the data / sf / status results, mode and sf layout; the table region (every peer's)
// and the sf region.
struct FetchShapes {
  int64_t T = 0, E = 0;  // tokens, entries per token
  int64_t P = 0;         // scale-factor packs per row
  int64_t total = 0;     // rows of the whole table: num_ranks * num_entries
  Allocation* a = nullptr;
  uint8_t* sf_table = nullptr;
};
inline ffi::Error check_fetch(int32_t op, Member& m, const ffi::AnyBuffer& indices, const ffi::AnyBuffer& data,
                              const ffi::AnyBuffer& sf_out, const ffi::AnyBuffer& status, int64_t alloc_id,
                              int64_t offset, int64_t num_entries, int64_t row_bytes, int64_t mode,
                              int64_t sf_alloc_id, int64_t sf_offset, int64_t num_sf_packs, int64_t sf_layout,
                              FetchShapes* f) {
  if (indices.element_type() != ffi::DataType::S32 || indices.dimensions().size() != 2)
    return op_error(op, "indices must be an int32 [T, E] array");
  const int64_t T = indices.dimensions()[0], E = indices.dimensions()[1];
  f->T = T;
  f->E = E;
  if (mode < engram::kModeFill || mode > engram::kModeChecked) return op_error(op, "bad mode " + num(mode));
  if (sf_layout != engram::kSfRow && sf_layout != engram::kSfTmaColMajor)
    return op_error(op, "bad sf_layout " + num(sf_layout));
  if (data.size_bytes() != static_cast<uint64_t>(T * E * row_bytes))
    return op_error(op, "data result has " + num(data.size_bytes()) + " bytes, expected T*E*row_bytes = " +
                            num(T * E * row_bytes));
  const int64_t P = num_sf_packs;
  f->P = P;
  const int64_t sf_elems = P > 0 ? engram::sf_out_elems(T, E * P, static_cast<int32_t>(sf_layout)) : 0;
  if (sf_out.size_bytes() != static_cast<uint64_t>(sf_elems * engram::kSfWordBytes))
    return op_error(op, "sf result has " + num(sf_out.size_bytes()) + " bytes, expected " +
                            num(sf_elems * engram::kSfWordBytes));
  if (status.size_bytes() != sizeof(int32_t)) return op_error(op, "status result must be one int32");
  f->total = static_cast<int64_t>(m.nranks) * num_entries;
  if (auto e = check_region(m, alloc_id, offset, static_cast<uint64_t>(num_entries) * row_bytes, op, &f->a);
      !e.success())
    return e;
  return sf_region(m, sf_alloc_id, sf_offset,
                   static_cast<uint64_t>(P > 0 ? f->total * P * engram::kSfWordBytes : 0), op, &f->sf_table);
}

// fetch: the gather configuration attributes (EngramConfig). Checked on every backend, used by CUDA only.
struct GatherConfig {
  int32_t gather = engram::kGatherSm;
  int32_t sms = 1;
  int64_t tma_smem_bytes = engram::kTmaMinSmemBytes;
  int32_t loads = engram::kLoadsAuto;
  int32_t blocks_per_sm = 0;
};
inline ffi::Error check_gather_config(int32_t op, int64_t gather, int64_t gather_sms, int64_t tma_smem_bytes,
                                      int64_t sm_loads, int64_t sm_blocks_per_sm, GatherConfig* g) {
  if (gather != engram::kGatherSm && gather != engram::kGatherTma && gather != engram::kGatherSmFew)
    return op_error(op, "bad gather " + num(gather) + " (0 = sm, 1 = tma, 2 = sm_few)");
  if (gather_sms < 1 || gather_sms > engram::kMaxGatherSms)
    return op_error(op, "gather_sms " + num(gather_sms) + " is not in [1, " + num(engram::kMaxGatherSms) + "]");
  if (tma_smem_bytes < engram::kTmaMinSmemBytes || tma_smem_bytes > (int64_t{1} << 30))
    return op_error(op, "tma_smem_bytes " + num(tma_smem_bytes) + " is below the minimum " +
                            num(engram::kTmaMinSmemBytes));
  if (sm_loads < engram::kLoadsAuto || sm_loads > engram::kLoadsPlain)
    return op_error(op, "bad sm_loads " + num(sm_loads) + " (0 auto, 1 volatile, 2 cg, 3 plain)");
  if (sm_blocks_per_sm < 0 || sm_blocks_per_sm > engram::kMaxBlocksPerSm)
    return op_error(op, "sm_blocks_per_sm " + num(sm_blocks_per_sm) + " is not in [0, " +
                            num(engram::kMaxBlocksPerSm) + "]");
  g->gather = static_cast<int32_t>(gather);
  g->sms = static_cast<int32_t>(gather_sms);
  g->tma_smem_bytes = tma_smem_bytes;
  g->loads = static_cast<int32_t>(sm_loads);
  g->blocks_per_sm = static_cast<int32_t>(sm_blocks_per_sm);
  return ffi::Error::Success();
}

}  // namespace engram_validate
}  // namespace jax_engram
