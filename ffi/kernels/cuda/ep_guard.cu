// The guard of the one-rank local path (jax_engram/_ep_local.py) on CUDA: the dispatch kernel's routing check
// (ep_dispatch.cu, layout pass 1) without the dispatch. ONE CTA, one thread per token and round; each thread loads its
// token's K ids into registers, writes them to topk_out (the copy the local path computes the layout from) and finds
// its first bad k: an id outside [-1, E), or a valid id an earlier k of the token holds. The smallest
// (token << 6 | k) over all tokens is the first bad entry in (token, k) order, the entry the dispatch kernel
// records; thread 0 records it exactly as the dispatch kernel records its own rank's bad entry (kErrBadInput,
// kOpEpDispatch, peer = rank, observed = the id, detail = ep_bad_detail(token, kind)). The next op's handler or
// ctx.check() reports it, as for the dispatch kernel. With records = 1 (a ("node", "gpu") group's routing records,
// EpGuardAttrs) a single thread reports the group's first offender instead (records_kernel).
//
// One CTA so that "first" needs no grid-wide reduction (no scratch memory, no second launch): the ids of a round are
// one load per thread, all in flight together, and the check is a few compares, so a round costs about one memory
// round trip.
#include <climits>

#include "kernels/cuda/ep.h"
#include "kernels/cuda/sync.cuh"

namespace jax_engram {
namespace {

// Threads of the CTA: ids are kept in registers (kMaxK per thread), so the widest tokens get half as many threads.
constexpr int guard_threads(int max_k) { return max_k <= 16 ? 1024 : 512; }

// kMaxK >= K: the register array's size (compile-time indices keep it in registers).
template <int kMaxK>
__global__ void __launch_bounds__(guard_threads(kMaxK)) guard_kernel(const EpGuardParams p) {
  __shared__ unsigned long long sh_bad;  // the smallest (token << 6 | k) of a bad entry, ULLONG_MAX: none
  const int tid = threadIdx.x;
  const int K = p.K, E = p.E;
  if (tid == 0) {
    sh_bad = ULLONG_MAX;
    if (p.token_out != p.token) *p.token_out = *p.token;
  }
  __syncthreads();
  for (int64_t t = tid; t < p.N; t += blockDim.x) {
    const int32_t* row = p.topk + t * K;
    int32_t* out = p.topk_out + t * K;
    int id[kMaxK];
#pragma unroll
    for (int k = 0; k < kMaxK; ++k) id[k] = k < K ? __ldg(row + k) : -1;
#pragma unroll
    for (int k = 0; k < kMaxK; ++k)
      if (k < K) out[k] = id[k];
    int first = -1;
#pragma unroll
    for (int k = kMaxK - 1; k >= 0; --k) {  // descending: the last bad k seen is the smallest
      bool bad = k < K && (id[k] < -1 || id[k] >= E);
#pragma unroll
      for (int j = 0; j < k; ++j) bad |= id[k] >= 0 && id[j] == id[k];  // k >= K holds -1: never a duplicate
      if (bad) first = k;
    }
    if (first >= 0) atomicMin(&sh_bad, (static_cast<unsigned long long>(t) << 6) | static_cast<unsigned>(first));
  }
  __syncthreads();
  if (tid == 0 && sh_bad != ULLONG_MAX) {
    const int64_t t = static_cast<int64_t>(sh_bad >> 6);
    const int k = static_cast<int>(sh_bad & 63);
    const int id = p.topk[t * K + k];
    const int kind = (id < -1 || id >= E) ? kEpBadExpertRange : kEpBadDuplicateExpert;
    cuda::record_error_device(p.err, kErrBadInput, kOpEpDispatch, p.rank, p.rank, 0, id, 0, ep_bad_detail(t, kind));
  }
}

// A ("node", "gpu") group's routing records [R + 1, 3] (EpGuardAttrs records = 1): one thread copies them and
// records the first rank's bad entry as this rank (the last row) reports a peer's, in global numbers.
__global__ void records_kernel(const EpGuardParams p) {
  if (p.token_out != p.token) *p.token_out = *p.token;
  const int64_t R = p.N - 1;
  for (int64_t i = 0; i < p.N * 3; ++i) p.topk_out[i] = p.topk[i];
  const int64_t r = ep_first_offender(p.topk, R);
  if (r >= 0)
    cuda::record_error_device(p.err, kErrBadInput, kOpEpDispatch, p.topk[R * 3], static_cast<int32_t>(r), 0,
                              p.topk[r * 3 + 2], 0, ep_bad_detail(p.topk[r * 3 + 1], p.topk[r * 3]));
}

template <int kMaxK>
cudaError_t launch(const EpGuardParams& p, cudaStream_t stream) {
  guard_kernel<kMaxK><<<1, guard_threads(kMaxK), 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_ep_guard(const EpGuardParams& p, cudaStream_t stream) {
  if (p.K < 0 || p.K > kEpMaxTopk || p.N < 0 || p.N >= (int64_t{1} << 31) || !p.token || !p.token_out ||
      (p.N * p.K > 0 && (!p.topk || !p.topk_out)))
    return cudaErrorInvalidValue;
  if (p.records) {
    if (p.K != 3 || p.N < 2) return cudaErrorInvalidValue;
    records_kernel<<<1, 1, 0, stream>>>(p);
    return cudaGetLastError();
  }
  if (p.K <= 1) return launch<1>(p, stream);
  if (p.K <= 2) return launch<2>(p, stream);
  if (p.K <= 4) return launch<4>(p, stream);
  if (p.K <= 8) return launch<8>(p, stream);
  if (p.K <= 16) return launch<16>(p, stream);
  return launch<32>(p, stream);
}

}  // namespace jax_engram
