// Engram gather: rows read straight from the owner's memory (peer HBM over NVLink, or host-NUMA memory mapped
// into this GPU's view) into the output; scale factors from the own replicated table. Two gathers:
//
// "sm" (engram::kGatherSm): the rows of a lookup are split into "units" of one vector (V = the widest power of two
// <= 16 bytes dividing row_bytes, engram::vector_bytes), units = T*E*row_bytes/|V|, consecutive threads take
// consecutive units (coalesced: a warp reads 512 contiguous bytes of a row when V is 16 bytes) and every thread
// keeps kUnroll independent loads in flight (grid-stride). The grid is what is resident at once on every SM: the
// lowest latency, but the gather holds the whole GPU while the bytes move.
//
// "tma" (engram::kGatherTma): bulk copies on a few CTAs (engram::TmaPlan in engram_layout.h). Each warp is one
// pipeline of `stages` shared-memory buffers; its lanes issue one cp.async.bulk per row piece of a chunk (global ->
// shared, completing on the buffer's mbarrier) and lane 0 writes the landed chunk to the output with one bulk copy
// (shared -> global). The copy engine of each SM (TMA) moves the bytes; the warps only issue and wait, so a few
// CTAs keep the link busy (kTmaWarps * (stages - 1) chunks in flight per CTA) and the other SMs stay free.
//
// "sm_few" (engram::kGatherSmFew): the "sm" gather on at most gather_sms CTAs (also where "tma" cannot run).
//
// Nothing depends on T, E, hidden or num_entries at compile time: divisions by the row length and by num_entries use
// precomputed multiply-shift divisors (sm) or run once per row piece (tma).
#include <algorithm>
#include <cstdint>
#include <mutex>

#include "jax_engram/engram_layout.h"
#include "kernels/cuda/engram.cuh"
#include "kernels/cuda/sync.cuh"

