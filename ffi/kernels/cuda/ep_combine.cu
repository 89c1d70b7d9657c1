// EP combine on CUDA: the PUSH protocol of ep_layout.h (EpCombineLayout slots), one cooperative launch of
// G = num_sms CTAs. Numerics bit-exact with docs/semantics.md ("MoE combine") and the CPU backend: every fp32 sum is
// a left fold from -0.0 in a fixed order, one rounding to the output dtype.
//
// CTA c of rank `me` (combine sequence number seq, staging half seq & 1):
//   stage warps (expert side): received rows i < psum_rank[R-1] in chunks of `chunk` rows (chunk j on CTA j % G):
//     row i came from (s, t) = divmod(meta[i, 0], M); its value -- non-expand y[i] as is; expand the fp32 sum over
//     valid local k ascending of y[meta[i, 2+k]] rounded once (one valid k: copied, none: zeros) -- and its weights
//     row are STORED into slot `me` of rank s at row t (NVLink stores; own memory for s == me, expand only: a
//     non-expand own row is read by the source side straight from y, so it is not copied). After each chunk
//     progress[c] = (seq << 32) | chunks done in slot `me` of every rank; the last CTA publishes own.combine_ready.
//     Then the stage warps join the source side's reduction; CTA 0 finally waits for every peer's ready >= seq and
//     fails on a peer's bad word.
//   pull warps (source side, own memory and y only): own tokens t (chunks of `chunk` tokens, chunk j on CTA j % G,
//     tokens handed out dynamically): the master lanes of t's top-k (highest k per dest rank) in ascending lane
//     order ARE the dest ranks in ascending master position; each master lane waits for progress of its rank's
//     slot on the chunk of dst_row[t, d] (non-expand d == me: y[dst_row[t, me]], no wait), then acc = -0 (+ bias0)
//     (+ bias1) + rows in that order, one rounding. A lone row without bias is copied; no row and no bias gives +0.
//     combined_topk_weights[t, k] = the weight k of the rank owning expert k, 0 where masked.
#include <cuda_bf16.h>

#include <climits>
#include <cstdlib>

#include "kernels/cuda/ep_common.cuh"
#include "kernels/cuda/ep_trace.h"

namespace jax_engram {
namespace ep {
namespace {

JE_DEVICE float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
JE_DEVICE float to_f(float v) { return v; }
template <typename T>
JE_DEVICE T from_f(float v);
template <>
JE_DEVICE __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
JE_DEVICE float from_f<float>(float v) { return v; }

template <typename T, typename V, int U>
JE_DEVICE void add_units(float (&a)[U][sizeof(V) / sizeof(T)], const V (&v)[U]) {
  constexpr int NE = sizeof(V) / sizeof(T);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const T* e = reinterpret_cast<const T*>(&v[u]);
#pragma unroll
    for (int q = 0; q < NE; ++q) a[u][q] += to_f(e[q]);
  }
}

// out = T(-0 (+ b0) (+ b1) + src(bit_0) + src(bit_1) + ...) over the set bits of `mask` ascending; the source of
// bit b is `lane_src` of lane b. Loads of two sources are in flight together; the sum order is fixed.
template <typename T, typename V, int U>
__device__ __noinline__ void warp_reduce_v(uint8_t* out, const uint8_t* b0, const uint8_t* b1, unsigned mask,
                                           const uint8_t* lane_src, int64_t nbytes, int lane) {
  constexpr int NE = sizeof(V) / sizeof(T);
  const int64_t n = nbytes / static_cast<int64_t>(sizeof(V));
  for (int64_t base = 0; base < n; base += 32 * U) {
    float a[U][NE];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int q = 0; q < NE; ++q) a[u][q] = -0.0f;
    for (const uint8_t* b : {b0, b1}) {
      if (!b) continue;
      V v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t idx = base + u * 32 + lane;
        v[u] = idx < n ? reinterpret_cast<const V*>(b)[idx] : V{};
      }
      add_units<T, V, U>(a, v);
    }
    unsigned mm = mask;
    while (mm) {
      const int ba = __ffs(mm) - 1;
      mm &= mm - 1;
      const V* sa = reinterpret_cast<const V*>(__shfl_sync(kFull, reinterpret_cast<unsigned long long>(lane_src), ba));
      const V* sb = nullptr;
      if (mm) {
        const int bb = __ffs(mm) - 1;
        mm &= mm - 1;
        sb = reinterpret_cast<const V*>(__shfl_sync(kFull, reinterpret_cast<unsigned long long>(lane_src), bb));
      }
      V va[U], vb[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t idx = base + u * 32 + lane;
        va[u] = idx < n ? __ldcg(sa + idx) : V{};
        vb[u] = (sb && idx < n) ? __ldcg(sb + idx) : V{};
      }
      add_units<T, V, U>(a, va);
      if (sb) add_units<T, V, U>(a, vb);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t idx = base + u * 32 + lane;
      if (idx < n) {
        V v;
        T* e = reinterpret_cast<T*>(&v);
#pragma unroll
        for (int q = 0; q < NE; ++q) e[q] = from_f<T>(a[u][q]);
        reinterpret_cast<V*>(out)[idx] = v;
      }
    }
  }
}

