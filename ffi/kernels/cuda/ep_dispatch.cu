// EP dispatch and cached dispatch on CUDA: the PUSH protocol of ep_layout.h (inbox slots), one cooperative launch
// of G = num_sms CTAs (kEpThreads threads each). NVLink carries only stores: every rank writes the rows it sends
// straight into the slot it owns in each destination's inbox, and every receiver polls and reads only its own
// memory. Why (tools/probe_nvlink.cu): SM stores reach the link rate with few CTAs in both directions at once,
// remote loads stay below it, and remote polling by many warps competes with the data.
//
// Dispatch, CTA c of rank `me` (call sequence number seq, staging half seq & 1). CTA c owns the token range
// ep_cta_tokens (ep.h: ~M/G each; CTA 0 none when M <= 32 G), cut into `chunk` chunks (ep_dispatch_chunks):
//   1. Layout (all warps): the counting sort over the CTA's range; pass 1 counts per dest rank (a token once per
//      rank) and per expert into per-warp shared counters and finds the first bad (t, k); per-CTA totals ->
//      scratch; grid barrier; exclusive prefix over (earlier CTAs, earlier warps); CTA 0 writes the totals and
//      pushes the header (counts, exp_counts, bad words, N; then flag = seq) into its slot on every peer; pass 2
//      walks the tokens again in order and hands out positions, writing topk_idx, weights, pos_rank, pos_exp of
//      the range into the own half. Both passes read the range's topk rows from a shared-memory copy when it fits.
//   2. Stage warps (sender): per chunk of the CTA's range, each token's pos for d into the slot on d, and for each
//      d the token goes to its x / scales row and its topk / weights / pos_exp rows; then progress[c] =
//      (seq << 32) | chunks done on every peer (release.sys). The last CTA done publishes own ready.
//      Then (tables ready): dst_row of the range, zero padding rows, CTA 0 the count outputs and the end-of-call
//      wait for every peer's ready >= seq (ep_layout.h: the two-halves argument holds for the inboxes too: a rank
//      pushes into half p in call n only after every peer published ready for call n-1).
//   3. Pull warps (receiver): wait for every peer's header (own memory), fail on a bad one, build the receive
//      tables (psum over source ranks, per local expert start / per-source offsets) in shared memory, then for each
//      (chunk of the CTA's range, source s) -- own rows straight from x -- wait for progress[c] of slot s and copy
//      each received row from the slot into its final place(s), writing metadata / topk / weights beside it.
// Cached dispatch: no layout; stage warps push x, scales and weights of the tokens whose handle dst_row[t, d] >= 0;
// pull warps walk the handle's metadata (rows i < psum_rank[R-1]) and copy (s, t) = divmod(meta[i, 0], M) from
// slot s into row i / the expand rows meta[i, 2+k].
#include <algorithm>
#include <climits>
#include <cstdlib>

#include "kernels/cuda/ep_common.cuh"
#include "kernels/cuda/ep_trace.h"

