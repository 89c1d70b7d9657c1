// CPU EP dispatch / combine (pull protocol, docs/DESIGN.md; every offset from ep_layout.h).
#include "kernels/cpu/ep.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/cpu/sync.h"

namespace jax_engram::cpu {
namespace {

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even (as XLA's convert)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// seq = ++own.seq (owner-private word).
inline uint64_t next_seq(Member& m, uint64_t seq_off) {
  uint64_t* p = at<uint64_t>(m.alloc(0)->local, seq_off);
  const uint64_t seq = *p + 1;
  *p = seq;
  return seq;
}

// Marks this call's input as bad (before publishing), so every peer fails too instead of timing out.
inline void mark_bad(Member& m, uint64_t bad_off, uint64_t seq, int64_t detail, int64_t value) {
  uint8_t* ws = m.alloc(0)->local;
  *at<int64_t>(ws, bad_off + 8) = detail;
  *at<int64_t>(ws, bad_off + 16) = value;
  *at<uint64_t>(ws, bad_off) = seq;
}

inline void publish(Member& m, uint64_t ready_off, uint64_t seq) {
  store_release(at<uint64_t>(m.alloc(0)->local, ready_off), seq);
}

// Waits for every peer's ready >= seq, then fails if a peer marked this call bad.
bool wait_peers(Member& m, int32_t op, uint64_t ready_off, uint64_t bad_off, uint64_t seq) {
  Allocation* w = m.alloc(0);
  for (int s = 0; s < m.nranks; ++s)
    if (!wait_at_least(m, op, s, at<uint64_t>(w->peers[s], ready_off), seq)) return false;
  for (int s = 0; s < m.nranks; ++s) {
    const uint8_t* pw = w->peers[s];
    if (load_acquire(at<uint64_t>(pw, bad_off)) == seq) {
      record_error(m.error_host, kErrBadInput, op, m.rank, s, 0, *at<int64_t>(pw, bad_off + 16), 0,
                   *at<int64_t>(pw, bad_off + 8));
      return false;
    }
  }
  return true;
}

inline void fail_local(Member& m, int32_t op, int64_t detail, int64_t value) {
  record_error(m.error_host, kErrBadInput, op, m.rank, m.rank, 0, value, 0, detail);
}

// The first bad entry of topk [N, K] in token order, then k order: an id outside [-1, E) or a valid id an earlier k
// of the token holds. Returns false (nothing bad) or fills *detail = ep_bad_detail(token, kind) and *value = the id.
bool first_bad_route(const int32_t* topk, int64_t N, int64_t K, int64_t E, int64_t* detail, int64_t* value) {
  for (int64_t t = 0; t < N; ++t) {
    const int32_t* row = topk + t * K;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t id = row[k];
      int32_t kind = 0;
      if (id < -1 || id >= E) kind = kEpBadExpertRange;
      for (int64_t j = 0; j < k && !kind; ++j)
        if (id >= 0 && row[j] == id) kind = kEpBadDuplicateExpert;
      if (kind) {
        *detail = ep_bad_detail(t, kind);
        *value = id;
        return true;
      }
    }
  }
  return false;
}

}  // namespace

void ep_local_scatter(const uint8_t* x, const int32_t* dest, const int32_t* src, uint8_t* out, int64_t N, int64_t K,
                      int64_t rows, int64_t row_bytes) {
  // Row r belongs to token src[r] when that token lists r among its destinations; every other row is zeroed.
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t s = src[r];
    bool owned = false;
    if (s >= 0 && s < N)
      for (int64_t k = 0; k < K; ++k) owned |= dest[s * K + k] == r;
    if (owned)
      std::memcpy(out + r * row_bytes, x + s * row_bytes, static_cast<size_t>(row_bytes));
    else
      std::memset(out + r * row_bytes, 0, static_cast<size_t>(row_bytes));
  }
}