// out = T(-0 + a + b) for two rows and no bias (the common case: at 2 ranks every token with experts on both):
// 8 units per lane of both rows in flight and no accumulator kept across terms, faster than the general form below
// and than a cp.async ring (tools/probe_reduce.cu compares them).
template <typename T, int U>
__device__ __noinline__ void warp_sum2_v(uint8_t* out, const uint4* sa, const uint4* sb, int64_t nbytes, int lane) {
  constexpr int NE = 16 / sizeof(T);
  const int64_t n = nbytes / 16;
  for (int64_t base = 0; base < n; base += 32 * U) {
    uint4 va[U], vb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t idx = base + u * 32 + lane;
      va[u] = idx < n ? __ldcg(sa + idx) : uint4{};
      vb[u] = idx < n ? __ldcg(sb + idx) : uint4{};
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t idx = base + u * 32 + lane;
      if (idx >= n) continue;
      const T* ea = reinterpret_cast<const T*>(&va[u]);
      const T* eb = reinterpret_cast<const T*>(&vb[u]);
      uint4 v;
      T* e = reinterpret_cast<T*>(&v);
#pragma unroll
      for (int q = 0; q < NE; ++q) e[q] = from_f<T>((-0.0f + to_f(ea[q])) + to_f(eb[q]));
      reinterpret_cast<uint4*>(out)[idx] = v;
    }
  }
}

// out = T(((-0 + row_0) + row_1) + ... + row_{NS-1}) for NS = 3..8 rows and no bias: U units of EVERY row in flight
// at once (NS * U = 12..16 loads of 16 bytes per lane), no accumulator kept across loads. The expand combine's expert
// side sums ~4 rows per pushed row (top-8 of 256 at 2 ranks: 1-8 local experts per token, mean 4); the general path
// below keeps only two rows' loads in flight and is latency-bound there. Same fold order, same result bits.
struct RowPtrs {
  const uint4* p[8];
};
template <typename T, int NS, int U>
__device__ __noinline__ void warp_sumn_v(uint8_t* out, const RowPtrs s, int64_t nbytes, int lane) {
  constexpr int NE = 16 / sizeof(T);
  const int64_t n = nbytes / 16;
  for (int64_t base = 0; base < n; base += 32 * U) {
    uint4 v[NS][U];
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t idx = base + u * 32 + lane;
        v[j][u] = idx < n ? __ldcg(s.p[j] + idx) : uint4{};
      }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t idx = base + u * 32 + lane;
      if (idx >= n) continue;
      uint4 o;
      T* e = reinterpret_cast<T*>(&o);
#pragma unroll
      for (int q = 0; q < NE; ++q) {
        float a = -0.0f;
#pragma unroll
        for (int j = 0; j < NS; ++j) a += to_f(reinterpret_cast<const T*>(&v[j][u])[q]);
        e[q] = from_f<T>(a);
      }
      reinterpret_cast<uint4*>(out)[idx] = o;
    }
  }
}