namespace jax_engram {
namespace ep {
namespace {

// Receive tables in dynamic shared memory (after the layout counters).
struct Tables {
  int* psum_excl;  // [R + 1] region start of source s; [R] = num_recv
  int* base_dst;   // [R]     sum_{s < me} counts_s[d]   (dst_row)
  int* cnt_e;      // [E_loc] count[e]
  int* start_e;    // [E_loc] start[e]
  int* padpre;     // [E_loc + 1] prefix of padding rows
  int* off;        // [R * E_loc] offset of source s inside segment e
  int* src_counts; // [R * R]  copy-engine rows: tokens source s sends to rank d (from every source's topk rows)
};

JE_DEVICE Tables tables_at(uint8_t* smem, int offset, int R, int E_loc) {
  Tables t;
  int* b = reinterpret_cast<int*>(smem + offset);
  t.psum_excl = b;
  t.base_dst = t.psum_excl + R + 1;
  t.cnt_e = t.base_dst + R;
  t.start_e = t.cnt_e + E_loc;
  t.padpre = t.start_e + E_loc;
  t.off = t.padpre + E_loc + 1;
  t.src_counts = t.off + R * E_loc;
  return t;
}

int tables_bytes(int R, int E_loc) { return (2 * R + 1 + 3 * E_loc + 1 + R * E_loc + R * R) * 4; }

// The own half's sender-side sections (layout outputs of this rank).
struct Half {
  int32_t* counts;
  int32_t* exp_counts;
  int32_t* topk;
  int32_t* pos_rank;
  int32_t* pos_exp;
};

JE_DEVICE Half half_at(uint8_t* h, const EpDispatchLayout& L) {
  Half r;
  r.counts = reinterpret_cast<int32_t*>(h + L.counts());
  r.exp_counts = reinterpret_cast<int32_t*>(h + L.exp_counts());
  r.topk = reinterpret_cast<int32_t*>(h + L.topk_idx());
  r.pos_rank = reinterpret_cast<int32_t*>(h + L.pos_rank());
  r.pos_exp = reinterpret_cast<int32_t*>(h + L.pos_exp());
  return r;
}

// An inbox slot (EpInbox), own or a peer's.
struct Slot {
  uint8_t* base;
  __device__ uint64_t* ctrl(uint64_t off) const { return reinterpret_cast<uint64_t*>(base + off); }
  int32_t* counts;
  int32_t* exp_counts;
  int32_t* pos;
  int32_t* topk;
  float* w;
  int32_t* pexp;
  uint8_t* x;
  uint8_t* sf;
};

JE_DEVICE Slot slot_at(uint8_t* half_base, const EpDispatchLayout& L, int slot) {
  const EpInbox I = L.inbox();
  Slot r;
  r.base = half_base + L.inbox_at(slot);
  r.counts = reinterpret_cast<int32_t*>(r.base + I.counts());
  r.exp_counts = reinterpret_cast<int32_t*>(r.base + I.exp_counts());
  r.pos = reinterpret_cast<int32_t*>(r.base + I.pos());
  r.topk = reinterpret_cast<int32_t*>(r.base + I.topk_idx());
  r.w = reinterpret_cast<float*>(r.base + I.weights());
  r.pexp = reinterpret_cast<int32_t*>(r.base + I.pos_exp());
  r.x = r.base + I.x();
  r.sf = r.base + I.scales();
  return r;
}

// The peers' staging bases, copied from the device array p.w.st_peers into shared memory at the kernel's start
// (cache_peer_bases) when there are at most kPeerCache ranks: every push and release computes a peer's slot, and
// each global load of its base would add a dependent round trip to a small dispatch's critical path.
constexpr int kPeerCache = 8;
__shared__ uint8_t* sh_st_peers[kPeerCache];

// Before the kernel's first __syncthreads, by every thread.
JE_DEVICE void cache_peer_bases(const EpDispatchParams& p) {
  if (p.w.nranks <= kPeerCache && static_cast<int>(threadIdx.x) < p.w.nranks)
    sh_st_peers[threadIdx.x] = p.w.st_peers[threadIdx.x];
}

// Slot of source s in rank d's inbox for this call's half (d's memory, through the peer mapping or own).
JE_DEVICE Slot peer_slot(const EpDispatchParams& p, uint64_t hoff, int s, int d) {
  uint8_t* base =
      (d == p.w.rank ? p.w.st_own : (p.w.nranks <= kPeerCache ? sh_st_peers[d] : p.w.st_peers[d])) + hoff;
  return slot_at(base, p.L, static_cast<int>(ep_inbox_slot(s, d, p.w.nranks)));
}


// Bounded wait of lane 0 for the own-memory word *w >= target (written by `peer`); whole warp, false on failure.
JE_DEVICE bool warp_wait_local(const uint64_t* w, uint64_t target, const EpWindow& win, int32_t op, int32_t peer,
                               int lane) {
  int ok = 1;
  if (lane == 0) ok = wait_local(w, target, win, op, peer);
  ok = __shfl_sync(kFull, ok, 0);
  __syncwarp();
  return ok != 0;
}

// Copy-engine rows: waits (whole warp) until piece j of source s's x rows is in the own slot `sl`, unless it is the
// piece this warp waited for last (*seen = s * kEpCeMaxPieces + j). Not "or an earlier one": the pieces alternate
// between copy streams, so a later piece can land before an earlier one. False on failure (timeout recorded).
JE_DEVICE bool wait_ce_piece(const EpDispatchParams& p, const Slot& sl, int s, int j, uint64_t seq, int* seen,
                             int lane) {
  const int key = s * kEpCeMaxPieces + j;
  if (*seen == key) return true;
  if (!warp_wait_local(sl.ctrl(EpInbox::kCe + 8ull * j), seq, p.w, kOpEpDispatch, s, lane)) return false;
  *seen = key;
  return true;
}

// Copy-engine rows: the handler chose the staging half by its own count of dispatch-type calls; a call whose
// device sequence number differs would read (and its peers' copies would have written) the wrong half. Recorded
// as kErrSequence by one thread; the call then publishes nothing (its peers time out).
JE_DEVICE bool ce_sequence_ok(const EpDispatchParams& p, uint64_t seq) {
  if (!p.ce_pieces || seq == p.ce_seq) return true;
  if (blockIdx.x == 0 && threadIdx.x == 0)
    cuda::record_error_device(p.w.err, kErrSequence, kOpEpDispatch, p.w.rank, p.w.rank,
                              static_cast<int64_t>(p.ce_seq), static_cast<int64_t>(seq), 0, 0);
  return false;
}

// Publishes progress[c][warp] = (seq << 32) | n on every peer's slot of this rank. Whole warp, after its pushes.
JE_DEVICE void publish_progress(const EpDispatchParams& p, uint64_t hoff, uint64_t seq, int n, int warp, int lane) {
  __threadfence_system();
  __syncwarp();
  for (int d = lane; d < p.w.nranks; d += 32) {
    if (d == p.w.rank) continue;
    st_release_sys_u64(peer_slot(p, hoff, p.w.rank, d).ctrl(EpInbox::kProgress + 8ull * ep_progress_index(blockIdx.x, warp)),
                       progress_value(seq, n));
  }
}

// The progress word (and value) that covers chunk `li` of source CTA `c` (chunk li is pushed by stage warp li % SW
// as its (li / SW)-th).
JE_DEVICE const uint64_t* chunk_word(const Slot& sl, int c, int li, int SW) {
  return sl.ctrl(EpInbox::kProgress + 8ull * ep_progress_index(c, li % SW));
}
JE_DEVICE uint64_t chunk_value(uint64_t seq, int li, int SW) { return progress_value(seq, li / SW + 1); }

// Copies `nbytes` from src to the destinations of the set bits of `mask`: bit b's is lane b's `lane_dst`.
template <typename V, int U>
JE_DEVICE void warp_push_v(const uint8_t* src, unsigned mask, uint8_t* lane_dst, int64_t nbytes, int lane) {
  const auto dst = [=](int b) {
    return reinterpret_cast<uint8_t*>(__shfl_sync(kFull, reinterpret_cast<unsigned long long>(lane_dst), b));
  };
  warp_fanout_v<V, U>(src, mask, dst, nbytes, lane);
}

JE_DEVICE void warp_push(const uint8_t* src, unsigned mask, uint8_t* lane_dst, int64_t nbytes, int lane) {
  if (nbytes <= 0 || mask == 0) return;
  uint64_t a = reinterpret_cast<uint64_t>(src) | static_cast<uint64_t>(nbytes);
  unsigned mm = mask;
  while (mm) {
    const int b = __ffs(mm) - 1;
    mm &= mm - 1;
    a |= __shfl_sync(kFull, reinterpret_cast<unsigned long long>(lane_dst), b);
  }
  if ((a & 15) == 0) warp_push_v<uint4, 16>(src, mask, lane_dst, nbytes, lane);
  else if ((a & 3) == 0) warp_push_v<unsigned, 4>(src, mask, lane_dst, nbytes, lane);
  else warp_push_v<unsigned char, 4>(src, mask, lane_dst, nbytes, lane);
}

// Sender: token t to every peer d with dest_ok(d) (pos of d from `pos_of`). Whole warp. `meta`: also the topk /
// pos_exp rows (full dispatch); weights rows whenever the call has weights.
template <typename PosOf>
JE_DEVICE void push_token(const EpDispatchParams& p, const Half& own, uint64_t hoff, int t, bool meta, PosOf pos_of,
                          int lane) {
  const int R = p.w.nranks, me = p.w.rank, K = p.K;
  const int64_t tK = static_cast<int64_t>(t) * K;
  // routing rows (lane k < K), loaded before the x row goes out so that their latency overlaps it
  const int32_t id = (meta && lane < K) ? own.topk[tK + lane] : -1;
  const int32_t pe = (meta && p.expand && lane < K) ? own.pos_exp[tK + lane] : -1;
  const float wv = (p.weights && lane < K) ? p.weights[tK + lane] : 0.0f;
  for (int d0 = 0; d0 < R; d0 += 32) {
    const int d = d0 + lane;
    int pos = -1;
    Slot sl{};
    if (d < R && d != me) {
      pos = pos_of(d);
      sl = peer_slot(p, hoff, me, d);
      if (meta) sl.pos[t] = pos;
    }
    const unsigned dm = __ballot_sync(kFull, pos >= 0);
    if (!dm) continue;
    if (!p.ce_pieces)  // else the copy engine carries the x rows (ep.h "copy-engine rows")
      warp_push(p.x + t * p.x_bytes, dm, pos >= 0 ? sl.x + t * p.L.x_row : nullptr, p.x_bytes, lane);
    if (p.sf_bytes) warp_push(p.sf + t * p.sf_bytes, dm, pos >= 0 ? sl.sf + t * p.L.sf_row : nullptr, p.sf_bytes, lane);
    // routing rows: lane k < K of each destination in turn
    unsigned mm = dm;
    while (mm) {
      const int b = __ffs(mm) - 1;
      mm &= mm - 1;
      const Slot sb = peer_slot(p, hoff, me, d0 + b);
      if (lane < K) {
        if (meta) sb.topk[tK + lane] = id;
        if (meta && p.expand) sb.pexp[tK + lane] = pe;
        if (p.weights) sb.w[tK + lane] = wv;
      }
    }
  }
}

// Stage warp `warp` of SW: chunk li = warp, warp + SW, ... of the CTA's range [t0, t0 + len) (tokens below te),
// token by token (push_token; destination positions pos_of(t, d)); a progress release after each non-empty chunk,
// counting empty chunks too (the receivers wait for li / SW + 1). Copy-engine rows: the routing rows only, released
// once: under the copy engine's traffic each release waits for this warp's small stores to cross a saturated link,
// and the receivers would wait for them.
template <typename PosOf>
JE_DEVICE void push_chunks(const EpDispatchParams& p, const Half& own, uint64_t hoff, uint64_t seq, int t0, int len,
                           int te, int warp, int SW, bool meta, PosOf pos_of, int lane) {
  int n = 0;
  for (int li = warp; li < p.chunk; li += SW) {
    ++n;
    const int cb = ep_chunk_begin(t0, len, p.chunk, li), ce = min(ep_chunk_begin(t0, len, p.chunk, li + 1), te);
    if (cb >= ce) continue;
    for (int t = cb; t < ce; ++t) push_token(p, own, hoff, t, meta, [&](int d) { return pos_of(t, d); }, lane);
    if (!p.ce_pieces) publish_progress(p, hoff, seq, n, warp, lane);
  }
  if (p.ce_pieces && n > 0) publish_progress(p, hoff, seq, n, warp, lane);
}

// Zero padding rows of the expand layout: rows [start+count, start+align(count, A)) of every local expert,
// spread over every stage warp of the grid.
JE_DEVICE void zero_padding_rows(const EpDispatchParams& p, const Tables& tb, int E_loc, int SW) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int total = tb.padpre[E_loc];
  for (int q = blockIdx.x * SW + warp; q < total; q += gridDim.x * SW) {
    int lo = 0, hi = E_loc - 1;  // last e with padpre[e] <= q
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tb.padpre[mid] <= q) lo = mid; else hi = mid - 1;
    }
    const int64_t row = static_cast<int64_t>(tb.start_e[lo]) + tb.cnt_e[lo] + (q - tb.padpre[lo]);
    if (row >= p.rows) continue;
    warp_zero(p.recv_x, p.x_bytes, row, p.x_bytes, lane);
    if (p.sf_bytes) warp_zero(p.recv_sf, p.sf_bytes, row, p.sf_bytes, lane);
    if (p.recv_w && lane == 0) p.recv_w[row] = 0.0f;
  }
}

