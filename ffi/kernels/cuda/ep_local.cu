// The one-rank local path's kernels (jax_engram/_ep_local.py, expand layout): the dispatch (one kernel up to
// kEpLocalLayoutMaxEntries entries, chunked kernels above), and the row scatter of large and cached dispatches.
//
// The dispatch (ep.h EpLocalDispatchParams; the layout's rule is cpu::ep_local_layout): so few entries that every CTA
// holds the whole layout in shared memory: counts per expert (shared atomics), the aligned and unaligned segment
// starts (block scans), a stable block radix sort of the entries by expert (an entry's rank among its expert's
// entries is its sorted position minus the expert's unaligned start), and the receive token order (a scan of the
// tokens that have an expert). Each CTA then writes, from shared memory alone, its share of one index space over the
// layout's outputs and the receive weights, the rows of its tokens (blockIdx.x, + gridDim.x, ...: each token's row
// read once and written to each of its receive rows) and its share of the rows no entry fills (zeroed). No CTA waits
// for another, and one launch replaces the dozen small kernels XLA makes of the same layout, the row scatter and the
// weights' gather. The dispatch is also its own guard: CTA 0 checks the routing as the guard's kernel does
// (ep_guard.cu), records its first bad entry the same way, and copies the token. So a small dispatch is one custom
// call: in a loop of small ops the host's cost per custom call, more than the GPU time, sets the pace.
//
// The row scatter (ep.h EpLocalScatterParams; cached dispatches, and the rows of a large dispatch): every
// token's row is read from HBM once and written to each of its receive rows, and the rows no entry fills are zeroed.
// A gather of the receive rows (one read of x per written row) reads each token's row K times, and x is larger than
// L2 at the shapes where bandwidth matters, so the scatter moves (1 + K) rows per token where the gather moves 2K.
//
// Grid: CTAs [0, N) are tokens (each copies its row, in 16-byte words where the row allows, to its destinations);
// the CTAs after them take kZeroRowsPerCta receive rows each and zero those no token writes. Row r belongs to token
// src[r] when that token lists r among its destinations, and is zeroed otherwise; a token CTA writes only the rows
// that belong to it. So every row has exactly one writer, and the result is the CPU kernel's, whatever dest and src
// hold (a handle's metadata rebuilds them; a layout made from the routing always has them agree).
#include <climits>
#include <cstdint>

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels/cuda/ep.h"
#include "kernels/cuda/sync.cuh"

