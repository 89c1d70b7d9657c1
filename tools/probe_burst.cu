// The latency floor of a small dispatch on two GPUs of one process: each GPU's kernel pushes B bytes of rows into
// the other GPU's memory with SM stores, fences (membar.sys), bumps a counter on the peer (release, one per CTA)
// and ends when it has seen every peer CTA's bump. Nothing else: no layout, no receiver copies. The per-call time of
// a loop of such kernels (both GPUs at once) is what a 128-token dispatch can reach at best with SM stores; the
// per-phase times say where a burst of that size spends it.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o probe_burst tools/probe_burst.cu && ./probe_burst [iters] [pipe]
// ("pipe": the skeleton of a latency dispatch with roles split over SMs, pipe_kernel below)
//
// Columns: G CTAs (512 threads) | W warps of each CTA that store | unit = bytes a warp moves at a time (a row is
// 14,336 bytes, hidden 7168 bf16; units are dealt round-robin over all storing warps) | MB pushed per direction |
// per call (us, loop of `iters` launches, event-timed) | medians over calls, us since the GPU's earliest CTA start:
// issued = last warp's stores issued, fenced = last warp's fence done, seen = CTA 0 saw every peer CTA's bump.
#include <cuda_runtime.h>

#include <algorithm>
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

constexpr int kThreads = 512;
constexpr size_t kRow = 14336;

__device__ __forceinline__ uint64_t gtimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

struct Args {
  const uint4* src;       // local rows
  uint4* dst;             // the peer's inbox
  unsigned long long* peer_ctr;  // on the peer: bumped once per CTA per call
  unsigned long long* own_ctr;   // here: the peer's CTAs bump it
  unsigned long long* ts;        // [iters][G][3]: start, issued, fenced
  unsigned long long* seen;      // [iters]
  int* err;
  size_t bytes, unit;
  int W, peer_ctas, it;
  unsigned long long seq;
};

template <bool kLoad>
__global__ void __launch_bounds__(kThreads, 1) burst_kernel(Args a) {
  __shared__ unsigned long long sh_start, sh_issued, sh_fenced;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, G = gridDim.x, c = blockIdx.x;
  if (tid == 0) {
    sh_start = gtimer();
    sh_issued = 0;
    sh_fenced = 0;
  }
  __syncthreads();
  if (warp < a.W && a.bytes > 0) {
    const size_t units = (a.bytes + a.unit - 1) / a.unit, nw = static_cast<size_t>(G) * a.W;
    const size_t vec_per_unit = a.unit / 16;
    for (size_t u = static_cast<size_t>(c) * a.W + warp; u < units; u += nw) {
      const size_t v0 = u * vec_per_unit, v1 = min(static_cast<unsigned long long>(v0 + vec_per_unit), static_cast<unsigned long long>(a.bytes / 16));
      for (size_t base = v0; base < v1; base += 32 * 16) {
        uint4 v[16];
#pragma unroll
        for (int k = 0; k < 16; ++k) {
          const size_t i = base + k * 32 + lane;
          if (i < v1) v[k] = kLoad ? __ldcg(a.src + i) : make_uint4(i, k, lane, 1);
        }
#pragma unroll
        for (int k = 0; k < 16; ++k) {
          const size_t i = base + k * 32 + lane;
          if (i < v1) a.dst[i] = v[k];
        }
      }
    }
    if (lane == 0) atomicMax(&sh_issued, gtimer());
    __threadfence_system();
    if (lane == 0) atomicMax(&sh_fenced, gtimer());
  }
  __syncthreads();
  if (tid == 0) {
    asm volatile("red.release.sys.global.add.u64 [%0], 1;" ::"l"(a.peer_ctr) : "memory");
    unsigned long long* t = a.ts + (static_cast<size_t>(a.it) * G + c) * 3;
    t[0] = sh_start;
    t[1] = sh_issued;
    t[2] = sh_fenced;
  }
  if (c == 0 && tid == 0) {
    const unsigned long long want = a.seq * a.peer_ctas;
    unsigned long long v = 0;
    for (long long n = 0; n < (1ll << 28); ++n) {
      asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(a.own_ctr) : "memory");
      if (v >= want) break;
    }
    if (v < want) atomicExch(a.err, 1);
    a.seen[a.it] = gtimer();
  }
}