// Lanes k < K of a token (expert id, dest rank d, valid): dup = an earlier lane holds the same valid id; master =
// the highest valid lane with this d (the lane that counts the token once for d). K shuffles rather than
// __match_any_sync: the layout's loops walk tokens one after the other, and two match.any per token are slower.
JE_DEVICE void token_lanes(int id, int d, bool valid, int K, int lane, bool* dup, bool* master) {
  bool du = false, ma = valid;
  for (int j = 0; j < K; ++j) {
    const int oid = __shfl_sync(kFull, id, j), od = __shfl_sync(kFull, d, j);
    du |= valid && j < lane && oid == id;
    ma &= !(j > lane && od == d && od >= 0);
  }
  *dup = du;
  *master = ma;
}

JE_DEVICE int align32(int x, int A) { return A == 1 ? x : (x + A - 1) / A * A; }

// Exclusive scan out[i] = sum_{j<i} v(i) for i < n by ONE warp (each lane a run of consecutive entries); returns
// the total. Why not one thread: a serial loop over hundreds of experts with 64-bit divisions is slow under load.
template <typename F>
JE_DEVICE int warp_exclusive_scan(int n, F v, int* out, int lane) {
  const int per = (n + 31) / 32;
  const int b = min(lane * per, n), e = min(b + per, n);
  int sum = 0;
  for (int i = b; i < e; ++i) sum += v(i);
  int incl = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += y;
  }
  int run = incl - sum;
  for (int i = b; i < e; ++i) {
    const int x = v(i);
    out[i] = run;
    run += x;
  }
  return __shfl_sync(kFull, incl, 31);
}

// start_e (unless `with_start` is false) and the padding prefix from cnt_e: one warp.
JE_DEVICE void build_expert_tables(const Tables& tb, int E_loc, int A, bool with_start, int lane) {
  if (with_start) warp_exclusive_scan(E_loc, [&](int e) { return align32(tb.cnt_e[e], A); }, tb.start_e, lane);
  const int tot = warp_exclusive_scan(E_loc, [&](int e) { return align32(tb.cnt_e[e], A) - tb.cnt_e[e]; }, tb.padpre,
                                      lane);
  if (lane == 0) tb.padpre[E_loc] = tot;
}

// Receiver: one token (s, t) -> non-expand row i (and its expand rows). Whole warp. Every source is own memory:
// x / topk / weights / pos_exp of the own rank, or the slot s pushed.
JE_DEVICE void pull_token(const EpDispatchParams& p, const Tables& tb, const Half& own, const Slot& sl, int s, int t,
                          int i, int E_loc, int lane) {
  const int me = p.w.rank, K = p.K, M = p.M;
  const bool self = s == me;
  const int64_t tK = static_cast<int64_t>(t) * K;
  const uint8_t* src_x = self ? p.x + t * p.x_bytes : sl.x + t * p.L.x_row;
  const uint8_t* src_sf = self ? p.sf + t * p.sf_bytes : sl.sf + t * p.L.sf_row;
  int id = -1, pe = -1;
  float wv = 0.0f;
  if (lane < K) {
    id = self ? p.topk[tK + lane] : __ldcg(sl.topk + tK + lane);
    if (p.recv_w) wv = self ? p.weights[tK + lane] : __ldcg(sl.w + tK + lane);
    if (p.expand) pe = self ? own.pos_exp[tK + lane] : __ldcg(sl.pexp + tK + lane);
  }
  if (!p.expand) {
    warp_copy(src_x, p.recv_x, p.x_bytes, 1u, i, p.x_bytes, lane);
    if (p.sf_bytes) warp_copy(src_sf, p.recv_sf, p.sf_bytes, 1u, i, p.sf_bytes, lane);
  }
  const bool local = id >= 0 && id / E_loc == me;
  const unsigned lm = __ballot_sync(kFull, local);
  const int master = lm ? 31 - __clz(lm) : -1;
  int32_t* mrow = p.meta + static_cast<int64_t>(i) * (K + 2);
  if (lane == 0) mrow[0] = ep_meta_gid(s, t, M);
  if (lane == 1) mrow[1] = ep_meta_rank_k(s, master, K);
  if (!p.expand) {
    if (lane < K) {
      mrow[2 + lane] = -1;
      p.recv_topk[static_cast<int64_t>(i) * K + lane] = local ? id - me * E_loc : -1;
      if (p.recv_w) p.recv_w[static_cast<int64_t>(i) * K + lane] = wv;
    }
    return;
  }
  const int e = local ? id - me * E_loc : 0;
  const int64_t row = local ? static_cast<int64_t>(tb.start_e[e]) + tb.off[s * E_loc + e] + pe : -1;
  const bool ok = local && row >= 0 && row < p.rows;
  if (lane < K) mrow[2 + lane] = ok ? static_cast<int32_t>(row) : -1;
  if (ok && p.recv_w) p.recv_w[row] = wv;
  const unsigned dm = __ballot_sync(kFull, ok);
  warp_copy(src_x, p.recv_x, p.x_bytes, dm, row, p.x_bytes, lane);
  if (p.sf_bytes) warp_copy(src_sf, p.recv_sf, p.sf_bytes, dm, row, p.sf_bytes, lane);
}