namespace jax_engram {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kZeroRowsPerCta = 8;

// ------------------------------------------------------------------------------------------------------- layout
constexpr int kLayoutThreads = 512;
constexpr int kLayoutItems = kEpLocalLayoutMaxEntries / kLayoutThreads;  // entries (and scan items) per thread
static_assert(kLayoutThreads * kLayoutItems == kEpLocalLayoutMaxEntries, "the sort holds every entry");
static_assert(kEpMaxLocalExperts <= kEpLocalLayoutMaxEntries, "the scans hold every expert (of one rank)");
constexpr int64_t kLayoutOutputsPerCta = 8192;
// Every CTA computes the whole layout before it moves a row, so a second wave of CTAs would pay that time again: the
// grid stays within one wave, at most this many CTAs, each taking N / grid tokens' rows.
constexpr int64_t kLocalDispatchMaxCtas = 128;
using LayoutSort = cub::BlockRadixSort<int32_t, kLayoutThreads, kLayoutItems, int32_t>;
using LayoutScan = cub::BlockScan<int32_t, kLayoutThreads>;

// Dynamic shared memory of a launch: the per-expert arrays, then the sort's storage, which the per-entry and
// per-token arrays reuse once the sort is done.
__host__ __device__ constexpr size_t layout_head_bytes(int E) { return (3 * static_cast<size_t>(E) * 4 + 15) / 16 * 16; }
constexpr size_t layout_smem_bytes(int E, int n, int N) {
  return layout_head_bytes(E) + ((2 * static_cast<size_t>(n) + 2 * static_cast<size_t>(N)) * 4 >
                                         sizeof(LayoutSort::TempStorage)
                                     ? (2 * static_cast<size_t>(n) + 2 * static_cast<size_t>(N)) * 4
                                     : sizeof(LayoutSort::TempStorage));
}
static_assert(layout_smem_bytes(kEpMaxLocalExperts, kEpLocalLayoutMaxEntries, kEpLocalLayoutMaxEntries) +
                      sizeof(LayoutScan::TempStorage) + sizeof(unsigned long long) + kEpMaxTopk * sizeof(int32_t) <=
                  48 * 1024,
              "the largest layout fits the default shared memory of a CTA");

// The exclusive prefix sum of a[0, n) (shared memory, n <= kEpLocalLayoutMaxEntries) in place; returns the total.
// Every thread calls it after a barrier that follows the last write of a.
__device__ int32_t layout_scan(int32_t* a, int n, LayoutScan::TempStorage& tmp) {
  int32_t v[kLayoutItems];
  const int base = threadIdx.x * kLayoutItems;
  for (int i = 0; i < kLayoutItems; ++i) v[i] = base + i < n ? a[base + i] : 0;
  int32_t total;
  LayoutScan(tmp).ExclusiveSum(v, v, total);
  for (int i = 0; i < kLayoutItems; ++i)
    if (base + i < n) a[base + i] = v[i];
  __syncthreads();  // a is complete, and tmp free for the next scan
  return total;
}

// The first bad k of a token's ids (an id outside [-1, E), or a valid id an earlier k holds), -1: none -- the
// guard's rule (ep_guard.cu), for the few tokens of a layout this size.
__device__ int layout_first_bad_k(const int32_t* row, int K, int E) {
  for (int k = 0; k < K; ++k) {
    const int32_t id = row[k];
    if (id < -1 || id >= E) return k;
    if (id >= 0)
      for (int j = 0; j < k; ++j)
        if (row[j] == id) return k;
  }
  return -1;
}

// The last expert whose segment starts at or before row r (start: ascending, E entries).
__device__ inline int segment_of_row(const int32_t* start, int E, int32_t r) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (start[mid] <= r) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Records the routing's first bad entry (bad: its token << 6 | k) as the guard's kernel records it.
__device__ inline void record_first_bad(const EpLocalDispatchParams& p, unsigned long long bad) {
  const int64_t bt = static_cast<int64_t>(bad >> 6);
  const int bad_id = p.topk[bt * p.K + static_cast<int>(bad & 63)];
  const int kind = (bad_id < -1 || bad_id >= p.E) ? kEpBadExpertRange : kEpBadDuplicateExpert;
  cuda::record_error_device(p.err, kErrBadInput, kOpEpDispatch, p.rank, p.rank, 0, bad_id, 0, ep_bad_detail(bt, kind));
}

// Token t's row to its receive rows dest[0, K) (-1: none), in words of V (all threads of the CTA).
template <typename V>
__device__ void copy_token_row(const EpLocalDispatchParams& p, int64_t t, const int32_t* dest, int K) {
  const int64_t words = p.row_bytes / static_cast<int64_t>(sizeof(V));
  const V* src = reinterpret_cast<const V*>(p.x + t * p.row_bytes);
  for (int64_t w = threadIdx.x; w < words; w += kLayoutThreads) {
    const V v = src[w];
    for (int k = 0; k < K; ++k)
      if (dest[k] >= 0) reinterpret_cast<V*>(p.recv_x + dest[k] * p.row_bytes)[w] = v;
  }
}

template <typename V>
__device__ void zero_row(const EpLocalDispatchParams& p, int64_t r) {
  const int64_t words = p.row_bytes / static_cast<int64_t>(sizeof(V));
  V* row = reinterpret_cast<V*>(p.recv_x + r * p.row_bytes);
  for (int64_t w = threadIdx.x; w < words; w += kLayoutThreads) row[w] = V{};
}

// vec16: rows move in 16-byte words (row_bytes and both row buffers allow it; else bytes).
__global__ void __launch_bounds__(kLayoutThreads) local_dispatch_kernel(const EpLocalDispatchParams p, bool vec16) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ LayoutScan::TempStorage scan_tmp;
  __shared__ unsigned long long sh_bad;  // CTA 0: the smallest (token << 6 | k) of a bad entry, ULLONG_MAX: none
  const int N = p.N, K = p.K, E = p.E, n = N * K, W = K + 2, tid = threadIdx.x;
  int32_t* cnt = reinterpret_cast<int32_t*>(smem);  // [E] entries per expert
  int32_t* start = cnt + E;                         // [E] aligned segment starts: the first receive row of e
  int32_t* first = start + E;                       // [E] unaligned starts: e's first position in the sorted order
  unsigned char* rest = smem + layout_head_bytes(E);
  auto& sort_tmp = *reinterpret_cast<LayoutSort::TempStorage*>(rest);
  int32_t* sorted = reinterpret_cast<int32_t*>(rest);  // [n] the entry at each sorted position (after the sort)
  int32_t* row_of = sorted + n;                         // [n] the receive row of each entry, -1: none
  int32_t* pos = row_of + n;                            // [N] the receive token row of each token (exclusive scan)
  int32_t* tok = pos + N;                               // [N] the token of each receive token row < num

