// What a given number of SMs can reach for EP combine's source-side sum on ONE GPU: out[t] = bf16(f32(a[t]) +
// f32(b[t])) over 4096 tokens of 7168 bf16 (DeepEP's combine shape at 2 ranks: one own row and one row pushed by
// the peer), one token per warp at a time, tokens handed out by an atomic counter as in the combine kernel.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o probe_reduce tools/probe_reduce.cu && ./probe_reduce
//
// Variants: "reg U" = U 16-byte loads per lane per source in registers, then the sum; "ring S" = the combine
// kernel's cp.async ring of S 1 KB slots per warp; "copy U" = out[t] = a[t] (one source, for scale). GB/s counts
// every byte read or written once (3 rows per token for sums, 2 for copies), per SM = that / CTAs.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

constexpr int kTokens = 4096, kRowBytes = 7168 * 2, kUnits = kRowBytes / 16;

__device__ int g_next;

__device__ __forceinline__ void add8(float (&a)[8], const uint4& v) {
  const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
  for (int q = 0; q < 8; ++q) a[q] += __bfloat162float(e[q]);
}
__device__ __forceinline__ uint4 pack8(const float (&a)[8]) {
  uint4 v;
  __nv_bfloat16* e = reinterpret_cast<__nv_bfloat16*>(&v);
#pragma unroll
  for (int q = 0; q < 8; ++q) e[q] = __float2bfloat16_rn(a[q]);
  return v;
}

__device__ __forceinline__ int next_token(int lane) {
  int t = 0;
  if (lane == 0) t = atomicAdd(&g_next, 1);
  return __shfl_sync(0xffffffffu, t, 0);
}

template <int U, bool kSum>
__global__ void __launch_bounds__(512, 1) reg_kernel(const uint4* a, const uint4* b, uint4* out) {
  const int lane = threadIdx.x & 31;
  for (int t = next_token(lane); t < kTokens; t = next_token(lane)) {
    const uint4* pa = a + static_cast<size_t>(t) * kUnits;
    const uint4* pb = b + static_cast<size_t>(t) * kUnits;
    uint4* po = out + static_cast<size_t>(t) * kUnits;
    for (int base = 0; base < kUnits; base += 32 * U) {
      uint4 va[U], vb[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * 32 + lane;
        va[u] = i < kUnits ? __ldcg(pa + i) : uint4{};
        if (kSum) vb[u] = i < kUnits ? __ldcg(pb + i) : uint4{};
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * 32 + lane;
        if (i >= kUnits) continue;
        if (!kSum) {
          po[i] = va[u];
          continue;
        }
        float acc[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] = -0.0f;
        add8(acc, va[u]);
        add8(acc, vb[u]);
        po[i] = pack8(acc);
      }
    }
  }
}

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gsrc) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(gsrc) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// The combine kernel's ring: items (slice, term), 2 x 16 B per lane per 1 KB slot, S - 1 items in flight.
template <int S>
__global__ void __launch_bounds__(512, 1) ring_kernel(const uint4* a, const uint4* b, uint4* out) {
  extern __shared__ uint4 smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint4* ring = smem + warp * S * 64;
  constexpr int nslices = (kUnits + 63) / 64, total = nslices * 2;
  for (int t = next_token(lane); t < kTokens; t = next_token(lane)) {
    const uint4* src[2] = {a + static_cast<size_t>(t) * kUnits, b + static_cast<size_t>(t) * kUnits};
    uint4* po = out + static_cast<size_t>(t) * kUnits;
    auto issue = [&](int item) {
      if (item < total) {
        const int sl = item >> 1, q = item & 1;
        uint4* slot = ring + (item % S) * 64;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int i = sl * 64 + u * 32 + lane;
          if (i < kUnits) cp_async16(slot + u * 32 + lane, src[q] + i);
        }
      }
      cp_commit();
    };
#pragma unroll 1
    for (int i = 0; i < S; ++i) issue(i);
    float acc[2][8];
#pragma unroll 1
    for (int item = 0; item < total; ++item) {
      cp_wait<S - 1>();
      const int sl = item >> 1, q = item & 1;
      const uint4* slot = ring + (item % S) * 64;
      if (q == 0)
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[u][e] = -0.0f;
#pragma unroll
      for (int u = 0; u < 2; ++u) add8(acc[u], slot[u * 32 + lane]);
      if (q == 1)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int i = sl * 64 + u * 32 + lane;
          if (i < kUnits) po[i] = pack8(acc[u]);
        }
      issue(item + S);
    }
    cp_wait<0>();
  }
}

// The combine kernel's warp_reduce_async as it is (noinline, terms table in shared memory, runtime term count).
template <int S>
__device__ __noinline__ void reduce_async_dyn(uint8_t* out, const uint8_t* const* terms, int nterms, int64_t nbytes,
                                              uint4* ring, int lane) {
  const int64_t n = nbytes / 16;
  const int nslices = static_cast<int>((n + 63) / 64);
  const int total = nslices * nterms;
  auto issue = [&](int item) {
    if (item < total) {
      const int sl = item / nterms, q = item % nterms;
      const uint4* src = reinterpret_cast<const uint4*>(terms[q]);
      uint4* slot = ring + (item % S) * 64;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int64_t idx = static_cast<int64_t>(sl) * 64 + u * 32 + lane;
        if (idx < n) cp_async16(slot + u * 32 + lane, src + idx);
      }
    }
    cp_commit();
  };