// kCe: copy-engine rows (p.ce_pieces > 0), with the receivers' layout of the peers' tokens. A template parameter so
// that the SM-store kernel carries none of that code (a shared kernel spills more registers and slows small
// dispatches). kTrace: the JAX_ENGRAM_EP_TRACE code (p.trace > 0 launches that instantiation; ep_trace.h), so the
// untraced kernels carry none of it.
template <bool kCe, bool kTrace>
__global__ void __launch_bounds__(kEpThreads, 1) dispatch_kernel(const EpDispatchParams p, int SW) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ uint64_t sh_seq;
  __shared__ unsigned long long sh_bad;
  __shared__ int sh_abort, sh_next, sh_done, sh_piece_seen;
  __shared__ uint64_t sh_t0;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int G = gridDim.x, c = blockIdx.x;
  const int R = p.w.nranks, me = p.w.rank;
  const int M = p.M, N = p.N, K = p.K, E = p.E, E_loc = E / R, RE = R + E;
  uint8_t* ws = p.w.ws_own;
  EP_TRACE_DECL(kTrace);
  const int trace = kTrace ? p.trace : 0;
  cache_peer_bases(p);
  if (tid == 0) {
    sh_t0 = cuda::globaltimer_ns();
    sh_seq = enter_seq(ws, EpWorkspace::dispatch_seq(p.sequence), EpScratch::kDispatchArrive);
    trace_span_begin(trace, ws, sh_t0);
    sh_bad = ULLONG_MAX;
    sh_abort = 0;
    sh_next = 0;
    sh_done = 0;
    sh_piece_seen = 0;
    if (c == 0 && p.token_out) *p.token_out = *p.token;
  }
  __syncthreads();
  const uint64_t seq = sh_seq;
  const uint64_t hoff = p.w.st_offset + p.L.half(seq);
  const Half own = half_at(p.w.st_own + hoff, p.L);
  const Tables tb = tables_at(smem, p.smem_tables, R, E_loc);

  // ---- 1. layout: pass 1 (counts, first bad entry) --------------------------------------------------------
  int* cnt = reinterpret_cast<int*>(smem);
  const int LW = p.layout_warps;
  for (int q = tid; q < LW * RE; q += blockDim.x) cnt[q] = 0;
  // Copy-engine rows: this CTA also lays out the same range of every peer's tokens (their topk rows come by the
  // copy engine, ep.h), counting per dest rank and per LOCAL expert: per warp [R-1][LW][RL], peer q = me + 1 + q1.
  constexpr bool rl = kCe;
  const int RL = R + E_loc;
  int* pcnt = rl ? reinterpret_cast<int*>(smem + p.smem_peer_cnt) : nullptr;
  for (int q = tid; rl && q < (R - 1) * LW * RL; q += blockDim.x) pcnt[q] = 0;
  int t0, t1;
  ep_cta_tokens(M, G, c, &t0, &t1);
  // The range's topk rows, loaded once with every load in flight: both layout passes walk their tokens one after
  // the other, and a global load per token would make each pass a chain of round trips.
  int* tk_cache = p.smem_topk >= 0 ? reinterpret_cast<int*>(smem + p.smem_topk) : nullptr;
  if (tk_cache)
    for (int q = tid; q < (min(t1, N) - t0) * K; q += blockDim.x) tk_cache[q] = __ldg(p.topk + static_cast<int64_t>(t0) * K + q);
  const auto topk_at = [&](int t, int k) {
    return tk_cache ? tk_cache[(t - t0) * K + k] : p.topk[static_cast<int64_t>(t) * K + k];
  };
  __syncthreads();
  EP_TRACE(p, sh_t0, "dispatch entered", tid == 0);
  const int per_w = (t1 - t0 + LW - 1) / LW;
  const int wa = min(t0 + warp * per_w, t1), wb = min(wa + per_w, t1);
  if (warp < LW) {
    int* wc = cnt + warp * RE;
    for (int t = wa; t < min(wb, N); ++t) {
      const int id = lane < K ? topk_at(t, lane) : -1;
      const bool in_range = id >= -1 && id < E;
      const bool valid = id >= 0 && id < E;
      const int d = valid ? id / E_loc : -1;
      bool dup, master;
      token_lanes(id, d, valid, K, lane, &dup, &master);
      const unsigned badm = __ballot_sync(kFull, !in_range || dup);
      if (badm && lane == 0) atomicMin(&sh_bad, (static_cast<unsigned long long>(t) << 6) | (__ffs(badm) - 1));
      if (valid) atomicAdd(&wc[R + id], 1);
      if (master) atomicAdd(&wc[d], 1);
    }
  }
  // Peers' ranges (copy-engine rows): wait for their routing rows (own memory; they travel beside x's first piece
  // and land while the own pass 1 runs), then pass 1 over them. Bad keys carry the peer's distance q1 + 1 in bits
  // 40+ so that the grid's first bad is the own one when there is one, else the nearest peer's.
  bool rfail = false;
  int* ptk = rl && p.smem_peer_topk >= 0 ? reinterpret_cast<int*>(smem + p.smem_peer_topk) : nullptr;
  const int rng = ep_tokens_per_cta(M, G);
  const auto peer_topk_at = [&](int q1, const int32_t* stk, int t, int k) {
    return ptk ? ptk[(q1 * rng + t - t0) * K + k] : __ldcg(stk + static_cast<int64_t>(t) * K + k);
  };
  const auto peer_n = [&](const Slot& sl) { return min(static_cast<int>(ld_volatile_u64(sl.ctrl(EpInbox::kN))), M); };
  if (rl) {
    EP_TRACE(p, sh_t0, "dispatch own pass1", tid == 0);
    for (int q1 = tid; q1 < R - 1; q1 += blockDim.x) {
      const int s = (me + 1 + q1) % R;
      if (!wait_local(peer_slot(p, hoff, s, me).ctrl(EpInbox::kFlag), seq, p.w, kOpEpDispatch, s))
        atomicOr(&sh_abort, 1);
    }
    __syncthreads();
    rfail = sh_abort != 0;
    EP_TRACE(p, sh_t0, "dispatch routing in", tid == 0);
    if (!rfail && ptk) {
      for (int q1 = 0; q1 < R - 1; ++q1) {
        const Slot sl = peer_slot(p, hoff, (me + 1 + q1) % R, me);
        const int n = (min(t1, peer_n(sl)) - t0) * K;
        for (int q = tid; q < n; q += blockDim.x) ptk[q1 * rng * K + q] = __ldcg(sl.topk + static_cast<int64_t>(t0) * K + q);
      }
      __syncthreads();
    }
    if (!rfail && warp < LW) {
      for (int q1 = 0; q1 < R - 1; ++q1) {
        const Slot sl = peer_slot(p, hoff, (me + 1 + q1) % R, me);
        const int te = min(wb, peer_n(sl));
        int* wc = pcnt + (q1 * LW + warp) * RL;
        for (int t = wa; t < te; ++t) {
          const int id = lane < K ? peer_topk_at(q1, sl.topk, t, lane) : -1;
          const bool in_range = id >= -1 && id < E;
          const bool valid = id >= 0 && id < E;
          const int d = valid ? id / E_loc : -1;
          bool dup, master;
          token_lanes(id, d, valid, K, lane, &dup, &master);
          const unsigned badm = __ballot_sync(kFull, !in_range || dup);
          if (badm && lane == 0)
            atomicMin(&sh_bad, (static_cast<unsigned long long>(q1 + 1) << 40) | (static_cast<unsigned long long>(t) << 6) |
                                   (__ffs(badm) - 1));
          if (valid && d == me) atomicAdd(&wc[R + id - me * E_loc], 1);
          if (master) atomicAdd(&wc[d], 1);
        }
      }
    }
  }
  __syncthreads();
  EP_TRACE(p, sh_t0, "dispatch pass1", tid == 0);
  int* cta_counts = reinterpret_cast<int*>(ws + EpScratch::kCtaCounts);
  for (int q = tid; q < RE; q += blockDim.x) {
    int run = 0;
    for (int w2 = 0; w2 < LW; ++w2) {
      const int v = cnt[w2 * RE + q];
      cnt[w2 * RE + q] = run;
      run += v;
    }
    cta_counts[static_cast<int64_t>(c) * RE + q] = run;
  }
  int* peer_counts = reinterpret_cast<int*>(ws + EpScratch::kCtaPeerCounts);  // [G][R-1][RL]
  for (int q = tid; rl && q < (R - 1) * RL; q += blockDim.x) {
    const int q1 = q / RL, f = q % RL;
    int run = 0;
    for (int w2 = 0; w2 < LW; ++w2) {
      const int v = pcnt[(q1 * LW + w2) * RL + f];
      pcnt[(q1 * LW + w2) * RL + f] = run;
      run += v;
    }
    peer_counts[static_cast<int64_t>(c) * (R - 1) * RL + q] = run;
  }
  if (tid == 0) *ws_u64(ws, EpScratch::kCtaBad + 8ull * c) = sh_bad;
  // internal failure (grid barrier timeout, sequence mismatch, a peer's routing rows missing): publish nothing,
  // peers time out
  const bool synced = grid_sync(ws, p.w, kOpEpDispatch);
  const bool iabort = !synced || !ce_sequence_ok(p, seq) || rfail;
  EP_TRACE(p, sh_t0, "dispatch grid_sync", tid == 0);

  // ---- prefix over earlier CTAs; CTA 0: totals; first bad entry of the grid -------------------------------
  for (int c2 = tid; c2 < G; c2 += blockDim.x)  // sh_bad holds this CTA's own; the grid's min of all
    atomicMin(&sh_bad, __ldcg(reinterpret_cast<const unsigned long long*>(ws + EpScratch::kCtaBad) + c2));
  for (int q = tid; q < RE; q += blockDim.x) {
    int base = 0, tot = 0;
#pragma unroll 8
    for (int c2 = 0; c2 < G; ++c2) {
      const int v = __ldcg(cta_counts + static_cast<int64_t>(c2) * RE + q);
      if (c2 < c) base += v;
      tot += v;
    }
    for (int w2 = 0; w2 < LW; ++w2) cnt[w2 * RE + q] += base;
    if (c == 0) {
      if (q < R) own.counts[q] = tot; else own.exp_counts[q - R] = tot;
    }
    if (rl) {  // the receive tables' inputs, which the peers' headers carry otherwise
      if (q < R) tb.src_counts[me * R + q] = tot;
      else if ((q - R) / E_loc == me) tb.off[q - R] = tot;  // off[me * E_loc + e], e = q - R - me * E_loc
    }
  }
  for (int q = tid; rl && q < (R - 1) * RL; q += blockDim.x) {
    const int q1 = q / RL, f = q % RL, s = (me + 1 + q1) % R;
    int base = 0, tot = 0;
#pragma unroll 8
    for (int c2 = 0; c2 < G; ++c2) {
      const int v = __ldcg(peer_counts + static_cast<int64_t>(c2) * (R - 1) * RL + q);
      if (c2 < c) base += v;
      tot += v;
    }
    for (int w2 = 0; w2 < LW; ++w2) pcnt[(q1 * LW + w2) * RL + f] += base;
    if (f < R) tb.src_counts[s * R + f] = tot; else tb.off[s * E_loc + f - R] = tot;
  }
  __syncthreads();
  EP_TRACE(p, sh_t0, "dispatch prefix", tid == 0);
  const bool bad = sh_bad != ULLONG_MAX;
  if (bad && c == 0 && tid == 0 && !iabort && (sh_bad >> 40) != 0) {  // a peer's (copy-engine rows)
    const int s = (me + static_cast<int>(sh_bad >> 40)) % R;
    const int t = static_cast<int>((sh_bad >> 6) & ((1ull << 34) - 1)), k = static_cast<int>(sh_bad & 63);
    const int id = __ldcg(peer_slot(p, hoff, s, me).topk + static_cast<int64_t>(t) * K + k);
    cuda::record_error_device(p.w.err, kErrBadInput, kOpEpDispatch, me, s, 0, id, 0,
                              ep_bad_detail(t, (id < -1 || id >= E) ? kEpBadExpertRange : kEpBadDuplicateExpert));
  } else if (bad && c == 0 && tid == 0 && !iabort) {
    const int t = static_cast<int>(sh_bad >> 6), k = static_cast<int>(sh_bad & 63);
    const int id = p.topk[static_cast<int64_t>(t) * K + k];
    const int kind = (id < -1 || id >= E) ? kEpBadExpertRange : kEpBadDuplicateExpert;
    const int64_t detail = ep_bad_detail(t, kind);
    *reinterpret_cast<volatile int64_t*>(ws + EpWorkspace::kDispatchBadDetail) = detail;
    *reinterpret_cast<volatile int64_t*>(ws + EpWorkspace::kDispatchBadValue) = id;
    __threadfence_system();
    *reinterpret_cast<volatile uint64_t*>(ws_u64(ws, EpWorkspace::kDispatchBad)) = seq;
    cuda::record_error_device(p.w.err, kErrBadInput, kOpEpDispatch, me, me, 0, id, 0, detail);
  }

  // Header (CTA 0): totals, bad words and N into this rank's slot on every peer, then the flag. Before pass 2:
  // the receivers' tables need only the totals, and pass 2 of CTA 0's range would delay them.
  if (c == 0 && !iabort && !rl) {  // copy-engine rows: the receivers count for themselves
    for (int q = tid; q < (R - 1) * RE; q += blockDim.x) {
      const int d = (me + 1 + q / RE) % R, f = q % RE;
      const Slot sl = peer_slot(p, hoff, me, d);
      if (f < R) sl.counts[f] = own.counts[f]; else sl.exp_counts[f - R] = own.exp_counts[f - R];
    }
    for (int d = tid; d < R; d += blockDim.x) {
      if (d == me) continue;
      const Slot sl = peer_slot(p, hoff, me, d);
      if (bad) {
        const int t = static_cast<int>(sh_bad >> 6), k = static_cast<int>(sh_bad & 63);
        const int id = p.topk[static_cast<int64_t>(t) * K + k];
        *reinterpret_cast<int64_t*>(sl.ctrl(EpInbox::kBadDetail)) =
            ep_bad_detail(t, (id < -1 || id >= E) ? kEpBadExpertRange : kEpBadDuplicateExpert);
        *reinterpret_cast<int64_t*>(sl.ctrl(EpInbox::kBadValue)) = id;
      }
      *sl.ctrl(EpInbox::kBad) = bad ? seq : 0;
      *sl.ctrl(EpInbox::kN) = static_cast<uint64_t>(N);
    }
    __syncthreads();
    if (tid == 0) {
      __threadfence_system();
      for (int d = 0; d < R; ++d)
        if (d != me) st_release_sys_u64(peer_slot(p, hoff, me, d).ctrl(EpInbox::kFlag), seq);
    }
  }
  // ---- layout pass 2: positions in token order --------------------------------------------------------------
  if (!bad && !iabort && warp < LW) {
    int* wc = cnt + warp * RE;
    for (int t = wa; t < wb; ++t) {
      const int64_t tK = static_cast<int64_t>(t) * K;
      if (t < N) {
        const int id = lane < K ? topk_at(t, lane) : -1;
        const bool valid = id >= 0;
        const int pe = valid ? atomicAdd(&wc[R + id], 1) : -1;
        const int d = valid ? id / E_loc : -1;
        bool dup, master;
        token_lanes(id, d, valid, K, lane, &dup, &master);
        const int pr = master ? atomicAdd(&wc[d], 1) : -1;
        if (lane < K) {  // topk: for push_token (copy-engine rows: the peers have the topk rows already)
          if (!rl) own.topk[tK + lane] = id;
          own.pos_exp[tK + lane] = pe;
        }
        // pos_rank row: -1, then each master lane's position at its rank (distinct ranks; __syncwarp orders the
        // two stores to one word). Was a K-step shuffle search per 32 ranks: ~16 dependent shuffles per token.
        for (int dd = lane; dd < R; dd += 32) own.pos_rank[static_cast<int64_t>(t) * R + dd] = -1;
        __syncwarp();
        if (pr >= 0) own.pos_rank[static_cast<int64_t>(t) * R + d] = pr;
      } else {
        if (lane < K) {
          if (!rl) own.topk[tK + lane] = -1;
          own.pos_exp[tK + lane] = -1;
        }
        for (int dd = lane; dd < R; dd += 32) own.pos_rank[static_cast<int64_t>(t) * R + dd] = -1;
      }
    }
  }
  // Peers' pass 2 (copy-engine rows): the position of each of their tokens here and of its (t, k) pairs among the
  // peer's pairs to that local expert -- what the peer's own pass 2 finds -- into the own inbox slot's pos / pos_exp.
  if (rl && !bad && !iabort && warp < LW) {
    for (int q1 = 0; q1 < R - 1; ++q1) {
      const Slot sl = peer_slot(p, hoff, (me + 1 + q1) % R, me);
      const int te = min(wb, peer_n(sl));
      int* wc = pcnt + (q1 * LW + warp) * RL;
      for (int t = wa; t < te; ++t) {
        const int id = lane < K ? peer_topk_at(q1, sl.topk, t, lane) : -1;
        const bool valid = id >= 0;
        const int d = valid ? id / E_loc : -1;
        const int pe = d == me ? atomicAdd(&wc[R + id - me * E_loc], 1) : -1;
        bool dup, master;
        token_lanes(id, d, valid, K, lane, &dup, &master);
        const int pr = master && d == me ? atomicAdd(&wc[me], 1) : -1;
        if (p.expand && lane < K) sl.pexp[static_cast<int64_t>(t) * K + lane] = pe;
        const unsigned pm = __ballot_sync(kFull, pr >= 0);
        const int v = pm ? __shfl_sync(kFull, pr, __ffs(pm) - 1) : -1;
        if (lane == 0) sl.pos[t] = v;
      }
    }
  }
  __syncthreads();  // pass 2 of this CTA's range (and CTA 0's totals) visible to the whole CTA
  EP_TRACE(p, sh_t0, "dispatch layout+header", tid == 0);

  const int PW = nwarps - SW;
  const int NCH = p.chunk, len = t1 - t0;
  if (warp < SW) {
    // ---- 2. stage warps: push this CTA's range, chunk by chunk ----------------------------------------------------
    if (!bad && !iabort && !rl) {  // chunk li of the range by warp li % SW; no barrier between warps
      push_chunks(p, own, hoff, seq, t0, len, min(t1, N), warp, SW, true,
                  [&](int t, int d) { return own.pos_rank[static_cast<int64_t>(t) * R + d]; }, lane);
    }
    EP_TRACE(p, sh_t0, "dispatch pushed", lane == 0 && (warp == 0 || warp == SW - 1));
    bar_sync(1, SW * 32);
    if (tid == 0 && !iabort &&
        staged_arrive(ws, EpScratch::kDispatchStaged, EpWorkspace::dispatch_ready(p.sequence), seq) && trace > 1)
      printf("EPTRACE dispatch ready published rank %d cta %d: %.1f us (start %.1f)\n", me, c,
             (cuda::globaltimer_ns() - sh_t0) * 1e-3, (sh_t0 % 1000000000ull) * 1e-3);
    bar_sync(2, blockDim.x);  // receive tables built by the pull warps
    if (!sh_abort && !bad && !iabort) {
      const int te = min(t1, N);
      for (int q = tid; q < (te - t0) * R; q += SW * 32) {
        const int t = t0 + q / R, d = q % R;
        const int pos = own.pos_rank[static_cast<int64_t>(t) * R + d];
        p.dst_row[static_cast<int64_t>(t) * R + d] = pos >= 0 ? tb.base_dst[d] + pos : -1;
      }
      if (c == 0) {
        for (int s = tid; s < R; s += SW * 32) p.psum_rank[s] = tb.psum_excl[s + 1];
        if (tid == 0) *p.num_recv = tb.psum_excl[R];
        for (int e = tid; e < E_loc; e += SW * 32) {
          const int a = align32(tb.cnt_e[e], p.A);
          p.unaligned[e] = tb.cnt_e[e];
          p.group_sizes[e] = a;
          p.psum_expert[e] = p.expand ? tb.start_e[e] + tb.cnt_e[e] : tb.start_e[e] + a;
        }
      }
      if (p.expand && p.zero_padding) zero_padding_rows(p, tb, E_loc, SW);
    }
    EP_TRACE(p, sh_t0, "dispatch dst_row+counts", tid == 0);
    if (c == 0 && !iabort && !sh_abort) {  // a call ends only after every peer published its ready
      for (int s = tid; s < R; s += SW * 32)
        wait_ge(ws_u64(p.w.ws_peers[s], EpWorkspace::dispatch_ready(p.sequence)), seq, p.w, kOpEpDispatch, s);
    }
    EP_TRACE(p, sh_t0, "dispatch end_wait", tid == 0);
    trace_span_end(trace, ws, &sh_done, "dispatch", me);
    EP_TRACE_FLUSH(p, sh_t0);
    return;
  }

  // ---- 3. pull warps ------------------------------------------------------------------------------------------------
  const int ptid = tid - SW * 32, pthreads = PW * 32;
  bool ok = !bad && !iabort;
  if (ok && !rl) {
    for (int s = ptid; s < R; s += pthreads) {  // every peer's header (own memory)
      if (s == me) continue;
      const Slot sl = peer_slot(p, hoff, s, me);
      if (!wait_local(sl.ctrl(EpInbox::kFlag), seq, p.w, kOpEpDispatch, s)) {
        atomicOr(&sh_abort, 1);
      } else if (ld_volatile_u64(sl.ctrl(EpInbox::kBad)) == seq) {
        cuda::record_error_device(p.w.err, kErrBadInput, kOpEpDispatch, me, s, 0,
                                  *reinterpret_cast<const volatile int64_t*>(sl.ctrl(EpInbox::kBadValue)), 0,
                                  *reinterpret_cast<const volatile int64_t*>(sl.ctrl(EpInbox::kBadDetail)));
        atomicOr(&sh_abort, 1);
      }
    }
    bar_sync(3, pthreads);
    ok = !sh_abort;
  }
  EP_TRACE(p, sh_t0, "dispatch headers_in", ptid == 0);
  if (ok) {
    // receive tables (counts of source q: own totals or q's header; copy-engine rows: src_counts / off, filled
    // after the grid barrier)
    for (int q = ptid; q < R; q += pthreads) {
      const int32_t* cq = q == me ? own.counts : peer_slot(p, hoff, q, me).counts;
      tb.psum_excl[q + 1] = rl ? tb.src_counts[q * R + me] : __ldcg(cq + me);  // recv_from[q], scanned below
      int b = 0;
      for (int s = 0; s < me; ++s) b += rl ? tb.src_counts[s * R + q] : __ldcg(peer_slot(p, hoff, s, me).counts + q);
      tb.base_dst[q] = b;
    }
    for (int q = ptid; !rl && q < R * E_loc; q += pthreads) {
      const int s = q / E_loc, e = q % E_loc;
      const int32_t* ec = s == me ? own.exp_counts : peer_slot(p, hoff, s, me).exp_counts;
      tb.off[q] = __ldcg(ec + me * E_loc + e);
    }
    bar_sync(3, pthreads);
    if (ptid == 0) {  // in place, so one thread (R adds, no divisions)
      tb.psum_excl[0] = 0;
      for (int s = 0; s < R; ++s) tb.psum_excl[s + 1] += tb.psum_excl[s];
    }
    for (int e = ptid; e < E_loc; e += pthreads) {
      int run = 0;
      for (int s = 0; s < R; ++s) {
        const int v = tb.off[s * E_loc + e];
        tb.off[s * E_loc + e] = run;
        run += v;
      }
      tb.cnt_e[e] = run;
    }
    bar_sync(3, pthreads);
    if (ptid < 32) build_expert_tables(tb, E_loc, p.A, true, lane);
    bar_sync(3, pthreads);
  }
  bar_arrive(2, blockDim.x);
  EP_TRACE(p, sh_t0, "dispatch tables", ptid == 0);
  if (!ok) {
    trace_span_end(trace, ws, &sh_done, "dispatch", me);
    return;
  }

  // pulls: items (chunk li of this CTA's range, source slot q), own rank first, handed out dynamically
  const int per = ep_tokens_per_cta(M, G);
  int ce_seen = -1;
  for (;;) {
    int it = 0;
    if (lane == 0) it = atomicAdd(&sh_next, 1);
    it = __shfl_sync(kFull, it, 0);
    if (it >= NCH * R) break;
    const int li = it / R, q = it % R;
    const int s = (me + q) % R;
    const bool self = s == me;
    const Slot sl = self ? Slot{} : peer_slot(p, hoff, s, me);
    const int Ns = self ? N : static_cast<int>(ld_volatile_u64(sl.ctrl(EpInbox::kN)));
    const int cb = ep_chunk_begin(t0, len, NCH, li), ce = min(ep_chunk_begin(t0, len, NCH, li + 1), Ns);
    if (cb >= ce) continue;
    // copy-engine rows: the routing rows are this CTA's own pass 2, then per item only the piece; the items are
    // small (~2 tokens, ep_ce_chunks)
    if (!self && !p.ce_pieces &&
        !warp_wait_local(chunk_word(sl, c, li, SW), chunk_value(seq, li, SW), p.w, kOpEpDispatch, s, lane))
      return;
    if (!self && p.ce_pieces) {  // every piece the chunk touches: with several copy streams they land in any order
      const int j0 = ep_ce_piece_of(cb - t0, per, p.ce_pieces, p.ce_taper);
      const int j1 = ep_ce_piece_of(ce - 1 - t0, per, p.ce_pieces, p.ce_taper);
      for (int j = j0; j <= j1; ++j) {
        if (!wait_ce_piece(p, sl, s, j, seq, &ce_seen, lane)) return;
        if (trace > 1 && lane == 0 && (j == 0 || j == p.ce_pieces - 1)) {  // first warp of the CTA to see it
          const int bit = j == 0 ? 1 : 2;
          if (!(atomicOr(&sh_piece_seen, bit) & bit))
            EP_TRACE(p, sh_t0, j == 0 ? "dispatch ce piece 0 in" : "dispatch ce last piece in", true);
        }
      }
    }
    int pos = -1;
    if (lane < ce - cb) pos = self ? own.pos_rank[static_cast<int64_t>(cb + lane) * R + me] : __ldcg(sl.pos + cb + lane);
    unsigned vm = __ballot_sync(kFull, pos >= 0);
    while (vm) {
      const int b = __ffs(vm) - 1;
      vm &= vm - 1;
      const int pb = __shfl_sync(kFull, pos, b);
      pull_token(p, tb, own, sl, s, cb + b, tb.psum_excl[s] + pb, E_loc, lane);
    }
  }
  EP_TRACE(p, sh_t0, "dispatch pulled", lane == 0 && (warp == SW || warp == nwarps - 1));
  trace_span_end(trace, ws, &sh_done, "dispatch", me);
  EP_TRACE_FLUSH(p, sh_t0);
}

