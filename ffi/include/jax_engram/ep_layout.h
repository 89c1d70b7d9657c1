// Expert-parallel (MoE dispatch / combine) layout: the one source of truth for the CPU backend and the CUDA
// kernels. Protocols in docs/DESIGN.md ("EP dispatch / combine"): pull on CPU, push (inbox slots) on CUDA. Everything here is plain
// arithmetic on offsets, usable on host and device; no state.
//
// Notation: R ranks, M = max_tokens_per_rank, N <= M local tokens, K top-k (<= 32), E experts,
// E_loc = E / R, A = expert_alignment, H = hidden, elt = bytes per x element, P = scale entries per token
// (4 bytes each; 0 = none). Source global id src_gid = s * M + t.
//
// Three pieces of memory:
//   1. the workspace EP block (WorkspaceLayout::kEp, fixed, in every rank's window): per-context sequence
//      counters and ready words (EpWorkspace below);
//   2. the dispatch staging region (EpDispatchLayout), symmetric, one per config (ctx.region key), two
//      halves selected by the call's sequence parity;
//   3. the combine staging region (EpCombineLayout), the same idea for combine.
#pragma once
#include "jax_engram/workspace.h"

namespace jax_engram {

inline constexpr int kEpMaxTopk = 32;
inline constexpr int kEpMaxLocalExperts = 256;
inline constexpr int kEpMaxExperts = 2048;
// A fresh one-rank expand dispatch (the local path, jax_engram/_ep_local.py) is one native call,
// jax_engram_ep_local_dispatch: its guard, its layout (the rule: cpu::ep_local_layout), its rows and its weights. On
// CUDA a dispatch of at most this many (token, k) entries is one kernel whose every CTA holds the whole layout in
// shared memory; a larger one works in chunks of whole tokens of at most this many entries (ep_local_chunk_tokens)
// with an int32 scratch buffer (ep_local_dispatch_scratch_words). A cached dispatch takes its layout from its handle
// and moves its rows with the row scatter.
inline constexpr int kEpLocalLayoutMaxEntries = 2048;
inline constexpr uint64_t kEpAlign = 128;  // every staging section starts on a 128-byte boundary

// ----------------------------------------------------------------------------------------------------------
// Workspace EP block (byte offsets from the window base; every word uint64, zero at context creation).
//
// Sequence numbers: every rank runs the same sequence of EP ops on a context (ordered by tokens), so the n-th
// dispatch-type call (dispatch or cached dispatch) has seq = n on every rank (n = 1, 2, ...); combine calls
// have their own counter. A call with sequence seq:
//   seq        = own.<op>_seq + 1; own.<op>_seq = seq   (owner-private; CUDA: written back once the kernel(s)
//                                                         of the call no longer need the old value)
//   writes its staging half (seq & 1), then
//   if its input is invalid: own.<op>_bad_detail = detail, own.<op>_bad_value = offending value,
//                            own.<op>_bad = seq (all before the ready store, which releases them)
//   own.<op>_ready = seq (release store: publishes the half)
//   waits (acquire, bounded by the context timeout) until peer.<op>_ready >= seq for every peer, then
//   fails with kErrBadInput naming the peer if peer.<op>_bad == seq,
//   reads the peers' half (seq & 1).
// Why two halves and one ready word suffice: rank A writes half p in call n only after its call n-1 saw every
// peer's ready >= n-1, which each peer published after finishing its reads of call n-2 (the last call that
// used half p). A peer can therefore be in call n-1 or n only; calls of different configs (different
// regions) share the counter, which is harmless (they never alias memory).
//
// Dispatch sequences (CUDA): dispatch-type calls run in one of two independent sequences (EpSequence), each with
// its own seq and ready words. The stream sequence (kStream; kDispatchSeq, kDispatchReady): the ordinary targets,
// launched on XLA's stream by a handler that runs for every call (the copy-engine rows need the host to count the
// calls: it picks the inbox half and the pieces' flag values by that count). The graph sequence (kGraph;
// kDispatchGraphSeq, kDispatchGraphReady): the graph targets, which XLA may capture into a CUDA graph and replay
// without running the handler (Context cuda_graphs=True; SM stores only), so no host count can follow them. A
// staging region belongs to one sequence (its ctx.region key names it: "stream" or "graph"), so the argument above
// holds per sequence: "call n-1" is the sequence's previous call, and the other sequence's calls never touch its
// regions. Combine has one sequence (its handler keeps no host state). The CPU backend uses the stream sequence
// only.
enum class EpSequence : int32_t { kStream = 0, kGraph = 1 };
inline constexpr int kEpDispatchSequences = 2;
struct EpWorkspace {
  static constexpr uint64_t kDispatchSeq = WorkspaceLayout::kEp + 0;
  static constexpr uint64_t kDispatchReady = WorkspaceLayout::kEp + 128;
  static constexpr uint64_t kDispatchBad = WorkspaceLayout::kEp + 256;        // seq of a call with bad input
  static constexpr uint64_t kDispatchBadDetail = WorkspaceLayout::kEp + 264;  // int64: ep_bad_detail()
  static constexpr uint64_t kDispatchBadValue = WorkspaceLayout::kEp + 272;   // int64: the offending id
  static constexpr uint64_t kCombineSeq = WorkspaceLayout::kEp + 512;
  static constexpr uint64_t kCombineReady = WorkspaceLayout::kEp + 640;
  static constexpr uint64_t kCombineBad = WorkspaceLayout::kEp + 768;
  static constexpr uint64_t kCombineBadDetail = WorkspaceLayout::kEp + 776;
  static constexpr uint64_t kCombineBadValue = WorkspaceLayout::kEp + 784;
  static constexpr uint64_t kDispatchGraphSeq = WorkspaceLayout::kEp + 1024;
  static constexpr uint64_t kDispatchGraphReady = WorkspaceLayout::kEp + 1152;
  static constexpr uint64_t kEnd = WorkspaceLayout::kEp + 2048;  // rest of the 4 MiB block: free (CUDA scratch)
  JE_HD static constexpr uint64_t dispatch_seq(EpSequence s) {
    return s == EpSequence::kGraph ? kDispatchGraphSeq : kDispatchSeq;
  }
  JE_HD static constexpr uint64_t dispatch_ready(EpSequence s) {
    return s == EpSequence::kGraph ? kDispatchGraphReady : kDispatchReady;
  }
};
static_assert(EpWorkspace::kEnd <= WorkspaceLayout::kEp + WorkspaceLayout::kEpBytes, "EP block overflow");

// Bad-input details (kErrBadInput, ErrorRecord::detail): token * 64 + kind.
enum EpBadKind : int32_t {
  kEpBadDuplicateExpert = 1,  // a token lists the same expert twice
  kEpBadExpertRange = 2,      // topk_idx outside [-1, E)
  kEpBadHandle = 3,           // handle arrays (metadata, dst_row, psum) out of range: not this dispatch's
};
JE_HD int64_t ep_bad_detail(int64_t token, int32_t kind) { return token * 64 + kind; }

// Routing records of a group (the guard's records mode): rec [R + 1, 3], row r = (kind, token, id) of global rank r's
// first bad entry (kind 0: none, else an EpBadKind), the last row = (the reading rank's global rank, 0, 0).
// Returns the first offending rank, or -1.
JE_HD int64_t ep_first_offender(const int32_t* rec, int64_t R) {
  for (int64_t r = 0; r < R; ++r)
    if (rec[r * 3] != 0) return r;
  return -1;
}

// ----------------------------------------------------------------------------------------------------------
// Static row counts and expand math.
JE_HD int64_t ep_align(int64_t x, int64_t a) { return (x + a - 1) / a * a; }
JE_HD int64_t ep_min(int64_t a, int64_t b) { return a < b ? a : b; }
// Rows of the non-expand receive layout (rank-major: region of source s at psum_rank[s-1]).
JE_HD int64_t ep_rows_nonexpand(int64_t R, int64_t M) { return R * M; }
// Rows of the expand receive layout: align(R*M*min(K,E_loc) + (A-1)*E_loc, A).
JE_HD int64_t ep_rows_expand(int64_t R, int64_t M, int64_t K, int64_t E_loc, int64_t A) {
  return ep_align(R * M * ep_min(K, E_loc) + (A - 1) * E_loc, A);
}
// The large one-rank dispatch's chunks: whole tokens, at most kEpLocalLayoutMaxEntries entries each (K <= 32: at least
// 64 tokens a chunk).
JE_HD int64_t ep_local_chunk_tokens(int64_t K) { return kEpLocalLayoutMaxEntries / (K < 1 ? 1 : K); }
JE_HD int64_t ep_local_chunks(int64_t N, int64_t K) {
  const int64_t T = ep_local_chunk_tokens(K);
  return (N + T - 1) / T;
}
// int32 words of the large one-rank dispatch's scratch (0 for one of at most kEpLocalLayoutMaxEntries entries): the
// routing's first bad entry (2 words, 8-byte aligned), the aligned segment start of every expert [E], the tokens with
// an entry before each chunk [C], and each chunk's entries per expert before it [C, E].
JE_HD int64_t ep_local_dispatch_scratch_words(int64_t N, int64_t K, int64_t E) {
  if (N * K <= kEpLocalLayoutMaxEntries) return 0;
  const int64_t C = ep_local_chunks(N, K);
  return 2 + E + C + C * E;
}
JE_HD int64_t ep_rows(bool expand, int64_t R, int64_t M, int64_t K, int64_t E_loc, int64_t A) {
  return expand ? ep_rows_expand(R, M, K, E_loc, A) : ep_rows_nonexpand(R, M);
}

// Master position of a token for destination rank d: the HIGHEST k with topk_idx[k] / E_loc == d
// (topk_idx[k] >= 0), or -1. Combine adds the ranks' rows in ascending master position.
JE_HD int ep_master_k(const int32_t* topk_row, int K, int E_loc, int d) {
  int mk = -1;
  for (int k = 0; k < K; ++k)
    if (topk_row[k] >= 0 && topk_row[k] / E_loc == d) mk = k;
  return mk;
}

// Expand layout on rank d, given (for its local experts e) count[e] = Σ_s exp_counts_s[d*E_loc + e]:
//   start[e]  = Σ_{j<e} align(count[j], A)                                       (segment start)
//   off_s[e]  = Σ_{s'<s} exp_counts_{s'}[d*E_loc + e]                            (source s inside segment e)
//   row(s, t, k) = start[e] + off_s[e] + pos_exp_s[t, k]      with e = topk_idx_s[t, k] - d*E_loc
// (rows of one segment are therefore sorted by src_gid: the deterministic order).
//   padding rows of e: [start[e] + count[e], start[e] + align(count[e], A))  (zeroed with zero_padding)
//   psum_expert[e] = start[e] + count[e] (expand) | Σ_{j<=e} align(count[j], A) (non-expand)
//   group_sizes[e] = align(count[e], A); unaligned[e] = count[e]
// Non-expand layout on rank d: recv_from[s] = counts_s[d]; psum_rank = inclusive scan of recv_from;
//   row(s, t) = (psum_rank[s-1] or 0) + pos_rank_s[t, d]; num_recv_tokens = psum_rank[R-1].
// Sender side: dst_row[t, d] = Σ_{s<me} counts_s[d] + pos_rank_me[t, d] (or -1 if t sends nothing to d).

// recv_src_metadata [R*M, K+2] int32, one row per received token in non-expand row order (both layouts):
//   [0] = src_gid = s*M + t, [1] = s*K + master_k(d), [2+k] = expand row of position k or -1
//   (non-expand: -1). Rows >= num_recv_tokens: unspecified.
JE_HD int32_t ep_meta_gid(int32_t s, int32_t t, int32_t M) { return s * M + t; }
JE_HD int32_t ep_meta_rank_k(int32_t s, int32_t master_k, int32_t K) { return s * K + master_k; }

// ----------------------------------------------------------------------------------------------------------
// Dispatch staging region: [half 0 | half 1], each half:
//   counts      int32[R]          tokens sent to each dest rank (a token counts once per rank)
//   exp_counts  int32[E]          (token, k) pairs per global expert
//   topk_idx    int32[M, K]       this rank's routing; rows >= N are -1
//   weights     f32[M, K]         topk_weights (if given; else unspecified)
//   pos_rank    int32[M, R]       exclusive position of token t among this rank's tokens sent to d, or -1
//   pos_exp     int32[M, K]       exclusive position of (t,k) among this rank's pairs to expert topk_idx[t,k]
//                                 (in token order), or -1 when masked
//   x           bytes[S, x_row]   x rows, x_row = align(H*elt, 16)           (pull protocol: S = M; push: 0)
//   scales      bytes[S, sf_row]  scale rows, sf_row = align(P*4, 16)
//   inbox       EpInbox[B]        push protocol only (B = R-1): what each peer pushed to this rank
// Cached dispatch writes only weights, x and scales (layout from the handle); the counting fields are
// neither written nor read. Each section starts on a kEpAlign boundary.
//
// Two protocols share this layout. PULL (CPU backend): a rank stages its own rows, peers read them. PUSH (CUDA):
// a rank writes each row straight into the inbox slot it owns on every destination rank, so NVLink carries
// stores (posted writes, which reach the link rate with few SMs: tools/probe_nvlink.cu) and every receiver
// polls and reads only its own memory. Slot of source s on rank d: ep_inbox_slot(s, d, R) (own rows never
// travel). Slot contents, per half:
//   ctrl        uint64 flag (= seq once the header below is valid), bad (= seq if the source's input is bad),
//               bad_detail, bad_value, n (the source's N), then progress[kEpInboxCtas][kEpInboxWarps]:
//               progress[c][w] = (seq << 32) | n once stage warp w of source CTA c pushed its first n chunks
//               (release, system scope; one word per warp so that no warp waits for another one's stores),
//               ce[kEpCeMaxPieces]: ce[j] = seq once the source's copy engine wrote piece j of its x rows (copy-engine
//               dispatch, ep.h "copy-engine rows"; written by the source's stream after the copy, not by a kernel)
//   counts      int32[R], exp_counts int32[E]   the source's totals (header)
//   pos         int32[M]          pos_rank_s[t, d] (or -1), for every t < N_s
//   topk_idx, weights, pos_exp    [M, K] rows of the tokens sent to d
//   x, scales   [M] rows of the tokens sent to d (row t = token t)
// Copy-engine dispatch: the source's copy stream writes n, topk_idx / weights / scales rows t < N_s, then flag;
// the receiver computes pos and pos_exp itself (no header: counts / exp_counts stay unused) and x comes in pieces.
inline constexpr int kEpInboxCtas = 160;  // the most CTAs an EP kernel may use
inline constexpr int kEpInboxWarps = 16;  // the most stage warps per CTA
inline constexpr int kEpCeMaxPieces = 32; // the most copy-engine pieces of a dispatch (ep.h)
inline constexpr int kEpCePeerCounts = 1536;  // copy-engine dispatch: the most (R-1) * (R + E/R) (CUDA scratch)
inline constexpr int kEpMaxStageWarps = kEpInboxWarps - 1;  // a CTA's push warps; at least one warp receives
JE_HD uint64_t ep_progress_index(int64_t cta, int64_t warp) { return (uint64_t)(cta * kEpInboxWarps + warp); }
JE_HD int64_t ep_inbox_slot(int64_t s, int64_t d, int64_t R) { return (s - d + R) % R - 1; }
struct EpInbox {
  int64_t R, M, K, E, x_row, sf_row;
  static constexpr uint64_t kFlag = 0, kBad = 8, kBadDetail = 16, kBadValue = 24, kN = 32, kProgress = 64;
  static constexpr uint64_t kCe = kProgress + 8ull * kEpInboxCtas * kEpInboxWarps;
  JE_HD uint64_t counts() const { return align_up(kCe + 8ull * kEpCeMaxPieces, kEpAlign); }
  JE_HD uint64_t exp_counts() const { return align_up(counts() + 4 * R, kEpAlign); }
  JE_HD uint64_t pos() const { return align_up(exp_counts() + 4 * E, kEpAlign); }
  JE_HD uint64_t topk_idx() const { return align_up(pos() + 4 * M, kEpAlign); }
  JE_HD uint64_t weights() const { return align_up(topk_idx() + 4 * M * K, kEpAlign); }
  JE_HD uint64_t pos_exp() const { return align_up(weights() + 4 * M * K, kEpAlign); }
  JE_HD uint64_t x() const { return align_up(pos_exp() + 4 * M * K, kEpAlign); }
  JE_HD uint64_t scales() const { return align_up(x() + (uint64_t)(M * x_row), kEpAlign); }
  JE_HD uint64_t bytes() const { return align_up(scales() + (uint64_t)(M * sf_row), kEpAlign); }
};
// ----------------------------------------------------------------------------------------------------------
// CUDA push protocol: the CTAs' token ranges, their push chunks and the copy-engine pieces. The host (handler: the
// copies' sizes) and every kernel (waits, chunk words) must agree on them exactly; tests/test_ep.py checks them
// through the module's test hooks.
// Token ranges of the dispatch CTAs (full and cached dispatch, both ranks' view of one call: from M and G only).
// With few tokens per CTA (M <= 32 G) CTA 0 gets none: it also computes the totals and writes the header, so its own
// rows would go out after the other CTAs', last on every receiver's path.
JE_HD int ep_first_token_cta(int64_t M, int G) { return G >= 2 && M <= 32 * static_cast<int64_t>(G) ? 1 : 0; }
JE_HD int ep_tokens_per_cta(int64_t M, int G) {
  const int n = G - ep_first_token_cta(M, G);
  return static_cast<int>((M + n - 1) / n);
}
// [t0, t1) of CTA c (empty for a CTA without tokens).
JE_HD void ep_cta_tokens(int M, int G, int c, int* t0, int* t1) {
  const int f = ep_first_token_cta(M, G), per = ep_tokens_per_cta(M, G);
  const int64_t b = c < f ? 0 : static_cast<int64_t>(c - f) * per;
  *t0 = static_cast<int>(b < M ? b : M);
  *t1 = c < f ? *t0 : static_cast<int>(b + per < M ? b + per : M);
}
// The CTA whose range holds token t (0 <= t < M).
JE_HD int ep_cta_of_token(int t, int M, int G) { return ep_first_token_cta(M, G) + t / ep_tokens_per_cta(M, G); }

// First token of chunk li of the range [t0, t0 + len) cut into nch chunks (li = nch: the range's end).
JE_HD int ep_chunk_begin(int t0, int len, int nch, int li) {
  return t0 + static_cast<int>(static_cast<int64_t>(li) * len / nch);
}
// The chunk holding token t of that range (t0 <= t < t0 + len): the largest li with ep_chunk_begin(li) <= t.
JE_HD int ep_chunk_of(int t, int t0, int len, int nch) {
  return static_cast<int>((static_cast<int64_t>(t - t0 + 1) * nch + len - 1) / len) - 1;
}

// Taper tau (0 = equal pieces): piece j's share is (100 + tau (P - 1 - 2 j)) / (100 P), so
// later pieces are smaller (P = 4, tau = 20: 40 / 30 / 20 / 10 %) and the receivers' copy of the last one, the tail
// of the call, shrinks; tau (P - 1) < 100 keeps every share positive. Integers only: the host's copies and the
// kernel's waits must agree exactly.
JE_HD int ep_ce_piece_begin(int per, int P, int j, int tau = 0) {
  return static_cast<int>(static_cast<int64_t>(per) * j * (100 + tau * (P - j)) / (100 * static_cast<int64_t>(P)));
}
// The piece holding range offset off (0 <= off < per): the smallest j with ep_ce_piece_begin(j + 1) > off.
JE_HD int ep_ce_piece_of(int off, int per, int P, int tau = 0) {
  if (tau == 0) return static_cast<int>((static_cast<int64_t>(off + 1) * P - 1) / per);
  int j = 0;
  while (j < P - 1 && ep_ce_piece_begin(per, P, j + 1, tau) <= off) ++j;
  return j;
}

struct EpDispatchLayout {
  int64_t R, M, K, E, x_row, sf_row;
  bool push;
  JE_HD static EpDispatchLayout make(int64_t R, int64_t M, int64_t K, int64_t E, int64_t hidden_bytes,
                                     int64_t num_scales, bool push = false) {
    return EpDispatchLayout{R, M, K, E, (int64_t)align_up(hidden_bytes, 16), (int64_t)align_up(num_scales * 4, 16),
                            push};
  }
  JE_HD int64_t stage_rows() const { return push ? 0 : M; }
  JE_HD int64_t inbox_slots() const { return push ? R - 1 : 0; }
  JE_HD EpInbox inbox() const { return EpInbox{R, M, K, E, x_row, sf_row}; }
  JE_HD uint64_t counts() const { return 0; }
  JE_HD uint64_t exp_counts() const { return align_up(counts() + 4 * R, kEpAlign); }
  JE_HD uint64_t topk_idx() const { return align_up(exp_counts() + 4 * E, kEpAlign); }
  JE_HD uint64_t weights() const { return align_up(topk_idx() + 4 * M * K, kEpAlign); }
  JE_HD uint64_t pos_rank() const { return align_up(weights() + 4 * M * K, kEpAlign); }
  JE_HD uint64_t pos_exp() const { return align_up(pos_rank() + 4 * M * R, kEpAlign); }
  JE_HD uint64_t x() const { return align_up(pos_exp() + 4 * M * K, kEpAlign); }
  JE_HD uint64_t scales() const { return align_up(x() + (uint64_t)(stage_rows() * x_row), kEpAlign); }
  JE_HD uint64_t inbox_at(int64_t slot) const {
    return align_up(scales() + (uint64_t)(stage_rows() * sf_row), kEpAlign) + (uint64_t)slot * inbox().bytes();
  }
  JE_HD uint64_t half_bytes() const { return inbox_at(inbox_slots()); }
  JE_HD uint64_t total_bytes() const { return 2 * half_bytes(); }
  JE_HD uint64_t half(uint64_t seq) const { return (seq & 1) * half_bytes(); }  // offset of the call's half
};
// Combine staging region: [half 0 | half 1], each half:
//   y        bytes[R*M, y_row]   row i = what this (expert) rank returns for its received token row i:
//                                non-expand y[i]; expand the fp32 sum over valid local k (ascending k) of
//                                y[meta[i, 2+k]] rounded once to y's dtype (one valid k: copied)
//   weights  f32[R*M, K]         non-expand w[i, :]; expand w[meta[i, 2+k]] or 0 (if weights given)
// y_row = align(H * elt_y, 16). That is the PULL protocol (CPU). PUSH (CUDA): the half is R slots, slot d on
// source rank s holding what expert rank d returns for s's tokens, indexed by token:
//   progress uint64[kEpInboxCtas][kEpInboxWarps]   progress[c][w] = (seq << 32) | n once stage warp w of d's CTA c
//                                    pushed its first n row chunks
//   y        bytes[M, y_row]        row t = the value above for d's received row of (s, t)
//   weights  f32[M, K]
struct EpCombineLayout {
  int64_t R, M, K, y_row;
  bool push;
  JE_HD static EpCombineLayout make(int64_t R, int64_t M, int64_t K, int64_t hidden_bytes, bool push = false) {
    return EpCombineLayout{R, M, K, (int64_t)align_up(hidden_bytes, 16), push};
  }
  JE_HD uint64_t y() const { return 0; }
  JE_HD uint64_t weights() const { return align_up(y() + (uint64_t)(R * M * y_row), kEpAlign); }
  // push slots
  JE_HD uint64_t slot_y() const { return align_up(8ull * kEpInboxCtas * kEpInboxWarps, kEpAlign); }
  JE_HD uint64_t slot_weights() const { return align_up(slot_y() + (uint64_t)(M * y_row), kEpAlign); }
  JE_HD uint64_t slot_bytes() const { return align_up(slot_weights() + 4 * M * K, kEpAlign); }
  JE_HD uint64_t slot_at(int64_t d) const { return (uint64_t)d * slot_bytes(); }
  JE_HD uint64_t half_bytes() const {
    return push ? R * slot_bytes() : align_up(weights() + 4 * R * M * K, kEpAlign);
  }
  JE_HD uint64_t total_bytes() const { return 2 * half_bytes(); }
  JE_HD uint64_t half(uint64_t seq) const { return (seq & 1) * half_bytes(); }
};
}  // namespace jax_engram