// The shape of a latency dispatch with roles split over SMs: Gp pusher CTAs store the rows into the peer's inbox
// (fence, one bump each on the peer's data counter); one control CTA stores 8 KB of routing rows to the peer at
// once (fence, bump on the peer's control counter) and waits for the peer's (ctl_seen); Gr receiver CTAs (and the
// pushers after their push when `join`) first copy the own rows locally (x -> out, their share), then wait for every
// peer pusher's bump (data_seen) and copy their share of the inbox out (copied). Per CTA: start, ctl_seen,
// data_seen, copied.
struct PipeArgs {
  const uint4* src;
  uint4* dst;      // the peer's inbox
  const uint4* inbox;  // own inbox
  uint4* out;      // local output [2 x bytes]: own rows, then the peer's
  unsigned long long *peer_data, *own_data, *peer_ctl, *own_ctl;
  uint4* peer_ctl_rows;
  unsigned long long* ts;  // [iters][G][4]
  int* err;
  size_t bytes;
  int Gp, join, it;
  unsigned long long seq;
};

__device__ __forceinline__ bool poll_ge(unsigned long long* p, unsigned long long want) {
  unsigned long long v = 0;
  for (long long n = 0; n < (1ll << 27); ++n) {
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    if (v >= want) return true;
  }
  return false;
}

// Warps [w0, w0 + nw) of the grid move vectors [0, n) src -> dst, 16 vectors in flight per lane.
__device__ __forceinline__ void grid_copy(const uint4* src, uint4* dst, size_t n, size_t gw, size_t nw, int lane) {
  for (size_t base = gw * 512; base < n; base += nw * 512) {
    uint4 v[16];
#pragma unroll
    for (int k = 0; k < 16; ++k)
      if (base + k * 32 + lane < n) v[k] = __ldcg(src + base + k * 32 + lane);
#pragma unroll
    for (int k = 0; k < 16; ++k)
      if (base + k * 32 + lane < n) dst[base + k * 32 + lane] = v[k];
  }
}

__global__ void __launch_bounds__(kThreads, 1) pipe_kernel(PipeArgs a) {
  __shared__ unsigned long long sh_t[4];
  __shared__ int sh_fail;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, G = gridDim.x, c = blockIdx.x;
  if (tid == 0) {
    sh_t[0] = gtimer();
    sh_t[1] = sh_t[2] = sh_t[3] = 0;
    sh_fail = 0;
  }
  __syncthreads();
  const size_t n = a.bytes / 16;
  const bool pusher = c < a.Gp, control = c == a.Gp, receiver = !pusher || a.join;
  if (pusher) {
    grid_copy(a.src, a.dst, n, static_cast<size_t>(c) * 16 + warp, static_cast<size_t>(a.Gp) * 16, lane);
    __threadfence_system();
    __syncthreads();
    if (tid == 0) asm volatile("red.release.sys.global.add.u64 [%0], 1;" ::"l"(a.peer_data) : "memory");
  }
  if (control) {
    a.peer_ctl_rows[tid] = make_uint4(tid, 1, 2, 3);  // 8 KB
    __threadfence_system();
    __syncthreads();
    if (tid == 0) {
      asm volatile("red.release.sys.global.add.u64 [%0], 1;" ::"l"(a.peer_ctl) : "memory");
      if (!poll_ge(a.own_ctl, a.seq)) sh_fail = 1;
      sh_t[1] = gtimer();
    }
  }
  if (receiver) {
    const int r0 = a.join ? 0 : a.Gp, nr = G - r0;  // receiver index among the receivers
    const size_t rw = static_cast<size_t>(c - r0) * 16 + warp, nrw = static_cast<size_t>(nr) * 16;
    grid_copy(a.src, a.out, n, rw, nrw, lane);  // own rows
    __syncthreads();
    if (tid == 0) {
      if (!poll_ge(a.own_data, a.seq * a.Gp)) sh_fail = 1;
      sh_t[2] = gtimer();
    }
    __syncthreads();
    grid_copy(a.inbox, a.out + n, n, rw, nrw, lane);
    __syncthreads();
    if (tid == 0) sh_t[3] = gtimer();
  }
  if (tid == 0) {
    if (sh_fail) atomicExch(a.err, 1);
    unsigned long long* t = a.ts + (static_cast<size_t>(a.it) * G + c) * 4;
    for (int k = 0; k < 4; ++k) t[k] = sh_t[k];
  }
}

struct Dev {
  uint4 *src, *inbox;
  unsigned long long *ctr, *ctl, *ts, *seen;
  uint4 *out, *ctl_rows;
  int* err;
  cudaStream_t st;
  cudaEvent_t e0, e1;
};

static Dev g[2];
static unsigned long long g_seq = 0;

static double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