namespace jax_engram {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 8;

struct Params {
  const int32_t* ids;
  uint64_t units;          // n_rows * nvec
  uint64_t n_rows;         // T * E
  uint32_t nvec;           // vectors per row
  engram::FastDiv div_nvec, div_entries;
  bool fast;               // units and ids < 2^31: 32-bit multiply-shift divisions
  int64_t total, num_entries, row_bytes, offset;
  uint8_t* const* peers;
  uint8_t* out;
  int32_t mode;
  const uint32_t* sf_table;
  uint32_t* sf_out;
  int64_t P, E, T, sf_cols;  // sf_cols = engram::sf_columns(T, layout)
  int32_t sf_layout;
  int32_t* status;
};

// ---- loads of a peer's / host memory ---------------------------------------------------------------------
// kLoad: kLoadPlain (ordinary ld.global), kLoadVolatile (relaxed.sys: never a stale cached line; needed for host
// memory, which the reading GPU's L2 may cache while another GPU writes it), kLoadCg (ld.global.cg, L2 only: peer
// HBM is cached only in its owner's L2, so this is coherent for device placement and lets the loads pipeline).
enum : int { kLoadPlain = 0, kLoadVolatile = 1, kLoadCg = 2 };
template <typename V, int kLoad>
struct Load;
template <int kLoad>
struct Load<uint4, kLoad> {
  static JE_DEVICE uint4 run(const uint8_t* p) {
    if (kLoad == kLoadPlain) return *reinterpret_cast<const uint4*>(p);
    if (kLoad == kLoadCg) return __ldcg(reinterpret_cast<const uint4*>(p));
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
  }
};
template <int kLoad>
struct Load<uint2, kLoad> {
  static JE_DEVICE uint2 run(const uint8_t* p) {
    if (kLoad == kLoadPlain) return *reinterpret_cast<const uint2*>(p);
    if (kLoad == kLoadCg) return __ldcg(reinterpret_cast<const uint2*>(p));
    uint2 v;
    asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
    return v;
  }
};
template <typename S, int kLoad>
struct ScalarLoad {
  static JE_DEVICE S run(const uint8_t* p) {
    if (kLoad == kLoadCg) return __ldcg(reinterpret_cast<const S*>(p));
    return kLoad == kLoadVolatile ? *reinterpret_cast<const volatile S*>(p) : *reinterpret_cast<const S*>(p);
  }
};
template <int kLoad>
struct Load<uint32_t, kLoad> : ScalarLoad<uint32_t, kLoad> {};
template <int kLoad>
struct Load<uint16_t, kLoad> : ScalarLoad<uint16_t, kLoad> {};
template <int kLoad>
struct Load<uint8_t, kLoad> : ScalarLoad<uint8_t, kLoad> {};

// ---- the gather ------------------------------------------------------------------------------------------
template <bool kFast>
JE_DEVICE uint64_t div_units(const Params& p, uint64_t u) {
  return kFast ? p.div_nvec.div(static_cast<uint32_t>(u)) : u / p.nvec;
}
template <bool kFast>
JE_DEVICE int64_t div_entries(const Params& p, int64_t g) {
  return kFast ? static_cast<int64_t>(p.div_entries.div(static_cast<uint32_t>(g))) : g / p.num_entries;
}

template <typename V, int kLoad, bool kFast>
JE_DEVICE void gather_rows(const Params& p) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool checked = p.mode == engram::kModeChecked;
  for (uint64_t base = first; base < p.units; base += stride * kUnroll) {
    V v[kUnroll];
    uint8_t* dst[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const uint64_t u = base + k * stride;
      dst[k] = nullptr;
      if (u >= p.units) continue;
      const uint64_t row = div_units<kFast>(p, u);
      const uint64_t vi = u - row * p.nvec;
      const int32_t g = __ldg(p.ids + row);
      bool oob;
      const int64_t id = engram::resolve_id(g, p.total, p.mode, &oob);
      if (checked && oob && vi == 0) atomicMin(p.status, static_cast<int32_t>(row));
      dst[k] = p.out + row * p.row_bytes + vi * sizeof(V);
      if (id >= 0) {
        const int64_t owner = div_entries<kFast>(p, id);
        const int64_t r = id - owner * p.num_entries;
        const uint8_t* base_ptr = reinterpret_cast<uint8_t*>(__ldg(reinterpret_cast<const unsigned long long*>(p.peers) + owner));
        v[k] = Load<V, kLoad>::run(base_ptr + p.offset + r * p.row_bytes + vi * sizeof(V));
      } else {
        v[k] = V{};
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k)
      if (dst[k]) *reinterpret_cast<V*>(dst[k]) = v[k];
  }
}

JE_DEVICE void gather_sf(const Params& p) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t n = p.n_rows * p.P;
  const int64_t EP = p.E * p.P;
  for (uint64_t w = first; w < n; w += stride) {
    const int64_t row = static_cast<int64_t>(w / p.P), pk = static_cast<int64_t>(w % p.P);
    const int64_t t = row / p.E, e = row % p.E;
    bool oob;
    const int64_t id = engram::resolve_id(__ldg(p.ids + row), p.total, p.mode, &oob);
    p.sf_out[engram::sf_out_index(t, e * p.P + pk, p.T, EP, p.sf_layout)] = id < 0 ? 0u : __ldg(p.sf_table + id * p.P + pk);
  }
  // Token padding columns [T, align(T, 4)) of the column-major layout are zero.
  const int64_t pad = p.sf_cols - p.T;
  if (pad > 0) {
    const uint64_t m = static_cast<uint64_t>(EP * pad);
    for (uint64_t w = first; w < m; w += stride) {
      const int64_t j = static_cast<int64_t>(w / pad), c = p.T + static_cast<int64_t>(w % pad);
      p.sf_out[j * p.sf_cols + c] = 0u;
    }
  }
}