  for (int e = tid; e < E; e += kLayoutThreads) cnt[e] = 0;
  if (tid == 0) {
    sh_bad = ULLONG_MAX;
    if (blockIdx.x == 0 && p.token_out != p.token) *p.token_out = *p.token;
  }
  __syncthreads();
  // The guard's check (CTA 0 alone: every CTA holds the whole routing): the routing's first bad entry in (token, k)
  // order, recorded below exactly as the guard records it. The layout does not depend on it: an id outside [0, E)
  // is no entry, and a duplicate is an entry like any other, so the outputs stay in bounds whatever the routing.
  if (blockIdx.x == 0)
    for (int t = tid; t < N; t += kLayoutThreads) {
      const int k = layout_first_bad_k(p.topk + static_cast<int64_t>(t) * K, K, E);
      if (k >= 0) atomicMin(&sh_bad, (static_cast<unsigned long long>(t) << 6) | static_cast<unsigned>(k));
    }
  // Sort keys: the expert of an entry, E for none, E + 1 past the last entry (so the n entries sort first); the sort
  // reads only the bits those take. Blocked: thread tid holds entries tid * kLayoutItems + i.
  int32_t key[kLayoutItems], val[kLayoutItems];
  for (int i = 0; i < kLayoutItems; ++i) {
    const int j = tid * kLayoutItems + i;
    int32_t k = E + 1;
    if (j < n) {
      const int32_t id = p.topk[j];
      k = id >= 0 && id < E ? id : E;  // an id outside [0, E) is no entry (the guard has reported it)
      if (k < E) atomicAdd(&cnt[k], 1);
    }
    key[i] = k;
    val[i] = j;
  }
  __syncthreads();
  for (int e = tid; e < E; e += kLayoutThreads) {
    start[e] = static_cast<int32_t>(ep_align(cnt[e], p.A));
    first[e] = cnt[e];
  }
  __syncthreads();
  if (blockIdx.x == 0 && tid == 0 && sh_bad != ULLONG_MAX) record_first_bad(p, sh_bad);  // behind a barrier
  layout_scan(start, E, scan_tmp);
  layout_scan(first, E, scan_tmp);
  LayoutSort(sort_tmp).Sort(key, val, 0, 32 - __clz(E + 1));  // stable: an expert's entries keep their (t, k) order
  __syncthreads();                                          // the sort's storage becomes sorted / row_of / pos / tok
  for (int i = 0; i < kLayoutItems; ++i) {
    const int q = tid * kLayoutItems + i;  // sorted position
    if (q >= n) continue;
    sorted[q] = val[i];
    row_of[val[i]] = key[i] < E ? start[key[i]] + q - first[key[i]] : -1;
  }
  __syncthreads();
  for (int t = tid; t < N; t += kLayoutThreads) {
    int has = 0;
    for (int k = 0; k < K; ++k) has |= row_of[t * K + k] >= 0;
    pos[t] = has;
  }
  __syncthreads();
  const int32_t num = layout_scan(pos, N, scan_tmp);
  const auto has_row = [&](int t) { return (t + 1 < N ? pos[t + 1] : num) > pos[t]; };
  for (int t = tid; t < N; t += kLayoutThreads)
    if (has_row(t)) tok[pos[t]] = t;
  __syncthreads();

