// Engram gather: rows read straight from the owner's memory (peer HBM over NVLink, or host-NUMA memory mapped
// into this GPU's view) into the output; scale factors from the own replicated table.
//
// Work decomposition: the rows of a lookup are split into "units" of one vector (V = the widest power of two
// <= 16 bytes dividing row_bytes, engram::vector_bytes), units = T*E*row_bytes/|V|, consecutive threads take
// consecutive units (coalesced: a warp reads 512 contiguous bytes of a row when V is 16 bytes) and every thread
// keeps kUnroll independent loads in flight (grid-stride). Nothing depends on T, E, hidden or num_entries at
// compile time: divisions by the row length and by num_entries use precomputed multiply-shift divisors.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "jax_engram/engram_layout.h"
#include "kernels/cuda/engram.cuh"
#include "kernels/cuda/sync.cuh"
#include "runtime/env.h"

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
cudaError_t launch_typed(const Params& p, uint64_t want_blocks, int sm_count, int load, const EngramTuning& t,
                         cudaStream_t stream) {
  switch (load) {
    case kLoadPlain: return launch_instance<V, kLoadPlain>(p, want_blocks, sm_count, t.blocks_per_sm, stream);
    case kLoadCg: return launch_instance<V, kLoadCg>(p, want_blocks, sm_count, t.blocks_per_sm, stream);
    default: return launch_instance<V, kLoadVolatile>(p, want_blocks, sm_count, t.blocks_per_sm, stream);
  }
}

}  // namespace

const EngramTuning& engram_tuning() {
  static const EngramTuning t = [] {
    EngramTuning r;
    r.blocks_per_sm = env_int("JAX_ENGRAM_ENGRAM_BLOCKS_PER_SM", 0, 0, 64);
    const char* l = std::getenv("JAX_ENGRAM_ENGRAM_LOADS");
    r.loads = !l || !*l ? EngramTuning::kAuto
              : std::strcmp(l, "plain") == 0 ? EngramTuning::kPlain
              : std::strcmp(l, "cg") == 0    ? EngramTuning::kCg
                                             : EngramTuning::kVolatile;
    return r;
  }();
  return t;
}

cudaError_t launch_engram_fetch(const EngramFetchArgs& a, cudaStream_t stream) {
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
  const EngramTuning& tune = engram_tuning();
  const int load = tune.loads == EngramTuning::kPlain      ? kLoadPlain
                   : tune.loads == EngramTuning::kCg       ? kLoadCg
                   : tune.loads == EngramTuning::kVolatile ? kLoadVolatile
                   : a.device_memory                       ? kLoadCg
                                                           : kLoadVolatile;
  // One unit per thread while the grid fits on the GPU at once (lowest latency for small T); beyond that every
  // thread loops with kUnroll loads in flight (bandwidth for large T).
  const uint64_t work = std::max<uint64_t>(std::max<uint64_t>(p.units, p.n_rows * p.P), 1);
  const uint64_t want = (work + kThreads - 1) / kThreads;
  cudaError_t e;
  switch (vb) {
    case 16: e = launch_typed<uint4>(p, want, a.sm_count, load, tune, stream); break;
    case 8: e = launch_typed<uint2>(p, want, a.sm_count, load, tune, stream); break;
    case 4: e = launch_typed<uint32_t>(p, want, a.sm_count, load, tune, stream); break;
    case 2: e = launch_typed<uint16_t>(p, want, a.sm_count, load, tune, stream); break;
    default: e = launch_typed<uint8_t>(p, want, a.sm_count, load, tune, stream); break;
  }
  if (e != cudaSuccess || !checked) return e;
  engram_check_kernel<<<1, 1, 0, stream>>>(a.status, a.ids, p.total, a.err, a.rank);
  return cudaGetLastError();
}

cudaError_t engram_kernels_loadable() {
  cudaFuncAttributes attr{};
  cudaError_t e = cudaFuncGetAttributes(&attr, engram_gather_kernel<uint4, kLoadVolatile>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, engram_check_kernel);
  if (e != cudaSuccess) cudaGetLastError();
  return e;
}

}  // namespace jax_engram
