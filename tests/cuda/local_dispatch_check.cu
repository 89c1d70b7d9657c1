// The one-rank expand dispatch's CUDA launch (launch_ep_local_dispatch: the one-kernel path up to
// kEpLocalLayoutMaxEntries entries, the chunked kernels above) against a sequential statement of its rule
// (cpu::ep_local_layout's, docs/semantics.md "One rank"), every output bit for bit: the receive rows of every entry,
// each row's source entry and token, the per-expert counts, aligned counts and prefix, the metadata, dst_row, the
// receive count, the rows, the weights and the routing's error record. Routings: clean (some entries -1), with
// duplicates, and with ids outside [-1, E); each case is launched twice on the same buffers (the scratch and the
// error record carry nothing from one launch to the next). tests/test_ep_local.py builds and runs it.
//
//   nvcc -std=c++17 -arch=native -Iffi -Iffi/include -o check tests/cuda/local_dispatch_check.cu \
//        ffi/kernels/cuda/ep_local.cu && ./check          # prints one line per case, then "ALL OK" (exit 0)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "kernels/cuda/ep.h"

using namespace jax_engram;
using Ints = std::vector<int32_t>;

namespace {

int failures = 0;

template <typename T>
T* to_device(const std::vector<T>& v) {
  T* d = nullptr;
  cudaMalloc(&d, v.size() * sizeof(T) + 16);
  cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}

template <typename T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> v(n);
  cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
  return v;
}

template <typename A, typename B>
void expect_equal(const A& got, const B& want, const char* what) {
  if (got == want) return;
  ++failures;
  std::printf("  MISMATCH %s\n", what);
}

struct Case {
  int N, K, E, A, M;
  int routing;  // 0: clean (a quarter of the entries -1), 1: ids in [-1, E) (duplicates), 2: ids in [-3, E + 3)
};

// The rule, sequentially: entry (t, k) of expert e takes row start[e] + (e's entries before it in (t, k) order);
// the first bad entry (an id outside [-1, E), or a valid id an earlier k of its token holds) is recorded.
struct Want {
  Ints count, aligned, psum, exp_row, src_entry, src_tok, meta, dst_row;
  int32_t num = 0;
  int64_t bad_detail = -1;
  int32_t bad_id = 0;
};

Want reference(const Case& c, const Ints& topk, int32_t rows) {
  const int N = c.N, K = c.K, E = c.E, W = K + 2;
  const int64_t n = static_cast<int64_t>(N) * K;
  Want w;
  w.count.assign(E, 0);
  w.aligned.assign(E, 0);
  w.psum.assign(E, 0);
  w.exp_row.assign(n, -1);
  w.src_entry.assign(rows, static_cast<int32_t>(n));
  w.src_tok.assign(rows, N);
  w.meta.assign(static_cast<size_t>(c.M) * W, -1);
  w.dst_row.assign(N, -1);
  for (int64_t j = 0; j < n; ++j)
    if (topk[j] >= 0 && topk[j] < E) ++w.count[topk[j]];
  Ints start(E), rank(E, 0);
  int32_t s = 0;
  for (int e = 0; e < E; ++e) {
    start[e] = s;
    w.aligned[e] = (w.count[e] + c.A - 1) / c.A * c.A;
    w.psum[e] = s + w.count[e];
    s += w.aligned[e];
  }
  for (int t = 0; t < N; ++t) {
    int master = -1;
    for (int k = 0; k < K; ++k) {
      const int32_t id = topk[static_cast<int64_t>(t) * K + k];
      const bool range = id < -1 || id >= E;
      bool dup = false;
      for (int q = 0; q < k && !range && id >= 0; ++q) dup |= topk[static_cast<int64_t>(t) * K + q] == id;
      if (w.bad_detail < 0 && (range || dup)) {
        w.bad_detail = ep_bad_detail(t, range ? kEpBadExpertRange : kEpBadDuplicateExpert);
        w.bad_id = id;
      }
      if (id < 0 || id >= E) continue;
      const int32_t r = start[id] + rank[id]++;
      master = k;
      w.exp_row[static_cast<int64_t>(t) * K + k] = r;
      if (r < rows) {
        w.src_entry[r] = t * K + k;
        w.src_tok[r] = t;
      }
    }
    if (master < 0) continue;
    w.dst_row[t] = w.num;
    int32_t* m = &w.meta[static_cast<size_t>(w.num) * W];
    m[0] = t;
    m[1] = master;
    for (int k = 0; k < K; ++k) m[2 + k] = w.exp_row[static_cast<int64_t>(t) * K + k];
    ++w.num;
  }
  return w;
}