  // This CTA's share of the outputs, in the order exp_row [n], the per-expert arrays [E], dst_row [N], the rows'
  // sources [rows], recv_src_metadata [M * W], num_recv [1].
  const int64_t total = n + E + N + static_cast<int64_t>(p.rows) + static_cast<int64_t>(p.M) * W + 1;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kLayoutThreads + tid; g < total;
       g += static_cast<int64_t>(gridDim.x) * kLayoutThreads) {
    int64_t i = g;
    if (i < n) {
      p.exp_row[i] = row_of[i];
      continue;
    }
    i -= n;
    if (i < E) {
      p.count[i] = cnt[i];
      p.aligned[i] = static_cast<int32_t>(ep_align(cnt[i], p.A));
      p.psum_expert[i] = start[i] + cnt[i];
      continue;
    }
    i -= E;
    if (i < N) {
      p.dst_row[i] = has_row(static_cast<int>(i)) ? pos[i] : -1;
      continue;
    }
    i -= N;
    if (i < p.rows) {  // row r is in the segment of the last expert starting at or before it
      const int32_t r = static_cast<int32_t>(i);
      const int e = segment_of_row(start, E, r);
      const int32_t o = r - start[e];
      const int32_t j = o < cnt[e] ? sorted[first[e] + o] : n;  // past the expert's entries: alignment padding
      p.src_entry[r] = j;
      p.src_tok[r] = j < n ? j / K : N;
      if (p.recv_w) p.recv_w[r] = j < n ? p.w[j] : 0u;  // the weight's bits; +0.0 without an entry
      continue;
    }
    i -= p.rows;
    if (i < static_cast<int64_t>(p.M) * W) {
      const int64_t r = i / W;
      const int c = static_cast<int>(i % W);
      int32_t v = -1;
      if (r < num) {
        const int t = tok[r];
        if (c == 0) {
          v = t;
        } else if (c == 1) {  // the master position: the last k with an expert
          for (int k = 0; k < K; ++k)
            if (row_of[t * K + k] >= 0) v = k;
        } else {
          v = row_of[t * K + c - 2];
        }
      }
      p.meta[i] = v;
      continue;
    }
    *p.num_recv = num;
  }
  if (p.row_bytes == 0) return;

  // The rows of this CTA's tokens: every row has at most one entry, so exactly one token writes it.
  __shared__ int32_t dest[kEpMaxTopk];
  for (int t = blockIdx.x; t < N; t += gridDim.x) {
    if (tid < K) {
      const int32_t r = row_of[t * K + tid];
      dest[tid] = r < p.rows ? r : -1;
    }
    __syncthreads();
    if (has_row(t)) {  // a token without an entry is not read (uniform over the CTA: no barrier inside)
      if (vec16) copy_token_row<uint4>(p, t, dest, K); else copy_token_row<uint8_t>(p, t, dest, K);
    }
    __syncthreads();  // dest is rewritten for the next token
  }
  // This CTA's share of the rows no entry fills (alignment padding, and the rows past the last segment): zero.
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {  // int64: r + gridDim.x may pass 2^31
    const int e = segment_of_row(start, E, static_cast<int32_t>(r));
    if (r - start[e] < cnt[e]) continue;  // an entry's row: its token's CTA writes it
    if (vec16) zero_row<uint4>(p, r); else zero_row<uint8_t>(p, r);
  }
}

// ----------------------------------------------------------------------------------------------- large dispatch
// Above kEpLocalLayoutMaxEntries entries no CTA can hold the whole layout. The entries are cut into chunks of whole
// tokens of at most kEpLocalLayoutMaxEntries entries (ep_local_chunk_tokens), and four kernels compute the same layout
// as the small kernel, bit for bit: (1) per chunk, the entries per expert, the tokens with an entry and the first bad
// entry of the routing; (2) one CTA turns those into each chunk's offsets (per expert and per token) and writes the
// per-expert outputs, the receive token count and the guard's record; (3) per chunk, a stable block radix sort of its
// entries by expert places each at row start[e] + (entries of e in earlier chunks) + (its rank within the chunk), which
// is its rank among all of e's entries in (token, k) order, and writes its row's source, weight and metadata; (4) the
// rows no entry fills (alignment padding, and rows past the last segment) get no source, and metadata rows past the
// receive count -1. The rows then move with the row scatter below.
struct LargeScratch {
  unsigned long long* bad;  // the smallest (token << 6 | k) of a bad entry, ULLONG_MAX: none (memset before (1))
  int32_t* start;           // [E] aligned segment starts
  int32_t* tok_before;      // [C] (1): tokens with an entry in the chunk; (2) on: in the chunks before it
  int32_t* before;          // [C, E] (1): the chunk's entries of expert e; (2) on: e's entries in earlier chunks
  int64_t C, T;             // chunks, tokens per chunk
};

__host__ __device__ inline LargeScratch large_scratch(const EpLocalDispatchParams& p) {
  LargeScratch s;
  s.bad = reinterpret_cast<unsigned long long*>(p.scratch);
  s.start = p.scratch + 2;
  s.T = ep_local_chunk_tokens(p.K);
  s.C = ep_local_chunks(p.N, p.K);
  s.tok_before = s.start + p.E;
  s.before = s.tok_before + s.C;
  return s;
}

