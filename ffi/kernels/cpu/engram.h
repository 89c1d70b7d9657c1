// CPU Engram gather (layout and id semantics in jax_engram/engram_layout.h).
#pragma once
#include <cstdint>

namespace jax_engram::cpu {

struct EngramGather {
  const int32_t* ids = nullptr;          // [T, E] global ids
  int64_t T = 0, E = 0;
  int64_t num_entries = 0;               // rows per rank
  int32_t nranks = 0;
  uint8_t* const* peers = nullptr;       // base of the table's allocation on every rank (this member's view)
  int64_t offset = 0;                    // region offset of the table in that allocation
  int64_t row_bytes = 0;
  int32_t mode = 0;                      // engram::Mode
  uint8_t* out = nullptr;                // [T*E, row_bytes]
  // Scale factors (sf_table == nullptr: none).
  const uint32_t* sf_table = nullptr;    // [nranks*num_entries, P] 4-byte words
  int64_t P = 0;
  int32_t sf_layout = 0;                 // engram::SfLayout
  uint32_t* sf_out = nullptr;            // engram::sf_out_elems(T, E*P, sf_layout) words
};

// Flat position of the first id >= nranks*num_entries, or -1 if none.
int64_t engram_first_out_of_range(const int32_t* ids, int64_t n, int64_t total);

// Gathers every row (and sf) of `g`. Out-of-range ids follow g.mode (checked: zero rows, like fill).
void engram_gather(const EngramGather& g);

}  // namespace jax_engram::cpu
