// CPU Engram gather: row copies straight from the owner's table region (mapped in this process) into the output,
// the scale factors from the replicated table.
#include "kernels/cpu/engram.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "jax_engram/engram_layout.h"

namespace jax_engram::cpu {
namespace {

// Rows prefetched ahead of the one being copied: random rows of a large table miss every cache and the TLB, so
// several dozen misses in flight per thread are what keeps host memory busy.
constexpr int64_t kPrefetchRows = 32;

// The source row of a resolved id (>= 0). One rank's table needs no division.
inline const uint8_t* row_source(const EngramGather& g, int64_t id) {
  if (g.nranks == 1) return g.peers[0] + g.offset + id * g.row_bytes;
  return g.peers[id / g.num_entries] + g.offset + (id % g.num_entries) * g.row_bytes;
}

// Always inlined: GCC treats a function made only of prefetches as free of side effects, and a call to one that is
// not inlined (this one has two callers) is deleted as dead code, prefetches and all.
__attribute__((always_inline)) inline void prefetch_source(const uint8_t* p, int64_t lines) {
  if (!p) return;
  for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(p + l * 64, 0, 0);
}

#if defined(__SSE2__)
// 16-byte non-temporal stores: the staging lines are not read for ownership and do not evict the table's lines.
inline void stream_row(uint8_t* dst, const uint8_t* src, int64_t rb) {
  auto* d = reinterpret_cast<__m128i*>(dst);
  const auto* s = reinterpret_cast<const __m128i*>(src);
  int64_t k = 0;
  for (; k + 4 <= rb / 16; k += 4) {  // a cache line per step: its four loads issue together
    const __m128i a = _mm_loadu_si128(s + k), b = _mm_loadu_si128(s + k + 1), c = _mm_loadu_si128(s + k + 2),
                  e = _mm_loadu_si128(s + k + 3);
    _mm_stream_si128(d + k, a);
    _mm_stream_si128(d + k + 1, b);
    _mm_stream_si128(d + k + 2, c);
    _mm_stream_si128(d + k + 3, e);
  }
  for (; k < rb / 16; ++k) _mm_stream_si128(d + k, _mm_loadu_si128(s + k));
}
inline void stream_zero(uint8_t* dst, int64_t rb) {
  auto* d = reinterpret_cast<__m128i*>(dst);
  const __m128i z = _mm_setzero_si128();
  for (int64_t k = 0; k < rb / 16; ++k) _mm_stream_si128(d + k, z);
}
#endif

}  // namespace

int64_t engram_first_out_of_range(const int32_t* ids, int64_t n, int64_t total) {
  for (int64_t i = 0; i < n; ++i)
    if (static_cast<int64_t>(ids[i]) >= total) return i;
  return -1;
}

int64_t engram_gather_rows(const EngramGather& g, int64_t begin, int64_t end) {
  const int64_t total = static_cast<int64_t>(g.nranks) * g.num_entries;
  const int64_t rb = g.row_bytes;
  int64_t first_bad = -1;
#if defined(__SSE2__)
  // Rows of out are 16-byte aligned iff the base and the row size are (XLA buffers and staging are 64-aligned).
  const bool nt = g.streaming && rb % 16 == 0 && reinterpret_cast<uintptr_t>(g.out) % 16 == 0;
#else
  const bool nt = false;
#endif
  // Each position's id is resolved once, kPrefetchRows ahead of its copy: its source pointer waits in a ring
  // while the prefetch of its lines is in flight (nullptr: a zero row).
  const int64_t lines = std::min<int64_t>((rb + 63) / 64, 8);
  const uint8_t* ring[kPrefetchRows];
  // With a scale-factor table (the CPU backend), the row's scale factors are prefetched too, into every cache level:
  // engram_gather_sf_range reads them right after this range, and a random read of the sf table per row would
  // otherwise cost a miss each.
  const bool sf = g.sf_table && g.P > 0;
  auto source = [&](int64_t i) -> const uint8_t* {
    bool oob = false;
    const int64_t id = engram::resolve_id(g.ids[i], total, g.mode, &oob);
    if (oob && (first_bad < 0 || i < first_bad)) first_bad = i;
    if (id < 0) return nullptr;
    if (sf) __builtin_prefetch(g.sf_table + id * g.P, 0, 3);
    return row_source(g, id);
  };
  for (int64_t i = begin; i < std::min(end, begin + kPrefetchRows); ++i) {
    ring[i % kPrefetchRows] = source(i);
    prefetch_source(ring[i % kPrefetchRows], lines);
  }
  for (int64_t i = begin; i < end; ++i) {
    const uint8_t* src = ring[i % kPrefetchRows];
    if (i + kPrefetchRows < end) {  // the slot just read takes the row kPrefetchRows ahead
      ring[i % kPrefetchRows] = source(i + kPrefetchRows);
      prefetch_source(ring[i % kPrefetchRows], lines);
    }
    uint8_t* dst = g.out + i * rb;
#if defined(__SSE2__)
    if (nt) {
      if (!src)
        stream_zero(dst, rb);
      else
        stream_row(dst, src, rb);
      continue;
    }
#endif
    if (!src)
      std::memset(dst, 0, rb);
    else
      std::memcpy(dst, src, rb);
  }
#if defined(__SSE2__)
  if (nt) _mm_sfence();  // non-temporal stores are weakly ordered: visible before whoever publishes this range
#endif
  return first_bad;
}

void engram_gather_sf_range(const EngramGather& g, int64_t begin, int64_t end) {
  if (!g.sf_table || g.P == 0) return;
  const int64_t total = static_cast<int64_t>(g.nranks) * g.num_entries;
  const int64_t EP = g.E * g.P;
  for (int64_t i = begin; i < end; ++i) {
    bool oob = false;
    const int64_t id = engram::resolve_id(g.ids[i], total, g.mode, &oob);
    const int64_t t = i / g.E, e = i % g.E;
    for (int64_t p = 0; p < g.P; ++p) {
      const int64_t j = e * g.P + p;
      g.sf_out[engram::sf_out_index(t, j, g.T, EP, g.sf_layout)] = id < 0 ? 0u : g.sf_table[id * g.P + p];
    }
  }
}

void engram_zero_sf_padding(const EngramGather& g) {
  if (!g.sf_table || g.P == 0 || g.sf_layout != engram::kSfTmaColMajor) return;
  const int64_t cols = engram::sf_columns(g.T, g.sf_layout), EP = g.E * g.P;
  if (cols == g.T) return;
  for (int64_t j = 0; j < EP; ++j)
    std::memset(g.sf_out + j * cols + g.T, 0, static_cast<size_t>(cols - g.T) * sizeof(uint32_t));
}

void engram_gather_sf(const EngramGather& g) {
  engram_zero_sf_padding(g);
  engram_gather_sf_range(g, 0, g.T * g.E);
}

void engram_gather(const EngramGather& g) {
  engram_gather_rows(g, 0, g.T * g.E);
  engram_gather_sf(g);
}

void engram_write(const EngramWrite& w) {
  std::memcpy(w.shard + w.start * w.row_bytes, w.src, static_cast<size_t>(w.rows * w.row_bytes));
  if (!w.sf_table) return;
  const int64_t slice = w.rows * w.sf_row_bytes;
  for (int32_t q = 0; q < w.nranks; ++q)
    std::memcpy(w.sf_table + (q * w.num_entries + w.start) * w.sf_row_bytes, w.sf_src + q * slice,
                static_cast<size_t>(slice));
}

namespace {
double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
// Runs f(lo, hi) on `threads` threads over equal parts of [0, bytes) (64-byte aligned); returns the seconds.
template <class F>
double split(int64_t bytes, int threads, F f) {
  std::vector<std::thread> ts;
  const int64_t part = (bytes / threads) & ~int64_t{63};
  const double t0 = seconds();
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([=] { f(part * t, t + 1 == threads ? bytes : part * (t + 1)); });
  for (auto& x : ts) x.join();
  return seconds() - t0;
}
}  // namespace

HostBandwidth host_memory_bandwidth(int64_t bytes, int threads) {
  bytes &= ~int64_t{63};
  threads = std::max(threads, 1);
  std::vector<uint8_t> a_buf(bytes + 64), b_buf(bytes + 64);  // touched (zeroed) here: pages are mapped
  uint8_t* a = a_buf.data() + (64 - reinterpret_cast<uintptr_t>(a_buf.data()) % 64) % 64;
  uint8_t* b = b_buf.data() + (64 - reinterpret_cast<uintptr_t>(b_buf.data()) % 64) % 64;
  std::memset(a, 1, bytes);
  HostBandwidth r;
  double tr = 1e30, tc = 1e30, tw = 1e30;
  std::vector<int64_t> sinks(threads * 8);
  for (int rep = 0; rep < 3; ++rep) {
    tr = std::min(tr, split(bytes, threads, [&, a](int64_t lo, int64_t hi) {
      int64_t s = 0;
      for (int64_t i = lo; i < hi; i += 64) s += *reinterpret_cast<const volatile int64_t*>(a + i);
      sinks[(lo / 64) % sinks.size()] = s;
    }));
    tc = std::min(tc, split(bytes, threads, [=](int64_t lo, int64_t hi) { std::memcpy(b + lo, a + lo, hi - lo); }));
    tw = std::min(tw, split(bytes, threads, [=](int64_t lo, int64_t hi) {
#if defined(__SSE2__)
      const __m128i z = _mm_set1_epi32(static_cast<int>(lo));
      for (int64_t i = lo; i < hi; i += 16) _mm_stream_si128(reinterpret_cast<__m128i*>(b + i), z);
      _mm_sfence();
#else
      std::memset(b + lo, static_cast<int>(lo), hi - lo);
#endif
    }));
  }
  r.read_gbps = bytes / tr / 1e9;
  r.memcpy_gbps = bytes / tc / 1e9;
  r.nt_write_gbps = bytes / tw / 1e9;
  return r;
}

}  // namespace jax_engram::cpu
