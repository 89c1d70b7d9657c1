// Host-side interface of the CUDA EP kernels (ep_dispatch.cu, ep_combine.cu, ep_guard.cu, ep_local.cu): parameter blocks and
// launchers.
// Plain C++ (no device code): included by handlers/cuda_ep.cc and the host orchestration (ep_copy_engine.cc).
//
// Both ops are ONE cooperative launch of `num_sms` CTAs each (push protocol: ep_layout.h, ep_dispatch.cu,
// ep_combine.cu), warp-specialised:
//   dispatch: layout (counting sort, grid barrier, header to every peer); "stage" warps store the rows each token
//             sends into the destinations' inbox slots and publish per-warp progress words there; "pull" warps wait
//             for the peers' headers in own memory, build the receive tables and copy rows out of the own inbox.
//   combine:  "stage" warps store the expert-side rows into the source ranks' slots (interleaved over sources,
//             progress words), "pull" warps reduce each own token's rows from the own slots in ascending
//             master-position order.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "jax_engram/ep_layout.h"
#include "runtime/runtime.h"

namespace jax_engram {

// Window + staging region of one member, for the EP kernels.
struct EpWindow {
  uint8_t* const* ws_peers = nullptr;  // device array: window (allocation 0) base of every rank
  uint8_t* ws_own = nullptr;
  uint8_t* const* st_peers = nullptr;  // device array: staging allocation base of every rank
  uint8_t* st_own = nullptr;
  uint64_t st_offset = 0;              // staging region offset inside its allocation (same on every rank)
  ErrorRecord* err = nullptr;
  uint64_t timeout_ns = 0;
  int32_t rank = 0, nranks = 0;
};

struct EpLaunch {
  int num_ctas = 24;     // persistent grid (SMs used)
  int stage_warps = 4;   // warps per CTA that stage (the rest pull); 1 <= stage_warps < kEpThreads/32
};

inline constexpr int kEpThreads = 512;  // threads per CTA of every EP kernel
inline constexpr int kEpMaxCtas = 160;  // scratch arrays are sized for this many CTAs
static_assert(kEpMaxCtas == kEpInboxCtas, "every CTA needs progress words in the inbox slots (ep_layout.h)");
static_assert(kEpThreads / 32 <= kEpInboxWarps, "every stage warp needs a progress word (ep_layout.h)");
static_assert(kEpThreads / 32 - 1 == kEpMaxStageWarps, "at least one warp per CTA receives (ep_layout.h)");

struct EpDispatchParams {
  EpWindow w;
  EpDispatchLayout L{};
  int32_t M = 0, N = 0, K = 0, E = 0, A = 1;
  int32_t expand = 0, zero_padding = 0;
  int64_t rows = 0;        // rows of recv_x (R*M or ep_rows_expand)
  int64_t x_bytes = 0;     // bytes per row of x / recv_x
  int64_t sf_bytes = 0;    // bytes per row of x_scales / recv_x_scales (P*4, 0 = none)
  // inputs
  const uint8_t* x = nullptr;
  const uint8_t* sf = nullptr;
  const int32_t* topk = nullptr;   // [N, K] (non-cached)
  const float* weights = nullptr;  // [N, K] or null
  const int32_t* token = nullptr;
  // cached-dispatch handle
  const int32_t* h_meta = nullptr;         // [R*M, K+2]
  const int32_t* h_psum_rank = nullptr;    // [R]
  const int32_t* h_psum_expert = nullptr;  // [E_loc]
  const int32_t* h_unaligned = nullptr;    // [E_loc]
  const int32_t* h_dst_row = nullptr;      // [N, R]: the sender side of the handle
  // outputs
  uint8_t* recv_x = nullptr;
  uint8_t* recv_sf = nullptr;
  int32_t* recv_topk = nullptr;    // non-expand [R*M, K] (non-cached) or null
  float* recv_w = nullptr;         // non-expand [R*M, K] | expand [rows] | null
  int32_t* psum_rank = nullptr;    // [R]           (non-cached)
  int32_t* psum_expert = nullptr;  // [E_loc]
  int32_t* unaligned = nullptr;    // [E_loc]
  int32_t* meta = nullptr;         // [R*M, K+2]
  int32_t* dst_row = nullptr;      // [N, R]
  int32_t* num_recv = nullptr;     // []
  int32_t* group_sizes = nullptr;  // [E_loc]
  int32_t* token_out = nullptr;
  // launch shape (filled by the launcher)
  int32_t chunk = 8;         // push chunks per CTA range (ep_dispatch_chunks; same on every rank: from M, G, SW)
  int32_t trace = 0;         // ep_trace_level() (ep_trace.h): printf of spans / phase times (diagnosis only)
  int32_t trace_cta = -1;    // ep_trace_cta(): the CTA traced beside CTA 0 (-1: the last)
  int32_t layout_warps = 0;
  int32_t smem_tables = 0;  // byte offset of the receive tables in dynamic shared memory
  int32_t smem_topk = -1;   // byte offset of the CTA's topk rows in dynamic shared memory (-1: read from global)
  // copy-engine rows (full dispatch): the peers' per-warp layout counters [R-1][layout_warps][R + E/R] and their topk
  // rows of the CTA's range [R-1][range][K] (-1: read from the inbox)
  int32_t smem_peer_cnt = 0;
  int32_t smem_peer_topk = -1;
  // Copy-engine rows (see "copy-engine rows" below): 0 = the stage warps store x rows to the peers; P > 0 = the
  // handler's copy streams write them in P pieces, piece j flagged by inbox ce[j] = seq, and this call must have
  // sequence number ce_seq (the host's count of the stream sequence's dispatch-type calls: the copies chose the half
  // by it).
  int32_t ce_pieces = 0;
  uint64_t ce_seq = 0;
  // the call's dispatch sequence (ep_layout.h EpSequence): its seq and ready words; kGraph never has ce_pieces
  EpSequence sequence = EpSequence::kStream;
  int32_t ce_taper = 0;  // piece sizes (ep_ce_piece_begin)
};

enum class EpDtype : int { kBF16 = 0, kF32 = 1 };

struct EpCombineParams {
  EpWindow w;
  EpCombineLayout L{};
  int32_t M = 0, N = 0, K = 0, E = 0, H = 0;
  int32_t expand = 0;
  int64_t rows = 0;         // rows of y
  EpDtype dtype = EpDtype::kBF16;  // y, biases and combined_x
  const uint8_t* y = nullptr;
  const float* weights = nullptr;  // non-expand [R*M, K] | expand [rows] | null
  const uint8_t* bias0 = nullptr;  // [N, H] or null
  const uint8_t* bias1 = nullptr;
  const int32_t* meta = nullptr;     // [R*M, K+2]
  const int32_t* dst_row = nullptr;  // [N, R]
  const int32_t* topk = nullptr;     // [N, K]
  const int32_t* psum_rank = nullptr;  // [R]
  const int32_t* token = nullptr;
  uint8_t* out = nullptr;    // [N, H]
  float* out_w = nullptr;    // [N, K] or null
  int32_t* token_out = nullptr;
  int32_t chunk = 8;         // rows per push chunk (same on every rank: from M, R, the CTA and stage warp counts)
  int32_t trace = 0;         // see EpDispatchParams
  int32_t trace_cta = -1;
};

// Combine push chunk (rows): each CTA owns ~`per_cta` rows, dealt round-robin to its stage warps in chunks, one
// progress release (fence + flag) per chunk; ~8 chunks per warp, 1..32 rows each. Larger chunks leave warps idle
// (the chunks of a source region are few and unevenly dealt).
inline int32_t ep_push_chunk(int64_t per_cta, int64_t stage_warps) {
  const int64_t q = 8 * stage_warps;
  const int64_t c = (per_cta + q - 1) / q;
  return static_cast<int32_t>(c < 1 ? 1 : (c > 32 ? 32 : c));
}

// Dispatch push chunks per CTA: the CTA's token range is cut into this many chunks of (almost) equal size (sizes
// differ by at most one token: ep_chunk_begin), dealt round-robin to the stage warps, so every stage warp pushes
// the same number of tokens give or take one per chunk (a fixed chunk size left some warps one chunk more, up to
// a third more data, and the CTA waits for its slowest warp). A multiple of stage_warps; ~4 chunks per warp for
// large ranges (receivers start early), at most 32 tokens per chunk (a chunk's positions are read one per lane).
inline int32_t ep_dispatch_chunks(int64_t per_cta, int64_t stage_warps) {
  int64_t m = (per_cta + 8 * stage_warps - 1) / (8 * stage_warps);
  m = m < 1 ? 1 : (m > 4 ? 4 : m);
  const int64_t m32 = (per_cta + 32 * stage_warps - 1) / (32 * stage_warps);
  if (m32 > m) m = m32;
  return static_cast<int32_t>(m * stage_warps);
}
// Copy-engine rows. The copy engine moves data over NVLink faster than SM or TMA stores, but it cannot follow the
// layout: its sizes are fixed when the host enqueues it. The inbox is indexed by token, so it does not need to: when
// (almost) every token goes to every peer (2 ranks at top-8, say), the host copies x's N rows whole into this rank's
// inbox slot on every peer, on a copy stream beside the kernel (ep_copy_engine.h). Ahead of them the same stream
// copies the routing rows (N, topk, weights, scales) and sets the slot's flag, and every receiver lays out the peer's
// tokens itself: each CTA runs the counting sort over its own range AND the same range of every peer's tokens, one
// grid barrier for both. So nothing but the copies crosses the link (SM-pushed routing rows would queue behind the
// copy traffic). Unused rows cross too; the policy (ep_ce_policy) accepts that only when the expected share is high.
// The rows go in P pieces so that receivers copy while the rest is still in flight: piece j is the range offsets
// [ep_ce_piece_begin(per, P, j), ep_ce_piece_begin(per, P, j + 1)) of EVERY CTA's token range (per =
// ep_tokens_per_cta), one strided copy per piece, so all CTAs receive in step and the tail after the last piece is
// about 1/P of each CTA's rows; then the copy stream writes ce[j] = seq into the peer's slot. Each piece and flag
// costs the copy engine a fixed time, more pieces shorten the tail: EPConfig.copy_engine_pieces (default 4).
// Taper: later pieces are smaller (4 pieces of 40 / 30 / 20 / 10 %), so the receivers' copy of the last piece, the
// call's tail, is shorter still.
inline constexpr int kEpCeTaper = 20;
// The pieces' bounds: ep_ce_piece_begin / ep_ce_piece_of (jax_engram/ep_layout.h).
// Chunks per CTA with copy-engine rows: the stage warps only push routing rows, so chunks are small (~2 tokens):
// a chunk is also the pull warps' unit of work, and after the last piece lands each CTA's share of it must spread
// over all of its pull warps. A multiple of stage_warps.
inline int32_t ep_ce_chunks(int64_t per_cta, int64_t stage_warps) {
  const int64_t n = (per_cta + 1) / 2;
  const int64_t m = (n + stage_warps - 1) / stage_warps;
  return static_cast<int32_t>((m < 1 ? 1 : m) * stage_warps);
}

// The one-rank local path's guard (jax_engram/_ep_local.py; ep_guard.cu): the dispatch's routing check alone.
struct EpGuardParams {
  const int32_t* topk = nullptr;  // [N, K]
  int32_t* topk_out = nullptr;    // [N, K]: the copy of topk
  int64_t N = 0;
  int32_t K = 0, E = 0;
  const int32_t* token = nullptr;  // 4 bytes, copied to token_out unless they are the same buffer
  int32_t* token_out = nullptr;
  ErrorRecord* err = nullptr;      // the member's error record
  int32_t rank = 0;
  int32_t records = 0;             // 1: topk is a group's routing records [N = R + 1, K = 3] (EpGuardAttrs)
};

// One launch on `stream` (a CTA per 256 tokens) copies topk to topk_out and records topk's first bad entry (an id outside [-1, E), a valid id
// listed twice in a token: the same entry, found in the same order, and the same record as the dispatch kernel's
// layout pass) in the member's error record; the next op's handler or ctx.check() reports it. No host sync.
// With p.records: one thread copies the records and records the group's first offender (cpu::ep_guard_records).
cudaError_t launch_ep_guard(const EpGuardParams& p, cudaStream_t stream);

// The one-rank local path's row scatter (ep_local.cu), expand layout: out[r] = x[src[r]] where src[r] is a token in
// [0, N) that lists r among its destinations dest[src[r], :], else a zero row (the CPU kernel's rule; in a layout
// made from the routing the two always agree). Rows move as bytes.
struct EpLocalScatterParams {
  const uint8_t* x = nullptr;     // [N, row_bytes]
  const int32_t* dest = nullptr;  // [N, K]: the receive row of entry (t, k), -1: none
  const int32_t* src = nullptr;   // [rows]: the source token of receive row r, outside [0, N): none (zeroed)
  uint8_t* out = nullptr;         // [rows, row_bytes]
  int64_t N = 0, rows = 0, row_bytes = 0;
  int32_t K = 0;
};

// One launch on `stream`: N + ceil(rows / 8) CTAs (see ep_local.cu). No host sync.
cudaError_t launch_ep_local_scatter(const EpLocalScatterParams& p, cudaStream_t stream);

// The one-rank local path's expand dispatch (ep_local.cu): its layout (cpu::ep_local_layout is the rule, bit for bit),
// rows and weights, N * K in [1, 2^31), E <= kEpMaxLocalExperts (one rank), M >= N. It is also the dispatch's guard:
// the routing's first bad entry is recorded as launch_ep_guard records it, and an id outside [0, E) is no entry.
// Above kEpLocalLayoutMaxEntries entries it needs `scratch` of ep_local_dispatch_scratch_words(N, K, E) int32 words.
struct EpLocalDispatchParams {
  const int32_t* topk = nullptr;   // [N, K]
  const int32_t* token = nullptr;  // 4 bytes, copied to token_out unless they are the same buffer
  int32_t* token_out = nullptr;
  ErrorRecord* err = nullptr;      // the member's error record
  int32_t rank = 0;
  int32_t N = 0, K = 0, E = 0, A = 1, M = 0, rows = 0;
  const uint8_t* x = nullptr;      // [N, row_bytes]
  uint8_t* recv_x = nullptr;       // [rows, row_bytes]: row r is x[its entry's token], zero without an entry
  int64_t row_bytes = 0;
  const uint32_t* w = nullptr;     // [N * K] float32 bits (nullptr: no weights)
  uint32_t* recv_w = nullptr;      // [rows]: w[its entry], +0.0 without an entry (nullptr: no weights)
  int32_t* exp_row = nullptr;      // [N, K]
  int32_t* src_entry = nullptr;    // [rows]
  int32_t* src_tok = nullptr;      // [rows]
  int32_t* count = nullptr;        // [E]
  int32_t* aligned = nullptr;      // [E]
  int32_t* psum_expert = nullptr;  // [E]
  int32_t* meta = nullptr;         // [M, K + 2]
  int32_t* dst_row = nullptr;      // [N]
  int32_t* num_recv = nullptr;     // [1]
  int32_t* scratch = nullptr;      // [scratch_words], above kEpLocalLayoutMaxEntries entries
  int64_t scratch_words = 0;
};

// At most kEpLocalLayoutMaxEntries entries: one launch on `stream`, up to 128 CTAs (one wave) that each compute the
// whole layout in shared memory (counts, scans, a stable block radix sort of the entries by expert), then write their
// share of the layout's outputs, of the tokens' rows (each token's row read once) and of the padding rows; CTA 0 also
// checks the routing and copies the token. Above it: a memset and five launches over chunks of whole tokens (counts
// per chunk, one CTA's scans, each chunk's sort and placement, the padding rows, the row scatter). See ep_local.cu.
// No host sync.
cudaError_t launch_ep_local_dispatch(const EpLocalDispatchParams& p, cudaStream_t stream);

// Shared memory the dispatch needs for a config (for validation in the handler): bytes, or -1 if impossible.
// `ce`: copy-engine rows (the peers' layout counters too); *peer_offset: where those start.
int64_t ep_dispatch_smem_bytes(int R, int E, bool ce, int* layout_warps, int* tables_offset, int* peer_offset = nullptr);

cudaError_t launch_ep_dispatch(EpDispatchParams p, const EpLaunch& l, cudaStream_t stream);
cudaError_t launch_ep_dispatch_cached(EpDispatchParams p, const EpLaunch& l, cudaStream_t stream);
cudaError_t launch_ep_combine(const EpCombineParams& p, const EpLaunch& l, cudaStream_t stream);

}  // namespace jax_engram