void ep_local_layout(const EpLocalLayoutArgs& a) {
  const int64_t N = a.N, K = a.K, E = a.E, M = a.M, rows = a.rows, n = N * K, W = K + 2;
  const auto valid = [E](int32_t id) { return id >= 0 && id < E; };
  std::vector<int32_t> start(static_cast<size_t>(E)), rank(static_cast<size_t>(E), 0);
  std::fill(a.count, a.count + E, 0);
  for (int64_t j = 0; j < n; ++j)
    if (valid(a.topk[j])) ++a.count[a.topk[j]];
  int32_t s = 0;
  for (int64_t e = 0; e < E; ++e) {
    start[e] = s;
    a.aligned[e] = static_cast<int32_t>(ep_align(a.count[e], a.A));
    a.psum_expert[e] = s + a.count[e];
    s += a.aligned[e];
  }
  std::fill(a.src_entry, a.src_entry + rows, static_cast<int32_t>(n));
  std::fill(a.src_tok, a.src_tok + rows, static_cast<int32_t>(N));
  int32_t num = 0;
  for (int64_t t = 0; t < N; ++t) {
    int32_t master = -1;
    for (int64_t k = 0; k < K; ++k) {  // (t, k) order: an entry's rank counts the earlier entries of its expert
      const int32_t id = a.topk[t * K + k];
      int32_t row = -1;
      if (valid(id)) {
        row = start[id] + rank[id]++;
        master = static_cast<int32_t>(k);
        if (row < rows) {
          a.src_entry[row] = static_cast<int32_t>(t * K + k);
          a.src_tok[row] = static_cast<int32_t>(t);
        }
      }
      a.exp_row[t * K + k] = row;
    }
    a.dst_row[t] = master >= 0 ? num : -1;
    if (master < 0) continue;
    if (num < M) {
      int32_t* m = a.meta + num * W;
      m[0] = static_cast<int32_t>(t);
      m[1] = master;
      std::copy(a.exp_row + t * K, a.exp_row + (t + 1) * K, m + 2);
    }
    ++num;
  }
  if (num < M) std::fill(a.meta + num * W, a.meta + M * W, -1);
  *a.num_recv = num;
}

bool ep_guard(Member& m, const int32_t* topk, int64_t N, int64_t K, int64_t E) {
  int64_t detail = 0, value = 0;
  if (!first_bad_route(topk, N, K, E, &detail, &value)) return true;
  fail_local(m, kOpEpDispatch, detail, value);
  return false;
}

bool ep_guard_records(Member& m, const int32_t* rec, int64_t R) {
  const int64_t r = ep_first_offender(rec, R);
  if (r < 0) return true;
  record_error(m.error_host, kErrBadInput, kOpEpDispatch, rec[R * 3], static_cast<int32_t>(r), 0, rec[r * 3 + 2], 0,
               ep_bad_detail(rec[r * 3 + 1], rec[r * 3]));
  return false;
}