// One received row i of a cached dispatch (source s, token t). Whole warp.
JE_DEVICE void pull_cached(const EpDispatchParams& p, const Slot& sl, int s, int t, int i, int lane) {
  const int me = p.w.rank, K = p.K;
  const bool self = s == me;
  const int64_t tK = static_cast<int64_t>(t) * K;
  const uint8_t* src_x = self ? p.x + t * p.x_bytes : sl.x + t * p.L.x_row;
  const uint8_t* src_sf = self ? p.sf + t * p.sf_bytes : sl.sf + t * p.L.sf_row;
  float wv = 0.0f;
  if (p.recv_w && lane < K) wv = self ? p.weights[tK + lane] : __ldcg(sl.w + tK + lane);
  if (!p.expand) {
    warp_copy(src_x, p.recv_x, p.x_bytes, 1u, i, p.x_bytes, lane);
    if (p.sf_bytes) warp_copy(src_sf, p.recv_sf, p.sf_bytes, 1u, i, p.sf_bytes, lane);
    if (p.recv_w && lane < K) p.recv_w[static_cast<int64_t>(i) * K + lane] = wv;
    return;
  }
  int64_t row = -1;
  if (lane < K) row = p.h_meta[static_cast<int64_t>(i) * (K + 2) + 2 + lane];
  if (row >= p.rows) {
    cuda::record_error_device(p.w.err, kErrBadInput, kOpEpDispatch, me, me, 0, row, 0,
                              ep_bad_detail(i, kEpBadHandle));
    row = -1;
  }
  const bool ok = row >= 0;
  if (ok && p.recv_w) p.recv_w[row] = wv;
  const unsigned dm = __ballot_sync(kFull, ok);
  warp_copy(src_x, p.recv_x, p.x_bytes, dm, row, p.x_bytes, lane);
  if (p.sf_bytes) warp_copy(src_sf, p.recv_sf, p.sf_bytes, dm, row, p.sf_bytes, lane);
}

