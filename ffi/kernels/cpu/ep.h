// CPU backend of EP dispatch / combine: the pull protocol of docs/DESIGN.md, offsets from ep_layout.h.
// Each function runs one call on one member (rank), synchronously: stage own data, publish, wait for the
// peers (bounded), pull. On failure it records the error in the member's ErrorRecord and returns false.
#pragma once
#include <cstdint>

#include "jax_engram/ep_layout.h"
#include "runtime/runtime.h"

namespace jax_engram::cpu {

struct EpConfig {
  int64_t M = 0;  // max_tokens_per_rank
  int64_t N = 0;  // local tokens (rows of x / topk_idx)
  int64_t K = 0;  // top-k
  int64_t E = 0;  // experts
  int64_t A = 1;  // expert alignment
  bool expand = false;
  int64_t rows = 0;  // rows of the receive layout (R*M or ep_rows_expand)
};

struct EpDispatchArgs {
  EpConfig c;
  const uint8_t* x = nullptr;   // [N, x_bytes]
  int64_t x_bytes = 0;          // bytes per row of x
  const uint8_t* sf = nullptr;  // [N, sf_bytes] or null
  int64_t sf_bytes = 0;         // P * 4
  const int32_t* topk = nullptr;  // [N, K]
  const float* w = nullptr;       // [N, K] or null
  // results
  uint8_t* recv_x = nullptr;     // [rows, x_bytes]
  uint8_t* recv_sf = nullptr;    // [rows, sf_bytes]
  int32_t* recv_topk = nullptr;  // [R*M, K] (non-expand) or null
  float* recv_w = nullptr;       // [R*M, K] | [rows] or null
  int32_t* psum_rank = nullptr;  // [R]
  int32_t* psum_expert = nullptr;  // [E_loc]
  int32_t* unaligned = nullptr;    // [E_loc]
  int32_t* meta = nullptr;         // [R*M, K+2]
  int32_t* dst_row = nullptr;      // [N, R]
  int32_t* num_recv = nullptr;     // []
  int32_t* group_sizes = nullptr;  // [E_loc]
};

struct EpCachedArgs {
  EpConfig c;
  const uint8_t* x = nullptr;
  int64_t x_bytes = 0;
  const uint8_t* sf = nullptr;
  int64_t sf_bytes = 0;
  const float* w = nullptr;            // [N, K] or null
  const int32_t* meta = nullptr;       // handle: [R*M, K+2]
  const int32_t* psum_rank = nullptr;  // handle: [R]
  const int32_t* psum_expert = nullptr;  // handle: [E_loc]
  const int32_t* unaligned = nullptr;    // handle: [E_loc]
  uint8_t* recv_x = nullptr;
  uint8_t* recv_sf = nullptr;
  float* recv_w = nullptr;
};

enum class EpFloat { kBF16, kF32 };

struct EpCombineArgs {
  EpConfig c;
  EpFloat dtype = EpFloat::kBF16;
  int64_t H = 0;                       // hidden (elements)
  const uint8_t* y = nullptr;          // [rows, H]
  const float* w = nullptr;            // non-expand [R*M, K], expand [rows], or null
  const uint8_t* bias0 = nullptr;      // [N, H] or null
  const uint8_t* bias1 = nullptr;      // [N, H] or null
  const int32_t* meta = nullptr;       // [R*M, K+2]
  const int32_t* dst_row = nullptr;    // [N, R]
  const int32_t* topk = nullptr;       // [N, K]
  const int32_t* psum_rank = nullptr;  // [R]
  uint8_t* out = nullptr;              // [N, H]
  float* out_w = nullptr;              // [N, K] or null
};

// The one-rank local path's row scatter (jax_engram/_ep_local.py, expand layout; the CUDA kernel: cuda/ep_local.cu):
// out[r] = x[src[r]] where src[r] is a token in [0, N) that lists r among its destinations dest[src[r], :], else a
// zero row (in a layout made from the routing the two always agree). Rows move as bytes.
void ep_local_scatter(const uint8_t* x, const int32_t* dest, const int32_t* src, uint8_t* out, int64_t N, int64_t K,
                      int64_t rows, int64_t row_bytes);
// The one-rank local path's expand layout of a checked routing (jax_engram/_ep_local.py; the CUDA kernel:
// cuda/ep_local.cu), N * K <= kEpLocalLayoutMaxEntries: entry (t, k) with a valid expert e (ids outside [0, E) are
// none) goes to receive row start[e] + its rank among e's entries in (t, k) order, start[e] = the sum of
// align(count, A) over the experts before e. Writes every handle array of that layout (ep_layout.h "recv_src_metadata";
// rows and tokens past the real counts: -1) and, per receive row, its source entry t * K + k (N * K: none) and token
// (N: none).
struct EpLocalLayoutArgs {
  const int32_t* topk = nullptr;   // [N, K]
  int64_t N = 0, K = 0, E = 0, A = 1, M = 0, rows = 0;
  int32_t* exp_row = nullptr;      // [N, K]: the receive row of entry (t, k), -1: none
  int32_t* src_entry = nullptr;    // [rows]
  int32_t* src_tok = nullptr;      // [rows]
  int32_t* count = nullptr;        // [E]: entries per expert
  int32_t* aligned = nullptr;      // [E]: align(count, A)
  int32_t* psum_expert = nullptr;  // [E]: start + count
  int32_t* meta = nullptr;         // [M, K + 2]: [t, master k, exp_row[t, :]] per receive token, -1 past them
  int32_t* dst_row = nullptr;      // [N]: the token's receive row (tokens with an expert, in order), -1: none
  int32_t* num_recv = nullptr;     // [1]: tokens with an expert
};
void ep_local_layout(const EpLocalLayoutArgs& a);
// The routing check of a dispatch without the dispatch (the one-rank local path's guard, jax_engram/_ep_local.py):
// the first bad entry of topk [N, K] (an id outside [-1, E), a valid id listed twice in a token), found in the same
// order as ep_dispatch finds it, is recorded in the member's ErrorRecord as ep_dispatch records it; returns false
// then. Touches nothing else (no window, no sequence).
bool ep_guard(Member& m, const int32_t* topk, int64_t N, int64_t K, int64_t E);
// The guard over a group's routing records (EpGuardAttrs records = 1): rec [R + 1, 3]. Records the first offender
// (the smallest global rank with a bad entry) as this rank (rec[R][0]) would see a peer's bad routing; false then.
bool ep_guard_records(Member& m, const int32_t* rec, int64_t R);

// `region` is the staging allocation, `offset` the staging region's offset in it (same on every rank).
bool ep_dispatch(Member& m, Allocation& region, uint64_t offset, const EpDispatchArgs& a);
bool ep_dispatch_cached(Member& m, Allocation& region, uint64_t offset, const EpCachedArgs& a);
bool ep_combine(Member& m, Allocation& region, uint64_t offset, const EpCombineArgs& a);

}  // namespace jax_engram::cpu
