// NVLink transfer ceilings between two GPUs of one process, by transfer engine and direction, so that the EP and
// Engram kernels can be judged against what SM loads/stores and TMA bulk copies can reach with a given number of
// SMs (the copy engine's figure is the P2P ceiling of the benchmarks).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o probe_nvlink tools/probe_nvlink.cu && ./probe_nvlink [MiB] [mode]
//   mode: engram | tma | ce_dispatch | fanout (local fan-out copies, one GPU) | mixed (copy engine + SM stores)
//
// "engram" runs only the Engram gather variants: half of the rows local, tables from cudaMalloc or from cuMem
// (VMM, the way jax_engram maps its windows), rows drawn from the whole 1 GiB table or from its first 128 MiB
// (the Engram benchmark's 524,288 rows of 256 bytes).
//
// Every line: engine, pattern, direction (1 = GPU0 -> GPU1 only, 2 = both at once), CTAs, GB/s per direction.
// "write" = SM loads of local memory, stores to the peer; "read" = loads of the peer's memory, stores to local;
// "gather256" = reads of random 256-byte rows of a 1 GiB peer table (the Engram access pattern); "scatter256" =
// stores of local rows to random 256-byte rows of the peer; "tma_*" = cp.async.bulk through shared memory.
#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

#define CU(x)                                                                               \
  do {                                                                                      \
    CUresult r_ = (x);                                                                      \
    if (r_ != CUDA_SUCCESS) {                                                               \
      std::fprintf(stderr, "%s:%d %s: CUresult %d\n", __FILE__, __LINE__, #x, (int)r_);     \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

// Driver entry points through the runtime (no -lcuda at link time).
template <typename T>
T driver_fn(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q));
  if (!fn || q != cudaDriverEntryPointSuccess) {
    std::fprintf(stderr, "cannot resolve %s\n", name);
    std::exit(1);
  }
  return reinterpret_cast<T>(fn);
}

constexpr int kThreads = 512;

// Contiguous copy, each warp moves 32 x 16 B x U per step; grid-stride over the whole range.
template <int U>
__global__ void __launch_bounds__(kThreads) copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t base = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < n; base += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (base + u * stride < n) v[u] = __ldcg(src + base + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (base + u * stride < n) dst[base + u * stride] = v[u];
  }
}

// 256-byte rows: 16 lanes per row; row r of the output <- row idx[r] of the table (gather), or the reverse.
template <int U, bool kGather>
__global__ void __launch_bounds__(kThreads) rows_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                                    const uint32_t* __restrict__ idx, size_t rows) {
  const size_t units = rows * 16;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t base = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < units; base += stride * U) {
    uint4 v[U];
    size_t d[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t q = base + u * stride;
      if (q < units) {
        const size_t r = q >> 4, c = q & 15;
        const size_t tr = idx[r];
        v[u] = __ldcg(src + (kGather ? tr * 16 + c : q));
        d[u] = kGather ? q : tr * 16 + c;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (base + u * stride < units) dst[d[u]] = v[u];
  }
}

// Engram-like gather variants: kVolatile = ld.volatile loads; kHalfLocal = odd rows from the local table (the
// 2-rank Engram mix: half of the ids are owned locally).
template <bool kVolatile, bool kHalfLocal>
__global__ void __launch_bounds__(kThreads) gather_var_kernel(const uint4* __restrict__ remote,
                                                          const uint4* __restrict__ local, uint4* __restrict__ dst,
                                                          const uint32_t* __restrict__ idx, size_t rows,
                                                          uint32_t row_mask = 0xffffffffu) {
  constexpr int U = 8;
  const size_t units = rows * 16;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t base = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < units; base += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t q = base + u * stride;
      if (q < units) {
        const size_t r = q >> 4, c = q & 15;
        const uint4* src = (kHalfLocal && (r & 1)) ? local : remote;
        const uint4* a = src + size_t(idx[r] & row_mask) * 16 + c;
        if (kVolatile)
          asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                       : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                       : "l"(a)
                       : "memory");
        else
          v[u] = __ldcg(a);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (base + u * stride < units) dst[base + u * stride] = v[u];
  }
}