// (1) One CTA per chunk.
__global__ void __launch_bounds__(kLayoutThreads) large_count_kernel(const EpLocalDispatchParams p) {
  __shared__ int32_t cnt[kEpMaxLocalExperts];
  __shared__ int32_t has_n;
  __shared__ unsigned long long sh_bad;
  const LargeScratch s = large_scratch(p);
  const int K = p.K, E = p.E, tid = threadIdx.x;
  const int64_t c = blockIdx.x, t0 = c * s.T, t1 = t0 + s.T < p.N ? t0 + s.T : p.N;
  for (int e = tid; e < E; e += kLayoutThreads) cnt[e] = 0;
  if (tid == 0) {
    has_n = 0;
    sh_bad = ULLONG_MAX;
    if (c == 0 && p.token_out != p.token) *p.token_out = *p.token;
  }
  __syncthreads();
  for (int64_t t = t0 + tid; t < t1; t += kLayoutThreads) {  // a thread per token: its K entries
    const int32_t* row = p.topk + t * K;
    const int bad_k = layout_first_bad_k(row, K, E);
    if (bad_k >= 0) atomicMin(&sh_bad, (static_cast<unsigned long long>(t) << 6) | static_cast<unsigned>(bad_k));
    int has = 0;
    for (int k = 0; k < K; ++k) {
      const int32_t id = row[k];
      if (id >= 0 && id < E) {  // an id outside [0, E) is no entry; a duplicate is an entry like any other
        atomicAdd(&cnt[id], 1);
        has = 1;
      }
    }
    if (has) atomicAdd(&has_n, 1);
  }
  __syncthreads();
  for (int e = tid; e < E; e += kLayoutThreads) s.before[c * E + e] = cnt[e];
  if (tid == 0) {
    s.tok_before[c] = has_n;
    if (sh_bad != ULLONG_MAX) atomicMin(s.bad, sh_bad);
  }
}

// (2) One CTA.
__global__ void __launch_bounds__(kLayoutThreads) large_scan_kernel(const EpLocalDispatchParams p) {
  __shared__ LayoutScan::TempStorage scan_tmp;
  __shared__ int32_t cnt[kEpMaxLocalExperts];
  __shared__ int32_t start[kEpMaxLocalExperts];
  const LargeScratch s = large_scratch(p);
  const int E = p.E, tid = threadIdx.x;
  for (int e = tid; e < E; e += kLayoutThreads) {  // per expert: an exclusive scan over the chunks
    int32_t run = 0;
    constexpr int kBatch = 8;  // loads issued together: a chain of single load-store steps would wait on each
    for (int64_t c0 = 0; c0 < s.C; c0 += kBatch) {
      int32_t v[kBatch];
      for (int b = 0; b < kBatch; ++b) v[b] = c0 + b < s.C ? s.before[(c0 + b) * E + e] : 0;
      for (int b = 0; b < kBatch && c0 + b < s.C; ++b) {
        s.before[(c0 + b) * E + e] = run;
        run += v[b];
      }
    }
    cnt[e] = run;
    start[e] = static_cast<int32_t>(ep_align(run, p.A));
  }
  __syncthreads();
  layout_scan(start, E, scan_tmp);
  for (int e = tid; e < E; e += kLayoutThreads) {
    s.start[e] = start[e];
    p.count[e] = cnt[e];
    p.aligned[e] = static_cast<int32_t>(ep_align(cnt[e], p.A));
    p.psum_expert[e] = start[e] + cnt[e];
  }
  // Tokens with an entry before each chunk: each thread sums a run of chunks, a block scan offsets the runs.
  const int64_t per = (s.C + kLayoutThreads - 1) / kLayoutThreads;
  const int64_t b0 = tid * per < s.C ? tid * per : s.C, b1 = b0 + per < s.C ? b0 + per : s.C;
  int32_t sum = 0;
  for (int64_t i = b0; i < b1; ++i) sum += s.tok_before[i];
  int32_t off, total;
  LayoutScan(scan_tmp).ExclusiveSum(sum, off, total);
  for (int64_t i = b0; i < b1; ++i) {
    const int32_t v = s.tok_before[i];
    s.tok_before[i] = off;
    off += v;
  }
  if (tid == 0) {
    *p.num_recv = total;
    if (*s.bad != ULLONG_MAX) record_first_bad(p, *s.bad);
  }
}