bool ep_dispatch(Member& m, Allocation& region, uint64_t offset, const EpDispatchArgs& a) {
  const EpConfig& c = a.c;
  const int R = m.nranks, d = m.rank;
  const int64_t M = c.M, N = c.N, K = c.K, E = c.E, E_loc = E / R, A = c.A;
  const auto L = EpDispatchLayout::make(R, M, K, E, a.x_bytes, a.sf_bytes / 4);
  const uint64_t seq = next_seq(m, EpWorkspace::kDispatchSeq);
  uint8_t* h = region.local + offset + L.half(seq);

  // 1. Validate and lay out own routing (counting sort in token order).
  int64_t bad_detail = 0, bad_value = 0;
  if (first_bad_route(a.topk, N, K, E, &bad_detail, &bad_value)) {
    mark_bad(m, EpWorkspace::kDispatchBad, seq, bad_detail, bad_value);
    publish(m, EpWorkspace::kDispatchReady, seq);
    fail_local(m, kOpEpDispatch, bad_detail, bad_value);
    return false;
  }
  int32_t* counts = at<int32_t>(h, L.counts());
  int32_t* exp_counts = at<int32_t>(h, L.exp_counts());
  int32_t* st_topk = at<int32_t>(h, L.topk_idx());
  int32_t* pos_rank = at<int32_t>(h, L.pos_rank());
  int32_t* pos_exp = at<int32_t>(h, L.pos_exp());
  std::fill(counts, counts + R, 0);
  std::fill(exp_counts, exp_counts + E, 0);
  std::fill(st_topk, st_topk + M * K, -1);
  std::fill(pos_rank, pos_rank + M * R, -1);
  std::fill(pos_exp, pos_exp + M * K, -1);
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t id = a.topk[t * K + k];
      st_topk[t * K + k] = id;
      if (id < 0) continue;
      const int64_t r = id / E_loc;
      if (pos_rank[t * R + r] < 0) pos_rank[t * R + r] = counts[r]++;
      pos_exp[t * K + k] = exp_counts[id]++;
    }
  }
  if (a.w) std::memcpy(at<float>(h, L.weights()), a.w, sizeof(float) * N * K);
  for (int64_t t = 0; t < N; ++t) std::memcpy(h + L.x() + t * L.x_row, a.x + t * a.x_bytes, a.x_bytes);
  if (a.sf_bytes)
    for (int64_t t = 0; t < N; ++t) std::memcpy(h + L.scales() + t * L.sf_row, a.sf + t * a.sf_bytes, a.sf_bytes);
  publish(m, EpWorkspace::kDispatchReady, seq);

  // 2. Wait for the peers' halves.
  if (!wait_peers(m, kOpEpDispatch, EpWorkspace::kDispatchReady, EpWorkspace::kDispatchBad, seq)) return false;
  std::vector<const uint8_t*> ph(R);
  for (int s = 0; s < R; ++s) ph[s] = region.peers[s] + offset + L.half(seq);

  // 3. Counts.
  std::vector<int64_t> rstart(R), count(E_loc, 0), start(E_loc), srcoff(R * E_loc);
  int64_t acc = 0;
  for (int s = 0; s < R; ++s) {
    rstart[s] = acc;
    acc += at<int32_t>(ph[s], L.counts())[d];
    a.psum_rank[s] = static_cast<int32_t>(acc);
  }
  *a.num_recv = static_cast<int32_t>(acc);
  for (int s = 0; s < R; ++s) {
    const int32_t* ec = at<int32_t>(ph[s], L.exp_counts()) + d * E_loc;
    for (int64_t e = 0; e < E_loc; ++e) {
      srcoff[s * E_loc + e] = count[e];
      count[e] += ec[e];
    }
  }
  int64_t run = 0;
  for (int64_t e = 0; e < E_loc; ++e) {
    start[e] = run;
    const int64_t al = ep_align(count[e], A);
    run += al;
    a.unaligned[e] = static_cast<int32_t>(count[e]);
    a.group_sizes[e] = static_cast<int32_t>(al);
    a.psum_expert[e] = static_cast<int32_t>(c.expand ? start[e] + count[e] : run);
  }
  // Sender side: row of my token t in dest r's non-expand layout.
  for (int r = 0; r < R; ++r) {
    int64_t before = 0;
    for (int s = 0; s < d; ++s) before += at<int32_t>(ph[s], L.counts())[r];
    for (int64_t t = 0; t < N; ++t) {
      const int32_t pr = pos_rank[t * R + r];
      a.dst_row[t * R + r] = pr < 0 ? -1 : static_cast<int32_t>(before + pr);
    }
  }

  // 4. Pull. Rows nobody writes are zero (x, scales, weights) / -1 (indices): unspecified by the contract.
  const int64_t rows_tok = R * M;
  std::memset(a.recv_x, 0, c.rows * a.x_bytes);
  if (a.sf_bytes) std::memset(a.recv_sf, 0, c.rows * a.sf_bytes);
  if (a.recv_w) std::memset(a.recv_w, 0, sizeof(float) * (c.expand ? c.rows : rows_tok * K));
  if (a.recv_topk) std::fill(a.recv_topk, a.recv_topk + rows_tok * K, -1);
  std::fill(a.meta, a.meta + rows_tok * (K + 2), -1);
  for (int s = 0; s < R; ++s) {
    const int32_t* s_topk = at<int32_t>(ph[s], L.topk_idx());
    const int32_t* s_pos_rank = at<int32_t>(ph[s], L.pos_rank());
    const int32_t* s_pos_exp = at<int32_t>(ph[s], L.pos_exp());
    const float* s_w = at<float>(ph[s], L.weights());
    for (int64_t t = 0; t < M; ++t) {
      const int32_t pr = s_pos_rank[t * R + d];
      if (pr < 0) continue;
      const int64_t i = rstart[s] + pr;
      const int32_t* trow = s_topk + t * K;
      int32_t* mrow = a.meta + i * (K + 2);
      mrow[0] = ep_meta_gid(s, static_cast<int32_t>(t), static_cast<int32_t>(M));
      mrow[1] = ep_meta_rank_k(s, ep_master_k(trow, static_cast<int>(K), static_cast<int>(E_loc), d),
                               static_cast<int32_t>(K));
      const uint8_t* xs = ph[s] + L.x() + t * L.x_row;
      const uint8_t* sfs = ph[s] + L.scales() + t * L.sf_row;
      if (!c.expand) {
        std::memcpy(a.recv_x + i * a.x_bytes, xs, a.x_bytes);
        if (a.sf_bytes) std::memcpy(a.recv_sf + i * a.sf_bytes, sfs, a.sf_bytes);
        for (int64_t k = 0; k < K; ++k) {
          const int32_t id = trow[k];
          a.recv_topk[i * K + k] = (id >= 0 && id / E_loc == d) ? static_cast<int32_t>(id - d * E_loc) : -1;
        }
        if (a.recv_w) std::memcpy(a.recv_w + i * K, s_w + t * K, sizeof(float) * K);
      } else {
        for (int64_t k = 0; k < K; ++k) {
          const int32_t id = trow[k];
          if (id < 0 || id / E_loc != d) continue;
          const int64_t e = id - d * E_loc;
          const int64_t row = start[e] + srcoff[s * E_loc + e] + s_pos_exp[t * K + k];
          std::memcpy(a.recv_x + row * a.x_bytes, xs, a.x_bytes);
          if (a.sf_bytes) std::memcpy(a.recv_sf + row * a.sf_bytes, sfs, a.sf_bytes);
          if (a.recv_w) a.recv_w[row] = s_w[t * K + k];
          mrow[2 + k] = static_cast<int32_t>(row);
        }
      }
    }
  }
  // Zero padding: the padding rows [start+count, start+align(count)) were zeroed above.
  return true;
}