__global__ void __launch_bounds__(kEpThreads, 1) dispatch_cached_kernel(const EpDispatchParams p, int SW) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ uint64_t sh_seq;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int G = gridDim.x, c = blockIdx.x;
  const int R = p.w.nranks, me = p.w.rank;
  const int M = p.M, N = p.N, K = p.K, E_loc = p.E / R;
  uint8_t* ws = p.w.ws_own;
  cache_peer_bases(p);
  if (tid == 0) {
    sh_seq = enter_seq(ws, EpWorkspace::dispatch_seq(p.sequence), EpScratch::kDispatchArrive);
    if (c == 0 && p.token_out) *p.token_out = *p.token;
  }
  __syncthreads();
  const uint64_t seq = sh_seq;
  if (!ce_sequence_ok(p, seq)) return;  // publishes nothing: the peers time out
  const uint64_t hoff = p.w.st_offset + p.L.half(seq);
  const Half own = half_at(p.w.st_own + hoff, p.L);
  const Tables tb = tables_at(smem, p.smem_tables, R, E_loc);
  const int PW = nwarps - SW;
  const int NCH = p.chunk;

  if (warp < SW) {  // the chunks of the full dispatch (ranges from M, tokens below N)
    int t0, t1;
    ep_cta_tokens(M, G, c, &t0, &t1);
    push_chunks(p, own, hoff, seq, t0, t1 - t0, min(t1, N), warp, SW, false,
                [&](int t, int d) { return p.h_dst_row[static_cast<int64_t>(t) * R + d]; }, lane);
    bar_sync(1, SW * 32);
    if (tid == 0) staged_arrive(ws, EpScratch::kDispatchStaged, EpWorkspace::dispatch_ready(p.sequence), seq);
    bar_sync(2, blockDim.x);
    if (p.expand && p.zero_padding) zero_padding_rows(p, tb, E_loc, SW);
    if (c == 0)
      for (int s = tid; s < R; s += SW * 32)
        wait_ge(ws_u64(p.w.ws_peers[s], EpWorkspace::dispatch_ready(p.sequence)), seq, p.w, kOpEpDispatch, s);
    return;
  }

  const int pw = warp - SW, ptid = tid - SW * 32, pthreads = PW * 32;
  // tables for zero padding: start[e] = align(psum_expert[e-1], A) (expand psum = start + count)
  for (int e = ptid; e < E_loc; e += pthreads) {
    tb.cnt_e[e] = p.h_unaligned[e];
    tb.start_e[e] = e == 0 ? 0 : align32(p.h_psum_expert[e - 1], p.A);
  }
  bar_sync(3, pthreads);
  if (ptid < 32) build_expert_tables(tb, E_loc, p.A, false, lane);
  bar_arrive(2, blockDim.x);

  int num_recv = p.h_psum_rank[R - 1];
  if (num_recv < 0 || num_recv > R * M) {
    if (c == 0 && ptid == 0)
      cuda::record_error_device(p.w.err, kErrBadInput, kOpEpDispatch, me, me, 0, num_recv, 0,
                                ep_bad_detail(0, kEpBadHandle));
    num_recv = 0;
  }
  int last_s = -1, last_c = -1, last_li = -1, ce_seen = -1;
  const int per = ep_tokens_per_cta(M, G);
  for (int blk = c * PW + pw; blk * 32 < num_recv; blk += G * PW) {
    const int i = blk * 32 + lane;
    int gid = -1;
    if (i < num_recv) {
      gid = p.h_meta[static_cast<int64_t>(i) * (K + 2)];
      if (gid < 0 || gid >= R * M) {
        cuda::record_error_device(p.w.err, kErrBadInput, kOpEpDispatch, me, me, 0, gid, 0,
                                  ep_bad_detail(i, kEpBadHandle));
        gid = -1;
      }
    }
    unsigned vm = __ballot_sync(kFull, gid >= 0);
    while (vm) {
      const int b = __ffs(vm) - 1;
      vm &= vm - 1;
      const int g = __shfl_sync(kFull, gid, b);
      const int s = g / M, t = g % M;
      const int sc = ep_cta_of_token(t, M, G);
      int sb, se;
      ep_cta_tokens(M, G, sc, &sb, &se);
      const int sli = ep_chunk_of(t, sb, se - sb, NCH);
      const Slot sl = s == me ? Slot{} : peer_slot(p, hoff, s, me);
      if (s != me && (s != last_s || sc != last_c || sli != last_li)) {
        if (!warp_wait_local(chunk_word(sl, sc, sli, SW), chunk_value(seq, sli, SW), p.w, kOpEpDispatch, s, lane))
          return;
        last_s = s;
        last_c = sc;
        last_li = sli;
      }
      // a piece covers the same offsets of every source CTA's range: the piece index steps back when these rows
      // cross into the next CTA's range (a repeated wait for a landed piece is two loads)
      if (s != me && p.ce_pieces) {
        const int j = ep_ce_piece_of(t - sb, per, p.ce_pieces, p.ce_taper);
        if (!wait_ce_piece(p, sl, s, j, seq, &ce_seen, lane)) return;
      }
      pull_cached(p, sl, s, t, blk * 32 + b, lane);
    }
  }
}

