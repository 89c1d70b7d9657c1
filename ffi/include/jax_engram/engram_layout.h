// Engram layout: the one source of truth for how a global id finds its row, what padded and out-of-range ids
// do, and where scale factors go in the two output layouts. Shared by the CPU gather and the CUDA kernel.
//
// Table: every rank of the context axis owns `num_entries` rows of `row_bytes` bytes, row-major at the same
// region offset of its symmetric allocation. Global id g in [0, nranks*num_entries):
//   owner = g / num_entries, row = g % num_entries, source = peers[owner] + region_offset + row*row_bytes.
// Lookup of indices [T, E] (flat position i = t*E + e) writes out[i*row_bytes, +row_bytes), i.e. data
// [T, E*hidden] with the E rows of token t concatenated along hidden.
//   g < 0            padding: zero row, zero scale factors (every mode).
//   g >= total       mode kFill: zero row / sf; kClip: read id total-1; kChecked: zero row / sf and the op
//                    reports kErrIdOutOfRange with the FIRST bad flat position (detail) and its id (observed).
// Scale factors (optional): a replicated table sf[total, P] of 4-byte words (float32 or int32 = packed
// UE8M0x4) indexed by global id. Output element j = e*P + p of token t goes to
//   kSfRow:          out[t*(E*P) + j]                                   ([T, E*P])
//   kSfTmaColMajor:  out[j*align(T, 4) + t], columns t in [T, align(T,4)) zero   ([E*P, align(T, 4)])
#pragma once
#include "jax_engram/hd.h"