bool ep_dispatch_cached(Member& m, Allocation& region, uint64_t offset, const EpCachedArgs& a) {
  const EpConfig& c = a.c;
  const int R = m.nranks;
  const int64_t M = c.M, N = c.N, K = c.K, E = c.E;
  const auto L = EpDispatchLayout::make(R, M, K, E, a.x_bytes, a.sf_bytes / 4);
  const uint64_t seq = next_seq(m, EpWorkspace::kDispatchSeq);
  uint8_t* h = region.local + offset + L.half(seq);
  if (a.w) std::memcpy(at<float>(h, L.weights()), a.w, sizeof(float) * N * K);
  for (int64_t t = 0; t < N; ++t) std::memcpy(h + L.x() + t * L.x_row, a.x + t * a.x_bytes, a.x_bytes);
  if (a.sf_bytes)
    for (int64_t t = 0; t < N; ++t) std::memcpy(h + L.scales() + t * L.sf_row, a.sf + t * a.sf_bytes, a.sf_bytes);
  publish(m, EpWorkspace::kDispatchReady, seq);
  if (!wait_peers(m, kOpEpDispatch, EpWorkspace::kDispatchReady, EpWorkspace::kDispatchBad, seq)) return false;

  const int64_t rows_tok = R * M;
  const int64_t num_recv = a.psum_rank[R - 1];
  if (num_recv < 0 || num_recv > rows_tok) {
    fail_local(m, kOpEpDispatch, ep_bad_detail(0, kEpBadHandle), num_recv);
    return false;
  }
  std::memset(a.recv_x, 0, c.rows * a.x_bytes);
  if (a.sf_bytes) std::memset(a.recv_sf, 0, c.rows * a.sf_bytes);
  if (a.recv_w) std::memset(a.recv_w, 0, sizeof(float) * (c.expand ? c.rows : rows_tok * K));
  for (int64_t i = 0; i < num_recv; ++i) {
    const int32_t* mrow = a.meta + i * (K + 2);
    const int64_t gid = mrow[0];
    if (gid < 0 || gid >= rows_tok) {
      fail_local(m, kOpEpDispatch, ep_bad_detail(i, kEpBadHandle), gid);
      return false;
    }
    const int64_t s = gid / M, t = gid % M;
    const uint8_t* hs = region.peers[s] + offset + L.half(seq);
    const uint8_t* xs = hs + L.x() + t * L.x_row;
    const uint8_t* sfs = hs + L.scales() + t * L.sf_row;
    const float* ws = at<float>(hs, L.weights()) + t * K;
    if (!c.expand) {
      std::memcpy(a.recv_x + i * a.x_bytes, xs, a.x_bytes);
      if (a.sf_bytes) std::memcpy(a.recv_sf + i * a.sf_bytes, sfs, a.sf_bytes);
      if (a.recv_w) std::memcpy(a.recv_w + i * K, ws, sizeof(float) * K);
    } else {
      for (int64_t k = 0; k < K; ++k) {
        const int64_t row = mrow[2 + k];
        if (row < 0) continue;
        if (row >= c.rows) {
          fail_local(m, kOpEpDispatch, ep_bad_detail(i, kEpBadHandle), row);
          return false;
        }
        std::memcpy(a.recv_x + row * a.x_bytes, xs, a.x_bytes);
        if (a.sf_bytes) std::memcpy(a.recv_sf + row * a.sf_bytes, sfs, a.sf_bytes);
        if (a.recv_w) a.recv_w[row] = ws[k];
      }
    }
  }
  return true;
}