// (3) One CTA per chunk; dynamic shared memory as the small kernel's (layout_smem_bytes).
__global__ void __launch_bounds__(kLayoutThreads) large_place_kernel(const EpLocalDispatchParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ LayoutScan::TempStorage scan_tmp;
  const LargeScratch s = large_scratch(p);
  const int K = p.K, E = p.E, W = K + 2, tid = threadIdx.x;
  const int64_t c = blockIdx.x, t0 = c * s.T, t1 = t0 + s.T < p.N ? t0 + s.T : p.N, j0 = t0 * K;
  const int nt = static_cast<int>(t1 - t0), nc = nt * K;  // tokens and entries of the chunk (nc <= the sort's)
  int32_t* cnt = reinterpret_cast<int32_t*>(smem);  // [E] the chunk's entries per expert
  int32_t* first = cnt + E;                         // [E] e's first position in the chunk's sorted order
  int32_t* base = first + E;                        // [E] the row of the chunk's first entry of e
  unsigned char* rest = smem + layout_head_bytes(E);
  auto& sort_tmp = *reinterpret_cast<LayoutSort::TempStorage*>(rest);
  int32_t* row_of = reinterpret_cast<int32_t*>(rest);  // [nc] after the sort: the row of each entry, -1: none
  int32_t* pos = row_of + nc;                          // [nt] the chunk's receive token rows (exclusive scan)

  for (int e = tid; e < E; e += kLayoutThreads) cnt[e] = 0;
  __syncthreads();
  int32_t key[kLayoutItems], val[kLayoutItems];
  for (int i = 0; i < kLayoutItems; ++i) {
    const int j = tid * kLayoutItems + i;
    int32_t k = E + 1;  // past the chunk's entries: sorts last
    if (j < nc) {
      const int32_t id = p.topk[j0 + j];
      k = id >= 0 && id < E ? id : E;
      if (k < E) atomicAdd(&cnt[k], 1);
    }
    key[i] = k;
    val[i] = j;
  }
  __syncthreads();
  for (int e = tid; e < E; e += kLayoutThreads) {
    first[e] = cnt[e];
    base[e] = s.start[e] + s.before[c * E + e];
  }
  __syncthreads();
  layout_scan(first, E, scan_tmp);
  LayoutSort(sort_tmp).Sort(key, val, 0, 32 - __clz(E + 1));  // stable: the chunk's entries of e keep their order
  __syncthreads();                                          // the sort's storage becomes row_of / pos
  for (int i = 0; i < kLayoutItems; ++i) {
    const int q = tid * kLayoutItems + i;  // sorted position within the chunk
    if (q >= nc) continue;
    const int j = val[i];
    const int32_t r = key[i] < E ? base[key[i]] + q - first[key[i]] : -1;
    row_of[j] = r;
    p.exp_row[j0 + j] = r;
    if (r >= 0 && r < p.rows) {  // a duplicate's extra entries may pass the last row: no row then
      const int64_t g = j0 + j;
      p.src_entry[r] = static_cast<int32_t>(g);
      p.src_tok[r] = static_cast<int32_t>(g / K);
      if (p.recv_w) p.recv_w[r] = p.w[g];  // the weight's bits
    }
  }
  __syncthreads();
  for (int t = tid; t < nt; t += kLayoutThreads) {
    int has = 0;
    for (int k = 0; k < K; ++k) has |= row_of[t * K + k] >= 0;
    pos[t] = has;
  }
  __syncthreads();
  const int32_t num = layout_scan(pos, nt, scan_tmp);
  const int32_t tok0 = s.tok_before[c];
  for (int t = tid; t < nt; t += kLayoutThreads) {
    const bool has = (t + 1 < nt ? pos[t + 1] : num) > pos[t];
    const int32_t g = tok0 + pos[t];
    p.dst_row[t0 + t] = has ? g : -1;
    if (!has) continue;
    int32_t* m = p.meta + static_cast<int64_t>(g) * W;  // g < N <= M
    int32_t master = -1;  // the last k with an expert
    for (int k = 0; k < K; ++k) {
      const int32_t r = row_of[t * K + k];
      if (r >= 0) master = k;
      m[2 + k] = r;
    }
    m[0] = static_cast<int32_t>(t0 + t);
    m[1] = master;
  }
}