static void run(int G, int W, size_t unit, size_t bytes, bool load, bool coop, int iters) {
  const int warm = 10;
  for (int i = 0; i < 2; ++i) {
    CK(cudaSetDevice(i));
    CK(cudaMemset(g[i].ctr, 0, 8));
    CK(cudaDeviceSynchronize());
  }
  g_seq = 0;
  for (int it = 0; it < warm + iters; ++it) {
    ++g_seq;
    for (int i = 0; i < 2; ++i) {
      CK(cudaSetDevice(i));
      if (it == warm) CK(cudaEventRecord(g[i].e0, g[i].st));
      Args a{g[i].src, g[1 - i].inbox, g[1 - i].ctr, g[i].ctr, g[i].ts, g[i].seen, g[i].err, bytes, unit, W, G, it,
             g_seq};
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(G);
      cfg.blockDim = dim3(kThreads);
      cfg.stream = g[i].st;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeCooperative;
      attr[0].val.cooperative = coop ? 1 : 0;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      if (load) CK(cudaLaunchKernelEx(&cfg, burst_kernel<true>, a));
      else CK(cudaLaunchKernelEx(&cfg, burst_kernel<false>, a));
    }
  }
  double per_call[2];
  std::vector<double> issued, fenced, seen, gapv;
  for (int i = 0; i < 2; ++i) {
    CK(cudaSetDevice(i));
    CK(cudaEventRecord(g[i].e1, g[i].st));
    CK(cudaStreamSynchronize(g[i].st));
    int err = 0;
    CK(cudaMemcpy(&err, g[i].err, 4, cudaMemcpyDeviceToHost));
    if (err) {
      std::printf("probe_burst: a wait timed out\n");
      std::exit(1);
    }
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, g[i].e0, g[i].e1));
    per_call[i] = ms * 1e3 / iters;
    std::vector<unsigned long long> ts(static_cast<size_t>(warm + iters) * G * 3), sn(warm + iters);
    CK(cudaMemcpy(ts.data(), g[i].ts, ts.size() * 8, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(sn.data(), g[i].seen, sn.size() * 8, cudaMemcpyDeviceToHost));
    unsigned long long prev_end = 0;
    for (int it = warm; it < warm + iters; ++it) {
      unsigned long long s0 = ~0ull, is = 0, fe = 0;
      for (int c = 0; c < G; ++c) {
        const unsigned long long* t = &ts[(static_cast<size_t>(it) * G + c) * 3];
        s0 = std::min(s0, t[0]);
        is = std::max(is, t[1]);
        fe = std::max(fe, t[2]);
      }
      if (bytes > 0) {
        issued.push_back((is - s0) * 1e-3);
        fenced.push_back((fe - s0) * 1e-3);
      }
      seen.push_back((sn[it] - s0) * 1e-3);
      if (prev_end) gapv.push_back((static_cast<double>(s0) - static_cast<double>(prev_end)) * 1e-3);
      prev_end = sn[it];
    }
  }
  std::printf("%4d %3d %6zu %6.2f %5s %4s %8.1f %7.1f %7.1f %7.1f %7.1f\n", G, W, unit, bytes / 1e6, load ? "ld" : "reg",
              coop ? "coop" : "-", 0.5 * (per_call[0] + per_call[1]), median(issued), median(fenced), median(seen),
              median(gapv));
  std::fflush(stdout);
}