bool ep_combine(Member& m, Allocation& region, uint64_t offset, const EpCombineArgs& a) {
  const EpConfig& c = a.c;
  const int R = m.nranks;
  const int64_t M = c.M, N = c.N, K = c.K, E_loc = c.E / R, H = a.H;
  const int64_t elt = a.dtype == EpFloat::kBF16 ? 2 : 4;
  const int64_t row_bytes = H * elt;
  const auto L = EpCombineLayout::make(R, M, K, row_bytes);
  const uint64_t seq = next_seq(m, EpWorkspace::kCombineSeq);
  uint8_t* h = region.local + offset + L.half(seq);
  const int64_t rows_tok = R * M;
  const int64_t num_recv = a.psum_rank[R - 1];
  std::vector<float> acc(H);
  auto load = [&](const uint8_t* p, int64_t j) -> float {
    if (a.dtype == EpFloat::kBF16) {
      uint16_t b;
      std::memcpy(&b, p + 2 * j, 2);
      return bf16_to_f32(b);
    }
    float f;
    std::memcpy(&f, p + 4 * j, 4);
    return f;
  };
  auto store_row = [&](uint8_t* p) {
    for (int64_t j = 0; j < H; ++j) {
      if (a.dtype == EpFloat::kBF16) {
        const uint16_t b = f32_to_bf16(acc[j]);
        std::memcpy(p + 2 * j, &b, 2);
      } else {
        std::memcpy(p + 4 * j, &acc[j], 4);
      }
    }
  };

  // 1. Stage what this (expert) rank returns for each received token row.
  bool bad = num_recv < 0 || num_recv > rows_tok;
  int64_t bad_at = 0, bad_val = num_recv;
  float* st_w = at<float>(h, L.weights());
  for (int64_t i = 0; i < num_recv && !bad; ++i) {
    uint8_t* dst = h + L.y() + i * L.y_row;
    if (!c.expand) {
      std::memcpy(dst, a.y + i * row_bytes, row_bytes);
      if (a.w) std::memcpy(st_w + i * K, a.w + i * K, sizeof(float) * K);
      continue;
    }
    const int32_t* mrow = a.meta + i * (K + 2);
    int nvalid = 0;
    int64_t last = -1;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = mrow[2 + k];
      if (r >= c.rows) { bad = true; bad_at = i; bad_val = r; break; }
      if (r >= 0) { ++nvalid; last = r; }
    }
    if (bad) break;
    if (nvalid == 1) {
      std::memcpy(dst, a.y + last * row_bytes, row_bytes);
    } else {
      std::fill(acc.begin(), acc.end(), -0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = mrow[2 + k];
        if (r < 0) continue;
        const uint8_t* src = a.y + r * row_bytes;
        for (int64_t j = 0; j < H; ++j) acc[j] += load(src, j);
      }
      if (nvalid == 0) std::fill(acc.begin(), acc.end(), 0.0f);
      store_row(dst);
    }
    if (a.w)
      for (int64_t k = 0; k < K; ++k) st_w[i * K + k] = mrow[2 + k] >= 0 ? a.w[mrow[2 + k]] : 0.0f;
  }
  if (bad) mark_bad(m, EpWorkspace::kCombineBad, seq, ep_bad_detail(bad_at, kEpBadHandle), bad_val);
  publish(m, EpWorkspace::kCombineReady, seq);
  if (bad) {
    fail_local(m, kOpEpCombine, ep_bad_detail(bad_at, kEpBadHandle), bad_val);
    return false;
  }
  if (!wait_peers(m, kOpEpCombine, EpWorkspace::kCombineReady, EpWorkspace::kCombineBad, seq)) return false;
  std::vector<const uint8_t*> ph(R);
  for (int s = 0; s < R; ++s) ph[s] = region.peers[s] + offset + L.half(seq);

  // 2. Source side: reduce each own token over its dest ranks in ascending master position.
  std::vector<std::pair<int, int>> dests;  // (master k, rank)
  for (int64_t t = 0; t < N; ++t) {
    const int32_t* trow = a.topk + t * K;
    dests.clear();
    for (int r = 0; r < R; ++r) {
      const int32_t row = a.dst_row[t * R + r];
      if (row < 0) continue;
      if (row >= rows_tok) {
        fail_local(m, kOpEpCombine, ep_bad_detail(t, kEpBadHandle), row);
        return false;
      }
      dests.emplace_back(ep_master_k(trow, static_cast<int>(K), static_cast<int>(E_loc), r), r);
    }
    std::sort(dests.begin(), dests.end());
    uint8_t* out = a.out + t * row_bytes;
    const int nb = (a.bias0 ? 1 : 0) + (a.bias1 ? 1 : 0);
    if (dests.empty() && nb == 0) {
      std::memset(out, 0, row_bytes);
    } else if (dests.size() == 1 && nb == 0) {
      std::memcpy(out, ph[dests[0].second] + L.y() + int64_t(a.dst_row[t * R + dests[0].second]) * L.y_row,
                  row_bytes);  // -0.0 + v == v: a lone term is returned unchanged
    } else {
      std::fill(acc.begin(), acc.end(), -0.0f);
      for (const uint8_t* b : {a.bias0, a.bias1})
        if (b)
          for (int64_t j = 0; j < H; ++j) acc[j] += load(b + t * row_bytes, j);
      for (const auto& [mk, r] : dests) {
        const uint8_t* src = ph[r] + L.y() + int64_t(a.dst_row[t * R + r]) * L.y_row;
        for (int64_t j = 0; j < H; ++j) acc[j] += load(src, j);
      }
      store_row(out);
    }
    if (a.out_w) {
      for (int64_t k = 0; k < K; ++k) {
        const int32_t id = trow[k];
        float v = 0.0f;
        if (id >= 0 && id / E_loc < R) {
          const int r = static_cast<int>(id / E_loc);
          const int32_t row = a.dst_row[t * R + r];
          if (row >= 0) v = at<float>(ph[r], L.weights())[int64_t(row) * K + k];
        }
        a.out_w[t * K + k] = v;
      }
    }
  }
  return true;
}

}  // namespace jax_engram::cpu