void run(const Case& c, std::mt19937& rng) {
  const int N = c.N, K = c.K, E = c.E, W = K + 2, H = 4;  // rows of 4 int32 words
  const int64_t n = static_cast<int64_t>(N) * K;
  const int32_t rows = static_cast<int32_t>(ep_rows_expand(1, c.M, K, E, c.A));
  Ints topk(n);
  for (int t = 0; t < N; ++t) {
    Ints perm(E);
    for (int e = 0; e < E; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int k = 0; k < K; ++k) {
      int32_t id;
      if (c.routing == 0) id = k < E && rng() % 4 ? perm[k] : -1;
      else if (c.routing == 1) id = static_cast<int32_t>(rng() % (E + 1)) - 1;
      else id = static_cast<int32_t>(rng() % (E + 6)) - 3;
      topk[static_cast<int64_t>(t) * K + k] = id;
    }
  }
  const Want want = reference(c, topk, rows);

  Ints x(static_cast<size_t>(N) * H), w(n);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<int32_t>(i) + 1;
  for (int64_t j = 0; j < n; ++j) w[j] = static_cast<int32_t>(j * 3 + 1);
  const int32_t junk = 0x7f7f7f7f;  // every output starts as junk: what the launch does not write shows
  EpLocalDispatchParams p;
  const Ints one(1, 0);
  p.topk = to_device(topk);
  p.token = to_device(one);
  p.token_out = to_device(one);
  p.err = to_device(std::vector<ErrorRecord>(1));
  p.N = N, p.K = K, p.E = E, p.A = c.A, p.M = c.M, p.rows = rows;
  p.x = reinterpret_cast<const uint8_t*>(to_device(x));
  p.row_bytes = H * 4;
  p.recv_x = reinterpret_cast<uint8_t*>(to_device(Ints(static_cast<size_t>(rows) * H, junk)));
  p.w = reinterpret_cast<const uint32_t*>(to_device(w));
  p.recv_w = reinterpret_cast<uint32_t*>(to_device(Ints(rows, junk)));
  p.exp_row = to_device(Ints(n, junk));
  p.src_entry = to_device(Ints(rows, junk));
  p.src_tok = to_device(Ints(rows, junk));
  p.count = to_device(Ints(E, junk));
  p.aligned = to_device(Ints(E, junk));
  p.psum_expert = to_device(Ints(E, junk));
  p.meta = to_device(Ints(static_cast<size_t>(c.M) * W, junk));
  p.dst_row = to_device(Ints(N, junk));
  p.num_recv = to_device(Ints(1, junk));
  p.scratch_words = ep_local_dispatch_scratch_words(N, K, E);
  p.scratch = to_device(Ints(p.scratch_words + 1, 0x55555555));
  for (int launch = 0; launch < 2; ++launch) {
    const cudaError_t e = launch_ep_local_dispatch(p, 0), s = cudaDeviceSynchronize();
    if (e != cudaSuccess || s != cudaSuccess) {
      ++failures;
      std::printf("  CUDA error: launch %s, sync %s\n", cudaGetErrorString(e), cudaGetErrorString(s));
    }
  }
  std::printf("N=%d K=%d E=%d A=%d M=%d routing=%d: %d rows, %lld scratch words, %d receive tokens, bad %lld\n", N,
              K, E, c.A, c.M, c.routing, rows, static_cast<long long>(p.scratch_words), want.num,
              static_cast<long long>(want.bad_detail));
  expect_equal(to_host(p.exp_row, n), want.exp_row, "exp_row");
  expect_equal(to_host(p.src_entry, rows), want.src_entry, "src_entry");
  expect_equal(to_host(p.src_tok, rows), want.src_tok, "src_tok");
  expect_equal(to_host(p.count, E), want.count, "count");
  expect_equal(to_host(p.aligned, E), want.aligned, "aligned");
  expect_equal(to_host(p.psum_expert, E), want.psum, "psum_expert");
  expect_equal(to_host(p.meta, static_cast<size_t>(c.M) * W), want.meta, "meta");
  expect_equal(to_host(p.dst_row, N), want.dst_row, "dst_row");
  expect_equal(to_host(p.num_recv, 1)[0], want.num, "num_recv");
  Ints recv_w(rows), recv_x(static_cast<size_t>(rows) * H, 0);
  for (int32_t r = 0; r < rows; ++r) {
    recv_w[r] = want.src_entry[r] < n ? w[want.src_entry[r]] : 0;
    if (want.src_tok[r] < N)
      for (int h = 0; h < H; ++h) recv_x[static_cast<size_t>(r) * H + h] = x[static_cast<size_t>(want.src_tok[r]) * H + h];
  }
  expect_equal(to_host(reinterpret_cast<const int32_t*>(p.recv_w), rows), recv_w, "recv_w");
  expect_equal(to_host(reinterpret_cast<const int32_t*>(p.recv_x), static_cast<size_t>(rows) * H), recv_x, "recv_x");
  expect_equal(to_host(p.token_out, 1)[0], 0, "token_out");
  const ErrorRecord rec = to_host(p.err, 1)[0];
  expect_equal(rec.code ? static_cast<int64_t>(rec.detail) : int64_t{-1}, want.bad_detail, "error detail");
  if (want.bad_detail >= 0) {
    expect_equal(static_cast<int64_t>(rec.observed), static_cast<int64_t>(want.bad_id), "error id");
    expect_equal(static_cast<int>(rec.op), static_cast<int>(kOpEpDispatch), "error op");
  }
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  const Case cases[] = {
      {2048, 1, 256, 1, 2048, 0},   // the one kernel's largest
      {2049, 1, 7, 3, 2100, 0},     // chunked: a second chunk of one token
      {4096, 8, 256, 1, 4096, 0},   // the bench's largest shape, 16 chunks
      {300, 32, 256, 128, 333, 0},  // top-32: chunks of 64 tokens, a wide alignment, M > N
      {5000, 1, 1, 1, 5000, 0},     // one expert across 3 chunks
      {1025, 4, 64, 8, 1025, 0},    // a last chunk of one token
      {100000, 8, 256, 4, 100000, 0},  // 391 chunks
      {700, 3, 5, 2, 720, 1},       // duplicates
      {65, 32, 8, 1, 70, 1},        // duplicates past the last row (K > E)
      {4097, 1, 3, 1, 4097, 1},
      {3000, 2, 4, 2, 3000, 2},     // ids outside [-1, E)
      {9000, 7, 33, 5, 9100, 2},
      {128, 8, 256, 1, 128, 2},     // the one kernel, bad routing
  };
  for (const Case& c : cases) run(c, rng);
  std::printf(failures ? "FAILED: %d mismatches\n" : "ALL OK\n", failures);
  return failures != 0;
}