static void run_pipe(int Gp, int Gr, int join, size_t bytes, int iters) {
  const int warm = 10, G = Gp + Gr;
  for (int i = 0; i < 2; ++i) {
    CK(cudaSetDevice(i));
    CK(cudaMemset(g[i].ctr, 0, 8));
    CK(cudaMemset(g[i].ctl, 0, 8));
    CK(cudaDeviceSynchronize());
  }
  unsigned long long seq = 0;
  for (int it = 0; it < warm + iters; ++it) {
    ++seq;
    for (int i = 0; i < 2; ++i) {
      CK(cudaSetDevice(i));
      if (it == warm) CK(cudaEventRecord(g[i].e0, g[i].st));
      PipeArgs a{g[i].src, g[1 - i].inbox, g[i].inbox, g[i].out, g[1 - i].ctr, g[i].ctr, g[1 - i].ctl, g[i].ctl,
                 g[1 - i].ctl_rows, g[i].ts, g[i].err, bytes, Gp, join, it, seq};
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(G);
      cfg.blockDim = dim3(kThreads);
      cfg.stream = g[i].st;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeCooperative;
      attr[0].val.cooperative = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      CK(cudaLaunchKernelEx(&cfg, pipe_kernel, a));
    }
  }
  double per_call = 0;
  std::vector<double> ctl, data, copied;
  for (int i = 0; i < 2; ++i) {
    CK(cudaSetDevice(i));
    CK(cudaEventRecord(g[i].e1, g[i].st));
    CK(cudaStreamSynchronize(g[i].st));
    int err = 0;
    CK(cudaMemcpy(&err, g[i].err, 4, cudaMemcpyDeviceToHost));
    if (err) {
      std::printf("probe_burst: a wait timed out\n");
      std::exit(1);
    }
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, g[i].e0, g[i].e1));
    per_call += 0.5 * ms * 1e3 / iters;
    std::vector<unsigned long long> ts(static_cast<size_t>(warm + iters) * G * 4);
    CK(cudaMemcpy(ts.data(), g[i].ts, ts.size() * 8, cudaMemcpyDeviceToHost));
    for (int it = warm; it < warm + iters; ++it) {
      unsigned long long s0 = ~0ull, cs = 0, ds = 0, cp = 0;
      for (int c = 0; c < G; ++c) {
        const unsigned long long* t = &ts[(static_cast<size_t>(it) * G + c) * 4];
        s0 = std::min(s0, t[0]);
        cs = std::max(cs, t[1]);
        ds = std::max(ds, t[2]);
        cp = std::max(cp, t[3]);
      }
      ctl.push_back((cs - s0) * 1e-3);
      data.push_back((ds - s0) * 1e-3);
      copied.push_back((cp - s0) * 1e-3);
    }
  }
  std::printf("pipe Gp %3d Gr %3d join %d  MB %5.2f  percall %6.1f  ctl_seen %5.1f  data_seen %5.1f  copied %5.1f\n",
              Gp, Gr, join, bytes / 1e6, per_call, median(ctl), median(data), median(copied));
  std::fflush(stdout);
}

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 200;
  const bool pipe = argc > 2 && std::string(argv[2]) == "pipe";
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  if (n < 2) {
    std::printf("probe_burst: needs 2 GPUs, found %d\n", n);
    return 0;
  }
  const size_t max_bytes = 512 * kRow;
  for (int i = 0; i < 2; ++i) {
    CK(cudaSetDevice(i));
    CK(cudaDeviceEnablePeerAccess(1 - i, 0));
    CK(cudaMalloc(&g[i].src, max_bytes));
    CK(cudaMalloc(&g[i].inbox, max_bytes));
    CK(cudaMemset(g[i].src, 1 + i, max_bytes));
    CK(cudaMalloc(&g[i].ctr, 8));
    CK(cudaMalloc(&g[i].ctl, 8));
    CK(cudaMalloc(&g[i].out, 2 * max_bytes));
    CK(cudaMalloc(&g[i].ctl_rows, kThreads * 16));
    CK(cudaMalloc(&g[i].ts, static_cast<size_t>(iters + 10) * 132 * 4 * 8));
    CK(cudaMalloc(&g[i].seen, static_cast<size_t>(iters + 10) * 8));
    CK(cudaMalloc(&g[i].err, 4));
    CK(cudaMemset(g[i].err, 0, 4));
    CK(cudaStreamCreateWithFlags(&g[i].st, cudaStreamNonBlocking));
    CK(cudaEventCreate(&g[i].e0));
    CK(cudaEventCreate(&g[i].e1));
  }
  std::printf("probe_burst: both GPUs push to each other at once; %d calls per line; rows of %zu bytes\n", iters, kRow);
  std::printf("%4s %3s %6s %6s %5s %4s %8s %7s %7s %7s %7s\n", "G", "W", "unit", "MB", "src", "lnch", "percall",
              "issued", "fenced", "seen", "gap");
  const size_t b128 = 128 * kRow;
  if (pipe) {  // the role-split latency dispatch's skeleton, 128 rows each way
    for (int join : {0, 1})
      for (int Gp : {4, 8, 12, 16}) run_pipe(Gp, 24 - Gp, join, b128, iters);
    run_pipe(24, 1, 1, b128, iters);
    run_pipe(8, 24, 0, b128, iters);
    run_pipe(8, 24, 1, b128, iters);
    run_pipe(16, 48, 1, b128, iters);
    for (size_t rows : {32, 64, 256}) run_pipe(8, 16, 1, rows * kRow, iters);
    return 0;
  }
  // the floor without data: a flag each way
  for (int G : {1, 24, 132}) run(G, 16, kRow, 0, true, true, iters);
  run(24, 16, kRow, 0, true, false, iters);
  // 128 rows: SMs, storing warps, unit size, register source
  for (int G : {8, 24, 66, 132})
    for (int W : {6, 16})
      for (size_t unit : {kRow, kRow / 4, size_t(1024)}) run(G, W, unit, b128, true, true, iters);
  for (int G : {24, 132}) run(G, 16, kRow / 4, b128, false, true, iters);
  // size scaling at 24 and 132 CTAs
  for (int G : {24, 132})
    for (size_t rows : {1, 8, 32, 64, 256, 512}) run(G, 16, kRow / 4, rows * kRow, true, true, iters);
  return 0;
}
