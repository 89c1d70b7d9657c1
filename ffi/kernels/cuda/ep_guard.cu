// The guard of the one-rank local path (jax_engram/_ep_local.py) on CUDA: the dispatch kernel's routing check
// (ep_dispatch.cu, layout pass 1) without the dispatch. One thread per token, kGuardThreads tokens per CTA, as many
// CTAs as the tokens need; each thread loads its token's K ids into registers (16-byte loads where the rows allow),
// writes them to topk_out (the copy the local path computes the layout from) and finds its first bad k: an id outside
// [-1, E), or a valid id an earlier k of the token holds. The smallest (token << 6 | k) of a CTA is its first bad
// entry in (token, k) order. The CTA that holds the routing's first bad entry records it, exactly as the dispatch
// kernel records its own rank's bad entry (kErrBadInput, kOpEpDispatch, peer = rank, observed = the id, detail =
// ep_bad_detail(token, kind)): a CTA with a bad entry first checks the tokens of every earlier CTA again (only on
// this error path) and records nothing if one of them is bad. No scratch memory, no second launch, one record.
// The next op's handler or ctx.check() reports it, as for the dispatch kernel. With records = 1 (a ("node", "gpu")
// group's routing records, EpGuardAttrs) a single thread reports the group's first offender instead
// (records_kernel).
#include <climits>

#include "kernels/cuda/ep.h"
#include "kernels/cuda/sync.cuh"

namespace jax_engram {
namespace {

constexpr int kGuardThreads = 256;

// The ids of token t (k < K; -1 past K) into registers: 16-byte loads where `vec4` (K a multiple of 4 and both
// buffers 16-byte aligned, decided by the launcher).
template <int kMaxK>
__device__ __forceinline__ void load_ids(const int32_t* topk, int64_t t, int K, bool vec4, int (&id)[kMaxK]) {
  const int32_t* row = topk + t * K;
  if constexpr (kMaxK >= 4) {
    if (vec4) {
#pragma unroll
      for (int k = 0; k < kMaxK; k += 4) {
        if (k < K) {
          const int4 v = __ldg(reinterpret_cast<const int4*>(row + k));
          id[k] = v.x, id[k + 1] = v.y, id[k + 2] = v.z, id[k + 3] = v.w;
        } else {
          id[k] = id[k + 1] = id[k + 2] = id[k + 3] = -1;
        }
      }
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < kMaxK; ++k) id[k] = k < K ? __ldg(row + k) : -1;
}

template <int kMaxK>
__device__ __forceinline__ void store_ids(int32_t* out, int64_t t, int K, bool vec4, const int (&id)[kMaxK]) {
  int32_t* row = out + t * K;
  if constexpr (kMaxK >= 4) {
    if (vec4) {
#pragma unroll
      for (int k = 0; k < kMaxK; k += 4)
        if (k < K) *reinterpret_cast<int4*>(row + k) = make_int4(id[k], id[k + 1], id[k + 2], id[k + 3]);
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < kMaxK; ++k)
    if (k < K) row[k] = id[k];
}

// The token's first bad k (an id outside [-1, E), or a valid id an earlier k holds), -1: none.
template <int kMaxK>
__device__ __forceinline__ int first_bad_k(const int (&id)[kMaxK], int K, int E) {
  int first = -1;
#pragma unroll
  for (int k = kMaxK - 1; k >= 0; --k) {  // descending: the last bad k seen is the smallest
    bool bad = k < K && (id[k] < -1 || id[k] >= E);
#pragma unroll
    for (int j = 0; j < k; ++j) bad |= id[k] >= 0 && id[j] == id[k];  // k >= K holds -1: never a duplicate
    if (bad) first = k;
  }
  return first;
}

// kMaxK >= K: the register array's size (compile-time indices keep it in registers).
template <int kMaxK>
__global__ void __launch_bounds__(kGuardThreads) guard_kernel(const EpGuardParams p, bool vec4) {
  __shared__ unsigned long long sh_bad;  // the smallest (token << 6 | k) of a bad entry of this CTA, ULLONG_MAX: none
  __shared__ int sh_earlier;             // an earlier CTA's token is bad: that CTA records
  const int tid = threadIdx.x;
  const int K = p.K, E = p.E;
  if (tid == 0) {
    sh_bad = ULLONG_MAX;
    sh_earlier = 0;
    if (blockIdx.x == 0 && p.token_out != p.token) *p.token_out = *p.token;
  }
  __syncthreads();
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kGuardThreads;
  const int64_t t = t0 + tid;
  if (t < p.N) {
    int id[kMaxK];
    load_ids<kMaxK>(p.topk, t, K, vec4, id);
    store_ids<kMaxK>(p.topk_out, t, K, vec4, id);
    const int first = first_bad_k<kMaxK>(id, K, E);
    if (first >= 0) atomicMin(&sh_bad, (static_cast<unsigned long long>(t) << 6) | static_cast<unsigned>(first));
  }
  __syncthreads();
  if (sh_bad == ULLONG_MAX) return;
  // The error path only; it stops once any thread found an earlier bad token (garbage routing: no N^2 rescan).
  for (int64_t u = tid; u < t0 && !*static_cast<volatile int*>(&sh_earlier); u += kGuardThreads) {
    int id[kMaxK];
    load_ids<kMaxK>(p.topk, u, K, vec4, id);
    if (first_bad_k<kMaxK>(id, K, E) >= 0) sh_earlier = 1;
  }
  __syncthreads();
  if (tid == 0 && !sh_earlier) {
    const int64_t bt = static_cast<int64_t>(sh_bad >> 6);
    const int k = static_cast<int>(sh_bad & 63);
    const int bad_id = p.topk[bt * K + k];
    const int kind = (bad_id < -1 || bad_id >= E) ? kEpBadExpertRange : kEpBadDuplicateExpert;
    cuda::record_error_device(p.err, kErrBadInput, kOpEpDispatch, p.rank, p.rank, 0, bad_id, 0,
                              ep_bad_detail(bt, kind));
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
  const int64_t grid = p.N > 0 ? (p.N + kGuardThreads - 1) / kGuardThreads : 1;  // one CTA copies the token
  const bool vec4 = p.K % 4 == 0 && (reinterpret_cast<uintptr_t>(p.topk) | reinterpret_cast<uintptr_t>(p.topk_out)) %
                                            16 == 0;
  guard_kernel<kMaxK><<<static_cast<unsigned>(grid), kGuardThreads, 0, stream>>>(p, vec4);
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