// TMA bulk copy src -> smem -> dst, kStages buffers of kChunk bytes per CTA, one issuing thread.
constexpr int kChunk = 32 * 1024;
constexpr int kStages = 6;

__device__ __forceinline__ void mbar_init(uint64_t* b, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"((unsigned)__cvta_generic_to_shared(b)), "r"(n));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"((unsigned)__cvta_generic_to_shared(b)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, unsigned phase) {
  asm volatile(
      "{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}" ::"r"(
          (unsigned)__cvta_generic_to_shared(b)),
      "r"(phase)
      : "memory");
}
__device__ __forceinline__ void bulk_g2s(void* s, const void* g, unsigned bytes, uint64_t* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   (unsigned)__cvta_generic_to_shared(s)),
               "l"(g), "r"(bytes), "r"((unsigned)__cvta_generic_to_shared(b))
               : "memory");
}
__device__ __forceinline__ void bulk_s2g(void* g, const void* s, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(g),
               "r"((unsigned)__cvta_generic_to_shared(s)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

__global__ void __launch_bounds__(32) tma_copy_kernel(const uint8_t* src, uint8_t* dst, size_t bytes) {
  extern __shared__ __align__(128) uint8_t sm[];
  __shared__ __align__(8) uint64_t bar[kStages];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < kStages; ++s) mbar_init(&bar[s], 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const size_t nchunks = bytes / kChunk;
  // chunk q of this CTA: blockIdx.x + q * gridDim.x
  size_t mine = nchunks > blockIdx.x ? (nchunks - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  size_t issued = 0, done = 0;
  unsigned phase[kStages] = {};
  while (done < mine) {
    while (issued < mine && issued - done < kStages) {
      const int s = issued % kStages;
      // the stage's previous store must have read smem before it is overwritten
      const size_t off = (blockIdx.x + issued * gridDim.x) * kChunk;
      mbar_expect_tx(&bar[s], kChunk);
      bulk_g2s(sm + s * kChunk, src + off, kChunk, &bar[s]);
      ++issued;
    }
    const int s = done % kStages;
    mbar_wait(&bar[s], phase[s]);
    phase[s] ^= 1;
    bulk_s2g(dst + (blockIdx.x + done * gridDim.x) * kChunk, sm + s * kChunk, kChunk);
    bulk_commit();
    ++done;
    bulk_wait_read<0>();  // simple: the smem of stage s is free again before it is refilled
  }
  bulk_wait_all();
}

struct Dev {
  uint8_t* a;  // source of transfers that start here
  uint8_t* b;  // destination of transfers that end here
  uint8_t* table;
  uint8_t* vtable;  // the same size, from cuMem (VMM) with both GPUs granted access
  uint32_t* idx;
  cudaStream_t st;
};

using Launch = void (*)(int dev, const Dev* d, int peer, int ctas, size_t bytes);

static Dev g_dev[2];

double run(Launch f, int dirs, int ctas, size_t bytes, int iters = 10) {
  for (int w = 0; w < 2; ++w)
    for (int i = 0; i < dirs; ++i) {
      CK(cudaSetDevice(i));
      f(i, g_dev, 1 - i, ctas, bytes);
    }
  for (int i = 0; i < 2; ++i) {
    CK(cudaSetDevice(i));
    CK(cudaStreamSynchronize(g_dev[i].st));
  }
  auto t0 = std::chrono::steady_clock::now();
  for (int it = 0; it < iters; ++it)
    for (int i = 0; i < dirs; ++i) {
      CK(cudaSetDevice(i));
      f(i, g_dev, 1 - i, ctas, bytes);
    }
  for (int i = 0; i < 2; ++i) {
    CK(cudaSetDevice(i));
    CK(cudaStreamSynchronize(g_dev[i].st));
  }
  CK(cudaGetLastError());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
  return bytes / s / 1e9;
}

// ---- the patterns; `dev` launches, the bytes move between dev and peer ----
void ce(int dev, const Dev* d, int peer, int, size_t bytes) {
  CK(cudaMemcpyPeerAsync(d[peer].b, peer, d[dev].a, dev, bytes, d[dev].st));
}
void sm_write(int dev, const Dev* d, int peer, int ctas, size_t bytes) {
  copy_kernel<8><<<ctas, kThreads, 0, d[dev].st>>>((const uint4*)d[dev].a, (uint4*)d[peer].b, bytes / 16);
}
void sm_read(int dev, const Dev* d, int peer, int ctas, size_t bytes) {
  copy_kernel<8><<<ctas, kThreads, 0, d[dev].st>>>((const uint4*)d[peer].a, (uint4*)d[dev].b, bytes / 16);
}
void gather256(int dev, const Dev* d, int peer, int ctas, size_t bytes) {
  rows_kernel<8, true><<<ctas, kThreads, 0, d[dev].st>>>((const uint4*)d[peer].table, (uint4*)d[dev].b, d[dev].idx,
                                                         bytes / 256);
}
void scatter256(int dev, const Dev* d, int peer, int ctas, size_t bytes) {
  rows_kernel<8, false><<<ctas, kThreads, 0, d[dev].st>>>((const uint4*)d[dev].a, (uint4*)d[peer].table, d[dev].idx,
                                                          bytes / 256);
}
void gather256v(int dev, const Dev* d, int peer, int ctas, size_t bytes) {
  gather_var_kernel<true, false><<<ctas, kThreads, 0, d[dev].st>>>((const uint4*)d[peer].table,
                                                                   (const uint4*)d[dev].table, (uint4*)d[dev].b,
                                                                   d[dev].idx, bytes / 256);
}
void gather256h(int dev, const Dev* d, int peer, int ctas, size_t bytes) {  // bytes = remote bytes
  gather_var_kernel<false, true><<<ctas, kThreads, 0, d[dev].st>>>((const uint4*)d[peer].table,
                                                                   (const uint4*)d[dev].table, (uint4*)d[dev].b,
                                                                   d[dev].idx, bytes / 128);
}
// Engram gather variants: half of the rows local; _s = rows from the first 128 MiB only; _v = cuMem tables.
constexpr uint32_t kSmallSpan = (128u << 20) / 256 - 1;
void gather256h_s(int dev, const Dev* d, int peer, int ctas, size_t bytes) {
  gather_var_kernel<false, true><<<ctas, kThreads, 0, d[dev].st>>>((const uint4*)d[peer].table,
                                                                   (const uint4*)d[dev].table, (uint4*)d[dev].b,
                                                                   d[dev].idx, bytes / 128, kSmallSpan);
}
void gather256h_v(int dev, const Dev* d, int peer, int ctas, size_t bytes) {
  gather_var_kernel<false, true><<<ctas, kThreads, 0, d[dev].st>>>((const uint4*)d[peer].vtable,
                                                                   (const uint4*)d[dev].vtable, (uint4*)d[dev].b,
                                                                   d[dev].idx, bytes / 128);
}
void gather256h_vs(int dev, const Dev* d, int peer, int ctas, size_t bytes) {
  gather_var_kernel<false, true><<<ctas, kThreads, 0, d[dev].st>>>((const uint4*)d[peer].vtable,
                                                                   (const uint4*)d[dev].vtable, (uint4*)d[dev].b,
                                                                   d[dev].idx, bytes / 128, kSmallSpan);
}

// The Engram kernel's batched structure (kernels/cuda/engram.cu gather_rows_batched) on the probe's data: a warp
// takes 32 rows; lane i resolves row base + i once (odd rows local, as above) and the warp moves the batch's
// 32 x 16 vectors with U loads in flight per lane, each vector's row pointer shuffled from its lane; the next
// batch's indices are loaded first. TPB threads per CTA.
template <int U>
__global__ void batched_kernel(const uint8_t* __restrict__ remote, const uint8_t* __restrict__ local,
                               uint4* __restrict__ dst, const uint32_t* __restrict__ idx, size_t rows) {
  const int lane = threadIdx.x & 31;
  const size_t nwarps = (static_cast<size_t>(gridDim.x) * blockDim.x) >> 5;
  const size_t step = nwarps * 32;
  size_t rb = ((static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5) * 32;
  auto source = [&](size_t r, uint32_t id) -> unsigned long long {
    if (r >= rows) return 0;
    return reinterpret_cast<unsigned long long>(((r & 1) ? local : remote) + size_t(id) * 256);
  };
  unsigned long long src = source(rb + lane, rb + lane < rows ? idx[rb + lane] : 0);
  for (; rb < rows; rb += step) {
    const size_t next = rb + step + lane;
    const uint32_t id_next = next < rows ? idx[next] : 0;
    const uint32_t total = static_cast<uint32_t>(rows - rb < 32 ? rows - rb : 32) * 16;
    uint4* out = dst + rb * 16;
    for (uint32_t q0 = 0; q0 < total; q0 += 32 * U) {
      uint4 v[U];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const uint32_t q = q0 + k * 32 + lane, r = q >> 4;
        const unsigned long long sp = __shfl_sync(0xffffffffu, src, r & 31);
        v[k] = make_uint4(0, 0, 0, 0);
        if (q < total && sp) v[k] = __ldcg(reinterpret_cast<const uint4*>(sp) + (q & 15));
      }
#pragma unroll
      for (int k = 0; k < U; ++k)
        if (q0 + k * 32 + lane < total) out[q0 + k * 32 + lane] = v[k];
    }
    src = source(next, id_next);
  }
}
template <int U, int TPB>
void batched(int dev, const Dev* d, int peer, int ctas, size_t bytes) {  // ctas = blocks per SM x 132
  batched_kernel<U><<<ctas, TPB, 0, d[dev].st>>>(d[peer].table, d[dev].table, (uint4*)d[dev].b, d[dev].idx,
                                                 bytes / 128);
}

// A cuMem allocation on `dev` (minimum granularity), mapped and readable / writable by both GPUs.
uint8_t* vmm_alloc(int dev, size_t bytes) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  static const auto granularity = driver_fn<decltype(&cuMemGetAllocationGranularity)>("cuMemGetAllocationGranularity");
  static const auto create = driver_fn<decltype(&cuMemCreate)>("cuMemCreate");
  static const auto reserve = driver_fn<decltype(&cuMemAddressReserve)>("cuMemAddressReserve");
  static const auto map = driver_fn<decltype(&cuMemMap)>("cuMemMap");
  static const auto set_access = driver_fn<decltype(&cuMemSetAccess)>("cuMemSetAccess");
  size_t gran = 0;
  CU(granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  bytes = (bytes + gran - 1) / gran * gran;
  CUmemGenericAllocationHandle h;
  CU(create(&h, bytes, &prop, 0));
  CUdeviceptr va = 0;
  CU(reserve(&va, bytes, 0, 0, 0));
  CU(map(va, bytes, 0, h, 0));
  CUmemAccessDesc acc[2] = {};
  for (int i = 0; i < 2; ++i) {
    acc[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc[i].location.id = i;
    acc[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  CU(set_access(va, bytes, acc, 2));
  return reinterpret_cast<uint8_t*>(va);
}

// ---- the copy-engine dispatch's pattern (ffi/handlers/cuda_ep.cc): x's rows into the peer's cuMem window, in P
// strided pieces (piece j = the same offsets of each of 24 token ranges), each followed by a flag write on the peer
// (cuStreamWriteValue64); `ctas` = P. Variants: plain 1D into cuMem, 1D pieces + flags, 2D pieces with / without
// flags, and 2D pieces + flags while 24 CTAs copy locally on the same GPU (the receivers' work).
constexpr int64_t kRow = 14336, kRanges = 24;
static cudaStream_t g_st2[2];
static cudaEvent_t g_ev2[2];
template <bool kTwoD, bool kFlags, bool kLocal>
void ce_pieces(int dev, const Dev* d, int peer, int P, size_t bytes) {
  static const auto write64 = driver_fn<decltype(&cuStreamWriteValue64)>("cuStreamWriteValue64");
  const int64_t rows = bytes / kRow, per = (rows + kRanges - 1) / kRanges;
  uint8_t* dst = d[peer].vtable;
  uint64_t* flag = reinterpret_cast<uint64_t*>(d[peer].vtable + (size_t(1) << 30) - 4096);
  if (kLocal) {
    CK(cudaEventRecord(g_ev2[dev], d[dev].st));
    CK(cudaStreamWaitEvent(g_st2[dev], g_ev2[dev], 0));
    copy_kernel<8><<<24, kThreads, 0, g_st2[dev]>>>((const uint4*)d[dev].table, (uint4*)(d[dev].table + 2 * bytes),
                                                   2 * bytes / 16);
  }
  for (int j = 0; j < P; ++j) {
    if (kTwoD) {
      const int64_t b0 = per * j / P, b1 = per * (j + 1) / P, full = std::min<int64_t>(kRanges, rows / per);
      if (b1 > b0)
        CK(cudaMemcpy2DAsync(dst + b0 * kRow, per * kRow, d[dev].a + b0 * kRow, per * kRow, (b1 - b0) * kRow, full,
                             cudaMemcpyDeviceToDevice, d[dev].st));
    } else {
      const size_t o0 = bytes / kRow * j / P * kRow, o1 = bytes / kRow * (j + 1) / P * kRow;
      CK(cudaMemcpyAsync(dst + o0, d[dev].a + o0, o1 - o0, cudaMemcpyDeviceToDevice, d[dev].st));
    }
    if (kFlags) CU(write64(reinterpret_cast<CUstream>(d[dev].st), reinterpret_cast<CUdeviceptr>(flag + j), j + 1, 0));
  }
  if (kLocal) {
    CK(cudaEventRecord(g_ev2[dev], g_st2[dev]));
    CK(cudaStreamWaitEvent(d[dev].st, g_ev2[dev], 0));
  }
}

// "mixed": the copy engine moves the first pct % of the bytes while `ctas` CTAs store the rest to the peer, both
// started together (a fork / join on a second stream): can the two engines together pass the copy engine alone?
static int g_mix_pct = 100, g_mix_ctas = 0;
static cudaEvent_t g_ev3[2];
void mixed(int dev, const Dev* d, int peer, int, size_t bytes) {
  const size_t ce_bytes = bytes * g_mix_pct / 100 / 4096 * 4096;
  CK(cudaEventRecord(g_ev2[dev], d[dev].st));
  CK(cudaStreamWaitEvent(g_st2[dev], g_ev2[dev], 0));
  if (ce_bytes) CK(cudaMemcpyPeerAsync(d[peer].b, peer, d[dev].a, dev, ce_bytes, g_st2[dev]));
  if (bytes > ce_bytes && g_mix_ctas > 0)
    copy_kernel<8><<<g_mix_ctas, kThreads, 0, d[dev].st>>>((const uint4*)(d[dev].a + ce_bytes),
                                                           (uint4*)(d[peer].b + ce_bytes), (bytes - ce_bytes) / 16);
  CK(cudaEventRecord(g_ev3[dev], g_st2[dev]));
  CK(cudaStreamWaitEvent(d[dev].st, g_ev3[dev], 0));
}
void local_copy24(int dev, const Dev* d, int, int, size_t bytes) {  // the local copy of ce_pieces<.., true> alone
  copy_kernel<8><<<24, kThreads, 0, d[dev].st>>>((const uint4*)d[dev].table, (uint4*)(d[dev].table + 2 * bytes),
                                                 2 * bytes / 16);
}

void tma_read(int dev, const Dev* d, int peer, int ctas, size_t bytes) {
  tma_copy_kernel<<<ctas, 32, kStages * kChunk, d[dev].st>>>(d[peer].a, d[dev].b, bytes);
}
void tma_write(int dev, const Dev* d, int peer, int ctas, size_t bytes) {
  tma_copy_kernel<<<ctas, 32, kStages * kChunk, d[dev].st>>>(d[dev].a, d[peer].b, bytes);
}

// Local fan-out (the expand dispatch's receiver side): every 14 KiB source row to kFan scattered rows of the same
// GPU. GB/s counts the bytes written. "lsu": a warp per row, 16-byte loads once, stores to every destination (the
// kernels' warp_copy); "tma": a warp per row, lane 0 loads it into the warp's shared-memory buffer with one
// cp.async.bulk and stores it with kFan bulk copies.
constexpr int kFanRow = 14336, kFan = 4;
__device__ __forceinline__ size_t fan_dst(size_t r, int j, size_t rows) { return (r * kFan + j) * 7919 % (rows * kFan); }

__global__ void __launch_bounds__(512) fan_lsu_kernel(const uint8_t* src, uint8_t* dst, size_t rows) {
  const int lane = threadIdx.x & 31;
  const size_t gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nw = (gridDim.x * blockDim.x) >> 5;
  constexpr int n = kFanRow / 16, U = 16;
  for (size_t r = gw; r < rows; r += nw) {
    const uint4* s = reinterpret_cast<const uint4*>(src + r * kFanRow);
    for (int base = 0; base < n; base += 32 * U) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (base + u * 32 + lane < n) v[u] = __ldcg(s + base + u * 32 + lane);
#pragma unroll
      for (int j = 0; j < kFan; ++j) {
        uint4* d = reinterpret_cast<uint4*>(dst + fan_dst(r, j, rows) * kFanRow);
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (base + u * 32 + lane < n) d[base + u * 32 + lane] = v[u];
      }
    }
  }
}

__global__ void __launch_bounds__(512) fan_tma_kernel(const uint8_t* src, uint8_t* dst, size_t rows) {
  extern __shared__ __align__(128) uint8_t sm[];
  __shared__ __align__(8) uint64_t bar[16];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane != 0) return;
  uint8_t* buf = sm + warp * kFanRow;
  mbar_init(&bar[warp], 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const size_t gw = blockIdx.x * (blockDim.x >> 5) + warp, nw = gridDim.x * (blockDim.x >> 5);
  unsigned phase = 0;
  for (size_t r = gw; r < rows; r += nw) {
    bulk_wait_read<0>();  // the previous row's stores have read the buffer
    mbar_expect_tx(&bar[warp], kFanRow);
    bulk_g2s(buf, src + r * kFanRow, kFanRow, &bar[warp]);
    mbar_wait(&bar[warp], phase);
    phase ^= 1;
    for (int j = 0; j < kFan; ++j) bulk_s2g(dst + fan_dst(r, j, rows) * kFanRow, buf, kFanRow);
    bulk_commit();
  }
  bulk_wait_all();
}

template <bool kTma>
void fanout(int dev, const Dev* d, int, int ctas, size_t bytes) {  // bytes: written
  const size_t rows = bytes / kFan / kFanRow;
  if (kTma)
    fan_tma_kernel<<<ctas, 512, 16 * kFanRow, d[dev].st>>>(d[dev].table, d[dev].b, rows);
  else
    fan_lsu_kernel<<<ctas, 512, 0, d[dev].st>>>(d[dev].table, d[dev].b, rows);
}

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? std::atol(argv[1]) : 256;
  const size_t bytes = mib << 20, table_bytes = size_t(1) << 30;
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  if (n < 2) {
    std::printf("probe_nvlink: needs 2 GPUs, found %d\n", n);
    return 0;
  }
  for (int i = 0; i < 2; ++i) {
    CK(cudaSetDevice(i));
    CK(cudaDeviceEnablePeerAccess(1 - i, 0));
    CK(cudaFuncSetAttribute(tma_copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kStages * kChunk));
    Dev& d = g_dev[i];
    CK(cudaMalloc(&d.a, bytes));
    CK(cudaMalloc(&d.b, std::max(bytes, table_bytes)));
    CK(cudaMalloc(&d.table, table_bytes));
    CK(cudaMalloc(&d.idx, bytes / 256 * 4));
    CK(cudaMemset(d.a, 1 + i, bytes));
    CK(cudaMemset(d.table, 3 + i, table_bytes));
    d.vtable = vmm_alloc(i, table_bytes);
    CK(cudaMemset(d.vtable, 5 + i, table_bytes));
    std::vector<uint32_t> h(bytes / 256);
    uint64_t x = 0x9e3779b97f4a7c15ull + i;
    for (auto& v : h) {
      x ^= x << 13; x ^= x >> 7; x ^= x << 17;
      v = static_cast<uint32_t>(x % (table_bytes / 256));
    }
    CK(cudaMemcpy(d.idx, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaStreamCreateWithFlags(&d.st, cudaStreamNonBlocking));
  }
  std::printf("probe_nvlink: %zu MiB per transfer, 2 GPUs, %d threads per CTA (SM kernels), TMA %d x %d KiB stages\n",
              mib, kThreads, kStages, kChunk / 1024);
  std::printf("%-11s %4s %5s %9s\n", "engine", "dirs", "ctas", "GB/s/dir");
  struct P { const char* name; Launch f; };
  if (argc > 2 && std::string(argv[2]) == "tma") {  // TMA bulk copies to / from the peer, beside CE and SM stores
    for (int dirs = 1; dirs <= 2; ++dirs) std::printf("%-11s %4d %5s %9.1f\n", "ce", dirs, "-", run(ce, dirs, 0, bytes));
    for (int dirs = 1; dirs <= 2; ++dirs) std::printf("%-11s %4d %5d %9.1f\n", "sm_write", dirs, 24, run(sm_write, dirs, 24, bytes));
    const P tv[] = {{"tma_write", tma_write}, {"tma_read", tma_read}};
    for (const P& p : tv)
      for (int dirs = 1; dirs <= 2; ++dirs)
        for (int c : {8, 16, 24, 32, 66}) {
          std::printf("%-11s %4d %5d %9.1f\n", p.name, dirs, c, run(p.f, dirs, c, bytes));
          std::fflush(stdout);
        }
    return 0;
  }
  if (argc > 2 && std::string(argv[2]) == "fanout") {  // bytes written, e.g. 448 (MiB): 8192 rows x 4 x 14 KiB
    for (int i = 0; i < 2; ++i) {
      CK(cudaSetDevice(i));
      CK(cudaFuncSetAttribute(fan_tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 16 * kFanRow));
    }
    const P fv[] = {{"fan_lsu", fanout<false>}, {"fan_tma", fanout<true>}};
    for (const P& p : fv)
      for (int c : {24, 32, 66, 132}) {
        std::printf("%-11s %4d %5d %9.1f   (GB/s written, one GPU)\n", p.name, 1, c, run(p.f, 1, c, bytes));
        std::fflush(stdout);
      }
    return 0;
  }
  if (argc > 2 && std::string(argv[2]) == "mixed") {  // e.g. 56 (MiB): a 4096-token dispatch's x
    for (int i = 0; i < 2; ++i) {
      CK(cudaSetDevice(i));
      CK(cudaStreamCreateWithFlags(&g_st2[i], cudaStreamNonBlocking));
      CK(cudaEventCreateWithFlags(&g_ev2[i], cudaEventDisableTiming));
      CK(cudaEventCreateWithFlags(&g_ev3[i], cudaEventDisableTiming));
    }
    std::printf("(mixed: ctas column = SM-store CTAs, then the copy engine's share in %%)\n");
    for (int dirs = 1; dirs <= 2; ++dirs)
      for (int c : {8, 16, 24})
        for (int pct : {100, 90, 80, 70, 60, 50, 0}) {
          g_mix_ctas = c;
          g_mix_pct = pct;
          std::printf("%-11s %4d %5d %9.1f   ce %d %%\n", "mixed", dirs, c, run(mixed, dirs, c, bytes), pct);
          std::fflush(stdout);
        }
    return 0;
  }
  if (argc > 2 && std::string(argv[2]) == "ce_dispatch") {  // bytes: e.g. 56 (MiB, 4096 rows of 14 KiB)
    for (int i = 0; i < 2; ++i) {
      CK(cudaSetDevice(i));
      CK(cudaStreamCreateWithFlags(&g_st2[i], cudaStreamNonBlocking));
      CK(cudaEventCreateWithFlags(&g_ev2[i], cudaEventDisableTiming));
    }
    for (int dirs = 1; dirs <= 2; ++dirs) std::printf("%-13s %4d %5s %9.1f\n", "ce", dirs, "-", run(ce, dirs, 0, bytes));
    const P cv[] = {{"ce_vmm_1d", ce_pieces<false, false, false>}, {"ce_vmm_1d_f", ce_pieces<false, true, false>},
                    {"ce_vmm_2d", ce_pieces<true, false, false>}, {"ce_vmm_2d_f", ce_pieces<true, true, false>},
                    {"ce_vmm_2d_f_loc", ce_pieces<true, true, true>}};
    std::printf("%-13s %4d %5d %9.1f   (24 CTAs copying 2x the bytes locally; GB/s of the CE-equivalent bytes)\n",
                "local_copy", 1, 24, run(local_copy24, 1, 24, bytes));
    std::printf("(ctas column = pieces)\n");
    for (const P& p : cv)
      for (int dirs = 1; dirs <= 2; ++dirs)
        for (int P : {1, 4, 8, 16}) {
          std::printf("%-15s %4d %5d %9.1f\n", p.name, dirs, P, run(p.f, dirs, P, bytes));
          std::fflush(stdout);
        }
    return 0;
  }
  if (argc > 2 && std::string(argv[2]) == "engram") {
    const P ev[] = {{"gather256h", gather256h}, {"gather256h_s", gather256h_s}, {"gather256h_v", gather256h_v},
                    {"gather256h_vs", gather256h_vs}};
    for (const P& p : ev)
      for (int dirs = 1; dirs <= 2; ++dirs)
        for (int c : {132, 528}) std::printf("%-13s %4d %5d %9.1f\n", p.name, dirs, c, run(p.f, dirs, c, bytes / 2));
    // the Engram kernel's structure: U loads in flight per lane, TPB threads per CTA, CTAs = blocks per SM x 132
    const P bv[] = {{"batched8x256", batched<8, 256>}, {"batched16x256", batched<16, 256>},
                    {"batched8x512", batched<8, 512>}, {"batched4x256", batched<4, 256>}};
    for (const P& p : bv)
      for (int c : {264, 528, 1056}) std::printf("%-13s %4d %5d %9.1f\n", p.name, 2, c, run(p.f, 2, c, bytes / 2));
    return 0;
  }
  for (int dirs = 1; dirs <= 2; ++dirs) std::printf("%-11s %4d %5s %9.1f\n", "ce", dirs, "-", run(ce, dirs, 0, bytes));
  const P pats[] = {{"sm_write", sm_write}, {"sm_read", sm_read}, {"gather256", gather256}};
  const int ctas[] = {8, 16, 24, 32, 66, 132};
  for (const P& p : pats)
    for (int dirs = 1; dirs <= 2; ++dirs)
      for (int c : ctas) std::printf("%-11s %4d %5d %9.1f\n", p.name, dirs, c, run(p.f, dirs, c, bytes));
  // Engram variants at full grid: volatile loads; half of the rows local (GB/s counts remote bytes only)
  const P vars[] = {{"gather256v", gather256v}, {"gather256h", gather256h}};
  for (const P& p : vars)
    for (int dirs = 1; dirs <= 2; ++dirs)
      for (int c : {132, 264, 528}) std::printf("%-11s %4d %5d %9.1f\n", p.name, dirs, c, run(p.f, dirs, c, bytes / 2));
  std::fflush(stdout);
  return 0;
}
