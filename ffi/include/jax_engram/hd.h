// Host/device qualifiers so one header serves the C++ CPU backend and the CUDA kernels.
#pragma once
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define JE_HD __host__ __device__ __forceinline__
#define JE_DEVICE __device__ __forceinline__
#else
#define JE_HD inline
#endif

namespace jax_engram {

JE_HD constexpr uint64_t align_up(uint64_t x, uint64_t a) { return a == 0 ? x : (x + a - 1) / a * a; }
JE_HD constexpr int64_t ceil_div(int64_t x, int64_t a) { return (x + a - 1) / a; }

}  // namespace jax_engram
