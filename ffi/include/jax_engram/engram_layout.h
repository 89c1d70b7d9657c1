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

}  // namespace jax_engram::engram