// Sum of (b0, b1, the rows of the set bits of `mask` ascending; row of bit b = lane_src of lane b) into out.
// Register loads, 4 units per lane of two terms at a time: a cp.async ring through shared memory is slower
// (tools/probe_reduce.cu).
template <typename T>
JE_DEVICE void warp_sum(uint8_t* out, const uint8_t* b0, const uint8_t* b1, unsigned mask, const uint8_t* lane_src,
                        int64_t nbytes, int lane) {
  uint64_t a = reinterpret_cast<uint64_t>(out) | reinterpret_cast<uint64_t>(b0) | reinterpret_cast<uint64_t>(b1) |
               static_cast<uint64_t>(nbytes);
  unsigned mm = mask;
  while (mm) {
    const int b = __ffs(mm) - 1;
    mm &= mm - 1;
    a |= __shfl_sync(kFull, reinterpret_cast<unsigned long long>(lane_src), b);
  }
  if ((a & 15) != 0) {
    warp_reduce_v<T, T, 4>(out, b0, b1, mask, lane_src, nbytes, lane);
  } else if (!b0 && !b1 && __popc(mask) == 2) {
    const int ba = __ffs(mask) - 1, bb = __ffs(mask & (mask - 1)) - 1;
    const auto* sa = reinterpret_cast<const uint4*>(__shfl_sync(kFull, reinterpret_cast<unsigned long long>(lane_src), ba));
    const auto* sb = reinterpret_cast<const uint4*>(__shfl_sync(kFull, reinterpret_cast<unsigned long long>(lane_src), bb));
    warp_sum2_v<T, 8>(out, sa, sb, nbytes, lane);
  } else if (!b0 && !b1 && __popc(mask) >= 3 && __popc(mask) <= 8) {
    RowPtrs s{};
    unsigned mm = mask;
    for (int j = 0; mm; ++j) {
      const int b = __ffs(mm) - 1;
      mm &= mm - 1;
      s.p[j] = reinterpret_cast<const uint4*>(__shfl_sync(kFull, reinterpret_cast<unsigned long long>(lane_src), b));
    }
    switch (__popc(mask)) {
      case 3: warp_sumn_v<T, 3, 5>(out, s, nbytes, lane); break;
      case 4: warp_sumn_v<T, 4, 4>(out, s, nbytes, lane); break;
      case 5: warp_sumn_v<T, 5, 3>(out, s, nbytes, lane); break;
      case 6: warp_sumn_v<T, 6, 2>(out, s, nbytes, lane); break;
      case 7: warp_sumn_v<T, 7, 2>(out, s, nbytes, lane); break;
      default: warp_sumn_v<T, 8, 2>(out, s, nbytes, lane); break;
    }
  } else {
    warp_reduce_v<T, uint4, 4>(out, b0, b1, mask, lane_src, nbytes, lane);  // 2 terms x 4 units in flight
  }
}

// Slot of expert rank d on rank s for this call's half.
JE_DEVICE uint8_t* combine_slot(const EpCombineParams& p, uint64_t hoff, int s, int d) {
  return (s == p.w.rank ? p.w.st_own : p.w.st_peers[s]) + hoff + p.L.slot_at(d);
}
// Progress word of (CTA c, stage warp w) in a slot.
JE_DEVICE uint64_t* slot_progress(uint8_t* slot, int c, int w) {
  return reinterpret_cast<uint64_t*>(slot) + ep_progress_index(c, w);
}