// (4) Grid-stride over the rows and the metadata.
__global__ void __launch_bounds__(kThreads) large_pad_kernel(const EpLocalDispatchParams p) {
  __shared__ int32_t start[kEpMaxLocalExperts];
  __shared__ int32_t cnt[kEpMaxLocalExperts];
  const LargeScratch s = large_scratch(p);
  const int E = p.E, W = p.K + 2;
  for (int e = threadIdx.x; e < E; e += kThreads) {
    start[e] = s.start[e];
    cnt[e] = p.count[e];
  }
  __syncthreads();
  const int32_t num = *p.num_recv;
  const int64_t n = static_cast<int64_t>(p.N) * p.K, rows = p.rows, total = rows + static_cast<int64_t>(p.M) * W;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; g < total;
       g += static_cast<int64_t>(gridDim.x) * kThreads) {
    if (g < rows) {
      const int32_t r = static_cast<int32_t>(g);
      const int e = segment_of_row(start, E, r);
      if (r - start[e] < cnt[e]) continue;  // an entry's row: (3) wrote it
      p.src_entry[r] = static_cast<int32_t>(n);
      p.src_tok[r] = p.N;
      if (p.recv_w) p.recv_w[r] = 0u;
      continue;
    }
    const int64_t i = g - rows;
    if (i / W >= num) p.meta[i] = -1;
  }
}

// ------------------------------------------------------------------------------------------------- scatter
template <typename V>
__global__ void __launch_bounds__(kThreads) local_scatter_kernel(const EpLocalScatterParams p) {
  const int64_t words = p.row_bytes / static_cast<int64_t>(sizeof(V));
  if (static_cast<int64_t>(blockIdx.x) < p.N) {
    const int64_t t = blockIdx.x;
    __shared__ int64_t dest[kEpMaxTopk];
    __shared__ int any;
    if (threadIdx.x == 0) any = 0;
    __syncthreads();
    if (threadIdx.x < p.K) {
      const int32_t r = p.dest[t * p.K + threadIdx.x];
      const bool mine = r >= 0 && r < p.rows && p.src[r] == t;  // outside the receive rows, or another's: not written
      dest[threadIdx.x] = mine ? r : -1;
      if (mine) any = 1;
    }
    __syncthreads();
    if (!any) return;  // no receive row: the token's row is not read
    const V* src = reinterpret_cast<const V*>(p.x + t * p.row_bytes);
    for (int64_t w = threadIdx.x; w < words; w += kThreads) {
      const V v = src[w];
      for (int k = 0; k < p.K; ++k)
        if (dest[k] >= 0) reinterpret_cast<V*>(p.out + dest[k] * p.row_bytes)[w] = v;
    }
    return;
  }
  const int64_t r0 = (static_cast<int64_t>(blockIdx.x) - p.N) * kZeroRowsPerCta;
  for (int64_t r = r0; r < r0 + kZeroRowsPerCta && r < p.rows; ++r) {
    const int32_t s = p.src[r];
    bool owned = false;  // the row belongs to token s (its CTA writes it)
    if (s >= 0 && s < p.N)
      for (int k = 0; k < p.K; ++k) owned |= p.dest[static_cast<int64_t>(s) * p.K + k] == r;
    if (owned) continue;
    V* row = reinterpret_cast<V*>(p.out + r * p.row_bytes);
    for (int64_t w = threadIdx.x; w < words; w += kThreads) row[w] = V{};
  }
}

