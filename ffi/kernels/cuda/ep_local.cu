// The one-rank local path's row scatter (jax_engram/_ep_local.py, expand layout; ep.h EpLocalScatterParams): every
// token's row is read from HBM once and written to each of its receive rows, and the rows no entry fills are zeroed.
// A gather of the receive rows (one read of x per written row) reads each token's row K times, and x is larger than
// L2 at the shapes where bandwidth matters, so the scatter moves (1 + K) rows per token where the gather moves 2K.
//
// Grid: CTAs [0, N) are tokens (each copies its row, in 16-byte words where the row allows, to its destinations);
// the CTAs after them take kZeroRowsPerCta receive rows each and zero those no token writes. Row r belongs to token
// src[r] when that token lists r among its destinations, and is zeroed otherwise; a token CTA writes only the rows
// that belong to it. So every row has exactly one writer, and the result is the CPU kernel's, whatever dest and src
// hold (a handle's metadata rebuilds them; a layout made from the routing always has them agree).
#include <cstdint>

#include "kernels/cuda/ep.h"

namespace jax_engram {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kZeroRowsPerCta = 8;

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