// Large lookups (more vectors than threads): a warp takes 32 rows at a time; lane i resolves row base + i ONCE
// (id, mode, owner, source pointer) and the warp then moves the batch's 32 * nvec vectors -- one contiguous range
// of the output -- with kUnroll loads in flight per lane, each vector's source row pointer shuffled from the lane
// that resolved it. Why: the per-vector path spends ~40 integer instructions per 16-byte vector (division, id
// load, owner lookup) and is issue-bound well below the link rate; here a vector costs a multiply-shift, two
// shuffles and the load / store. The ids of the NEXT batch are loaded before this batch's rows, so that the id
// load (a dependent round trip before any row load can start) overlaps the row loads instead of preceding them.
template <bool kFast>
JE_DEVICE unsigned long long row_source(const Params& p, uint64_t row, int32_t g, bool checked) {
  if (row >= p.n_rows) return 0;  // 0: zero row
  bool oob;
  const int64_t id = engram::resolve_id(g, p.total, p.mode, &oob);
  if (checked && oob) atomicMin(p.status, static_cast<int32_t>(row));
  if (id < 0) return 0;
  const int64_t owner = div_entries<kFast>(p, id);
  const int64_t r = id - owner * p.num_entries;
  return __ldg(reinterpret_cast<const unsigned long long*>(p.peers) + owner) + p.offset + r * p.row_bytes;
}

template <typename V, int kLoad, bool kFast>
JE_DEVICE void gather_rows_batched(const Params& p) {
  const int lane = threadIdx.x & 31;
  const uint64_t nwarps = (static_cast<uint64_t>(gridDim.x) * blockDim.x) >> 5;
  const uint64_t gw = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const bool checked = p.mode == engram::kModeChecked;
  const uint64_t step = nwarps * 32;
  uint64_t rb = gw * 32;
  unsigned long long src =
      row_source<kFast>(p, rb + lane, rb + lane < p.n_rows ? __ldg(p.ids + rb + lane) : 0, checked);
  for (; rb < p.n_rows; rb += step) {
    const uint64_t next = rb + step + lane;
    const int32_t g_next = next < p.n_rows ? __ldg(p.ids + next) : 0;
    const uint64_t left = p.n_rows - rb;
    const uint32_t total = static_cast<uint32_t>(left < 32 ? left : 32) * p.nvec;
    V* out = reinterpret_cast<V*>(p.out + rb * p.row_bytes);
    for (uint32_t q0 = 0; q0 < total; q0 += 32 * kUnroll) {
      V v[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const uint32_t q = q0 + k * 32 + lane;
        const uint32_t r = p.div_nvec.div(q);
        const unsigned long long s = __shfl_sync(0xffffffffu, src, r & 31);
        v[k] = V{};
        if (q < total && s) v[k] = Load<V, kLoad>::run(reinterpret_cast<const uint8_t*>(s) + (q - r * p.nvec) * sizeof(V));
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const uint32_t q = q0 + k * 32 + lane;
        if (q < total) out[q] = v[k];
      }
    }
    src = row_source<kFast>(p, next, g_next, checked);
  }
}

template <typename V, int kLoad>
__global__ void __launch_bounds__(kThreads) engram_gather_batched_kernel(Params p) {
  if (p.mode != engram::kModeChecked && blockIdx.x == 0 && threadIdx.x == 0) *p.status = 0;
  if (p.fast)
    gather_rows_batched<V, kLoad, true>(p);
  else
    gather_rows_batched<V, kLoad, false>(p);
  if (p.sf_table) gather_sf(p);
}

template <typename V, int kLoad>
__global__ void __launch_bounds__(kThreads) engram_gather_kernel(Params p) {
  if (p.mode != engram::kModeChecked && blockIdx.x == 0 && threadIdx.x == 0) *p.status = 0;
  if (p.fast)
    gather_rows<V, kLoad, true>(p);
  else
    gather_rows<V, kLoad, false>(p);
  if (p.sf_table) gather_sf(p);
}

// ---- the "tma" gather: bulk copies on a few CTAs ------------------------------------------------------------
constexpr int kTmaThreads = engram::kTmaWarps * 32;

struct TmaArgs {
  int64_t chunk_bytes = 0, chunks = 0, total_bytes = 0;
  int32_t stages = 0;
  ErrorRecord* err = nullptr;  // a wait past the timeout is recorded here (kErrTimeout)
  int32_t rank = 0;
  uint64_t timeout_ns = 0;
};

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // bulk copies and mbarrier transactions: sm_90 and later
constexpr unsigned kFullMask = 0xffffffffu;