template <typename V>
cudaError_t launch(const EpLocalScatterParams& p, cudaStream_t stream) {
  const int64_t grid = p.N + (p.rows + kZeroRowsPerCta - 1) / kZeroRowsPerCta;
  if (grid == 0) return cudaSuccess;
  local_scatter_kernel<V><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_ep_local_dispatch(const EpLocalDispatchParams& p, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(p.N) * p.K;
  if (p.K < 1 || p.K > kEpMaxTopk || n < 1 || n >= (int64_t{1} << 31) || p.E < 1 || p.E > kEpMaxLocalExperts ||
      p.A < 1 || p.M < p.N || p.rows < 0 || p.row_bytes < 0 || !p.topk || !p.token || !p.token_out || !p.err ||
      !p.exp_row || !p.count || !p.aligned || !p.psum_expert || !p.meta || !p.dst_row || !p.num_recv ||
      (p.rows > 0 && (!p.src_entry || !p.src_tok)) || (p.row_bytes > 0 && (!p.x || (p.rows > 0 && !p.recv_x))) ||
      (!p.w != !p.recv_w) || p.scratch_words != ep_local_dispatch_scratch_words(p.N, p.K, p.E) ||
      (p.scratch_words > 0 && (!p.scratch || reinterpret_cast<uintptr_t>(p.scratch) % 8 != 0)) ||
      p.N + (static_cast<int64_t>(p.rows) + kZeroRowsPerCta - 1) / kZeroRowsPerCta >= (int64_t{1} << 31))
    return cudaErrorInvalidValue;  // (the last: the row scatter's grid, checked before anything is queued)
  if (n > kEpLocalLayoutMaxEntries) {  // the chunked kernels, then the row scatter
    const LargeScratch s = large_scratch(p);
    cudaError_t e = cudaMemsetAsync(s.bad, 0xff, sizeof(unsigned long long), stream);
    if (e != cudaSuccess) return e;
    const unsigned chunks = static_cast<unsigned>(s.C);
    large_count_kernel<<<chunks, kLayoutThreads, 0, stream>>>(p);
    large_scan_kernel<<<1, kLayoutThreads, 0, stream>>>(p);
    large_place_kernel<<<chunks, kLayoutThreads, layout_smem_bytes(p.E, static_cast<int>(s.T * p.K),
                                                                    static_cast<int>(s.T)), stream>>>(p);
    const int64_t pad = static_cast<int64_t>(p.rows) + static_cast<int64_t>(p.M) * (p.K + 2);
    int64_t pad_grid = (pad + kThreads * 8 - 1) / (kThreads * 8);
    if (pad_grid < 1) pad_grid = 1;
    if (pad_grid > 4096) pad_grid = 4096;
    large_pad_kernel<<<static_cast<unsigned>(pad_grid), kThreads, 0, stream>>>(p);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    if (p.row_bytes == 0) return cudaSuccess;  // nothing to move (zero-byte buffers may have no address)
    EpLocalScatterParams sp;  // every row of an entry from its token, the rest zero
    sp.x = p.x, sp.dest = p.exp_row, sp.src = p.src_tok, sp.out = p.recv_x;
    sp.N = p.N, sp.rows = p.rows, sp.row_bytes = p.row_bytes, sp.K = p.K;
    return launch_ep_local_scatter(sp, stream);
  }
  const size_t smem = layout_smem_bytes(p.E, static_cast<int>(n), p.N);
  const int64_t total = n + p.E + p.N + static_cast<int64_t>(p.rows) + static_cast<int64_t>(p.M) * (p.K + 2) + 1;
  int64_t grid = (total + kLayoutOutputsPerCta - 1) / kLayoutOutputsPerCta;
  if (p.row_bytes > 0 && grid < p.N) grid = p.N;  // a CTA per token up to the cap
  if (grid > kLocalDispatchMaxCtas) grid = kLocalDispatchMaxCtas;
  const bool vec16 = p.row_bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.recv_x)) % 16 == 0;
  local_dispatch_kernel<<<static_cast<unsigned>(grid), kLayoutThreads, smem, stream>>>(p, vec16);
  return cudaGetLastError();
}

cudaError_t launch_ep_local_scatter(const EpLocalScatterParams& p, cudaStream_t stream) {
  if (p.K < 0 || p.K > kEpMaxTopk || p.N < 0 || p.rows < 0 || p.row_bytes < 0 ||
      p.N + (p.rows + kZeroRowsPerCta - 1) / kZeroRowsPerCta >= (int64_t{1} << 31) ||
      (p.N * p.K > 0 && !p.dest) || (p.rows > 0 && (!p.src || !p.out)) || (p.N > 0 && !p.x))
    return cudaErrorInvalidValue;
  if (p.row_bytes == 0) return cudaSuccess;  // nothing to move (zero-byte buffers may have no address)
  const auto aligned = [&](int64_t a) {
    return p.row_bytes % a == 0 && reinterpret_cast<uintptr_t>(p.x) % a == 0 &&
           reinterpret_cast<uintptr_t>(p.out) % a == 0;
  };
  if (aligned(16)) return launch<uint4>(p, stream);
  if (aligned(8)) return launch<uint2>(p, stream);
  if (aligned(4)) return launch<uint32_t>(p, stream);
  if (aligned(2)) return launch<uint16_t>(p, stream);
  return launch<uint8_t>(p, stream);
}

}  // namespace jax_engram