JE_DEVICE void mark_bad(const EpCombineParams& p, uint64_t seq, int64_t detail, int64_t value) {
  uint8_t* ws = p.w.ws_own;
  *reinterpret_cast<volatile int64_t*>(ws + EpWorkspace::kCombineBadDetail) = detail;
  *reinterpret_cast<volatile int64_t*>(ws + EpWorkspace::kCombineBadValue) = value;
  __threadfence_system();
  *reinterpret_cast<volatile uint64_t*>(ws_u64(ws, EpWorkspace::kCombineBad)) = seq;
  cuda::record_error_device(p.w.err, kErrBadInput, kOpEpCombine, p.w.rank, p.w.rank, 0, value, 0, detail);
}

// kTrace: the JAX_ENGRAM_EP_TRACE code (p.trace > 0 launches that instantiation; see dispatch_kernel).
template <typename T, bool kTrace>
__global__ void __launch_bounds__(kEpThreads, 1) combine_kernel(const EpCombineParams p, int SW) {
  __shared__ uint64_t sh_seq;
  __shared__ int sh_next, sh_done, sh_base_ready;
  __shared__ uint64_t sh_t0;
  __shared__ int sh_base[kMaxRanks];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int G = gridDim.x, c = blockIdx.x;
  const int R = p.w.nranks, me = p.w.rank;
  const int M = p.M, N = p.N, K = p.K, E = p.E, E_loc = E / R;
  uint8_t* ws = p.w.ws_own;
  EP_TRACE_DECL(kTrace);
  const int trace = kTrace ? p.trace : 0;
  if (tid == 0) {
    sh_t0 = cuda::globaltimer_ns();
    sh_seq = enter_seq(ws, EpWorkspace::kCombineSeq, EpScratch::kCombineArrive);
    trace_span_begin(trace, ws, sh_t0);
    sh_next = 0;
    sh_done = 0;
    sh_base_ready = 0;
    if (c == 0 && p.token_out) *p.token_out = *p.token;
  }
  __syncthreads();
  const uint64_t seq = sh_seq;
  const uint64_t hoff = p.w.st_offset + p.L.half(seq);
  const int64_t row_bytes = static_cast<int64_t>(p.H) * sizeof(T);
  const int CH = p.chunk;
  const int rows_tok = R * M;

  // Source side (own memory and y only): token t's sum over its dest ranks, handed out dynamically over the pull
  // warps and, once their pushes are done, the stage warps. False when a wait failed (abort).
  int* base = sh_base;  // base[d]: first row of this rank's region on d (computed by the pull warps)
  const int RS = p.expand ? R : R - 1;  // sources enumerated by the expert side's push items (see there)
  const auto src_of = [&](int j) { return p.expand ? j : (me + 1 + j) % R; };
  const int nch = (N + CH - 1) / CH;
  const int nloc = c < nch ? (nch - c + G - 1) / G : 0;
  uint64_t tr_wait = 0, tr_work = 0, tr_tokens = 0;  // trace >= 2: where the reduction's time goes
  auto reduce_tokens = [&]() -> bool {
    for (;;) {
      int it = 0;
      if (lane == 0) it = atomicAdd(&sh_next, 1);
      it = __shfl_sync(kFull, it, 0);
      if (it >= nloc * CH) break;
      const int t = (c + (it / CH) * G) * CH + it % CH;
      if (t >= N) continue;
      const int64_t tK = static_cast<int64_t>(t) * K;
      const int id = lane < K ? p.topk[tK + lane] : -1;
      const bool valid = id >= 0 && id < E;
      const int d = valid ? id / E_loc : -1;
      int row = valid ? p.dst_row[static_cast<int64_t>(t) * R + d] : -1;
      if (row >= rows_tok) {
        cuda::record_error_device(p.w.err, kErrBadInput, kOpEpCombine, me, me, 0, row, 0,
                                  ep_bad_detail(t, kEpBadHandle));
        row = -1;
      }
      const unsigned sd = __match_any_sync(kFull, valid ? d : -2 - lane);
      const bool master = valid && 31 - __clz(sd) == lane && row >= 0;
      const unsigned mm = __ballot_sync(kFull, master);
      int okw = 1;
      const uint64_t tr0 = trace > 1 ? cuda::globaltimer_ns() : 0;
      const bool own_row = !p.expand && d == me;  // non-expand own rank: the row is y[row] itself, nothing to wait for
      const uint8_t* slot = master && !own_row ? combine_slot(p, hoff, me, d) : nullptr;
      if (master && !own_row) {
        const int q = ((row - base[d]) / CH) * RS + (p.expand ? me : (me - d - 1 + R) % R), li = q / G;
        const uint64_t* w = slot_progress(const_cast<uint8_t*>(slot), q % G, li % SW);
        const uint64_t target = progress_value(seq, li / SW + 1);
        okw = wait_local(w, target, p.w, kOpEpCombine, d);
      }
      if (!__all_sync(kFull, okw)) return false;
      __syncwarp();
      const uint64_t tr1 = trace > 1 ? cuda::globaltimer_ns() : 0;
      const uint8_t* src = !master ? nullptr
                           : own_row ? p.y + static_cast<int64_t>(row) * row_bytes
                                     : slot + p.L.slot_y() + static_cast<int64_t>(t) * p.L.y_row;
      uint8_t* out = p.out + t * row_bytes;
      const uint8_t* b0 = p.bias0 ? p.bias0 + t * row_bytes : nullptr;
      const uint8_t* b1 = p.bias1 ? p.bias1 + t * row_bytes : nullptr;
      if (p.out_w && lane < K) {  // issued before the row: consumed after it
        float v = 0.0f;
        if (valid && row >= 0)
          v = !p.expand && d == me
                  ? (p.weights ? p.weights[static_cast<int64_t>(row) * K + lane] : 0.0f)
                  : __ldcg(reinterpret_cast<const float*>(combine_slot(p, hoff, me, d) + p.L.slot_weights()) + tK + lane);
        p.out_w[tK + lane] = v;
      }
      if (!b0 && !b1 && mm == 0) {
        warp_zero(out, 0, 0, row_bytes, lane);
      } else if (!b0 && !b1 && __popc(mm) == 1) {  // -0.0 + v == v: a lone term is returned unchanged
        warp_copy1(reinterpret_cast<const uint8_t*>(
                       __shfl_sync(kFull, reinterpret_cast<unsigned long long>(src), __ffs(mm) - 1)),
                   out, row_bytes, lane);
      } else {
        warp_sum<T>(out, b0, b1, mm, src, row_bytes, lane);
      }
      if (trace > 1) {
        const uint64_t tr2 = cuda::globaltimer_ns();
        tr_wait += tr1 - tr0;
        tr_work += tr2 - tr1;
        ++tr_tokens;
      }
    }
    return true;
  };

  if (warp < SW) {
    // ---- stage warps (expert side) ------------------------------------------------------------------------------
    int num_recv = p.psum_rank[R - 1];
    if (num_recv < 0 || num_recv > rows_tok) {
      if (c == 0 && tid == 0) mark_bad(p, seq, ep_bad_detail(0, kEpBadHandle), num_recv);
      num_recv = 0;
    }
    // Items (k, j) interleaved over the enumerated sources, q = k * RS + j: rows [b_s + k*CH, ...) of source
    // s = src_of(j)'s region [b_s, b_s + cnt_s) (b_s = psum_rank[s-1]). Item q is CTA q % G's li = q / G -th,
    // pushed by stage warp li % SW as its (li / SW)-th, and only source s is told. Why interleaved: in rank-major
    // order every expert rank returns the rows of source 0 first, so the last source could start reducing only
    // after all pushes ended. Enumerated: every rank for expand (own rows are summed and copied too), the OTHER
    // ranks for non-expand (the source side reads its own rows straight from y; enumerating them and skipping
    // would leave every CTA with q % R == me idle when R divides G).
    int kmax = 0;
    for (int j = 0; j < RS; ++j) {
      const int s = src_of(j);
      const int b = s == 0 ? 0 : min(max(p.psum_rank[s - 1], 0), num_recv);
      const int e = min(max(p.psum_rank[s], b), num_recv);
      kmax = max(kmax, (e - b + CH - 1) / CH);
    }
    const int nitems = kmax * RS;
    int n = 0;
    for (int li = warp; c + li * G < nitems; li += SW) {
      const int q = c + li * G, k = q / RS, src = src_of(q % RS);
      const int b = src == 0 ? 0 : min(max(p.psum_rank[src - 1], 0), num_recv);
      const int e = min(max(p.psum_rank[src], b), num_recv);
      const int ib = b + k * CH, ie = min(ib + CH, e);
      ++n;
      for (int i = ib; i < ie; ++i) {
        const int gid = p.meta[static_cast<int64_t>(i) * (K + 2)];
        if (gid < 0 || gid >= rows_tok) {
          if (lane == 0) mark_bad(p, seq, ep_bad_detail(i, kEpBadHandle), gid);
          continue;
        }
        const int s = gid / M, t = gid % M;
        uint8_t* slot = combine_slot(p, hoff, s, me);
        uint8_t* dst = slot + p.L.slot_y() + static_cast<int64_t>(t) * p.L.y_row;
        float* st_w = reinterpret_cast<float*>(slot + p.L.slot_weights()) + static_cast<int64_t>(t) * K;
        if (!p.expand) {
          warp_copy1(p.y + i * row_bytes, dst, row_bytes, lane);
          if (p.weights && lane < K) st_w[lane] = p.weights[static_cast<int64_t>(i) * K + lane];
          continue;
        }
        int64_t r = lane < K ? p.meta[static_cast<int64_t>(i) * (K + 2) + 2 + lane] : -1;
        if (r >= p.rows) {
          mark_bad(p, seq, ep_bad_detail(i, kEpBadHandle), r);
          r = -1;
        }
        const unsigned vm = __ballot_sync(kFull, r >= 0);
        const uint8_t* src = r >= 0 ? p.y + r * row_bytes : nullptr;
        if (vm == 0) {
          warp_zero(dst, 0, 0, row_bytes, lane);
        } else if (__popc(vm) == 1) {
          warp_copy1(reinterpret_cast<const uint8_t*>(
                         __shfl_sync(kFull, reinterpret_cast<unsigned long long>(src), __ffs(vm) - 1)),
                     dst, row_bytes, lane);
        } else {
          warp_sum<T>(dst, nullptr, nullptr, vm, src, row_bytes, lane);
        }
        if (p.weights && lane < K) st_w[lane] = r >= 0 ? p.weights[r] : 0.0f;
      }
      if (ib >= ie) continue;  // an empty item still counts in n (the source side derives n from q)
      // progress of this warp in slot `me` of rank src (no barrier with the other warps)
      __threadfence_system();
      __syncwarp();
      if (lane == 0) st_release_sys_u64(slot_progress(combine_slot(p, hoff, src, me), c, warp), progress_value(seq, n));
    }
    EP_TRACE(p, sh_t0, "combine pushed", lane == 0 && (warp == 0 || warp == SW - 1));
    bar_sync(1, SW * 32);
    if (tid == 0) staged_arrive(ws, EpScratch::kCombineStaged, EpWorkspace::kCombineReady, seq);
    // then help the source side reduce (its tables are ready long before the pushes end)
    if (lane == 0) {
      unsigned ns = 32;
      while (*reinterpret_cast<volatile int*>(&sh_base_ready) == 0) {
        __nanosleep(ns);
        ns = ns < 256 ? ns * 2 : 256;
      }
      __threadfence_block();
    }
    __syncwarp();
    reduce_tokens();
    if (c == 0) {  // a call ends only after every peer published its ready (ep_layout.h)
      for (int s = tid; s < R; s += SW * 32) {
        const uint8_t* pws = p.w.ws_peers[s];
        if (!wait_ge(ws_u64(pws, EpWorkspace::kCombineReady), seq, p.w, kOpEpCombine, s)) continue;
        if (s != me && cuda::ld_acquire_sys(ws_u64(pws, EpWorkspace::kCombineBad)) == seq)
          cuda::record_error_device(p.w.err, kErrBadInput, kOpEpCombine, me, s, 0,
                                    __ldcg(reinterpret_cast<const long long*>(pws + EpWorkspace::kCombineBadValue)),
                                    0, __ldcg(reinterpret_cast<const long long*>(pws + EpWorkspace::kCombineBadDetail)));
      }
    }
    EP_TRACE(p, sh_t0, "combine end_wait", tid == 0);
    trace_span_end(trace, ws, &sh_done, "combine", me);
    EP_TRACE_FLUSH(p, sh_t0);
    if (trace > 1 && lane == 0 && (c == 0 || c == G - 1))
      printf("EPREDUCE rank %d cta %d warp %d (stage): %llu tokens, waiting %.1f us, reducing %.1f us\n", me, c, warp,
             (unsigned long long)tr_tokens, tr_wait * 1e-3, tr_work * 1e-3);
    return;
  }

  // ---- pull warps (source side) ---------------------------------------------------------------------------------
  // base[d] = first row of this rank's region on d = min over tokens of dst_row[t, d] (pos 0 is the first token sent)
  const int ptid = tid - SW * 32, pthreads = (blockDim.x >> 5) * 32 - SW * 32;
  for (int d = ptid; d < R; d += pthreads) base[d] = INT_MAX;
  bar_sync(3, pthreads);
  for (int i = ptid; i < N * R; i += pthreads) {
    const int v = p.dst_row[i];
    if (v >= 0) atomicMin(&base[i % R], v);
  }
  bar_sync(3, pthreads);
  if (ptid == 0) {
    __threadfence_block();
    *reinterpret_cast<volatile int*>(&sh_base_ready) = 1;
  }
  if (!reduce_tokens()) return;
  EP_TRACE(p, sh_t0, "combine reduced", lane == 0 && (warp == SW || warp == 15));
  trace_span_end(trace, ws, &sh_done, "combine", me);
  EP_TRACE_FLUSH(p, sh_t0);
  if (trace > 1 && lane == 0 && (c == 0 || c == G - 1))
    printf("EPREDUCE rank %d cta %d warp %d: %llu tokens, waiting %.1f us, reducing %.1f us\n", me, c, warp,
           (unsigned long long)tr_tokens, tr_wait * 1e-3, tr_work * 1e-3);
}

}  // namespace
}  // namespace ep