cudaError_t launch(void (*kernel)(const EpDispatchParams, int), const EpDispatchParams& p, const EpLaunch& l,
                   int smem, cudaStream_t stream) {
  if (l.num_ctas < 1 || l.num_ctas > kEpMaxCtas || l.stage_warps < 1 || l.stage_warps >= kEpThreads / 32)
    return cudaErrorInvalidValue;
  cudaError_t e = cudaSuccess;
  if (smem > 48 * 1024) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(l.num_ctas);
  cfg.blockDim = dim3(kEpThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int sw = l.stage_warps;
  e = cudaLaunchKernelEx(&cfg, kernel, p, sw);
  if (e != cudaSuccess) return e;
  return cudaGetLastError();
}

}  // namespace
}  // namespace ep

int64_t ep_dispatch_smem_bytes(int R, int E, bool ce, int* layout_warps, int* tables_offset, int* peer_offset) {
  if (R < 1 || E < R) return -1;
  const int E_loc = E / R, RE = R + E, RL = ce ? (R - 1) * (R + E_loc) : 0;
  const int tables = (ep::tables_bytes(R, E_loc) + 15) / 16 * 16;
  const int budget = 200 * 1024;
  const int lw = std::min(kEpThreads / 32, (budget - tables) / ((RE + RL) * 4));
  if (lw < 1) return -1;
  if (layout_warps) *layout_warps = lw;
  const int peer = (lw * RE * 4 + 15) / 16 * 16;
  const int off = peer + (lw * RL * 4 + 15) / 16 * 16;
  if (peer_offset) *peer_offset = peer;
  if (tables_offset) *tables_offset = off;
  return off + tables;
}