JE_DEVICE uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
JE_DEVICE void mbar_init(uint64_t* b, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(count) : "memory");
}
// Adds `bytes` to the transactions the current phase waits for (before the copy that completes them).
JE_DEVICE void mbar_expect_tx(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}
JE_DEVICE void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory");
}
JE_DEVICE bool mbar_try_wait(uint64_t* b, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(smem_u32(b)), "r"(parity)
      : "memory");
  return done != 0;
}
// Bounded wait for the phase of parity `parity`; false (and the time waited) past timeout_ns (0: unbounded).
JE_DEVICE bool mbar_wait(uint64_t* b, uint32_t parity, uint64_t timeout_ns, uint64_t* waited_ns) {
  if (mbar_try_wait(b, parity)) return true;
  const uint64_t start = cuda::globaltimer_ns();
  while (!mbar_try_wait(b, parity)) {
    const uint64_t dt = cuda::globaltimer_ns() - start;
    if (timeout_ns && dt > timeout_ns) {
      *waited_ns = dt;
      return false;
    }
  }
  return true;
}
JE_DEVICE void bulk_load(void* smem_dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(smem_dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
JE_DEVICE void bulk_store(void* dst, const void* smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_u32(smem_src)),
               "r"(bytes)
               : "memory");
}
JE_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Until at most one bulk group of this thread still reads shared memory (the newest store may go on).
JE_DEVICE void bulk_wait_read_all_but_one() { asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory"); }
JE_DEVICE void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Shared memory written by ordinary stores is read next by a bulk copy (async proxy).
JE_DEVICE void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// One warp fills stage buffer `stage` with chunk c: every lane takes row pieces k = lane, lane + 32, ...; a piece
// with a source row is one bulk copy completing on `bar` (the lane first raises the phase's expected bytes), a
// zero row (padding, or out of range in fill / checked mode) is cleared by the whole warp with 16-byte stores.
// Lane 0 arrives on `bar` (arrival count 1) after every lane issued its copies, so the phase completes when all
// of the chunk's bytes have landed.
JE_DEVICE void tma_load_chunk(const Params& p, const TmaArgs& t, int64_t c, uint8_t* stage, uint64_t* bar, int lane) {
  const int64_t n_rows = static_cast<int64_t>(p.n_rows);
  int64_t r0 = 0, r1 = -1;
  engram::tma_chunk_rows(c, t.chunk_bytes, p.row_bytes, n_rows, &r0, &r1);
  const int64_t pieces = r1 - r0 + 1;
  const bool checked = p.mode == engram::kModeChecked;
  for (int64_t k0 = 0; k0 < pieces; k0 += 32) {  // warp-uniform trip count
    const int64_t k = k0 + lane;
    bool zero = false;
    int64_t stage_off = 0, len = 0;
    if (k < pieces) {
      const int64_t row = r0 + k;
      int64_t row_off;
      engram::tma_piece(c, t.chunk_bytes, p.row_bytes, n_rows, row, &row_off, &stage_off, &len);
      bool oob;
      const int64_t id = engram::resolve_id(__ldg(p.ids + row), p.total, p.mode, &oob);
      if (checked && oob && row_off == 0) atomicMin(p.status, static_cast<int32_t>(row));
      if (id >= 0) {
        const int64_t owner = id / p.num_entries;
        const int64_t r = id - owner * p.num_entries;
        const uint8_t* base =
            reinterpret_cast<const uint8_t*>(__ldg(reinterpret_cast<const unsigned long long*>(p.peers) + owner));
        mbar_expect_tx(bar, static_cast<uint32_t>(len));
        bulk_load(stage + stage_off, base + p.offset + r * p.row_bytes + row_off, static_cast<uint32_t>(len), bar);
      } else {
        zero = true;
      }
    }
    unsigned zmask = __ballot_sync(kFullMask, zero);
    while (zmask) {
      const int from = __ffs(zmask) - 1;
      zmask &= zmask - 1;
      const int64_t zo = __shfl_sync(kFullMask, stage_off, from);
      const int64_t zl = __shfl_sync(kFullMask, len, from);
      uint4* d = reinterpret_cast<uint4*>(stage + zo);
      for (int64_t q = lane; q < zl / 16; q += 32) d[q] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  fence_proxy_async_smem();
  __syncwarp();
  if (lane == 0) mbar_arrive(bar);
}
#endif

// Chunks of global warp w: w, w + W, ... (W warps in the grid); the i-th of them goes through stage i % stages.
// Prologue: the first `stages` chunks are issued. Step i: wait for chunk i, store it (lane 0, one bulk group per
// chunk), then refill the stage of chunk i-1 -- whose store has read its buffer once all but the newest bulk group
// have -- with chunk i-1+stages. So stages-1 chunks are loading while one is being stored.
__global__ void __launch_bounds__(kTmaThreads) engram_tma_kernel(Params p, TmaArgs t) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // no bulk copies before sm_90; the launcher never picks this kernel there (tma_max_dynamic_smem)
#else
  extern __shared__ __align__(128) uint8_t tma_smem[];
  __shared__ __align__(8) uint64_t bars[engram::kTmaWarps][engram::kTmaStages];
  if (p.mode != engram::kModeChecked && blockIdx.x == 0 && threadIdx.x == 0) *p.status = 0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int S = t.stages;
  uint64_t* bar = bars[warp];
  uint8_t* buf = tma_smem + static_cast<int64_t>(warp) * S * t.chunk_bytes;
  if (lane == 0) {
    for (int s = 0; s < S; ++s) mbar_init(&bar[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    // The table was written by an earlier kernel (write's publishing copy + barrier, ordered before this one by
    // the stream and the fork event); the warp's copies are ordered after this acquire by the __syncwarp below.
    asm volatile("fence.acq_rel.sys;" ::: "memory");
  }
  __syncwarp();
  // What this thread may read with ordinary loads, the bulk copies it issues (async proxy) read as well.
  asm volatile("fence.proxy.async.global;" ::: "memory");
  const int64_t nw = static_cast<int64_t>(gridDim.x) * engram::kTmaWarps;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * engram::kTmaWarps + warp;
  const int64_t n = gw < t.chunks ? (t.chunks - 1 - gw) / nw + 1 : 0;
  for (int64_t j = 0; j < n && j < S; ++j) tma_load_chunk(p, t, gw + j * nw, buf + j * t.chunk_bytes, &bar[j], lane);
  for (int64_t i = 0; i < n; ++i) {
    const int s = static_cast<int>(i % S);
    const int64_t c = gw + i * nw;
    int ok = 1;
    if (lane == 0) {
      uint64_t waited = 0;
      ok = mbar_wait(&bar[s], static_cast<uint32_t>((i / S) & 1), t.timeout_ns, &waited);
      if (ok) {
        fence_proxy_async_smem();
        const int64_t b0 = c * t.chunk_bytes;
        const int64_t len = t.total_bytes - b0 < t.chunk_bytes ? t.total_bytes - b0 : t.chunk_bytes;
        bulk_store(p.out + b0, buf + static_cast<int64_t>(s) * t.chunk_bytes, static_cast<uint32_t>(len));
        bulk_commit();
      } else {
        // expected: the chunk's bytes; observed: the chunk; detail: CTA * 1000 + warp (which pipeline stalled)
        cuda::record_error_device(t.err, kErrTimeout, kOpEngramFetch, t.rank, -1, t.chunk_bytes, c,
                                  static_cast<int64_t>(waited), static_cast<int64_t>(blockIdx.x) * 1000 + warp);
      }
    }
    ok = __shfl_sync(kFullMask, ok, 0);
    if (!ok) break;  // the error is reported by the next op / ctx.check(); nothing waits on this kernel's flags
    const int64_t j = i - 1 + S;
    if (i >= 1 && j < n) {
      const int sj = static_cast<int>((i - 1) % S);
      if (lane == 0) bulk_wait_read_all_but_one();
      __syncwarp();
      tma_load_chunk(p, t, gw + j * nw, buf + static_cast<int64_t>(sj) * t.chunk_bytes, &bar[sj], lane);
    }
  }
  if (lane == 0) bulk_wait_all();
  if (p.sf_table) gather_sf(p);
#endif
}

// Checked mode: after the gather, report the first out-of-range flat position (if any) in the error record.
__global__ void engram_check_kernel(const int32_t* status, const int32_t* ids, int64_t total, ErrorRecord* err,
                                    int32_t rank) {
  const int32_t pos = *reinterpret_cast<const volatile int32_t*>(status);
  if (pos == engram::kNoBadPosition) return;
  cuda::record_error_device(err, kErrIdOutOfRange, kOpEngramFetch, rank, -1, total, ids[pos], 0, pos);
}

// Resident blocks per SM of a kernel (queried once per instance; the grid never exceeds what runs at once, so
// the grid-stride loop has no second wave). Per kernel: the two paths use different register counts (e.g. 70 and
// 44 for 16-byte vectors), so the batched kernel fits more blocks than the per-vector one.
template <typename Kernel>
int resident_blocks_per_sm(Kernel kernel) {
  int b = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, kThreads, 0) != cudaSuccess || b < 1) {
    cudaGetLastError();
    b = 2;
  }
  return b;
}
template <typename V, int kLoad>
int resident_blocks_per_sm(bool batched) {
  static const int plain = resident_blocks_per_sm(engram_gather_kernel<V, kLoad>);
  static const int batch = resident_blocks_per_sm(engram_gather_batched_kernel<V, kLoad>);
  return batched ? batch : plain;
}

template <typename V, int kLoad>
cudaError_t launch_instance(const Params& p, uint64_t want_blocks, int sm_count, int blocks_per_sm,
                            cudaStream_t stream) {
  const uint64_t sms = static_cast<uint64_t>(std::max(sm_count, 1));
  const auto cap = [&](bool batched) {
    return sms * static_cast<uint64_t>(blocks_per_sm > 0 ? blocks_per_sm : resident_blocks_per_sm<V, kLoad>(batched));
  };
  if (want_blocks > cap(false) && p.units > p.n_rows * p.P && p.nvec <= (1u << 20)) {
    // more than one pass: the batched path (one row resolution per row instead of per vector); a warp per 32 rows
    const uint64_t warps = (p.n_rows + 31) / 32;
    const uint64_t blocks = (warps + kThreads / 32 - 1) / (kThreads / 32);
    const unsigned bgrid = static_cast<unsigned>(std::max<uint64_t>(1, std::min(blocks, cap(true))));
    engram_gather_batched_kernel<V, kLoad><<<bgrid, kThreads, 0, stream>>>(p);
  } else {
    const unsigned grid = static_cast<unsigned>(std::max<uint64_t>(1, std::min(want_blocks, cap(false))));
    engram_gather_kernel<V, kLoad><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename V>
cudaError_t launch_typed(const Params& p, uint64_t want_blocks, int sm_count, int load, int blocks_per_sm,
                         cudaStream_t stream) {
  switch (load) {
    case kLoadPlain: return launch_instance<V, kLoadPlain>(p, want_blocks, sm_count, blocks_per_sm, stream);
    case kLoadCg: return launch_instance<V, kLoadCg>(p, want_blocks, sm_count, blocks_per_sm, stream);
    default: return launch_instance<V, kLoadVolatile>(p, want_blocks, sm_count, blocks_per_sm, stream);
  }
}

}  // namespace

namespace {

// Dynamic shared memory the "tma" kernel may take on `device` (its opt-in limit minus its static part), after
// raising the kernel's limit to it once per device. 0 if the device has no bulk copies (compute capability < 9.0)
// or cannot say: then "tma" runs "sm_few".
int64_t tma_max_dynamic_smem(int device) {
  constexpr int kMaxDevices = 64;
  static std::once_flag once[kMaxDevices];
  static int64_t limit[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return 0;
  std::call_once(once[device], [device] {
    int optin = 0, major = 0;
    cudaFuncAttributes attr{};
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess || major < 9 ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
        cudaFuncGetAttributes(&attr, engram_tma_kernel) != cudaSuccess) {
      cudaGetLastError();
      limit[device] = 0;
      return;
    }
    const int64_t dyn = static_cast<int64_t>(optin) - static_cast<int64_t>(attr.sharedSizeBytes);
    if (dyn <= 0 ||
        cudaFuncSetAttribute(engram_tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dyn)) !=
            cudaSuccess) {
      cudaGetLastError();
      limit[device] = 0;
      return;
    }
    limit[device] = dyn;
  });
  return limit[device];
}

}  // namespace

cudaError_t launch_engram_fetch(const EngramFetchArgs& a, cudaStream_t stream, EngramLaunchInfo* info) {
  EngramLaunchInfo local_info;
  if (!info) info = &local_info;
  *info = EngramLaunchInfo{};
  const int64_t n_rows = a.T * a.E;
  const int vb = engram::vector_bytes(a.row_bytes);
  Params p{};
  p.ids = a.ids;
  p.n_rows = static_cast<uint64_t>(n_rows);
  p.nvec = static_cast<uint32_t>(a.row_bytes / vb);
  p.units = p.n_rows * p.nvec;
  p.total = static_cast<int64_t>(a.nranks) * a.num_entries;
  p.fast = p.units < (1ull << 31) && p.total <= (1ll << 31);
  p.div_nvec = engram::FastDiv(p.nvec);
  p.div_entries = engram::FastDiv(static_cast<uint32_t>(a.num_entries));
  p.num_entries = a.num_entries;
  p.row_bytes = a.row_bytes;
  p.offset = a.offset;
  p.peers = a.peers;
  p.out = a.out;
  p.mode = a.mode;
  p.sf_table = a.P > 0 ? a.sf_table : nullptr;
  p.sf_out = a.sf_out;
  p.P = a.P;
  p.E = a.E;
  p.T = a.T;
  p.sf_layout = a.sf_layout;
  p.sf_cols = engram::sf_columns(a.T, a.sf_layout);
  p.status = a.status;
  const bool checked = a.mode == engram::kModeChecked;
  if (checked) {
    // 0x7f7f7f7f = kNoBadPosition: larger than any flat position, lowered by atomicMin.
    cudaError_t e = cudaMemsetAsync(a.status, 0x7f, sizeof(int32_t), stream);
    if (e != cudaSuccess) return e;
  }
  if (n_rows == 0 && !(p.sf_table && p.sf_cols > p.T)) {
    if (!checked) return cudaMemsetAsync(a.status, 0, sizeof(int32_t), stream);
    return cudaSuccess;
  }
  const bool few_sms = a.gather == engram::kGatherTma || a.gather == engram::kGatherSmFew;
  cudaError_t e = cudaSuccess;
  bool launched = false;
  if (a.gather == engram::kGatherTma && engram::tma_eligible(a.row_bytes, static_cast<uint64_t>(a.offset),
                                      static_cast<uint64_t>(reinterpret_cast<uintptr_t>(a.out)))) {
    int device = 0;
    e = cudaGetDevice(&device);
    if (e != cudaSuccess) return e;
    const int64_t max_dyn = tma_max_dynamic_smem(device);
    if (max_dyn >= engram::kTmaMinSmemBytes) {
      const int64_t budget = std::min<int64_t>(std::max<int64_t>(a.tma_smem_bytes, engram::kTmaMinSmemBytes), max_dyn);
      const engram::TmaPlan plan = engram::tma_plan(n_rows, a.row_bytes, std::max(a.gather_sms, 1), budget);
      TmaArgs t;
      t.chunk_bytes = plan.chunk_bytes;
      t.chunks = plan.chunks;
      t.total_bytes = n_rows * a.row_bytes;
      t.stages = plan.stages;
      t.err = a.timeout_err;
      t.rank = a.rank;
      t.timeout_ns = a.timeout_ns;
      engram_tma_kernel<<<plan.grid, kTmaThreads, static_cast<size_t>(plan.smem_bytes), stream>>>(p, t);
      e = cudaGetLastError();
      *info = EngramLaunchInfo{engram::kGatherTma, plan.grid, plan.chunk_bytes, plan.chunks, plan.smem_bytes};
      launched = true;
    }
  }
  if (!launched) {
    // "sm": the full resident grid; "sm_few" (or "tma" asked for but not possible): at most gather_sms CTAs.
    const int load = a.sm_loads == engram::kLoadsPlain      ? kLoadPlain
                     : a.sm_loads == engram::kLoadsCg       ? kLoadCg
                     : a.sm_loads == engram::kLoadsVolatile ? kLoadVolatile
                     : a.device_memory                      ? kLoadCg
                                                            : kLoadVolatile;
    const int sms = few_sms ? std::max(a.gather_sms, 1) : a.sm_count;
    const int blocks_per_sm = few_sms ? 1 : a.sm_blocks_per_sm;
    // One unit per thread while the grid fits on the GPU at once (lowest latency for small T); beyond that every
    // thread loops with kUnroll loads in flight (bandwidth for large T).
    const uint64_t work = std::max<uint64_t>(std::max<uint64_t>(p.units, p.n_rows * p.P), 1);
    const uint64_t want = (work + kThreads - 1) / kThreads;
    switch (vb) {
      case 16: e = launch_typed<uint4>(p, want, sms, load, blocks_per_sm, stream); break;
      case 8: e = launch_typed<uint2>(p, want, sms, load, blocks_per_sm, stream); break;
      case 4: e = launch_typed<uint32_t>(p, want, sms, load, blocks_per_sm, stream); break;
      case 2: e = launch_typed<uint16_t>(p, want, sms, load, blocks_per_sm, stream); break;
      default: e = launch_typed<uint8_t>(p, want, sms, load, blocks_per_sm, stream); break;
    }
    info->gather = few_sms ? engram::kGatherSmFew : engram::kGatherSm;
    info->sms = static_cast<int32_t>(std::min<uint64_t>(want, static_cast<uint64_t>(std::max(sms, 1))));
  }
  if (e != cudaSuccess || !checked) return e;
  engram_check_kernel<<<1, 1, 0, stream>>>(a.status, a.ids, p.total, a.err, a.rank);
  return cudaGetLastError();
}

namespace {

// dst[0, bytes) = src[0, bytes) by the grid's x dimension, in the widest vectors (16 to 1 bytes) that both pointers
// and the size allow.
template <typename V>
JE_DEVICE void copy_vectors(uint8_t* dst, const uint8_t* src, uint64_t bytes) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t n = bytes / sizeof(V);
  auto* d = reinterpret_cast<V*>(dst);
  const auto* s = reinterpret_cast<const V*>(src);
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) d[i] = s[i];
}
JE_DEVICE void copy_aligned(uint8_t* dst, const uint8_t* src, uint64_t bytes) {
  const uintptr_t al = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes;
  if (al % 16 == 0) copy_vectors<uint4>(dst, src, bytes);
  else if (al % 8 == 0) copy_vectors<uint2>(dst, src, bytes);
  else if (al % 4 == 0) copy_vectors<uint32_t>(dst, src, bytes);
  else copy_vectors<uint8_t>(dst, src, bytes);
}

// blockIdx.y == 0: the rows; blockIdx.y == 1 + q: rank q's scale-factor slice. Every thread ends with a system
// fence: peers read the rows after the write's closing barrier (host memory included).
__global__ void engram_write_kernel(EngramWriteArgs a) {
  const int64_t start = engram::write_start_row(*a.row_offset, a.num_entries, a.rows);
  if (blockIdx.y == 0) {
    copy_aligned(a.shard + start * a.row_bytes, a.src, static_cast<uint64_t>(a.rows * a.row_bytes));
  } else {
    const int64_t q = blockIdx.y - 1, slice = a.rows * a.sf_row_bytes;
    copy_aligned(a.sf_table + (q * a.num_entries + start) * a.sf_row_bytes, a.sf_src + q * slice,
                 static_cast<uint64_t>(slice));
  }
  __threadfence_system();
}

}  // namespace

cudaError_t launch_engram_write(const EngramWriteArgs& a, cudaStream_t stream) {
  if (a.rows < 1 || !a.row_offset) return cudaErrorInvalidValue;
  constexpr int kThreads = 256;
  const uint64_t work = (static_cast<uint64_t>(a.rows * a.row_bytes) + 15) / 16;
  const dim3 grid(static_cast<unsigned>(std::min<uint64_t>((work + kThreads - 1) / kThreads, 1024)),
                  1 + (a.sf_table ? static_cast<unsigned>(a.nranks) : 0u));
  engram_write_kernel<<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t engram_kernels_loadable() {
  cudaFuncAttributes attr{};
  cudaError_t e = cudaFuncGetAttributes(&attr, engram_gather_kernel<uint4, kLoadVolatile>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, engram_tma_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, engram_check_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, engram_write_kernel);
  if (e != cudaSuccess) cudaGetLastError();
  return e;
}

}  // namespace jax_engram
