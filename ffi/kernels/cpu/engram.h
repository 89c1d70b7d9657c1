// CPU Engram gather (layout and id semantics in jax_engram/engram_layout.h). One routine over a range of flat
// positions serves the CPU backend's fetch and the host-table path of the CUDA fetch (runtime/host_gather.h runs
// it on worker threads).
#pragma once
#include <cstdint>

namespace jax_engram::cpu {

struct EngramGather {
  const int32_t* ids = nullptr;          // [T, E] global ids (host-readable)
  int64_t T = 0, E = 0;
  int64_t num_entries = 0;               // rows per rank
  int32_t nranks = 0;
  uint8_t* const* peers = nullptr;       // base of the table's allocation on every rank (host-readable view)
  int64_t offset = 0;                    // region offset of the table in that allocation
  int64_t row_bytes = 0;
  int32_t mode = 0;                      // engram::Mode
  uint8_t* out = nullptr;                // [T*E, row_bytes]: the result or a staging buffer
  bool streaming = true;                 // non-temporal stores into `out` where rows are 16-byte aligned
  // Scale factors (sf_table == nullptr: none).
  const uint32_t* sf_table = nullptr;    // [nranks*num_entries, P] 4-byte words
  int64_t P = 0;
  int32_t sf_layout = 0;                 // engram::SfLayout
  uint32_t* sf_out = nullptr;            // engram::sf_out_elems(T, E*P, sf_layout) words
};

// Flat position of the first id >= nranks*num_entries, or -1 if none.
int64_t engram_first_out_of_range(const int32_t* ids, int64_t n, int64_t total);

// Gathers the rows of flat positions [begin, end) of `g` (negative ids: zero rows; out of range: g.mode, checked
// like fill). Software prefetch a few dozen rows ahead; with g.streaming, 16-byte non-temporal stores followed by
// a store fence (so the rows are globally visible when this returns). Returns the first out-of-range flat
// position in the range, or -1.
int64_t engram_gather_rows(const EngramGather& g, int64_t begin, int64_t end);

// Gathers every scale factor of `g` (no-op without an sf table).
void engram_gather_sf(const EngramGather& g);
// The scale factors of flat positions [begin, end) only; with the col-major layout the padding columns
// (engram_zero_sf_padding) are not touched.
void engram_gather_sf_range(const EngramGather& g, int64_t begin, int64_t end);
// Zeroes the col-major layout's padding columns t in [T, align(T, 4)) (no-op otherwise).
void engram_zero_sf_padding(const EngramGather& g);

// Gathers every row and sf of `g` on the calling thread.
void engram_gather(const EngramGather& g);

// A write of `rows` rows of every rank's shard (EngramTable.write; where they land: engram::write_start_row).
struct EngramWrite {
  uint8_t* shard = nullptr;              // own table region [num_entries, row_bytes]
  const uint8_t* src = nullptr;          // [rows, row_bytes]
  int64_t num_entries = 0, rows = 0, row_bytes = 0;
  int64_t start = 0;                     // engram::write_start_row of the requested offset
  int32_t nranks = 0;
  uint8_t* sf_table = nullptr;           // own replicated sf table [nranks*num_entries, sf_row_bytes] (nullptr: none)
  const uint8_t* sf_src = nullptr;       // [nranks*rows, sf_row_bytes], rank-major
  int64_t sf_row_bytes = 0;
};
void engram_write(const EngramWrite& w);

// Measurement helpers (the CPU module's host_memory_bandwidth / host_gather_rate): `threads` threads over
// [0, bytes) each. GB/s of one pass.
struct HostBandwidth {
  double read_gbps = 0, memcpy_gbps = 0, nt_write_gbps = 0;
};
HostBandwidth host_memory_bandwidth(int64_t bytes, int threads);

}  // namespace jax_engram::cpu