cudaError_t launch_ep_dispatch(EpDispatchParams p, const EpLaunch& l, cudaStream_t stream) {
  int lw = 0, off = 0, peer = 0;
  const int64_t smem = ep_dispatch_smem_bytes(p.w.nranks, p.E, p.ce_pieces > 0, &lw, &off, &peer);
  if (smem < 0) return cudaErrorInvalidValue;
  p.layout_warps = lw;
  p.smem_tables = off;
  p.smem_peer_cnt = peer;
  // topk cache of the CTA's token range (then of the peers' ranges: copy-engine rows) when it fits beside the
  // counters and tables (H100/H200: 227 KB per CTA)
  const int64_t tpc = ep_tokens_per_cta(p.M, l.num_ctas);
  const int64_t cache = (smem + 15) / 16 * 16;
  const int64_t cache_bytes = tpc * p.K * 4;
  int64_t total = smem;
  p.smem_topk = -1;
  p.smem_peer_topk = -1;
  if (cache + cache_bytes <= 220 * 1024) {
    p.smem_topk = static_cast<int32_t>(cache);
    total = cache + cache_bytes;
    if (p.ce_pieces > 0 && total + (p.w.nranks - 1) * cache_bytes <= 220 * 1024) {
      p.smem_peer_topk = static_cast<int32_t>(total);
      total += (p.w.nranks - 1) * cache_bytes;
    }
  }
  p.chunk = p.ce_pieces ? ep_ce_chunks(tpc, l.stage_warps) : ep_dispatch_chunks(tpc, l.stage_warps);
  p.trace = ep_trace_level();
  p.trace_cta = ep_trace_cta();
  auto* kernel = p.ce_pieces > 0 ? (p.trace > 0 ? ep::dispatch_kernel<true, true> : ep::dispatch_kernel<true, false>)
                                  : (p.trace > 0 ? ep::dispatch_kernel<false, true> : ep::dispatch_kernel<false, false>);
  return ep::launch(kernel, p, l, static_cast<int>(total), stream);
}

cudaError_t launch_ep_dispatch_cached(EpDispatchParams p, const EpLaunch& l, cudaStream_t stream) {
  const int R = p.w.nranks;
  p.layout_warps = 0;
  p.smem_tables = 0;
  const int64_t tpc = ep_tokens_per_cta(p.M, l.num_ctas);
  p.chunk = p.ce_pieces ? ep_ce_chunks(tpc, l.stage_warps) : ep_dispatch_chunks(tpc, l.stage_warps);
  const int smem = (ep::tables_bytes(R, p.E / R) + 15) / 16 * 16;
  return ep::launch(ep::dispatch_cached_kernel, p, l, smem, stream);
}

}  // namespace jax_engram
