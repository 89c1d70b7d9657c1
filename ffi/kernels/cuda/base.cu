// Foundation kernels: the 1-CTA barrier and a copy kernel for window regions (own or a peer's).
#include <algorithm>

#include "kernels/cuda/base.h"
#include "kernels/cuda/sync.cuh"

namespace jax_engram {
namespace {

__global__ void barrier_kernel(SyncArgs s) { cuda::barrier_block(s); }

JE_DEVICE uint4 ld_volatile_v4(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// Grid-stride copy; 16-byte vectors when both pointers allow. kRemote: volatile (relaxed.sys) loads. kPublish:
// a system fence after the stores (see CopyFlags in base.h).
template <bool kRemote, bool kPublish>
__global__ void copy_kernel(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, uint64_t n) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t tid = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint64_t head = 0;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
    const uint64_t nv = n / 16;
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    for (uint64_t i = tid; i < nv; i += stride) d4[i] = kRemote ? ld_volatile_v4(s4 + i) : s4[i];
    head = nv * 16;
  }
  for (uint64_t i = head + tid; i < n; i += stride)
    dst[i] = kRemote ? *reinterpret_cast<const volatile uint8_t*>(src + i) : src[i];
  if (kPublish) __threadfence_system();
}

template <bool kRemote, bool kPublish>
cudaError_t copy_attributes(cudaFuncAttributes* attr) {
  return cudaFuncGetAttributes(attr, copy_kernel<kRemote, kPublish>);
}

}  // namespace

cudaError_t launch_barrier(const SyncArgs& s, cudaStream_t stream) {
  if (!s.peers || !s.own || s.nranks < 1) return cudaErrorInvalidValue;
  const int threads = std::min(1024, std::max(32, (s.nranks + 31) / 32 * 32));
  barrier_kernel<<<1, threads, 0, stream>>>(s);
  return cudaGetLastError();
}

cudaError_t launch_barrier(Member& m, cudaStream_t stream, int32_t op) {
  return launch_barrier(make_sync_args(m, op), stream);
}

cudaError_t launch_copy(void* dst, const void* src, uint64_t n, unsigned flags, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const uint64_t work = (n + 15) / 16;
  const unsigned blocks = static_cast<unsigned>(std::min<uint64_t>((work + kThreads - 1) / kThreads, 1024));
  auto* d = static_cast<uint8_t*>(dst);
  auto* s = static_cast<const uint8_t*>(src);
  const bool remote = flags & kCopySrcRemote, publish = flags & kCopyPublish;
  if (remote && publish) {
    copy_kernel<true, true><<<blocks, kThreads, 0, stream>>>(d, s, n);
  } else if (remote) {
    copy_kernel<true, false><<<blocks, kThreads, 0, stream>>>(d, s, n);
  } else if (publish) {
    copy_kernel<false, true><<<blocks, kThreads, 0, stream>>>(d, s, n);
  } else {
    copy_kernel<false, false><<<blocks, kThreads, 0, stream>>>(d, s, n);
  }
  return cudaGetLastError();
}

cudaError_t kernels_loadable(int device) {
  int cur = -1;
  cudaError_t e = cudaGetDevice(&cur);
  if (e != cudaSuccess) return e;
  if (cur != device) return cudaErrorInvalidDevice;  // callers set the device first
  cudaFuncAttributes attr{};
  e = cudaFuncGetAttributes(&attr, barrier_kernel);
  if (e == cudaSuccess) e = copy_attributes<true, true>(&attr);
  if (e == cudaSuccess) e = copy_attributes<true, false>(&attr);
  if (e == cudaSuccess) e = copy_attributes<false, true>(&attr);
  if (e == cudaSuccess) e = copy_attributes<false, false>(&attr);
  if (e != cudaSuccess) cudaGetLastError();
  return e;
}

}  // namespace jax_engram