#pragma unroll 1
  for (int i = 0; i < S; ++i) issue(i);
  float acc[2][8];
#pragma unroll 1
  for (int item = 0; item < total; ++item) {
    cp_wait<S - 1>();
    const int sl = item / nterms, q = item % nterms;
    const uint4* slot = ring + (item % S) * 64;
    if (q == 0)
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[u][e] = -0.0f;
#pragma unroll
    for (int u = 0; u < 2; ++u) add8(acc[u], slot[u * 32 + lane]);
    if (q == nterms - 1)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int64_t idx = static_cast<int64_t>(sl) * 64 + u * 32 + lane;
        if (idx < n) reinterpret_cast<uint4*>(out)[idx] = pack8(acc[u]);
      }
    issue(item + S);
  }
  cp_wait<0>();
}

template <int S>
__global__ void __launch_bounds__(512, 1) ring_dyn_kernel(const uint4* a, const uint4* b, uint4* out) {
  extern __shared__ uint4 smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint4* ring = smem + warp * (S * 64 + 18);  // + the terms table (36 pointers), as in the combine kernel
  const uint8_t** terms = reinterpret_cast<const uint8_t**>(ring + S * 64);
  for (int t = next_token(lane); t < kTokens; t = next_token(lane)) {
    __syncwarp();
    if (lane == 0) {
      terms[0] = reinterpret_cast<const uint8_t*>(a + static_cast<size_t>(t) * kUnits);
      terms[1] = reinterpret_cast<const uint8_t*>(b + static_cast<size_t>(t) * kUnits);
    }
    __syncwarp();
    reduce_async_dyn<S>(reinterpret_cast<uint8_t*>(out + static_cast<size_t>(t) * kUnits), terms, 2, kRowBytes, ring,
                        lane);
  }
}

template <typename K>
float run(K kernel, int ctas, int threads, int smem, const uint4* a, const uint4* b, uint4* o) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const int zero = 0;
  float best = 1e30f;
  for (int it = 0; it < 6; ++it) {
    CK(cudaMemcpyToSymbol(g_next, &zero, sizeof(int)));
    CK(cudaEventRecord(e0));
    kernel<<<ctas, threads, smem>>>(a, b, o);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (it > 0 && ms < best) best = ms;
  }
  CK(cudaGetLastError());
  return best * 1e3f;
}

int main() {
  uint4 *a, *b, *o;
  const size_t bytes = static_cast<size_t>(kTokens) * kRowBytes;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMalloc(&o, bytes));
  CK(cudaMemset(a, 0x3c, bytes));
  CK(cudaMemset(b, 0x3d, bytes));
  std::printf("probe_reduce: %d tokens x %d B, bf16 sum of 2 rows (copy: 1 row), one token per warp, best of 5\n",
              kTokens, kRowBytes);
  std::printf("%-8s %4s %7s %8s %9s %10s %12s\n", "variant", "U/S", "threads", "ctas", "us", "GB/s", "GB/s per SM");
  auto line = [&](const char* name, int us_, int threads, int ctas, float us, int rows) {
    const double gb = static_cast<double>(rows) * bytes / (us * 1e3);
    std::printf("%-8s %4d %7d %8d %9.1f %10.1f %12.1f\n", name, us_, threads, ctas, us, gb, gb / ctas);
  };
  {  // one warp alone: the time of one token's sum (latency-bound)
    const int sm = 8 * 1024 + 288;
    CK(cudaFuncSetAttribute(ring_dyn_kernel<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, sm));
    const float us = run(ring_dyn_kernel<8>, 1, 32, sm, a, b, o);
    std::printf("one warp, ringdyn 8: %.2f us per token\n", us / kTokens);
    const float ur = run(reg_kernel<2, true>, 1, 32, 0, a, b, o);
    std::printf("one warp, reg 2: %.2f us per token\n", ur / kTokens);
  }
  for (int ctas : {24, 48, 132})
    for (int threads : {512, 256}) {
      line("reg", 2, threads, ctas, run(reg_kernel<2, true>, ctas, threads, 0, a, b, o), 3);
      line("reg", 4, threads, ctas, run(reg_kernel<4, true>, ctas, threads, 0, a, b, o), 3);
      line("reg", 8, threads, ctas, run(reg_kernel<8, true>, ctas, threads, 0, a, b, o), 3);
      for (int s : {4, 8}) {
        const int sm = (threads / 32) * s * 1024;
        auto k = s == 4 ? ring_kernel<4> : ring_kernel<8>;
        CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, sm));
        line("ring", s, threads, ctas, run(k, ctas, threads, sm, a, b, o), 3);
      }
      {
        const int sm = (threads / 32) * (8 * 1024 + 288);
        CK(cudaFuncSetAttribute(ring_dyn_kernel<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, sm));
        line("ringdyn", 8, threads, ctas, run(ring_dyn_kernel<8>, ctas, threads, sm, a, b, o), 3);
      }
      line("copy", 4, threads, ctas, run(reg_kernel<4, false>, ctas, threads, 0, a, b, o), 2);
    }
  return 0;
}