cudaError_t launch_ep_combine(const EpCombineParams& p0, const EpLaunch& l, cudaStream_t stream) {
  if (l.num_ctas < 1 || l.num_ctas > kEpMaxCtas || l.stage_warps < 1 || l.stage_warps >= kEpThreads / 32)
    return cudaErrorInvalidValue;
  EpCombineParams p = p0;
  p.chunk = ep_push_chunk((p.M * p.w.nranks + l.num_ctas - 1) / l.num_ctas, l.stage_warps);
  p.trace = ep_trace_level();
  p.trace_cta = ep_trace_cta();
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(l.num_ctas);
  cfg.blockDim = dim3(kEpThreads);
  cfg.dynamicSmemBytes = 0;  // no shared-memory ring: all of it stays L1
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int sw = l.stage_warps;
  const bool tr = p.trace > 0;
  cudaError_t e = p.dtype == EpDtype::kBF16
                      ? cudaLaunchKernelEx(&cfg, tr ? ep::combine_kernel<__nv_bfloat16, true>
                                                    : ep::combine_kernel<__nv_bfloat16, false>, p, sw)
                      : cudaLaunchKernelEx(&cfg, tr ? ep::combine_kernel<float, true> : ep::combine_kernel<float, false>,
                                           p, sw);
  if (e != cudaSuccess) return e;
  return cudaGetLastError();
}

}  // namespace jax_engram