namespace jax_engram::engram {

enum Mode : int32_t { kModeFill = 0, kModeClip = 1, kModeChecked = 2 };
enum SfLayout : int32_t { kSfRow = 0, kSfTmaColMajor = 1 };

inline constexpr int64_t kSfTokenAlign = 4;   // DeepEP kNumAlignedSFPacks: 16-byte columns for TMA
inline constexpr int64_t kSfWordBytes = 4;    // float32 or int32 (UE8M0 x4)
// Fetch status word (int32): 0, or in checked mode the minimum bad flat position, kNoBadPosition if none
// (memset-able: every byte 0x7f). Flat positions T*E must stay below it (checked in Python).
inline constexpr int32_t kNoBadPosition = 0x7f7f7f7f;

// The id actually read for a looked-up id g, or -1 for a zero row. *out_of_range: g >= total (any mode).
JE_HD int64_t resolve_id(int64_t g, int64_t total, int32_t mode, bool* out_of_range) {
  *out_of_range = g >= total;
  if (g < 0) return -1;
  if (g < total) return g;
  return mode == kModeClip ? total - 1 : -1;
}

JE_HD int64_t sf_columns(int64_t T, int32_t layout) { return layout == kSfTmaColMajor ? align_up(T, kSfTokenAlign) : T; }

// Number of 4-byte elements of the sf output for T tokens and EP = E*P packs per token.
JE_HD int64_t sf_out_elems(int64_t T, int64_t EP, int32_t layout) { return sf_columns(T, layout) * EP; }

// Element index of (token t, pack j in [0, E*P)) in the sf output.
JE_HD int64_t sf_out_index(int64_t t, int64_t j, int64_t T, int64_t EP, int32_t layout) {
  return layout == kSfTmaColMajor ? j * align_up(T, kSfTokenAlign) + t : t * EP + j;
}

// Write of `n` rows of every rank's shard (1 <= n <= num_entries; n = num_entries: the whole shard). The requested
// start row is a device operand, so it is clamped as XLA's dynamic_update_slice clamps its start indices: the rows
// always land inside the shard. Data: own rows [start, start + n). Scale factors: the written operand holds the
// rows of every rank's slice, rank-major ([nranks * n, P]); rank q's go to global rows q*num_entries + start.
JE_HD int64_t write_start_row(int64_t requested, int64_t num_entries, int64_t n) {
  const int64_t last = num_entries - n;
  return requested < 0 ? 0 : requested > last ? last : requested;
}

// Widest power-of-two access (<= 16 bytes) that divides the row size: rows then start aligned to it (region
// offsets and XLA buffers are at least 64-byte aligned), so every access of a row is naturally aligned and
// rows whose size is not a multiple of 16 need no separate tail.
JE_HD int vector_bytes(int64_t row_bytes) {
  if (row_bytes % 16 == 0) return 16;
  if (row_bytes % 8 == 0) return 8;
  if (row_bytes % 4 == 0) return 4;
  if (row_bytes % 2 == 0) return 2;
  return 1;
}

// Division by a runtime-invariant divisor d >= 1 for dividends in [0, 2^31): multiply-high and shift
// (Granlund-Montgomery, as in CUTLASS's FastDivmod). Built on the host, used in the kernels' inner loops.
struct FastDiv {
  uint32_t d = 1, mul = 0, shift = 0;
  FastDiv() = default;
  explicit FastDiv(uint32_t divisor) : d(divisor) {
    if (d == 1) return;  // mul = 0 marks the identity
    uint32_t l = 0;
    while ((1ull << l) < d) ++l;  // ceil(log2 d)
    const uint64_t p = 31 + l;
    mul = static_cast<uint32_t>(((1ull << p) + d - 1) / d);
    shift = static_cast<uint32_t>(p - 32);
  }
  JE_HD uint32_t div(uint32_t n) const {
    if (mul == 0) return n;
    return static_cast<uint32_t>((static_cast<uint64_t>(n) * mul) >> 32) >> shift;
  }
};

// ---- gather configuration (jax_engram/config.py EngramConfig, passed as fetch attributes) ----------------------
// Gather: how the CUDA gather moves rows. kGatherSm: vector loads / stores by a grid of resident 256-thread blocks.
// kGatherTma: bulk copies global -> shared -> global (cp.async.bulk) on at most `gather_sms` CTAs (TmaPlan below).
// kGatherSmFew: the vector gather on at most `gather_sms` CTAs (what kGatherTma runs where bulk copies cannot).
enum Gather : int32_t { kGatherSm = 0, kGatherTma = 1, kGatherSmFew = 2 };
// Loads of the kGatherSm path: kLoadsAuto = kLoadsCg for tables in HBM, kLoadsVolatile for host memory.
enum Loads : int32_t { kLoadsAuto = 0, kLoadsVolatile = 1, kLoadsCg = 2, kLoadsPlain = 3 };
inline constexpr int32_t kMaxGatherSms = 1024;
inline constexpr int32_t kMaxBlocksPerSm = 64;

// ---- host-table path (jax_engram/config.py EngramConfig.host_gather; runtime/host_gather.h) -------------------
// HostGather: who moves the rows of a host-placed table on a GPU. kHostGatherGpu: the GPU gather above reads host
// memory over the link (its rate falls with the table size where an IOMMU translates device reads of host
// memory). kHostGatherCpu: CPU worker threads gather into pinned staging and the copy engine moves each chunk (no
// SMs). "auto" (resolved in Python): cpu for overlapped fetches; for lookups gpu while the per-rank shard is at
// most kHostGatherGpuMaxShardBytes, else cpu.
enum HostGather : int32_t { kHostGatherGpu = 0, kHostGatherCpu = 1 };
inline constexpr int64_t kHostGatherGpuMaxShardBytes = int64_t{1} << 30;
inline constexpr int32_t kMaxHostThreads = 256;
// Work item of a host gather (rows pulled by one worker at a time) and flagged chunk (one host->GPU copy each), at
// most these sizes.
inline constexpr int64_t kHostGatherItemBytes = int64_t{128} << 10;
inline constexpr int64_t kHostGatherChunkBytes = int64_t{2} << 20;
// Small gathers (a decode step's few MiB) use smaller pieces, down to these sizes: workers wake one after another,
// so every worker should find kHostGatherItemsPerThread items to pull (the first awake take more), and the copy
// engine should start after the first of at least kHostGatherMinChunks chunks rather than after the whole gather.
// Each chunk costs the launching thread two stream calls (a flag wait and a copy) inside the model's step, so a
// small gather is cut into few chunks: two halves down to 512 KiB each.
inline constexpr int64_t kHostGatherMinItemBytes = int64_t{16} << 10;
inline constexpr int64_t kHostGatherItemsPerThread = 8;
inline constexpr int64_t kHostGatherMinChunkBytes = int64_t{512} << 10;
inline constexpr int64_t kHostGatherMinChunks = 2;

// How one host gather of n rows of row_bytes by `threads` workers is cut: item_rows rows per work item,
// chunk_items items per flagged chunk.
struct HostGatherPlan {
  int64_t item_rows = 1, chunk_items = 1;
};
JE_HD HostGatherPlan host_gather_plan(int64_t n, int64_t row_bytes, int64_t threads) {
  const int64_t rb = row_bytes > 0 ? row_bytes : 1;
  const int64_t bytes = (n > 0 ? n : 0) * rb;
  const int64_t per = bytes / ((threads > 0 ? threads : 1) * kHostGatherItemsPerThread);
  const int64_t item_bytes = per < kHostGatherMinItemBytes ? kHostGatherMinItemBytes
                             : per > kHostGatherItemBytes  ? kHostGatherItemBytes
                                                           : per;
  HostGatherPlan p;
  p.item_rows = item_bytes / rb > 0 ? item_bytes / rb : 1;
  const int64_t share = bytes / kHostGatherMinChunks;
  const int64_t chunk_bytes = share < kHostGatherMinChunkBytes ? kHostGatherMinChunkBytes
                              : share > kHostGatherChunkBytes  ? kHostGatherChunkBytes
                                                               : share;
  p.chunk_items = chunk_bytes / (p.item_rows * rb) > 0 ? chunk_bytes / (p.item_rows * rb) : 1;
  return p;
}

// ---- bulk-copy (TMA) gather plan --------------------------------------------------------------------------
// The output [T*E*row_bytes] is cut into `chunks` of `chunk_bytes` (the last one shorter). Every CTA runs
// kTmaWarps independent pipelines (one per warp); global warp w = cta*kTmaWarps + warp takes chunks w, w + W,
// w + 2W, ... (W = grid*kTmaWarps) through its `stages` shared-memory buffers of chunk_bytes: the warp's lanes
// issue one bulk copy per row piece of a chunk (global -> shared, completing on the stage's mbarrier), and lane 0
// writes the whole chunk back with one bulk copy (shared -> global) once it has landed. A row piece is the part
// of one row inside one chunk: rows larger than a chunk span several chunks, small rows share one. Bulk copies
// need 16-byte sizes and addresses, hence chunk_bytes and row_bytes multiples of 16 (tma_eligible).
inline constexpr int32_t kTmaWarps = 4;
inline constexpr int32_t kTmaStages = 4;
inline constexpr int64_t kTmaAlign = 16;
inline constexpr int64_t kTmaMinChunk = 1024;
inline constexpr int64_t kTmaMaxChunk = 32768;   // well inside an mbarrier's transaction count (2^20 - 1)
inline constexpr int64_t kTmaMinSmemBytes = kTmaWarps * kTmaStages * kTmaMinChunk;  // 16 KiB

struct TmaPlan {
  int64_t chunk_bytes = 0;  // multiple of kTmaAlign
  int64_t chunks = 0;       // ceil(total bytes / chunk_bytes)
  int32_t stages = 0;       // buffers per warp
  int32_t grid = 0;         // CTAs, in [1, gather_sms]
  int64_t smem_bytes = 0;   // dynamic shared memory per CTA = kTmaWarps * stages * chunk_bytes
};

// Bulk copies can move these rows: 16-byte row sizes, table region offset and output address.
JE_HD bool tma_eligible(int64_t row_bytes, uint64_t table_offset, uint64_t out_address) {
  return row_bytes > 0 && row_bytes % kTmaAlign == 0 && table_offset % kTmaAlign == 0 && out_address % kTmaAlign == 0;
}

// Plan of a gather of n_rows rows of row_bytes on at most `sms` CTAs with at most `smem_budget` bytes of shared
// memory per CTA. Chunks are as large as the budget allows (fewer copies and waits per byte) but small enough that
// every pipeline of the grid gets kTmaStages of them when the lookup is small (all rows in flight at once).
JE_HD TmaPlan tma_plan(int64_t n_rows, int64_t row_bytes, int32_t sms, int64_t smem_budget) {
  TmaPlan p;
  p.stages = kTmaStages;
  const int64_t bytes = n_rows * row_bytes;
  int64_t cmax = smem_budget / (kTmaWarps * kTmaStages) / kTmaAlign * kTmaAlign;
  cmax = cmax < kTmaMinChunk ? kTmaMinChunk : (cmax > kTmaMaxChunk ? kTmaMaxChunk : cmax);
  const int64_t pipelines = static_cast<int64_t>(sms < 1 ? 1 : sms) * kTmaWarps;
  int64_t c = static_cast<int64_t>(align_up(static_cast<uint64_t>(ceil_div(bytes, pipelines * kTmaStages)), kTmaAlign));
  c = c < kTmaMinChunk ? kTmaMinChunk : (c > cmax ? cmax : c);
  p.chunk_bytes = c;
  p.chunks = bytes > 0 ? ceil_div(bytes, c) : 0;
  const int64_t g = ceil_div(p.chunks, kTmaWarps);
  p.grid = static_cast<int32_t>(g < 1 ? 1 : (g > sms ? (sms < 1 ? 1 : sms) : g));
  p.smem_bytes = static_cast<int64_t>(kTmaWarps) * p.stages * c;
  return p;
}

// Rows [*r0, *r1] (inclusive) that chunk `c` of a plan touches; false for an empty chunk.
JE_HD bool tma_chunk_rows(int64_t c, int64_t chunk_bytes, int64_t row_bytes, int64_t n_rows, int64_t* r0,
                          int64_t* r1) {
  const int64_t total = n_rows * row_bytes, b0 = c * chunk_bytes;
  if (b0 >= total || row_bytes <= 0) return false;
  const int64_t b1 = b0 + chunk_bytes < total ? b0 + chunk_bytes : total;
  *r0 = b0 / row_bytes;
  *r1 = (b1 - 1) / row_bytes;
  return true;
}

// Piece of row `row` inside chunk `c`: bytes [*row_off, *row_off + *len) of the row go to bytes [*stage_off, ..)
// of the chunk's stage buffer (and so to output byte c*chunk_bytes + *stage_off).
JE_HD void tma_piece(int64_t c, int64_t chunk_bytes, int64_t row_bytes, int64_t n_rows, int64_t row, int64_t* row_off,
                     int64_t* stage_off, int64_t* len) {
  const int64_t total = n_rows * row_bytes, b0 = c * chunk_bytes;
  const int64_t b1 = b0 + chunk_bytes < total ? b0 + chunk_bytes : total;
  const int64_t lo = row * row_bytes > b0 ? row * row_bytes : b0;
  const int64_t hi = (row + 1) * row_bytes < b1 ? (row + 1) * row_bytes : b1;
  *row_off = lo - row * row_bytes;
  *stage_off = lo - b0;
  *len = hi - lo;
}

}  // namespace jax_engram::engram
