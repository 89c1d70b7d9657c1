// Device helpers shared by the CUDA EP kernels (ep_dispatch.cu, ep_combine.cu), and the CUDA-only scratch words.
//
// The kernels run the PUSH protocol of ep_layout.h (EpInbox / EpCombineLayout slots): NVLink carries only stores,
// every receiver polls and reads its own memory (wait_local). Everything else in ep_layout.h is honoured: halves by
// seq parity, own.<op>_seq, own.<op>_ready = seq (release), and every call waits for every peer's ready >= seq
// before it ends (the two-halves argument of ep_layout.h, which covers the inbox slots too).
//
// CUDA scratch (own memory, in the free part of the workspace EP block after EpWorkspace::kEnd):
//   arrive / staged counters  atomicInc(G-1) counters: the last CTA to read the seq writes it back, the last CTA
//                             to finish pushing publishes ready;
//   grid barrier, per-CTA counts and first-bad keys of the dispatch layout.
// All ranks of a context launch the same number of CTAs and push warps (num_sms and the EPConfig's stage warps are
// attributes of the SPMD program): the receivers derive which progress word covers a chunk from them.
#pragma once
#include <cuda_bf16.h>

#include <climits>
#include <cstdint>

#include "jax_engram/ep_layout.h"
#include "kernels/cuda/ep.h"
#include "kernels/cuda/sync.cuh"

namespace jax_engram::ep {

inline constexpr unsigned kFull = 0xffffffffu;

struct EpScratch {
  static constexpr uint64_t kBase = align_up(EpWorkspace::kEnd, 4096);
  static constexpr uint64_t kGridBar = kBase;              // u32 count, u32 generation (dispatch layout)
  static constexpr uint64_t kDispatchArrive = kBase + 128;  // u32
  static constexpr uint64_t kDispatchStaged = kBase + 256;  // u32
  static constexpr uint64_t kCombineArrive = kBase + 384;   // u32
  static constexpr uint64_t kCombineStaged = kBase + 512;   // u32
  static constexpr uint64_t kTraceSpan = kBase + 1024;      // u64[8 + 2 * kTraceRing] (trace_span_end)
  static constexpr uint64_t kCtaBad = kBase + 4096;                                     // u64[kEpMaxCtas]
  static constexpr uint64_t kCtaCounts = align_up(kCtaBad + 8 * kEpMaxCtas, 4096);      // i32[G][R+E]
  // copy-engine rows: per-CTA counts of each peer's range, i32[G][R-1][R + E/R] (kEpCePeerCounts per CTA at most)
  static constexpr uint64_t kCtaPeerCounts = align_up(kCtaCounts + 4ull * kEpMaxCtas * (kMaxRanks + kEpMaxExperts), 4096);
  static constexpr uint64_t kEnd = kCtaPeerCounts + 4ull * kEpMaxCtas * kEpCePeerCounts;
};
static_assert(EpScratch::kEnd <= WorkspaceLayout::kEp + WorkspaceLayout::kEpBytes, "EP CUDA scratch overflow");

JE_DEVICE uint64_t* ws_u64(uint8_t* base, uint64_t off) { return reinterpret_cast<uint64_t*>(base + off); }
JE_DEVICE const uint64_t* ws_u64(const uint8_t* base, uint64_t off) {
  return reinterpret_cast<const uint64_t*>(base + off);
}

JE_DEVICE void st_release_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
JE_DEVICE uint64_t ld_volatile_u64(const uint64_t* p) { return *reinterpret_cast<const volatile uint64_t*>(p); }

// Named barriers (id 0 is __syncthreads). `count` threads, a multiple of 32.
JE_DEVICE void bar_sync(int id, int count) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory"); }
JE_DEVICE void bar_arrive(int id, int count) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory"); }

JE_DEVICE unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// The sequence number of this call, read by every CTA at entry; the LAST CTA to read it writes seq back
// (own.<op>_seq = seq), so no CTA can see the new value. Called by thread 0 only.
JE_DEVICE uint64_t enter_seq(uint8_t* ws, uint64_t seq_off, uint64_t arrive_off) {
  uint64_t* p = ws_u64(ws, seq_off);
  const uint64_t seq = ld_volatile_u64(p) + 1;
  __threadfence();
  if (atomicInc(reinterpret_cast<unsigned*>(ws + arrive_off), gridDim.x - 1) == gridDim.x - 1)
    *reinterpret_cast<volatile uint64_t*>(p) = seq;
  return seq;
}

// Marks the end of this CTA's staging; the last CTA publishes own.<op>_ready = seq (release, system scope).
// Called by one thread, after a barrier over every thread that wrote staging data. True in the CTA that published.
JE_DEVICE bool staged_arrive(uint8_t* ws, uint64_t staged_off, uint64_t ready_off, uint64_t seq) {
  __threadfence_system();
  if (atomicInc(reinterpret_cast<unsigned*>(ws + staged_off), gridDim.x - 1) == gridDim.x - 1) {
    __threadfence_system();
    st_release_sys_u64(ws_u64(ws, ready_off), seq);
    return true;
  }
  return false;
}

// Grid barrier of a cooperative launch (all CTAs co-resident). Own-memory counter + generation; leaves the
// counter at 0. Bounded by the context timeout (a failure is recorded; it cannot happen with a cooperative
// launch). Returns false on timeout.
JE_DEVICE bool grid_sync(uint8_t* ws, const EpWindow& w, int32_t op) {
  __shared__ int sh_ok;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* count = reinterpret_cast<unsigned*>(ws + EpScratch::kGridBar);
    volatile unsigned* gen = reinterpret_cast<volatile unsigned*>(ws + EpScratch::kGridBar + 4);
    const unsigned g = *gen;
    int ok = 1;
    __threadfence();
    if (atomicAdd(count, 1u) == gridDim.x - 1) {
      *reinterpret_cast<volatile unsigned*>(count) = 0;
      __threadfence();
      atomicAdd(const_cast<unsigned*>(gen), 1u);
    } else {
      const uint64_t start = cuda::globaltimer_ns();
      while (*gen == g) {
        if (cuda::globaltimer_ns() - start > w.timeout_ns) {
          cuda::record_error_device(w.err, kErrTimeout, op, w.rank, w.rank, gridDim.x, *count,
                                    cuda::globaltimer_ns() - start, -1);
          ok = 0;
          break;
        }
      }
    }
    __threadfence();
    sh_ok = ok;
  }
  __syncthreads();
  return sh_ok != 0;
}

// Bounded wait by ONE thread for *p >= target (p may be a peer's word); records a timeout against `peer`.
JE_DEVICE bool wait_ge(const uint64_t* p, uint64_t target, const EpWindow& w, int32_t op, int32_t peer) {
  SyncArgs s;  // only the fields wait_at_least reads
  s.err = w.err;
  s.timeout_ns = w.timeout_ns;
  s.rank = w.rank;
  s.nranks = w.nranks;
  s.op = op;
  return cuda::wait_at_least(p, target, s, peer);
}

JE_DEVICE uint64_t progress_value(uint64_t seq, uint64_t n) { return (seq << 32) | n; }

// Phase trace (JAX_ENGRAM_EP_TRACE=1, diagnosis only): the threads named by `cond` of CTA 0 and the last CTA note
// (phase, time since this CTA started) in registers and print them when their path ends (EP_TRACE_FLUSH), each
// line with the CTA's start on the GPU's global timer (µs within the second: consecutive calls show the gap
// between kernels). Why not printf at each phase: a printf takes microseconds and distorted the phases it timed.
struct EpTraceLog {
  static constexpr int kMax = 16;
  const char* what[kMax];
  float us[kMax];
  int n;
};
// `on`: a constant expression; false compiles every EP_TRACE / EP_TRACE_FLUSH of the kernel out (ep_trace_on_).
#define EP_TRACE_DECL(on) constexpr bool ep_trace_on_ = (on); EpTraceLog ep_tr_; ep_tr_.n = 0
// trace >= 1: the span of every kernel, from the first CTA's start to the last warp's end, kept in a ring in
// EpScratch::kTraceSpan and printed 16 kernels at a time (a printf per kernel would delay the next kernel):
// start (µs within the second of the GPU's global timer), span, and the gap since the previous kernel's end.
// trace >= 2: the phase lines too.
inline constexpr int kTraceRing = 16;
JE_DEVICE void trace_span_begin(int trace, uint8_t* ws, uint64_t t0) {  // thread 0 of every CTA
  if (trace) atomicMax(reinterpret_cast<unsigned long long*>(ws + EpScratch::kTraceSpan), ~t0);
}
JE_DEVICE void trace_span_end(int trace, uint8_t* ws, int* sh_done, const char* what, int rank) {  // every warp
  if (!trace) return;
  __syncwarp();
  if ((threadIdx.x & 31) != 0 || atomicAdd(sh_done, 1) != static_cast<int>(blockDim.x >> 5) - 1) return;
  // w: [0] ~min start, [1] max end, [2] CTAs done, [3] records in the ring, [4] previous end, [8..] ring
  auto* w = reinterpret_cast<unsigned long long*>(ws + EpScratch::kTraceSpan);
  atomicMax(w + 1, static_cast<unsigned long long>(cuda::globaltimer_ns()));
  __threadfence();
  if (atomicInc(reinterpret_cast<unsigned*>(w + 2), gridDim.x - 1) != gridDim.x - 1) return;
  const uint64_t st = ~atomicAdd(w, 0ull), en = atomicAdd(w + 1, 0ull);
  atomicExch(w, 0ull);
  atomicExch(w + 1, 0ull);
  const unsigned long long n = w[3];
  w[8 + 2 * n] = st;
  w[9 + 2 * n] = en;
  if (n + 1 < kTraceRing) {
    w[3] = n + 1;
    return;
  }
  w[3] = 0;
  for (int i = 0; i < kTraceRing; ++i) {
    const uint64_t s = w[8 + 2 * i], e = w[9 + 2 * i], prev = i ? w[9 + 2 * (i - 1)] : w[4];
    printf("EPSPAN %s rank %d: %.1f us (start %.1f, gap %.1f us)\n", what, rank, (e - s) * 1e-3,
           (s % 1000000000ull) * 1e-3, prev && s > prev ? (s - prev) * 1e-3 : -1.0);
  }
  w[4] = en;
}

#define EP_TRACE(p, t0, what_, cond)                                                                          \
  do {                                                                                                       \
    if (ep_trace_on_ && (p).trace > 1 && (blockIdx.x == 0 || static_cast<int>(blockIdx.x) == ((p).trace_cta >= 0 ? (p).trace_cta : static_cast<int>(gridDim.x) - 1)) && (cond) && ep_tr_.n < EpTraceLog::kMax) { \
      ep_tr_.what[ep_tr_.n] = (what_);                                                                       \
      ep_tr_.us[ep_tr_.n++] = static_cast<float>(cuda::globaltimer_ns() - (t0)) * 1e-3f;                    \
    }                                                                                                        \
  } while (0)
#define EP_TRACE_FLUSH(p, t0)                                                                                \
  do {                                                                                                       \
    if (ep_trace_on_ && (p).trace > 1)                                                                       \
      for (int i_ = 0; i_ < ep_tr_.n; ++i_)                                                                  \
        printf("EPTRACE %s rank %d cta %d warp %d: %.1f us (start %.1f)\n", ep_tr_.what[i_], (p).w.rank,      \
               (int)blockIdx.x, (int)(threadIdx.x >> 5), ep_tr_.us[i_], ((t0) % 1000000000ull) * 1e-3);        \
  } while (0)

// Bounded wait of ONE thread for the OWN-memory word *p >= target that a peer (or another CTA) releases: relaxed
// polls with a __nanosleep back-off, then one acquire load (the word only grows, so it returns at once). Why not a
// tight acquire poll: hundreds of waiting warps share the SMs with the copy warps and the L2 with the incoming
// NVLink stores, and system-scope acquires in a loop slowed the whole combine down by 10x, more with more SMs.
// Records a timeout against `peer`; returns false on timeout or when another failure was recorded (abort).
JE_DEVICE bool wait_local(const uint64_t* p, uint64_t target, const EpWindow& w, int32_t op, int32_t peer) {
  uint64_t v = ld_volatile_u64(p);
  if (v < target) {
    const uint64_t start = cuda::globaltimer_ns();
    uint64_t next_check = start + cuda::kErrorPollIntervalNs;
    unsigned ns = 32;
    while ((v = ld_volatile_u64(p)) < target) {
      __nanosleep(ns);
      ns = ns < 512 ? ns * 2 : 512;
      const uint64_t now = cuda::globaltimer_ns();
      if (now - start > w.timeout_ns) {
        cuda::record_error_device(w.err, kErrTimeout, op, w.rank, peer, static_cast<int64_t>(target),
                                  static_cast<int64_t>(v), static_cast<int64_t>(now - start), 0);
        return false;
      }
      if (now >= next_check) {
        next_check = now + cuda::kErrorPollIntervalNs;
        if (cuda::ld_volatile(&w.err->code) != 0) return false;
      }
    }
  }
  (void)cuda::ld_acquire_sys(p);
  return true;
}

// ------------------------------------------------------------------------------------------------------------
// Warp copies. Loads go through L2 (ld.global.cg: never a stale L1 line for staging memory other CTAs or GPUs
// wrote). V is the access width, chosen at run time from the alignment of every pointer and stride.
template <typename V>
JE_DEVICE V ld_cg(const V* p) {
  return __ldcg(p);
}

// Copies `nbytes` from src to the destinations of the set bits of `mask` (dst(b): where bit b's copy goes, the same
// on every lane): each vector is loaded once and stored to every destination. All 32 lanes call it with the same
// arguments.
template <typename V, int U, typename Dst>
__device__ __noinline__ void warp_fanout_v(const uint8_t* __restrict__ src, unsigned mask, Dst dst, int64_t nbytes,
                                           int lane) {
  const V* s = reinterpret_cast<const V*>(src);
  const int64_t n = nbytes / static_cast<int64_t>(sizeof(V));
  for (int64_t base = 0; base < n; base += 32 * U) {
    V v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t idx = base + u * 32 + lane;
      if (idx < n) v[u] = ld_cg(s + idx);
    }
    unsigned mm = mask;
    while (mm) {
      const int b = __ffs(mm) - 1;
      mm &= mm - 1;
      V* d = reinterpret_cast<V*>(dst(b));
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t idx = base + u * 32 + lane;
        if (idx < n) d[idx] = v[u];
      }
    }
  }
}

// Rows `row(b)` (b = set bits of `mask`, row value broadcast from lane b of `row_val`) of dst_base, stride
// `dst_stride`.
template <typename V, int U>
JE_DEVICE void warp_copy_v(const uint8_t* src, uint8_t* dst_base, int64_t dst_stride, unsigned mask, int64_t row_val,
                           int64_t nbytes, int lane) {
  warp_fanout_v<V, U>(
      src, mask, [=](int b) { return dst_base + __shfl_sync(kFull, row_val, b) * dst_stride; }, nbytes, lane);
}

JE_DEVICE int access_width(const void* src, const void* dst, int64_t stride, int64_t nbytes) {
  const uint64_t a = reinterpret_cast<uint64_t>(src) | reinterpret_cast<uint64_t>(dst) |
                     static_cast<uint64_t>(stride) | static_cast<uint64_t>(nbytes);
  if ((a & 15) == 0) return 16;
  if ((a & 7) == 0) return 8;
  if ((a & 3) == 0) return 4;
  if ((a & 1) == 0) return 2;
  return 1;
}

JE_DEVICE void warp_copy(const uint8_t* src, uint8_t* dst_base, int64_t dst_stride, unsigned mask, int64_t row_val,
                         int64_t nbytes, int lane) {
  if (nbytes <= 0 || mask == 0) return;
  switch (access_width(src, dst_base, dst_stride, nbytes)) {
    case 16: warp_copy_v<uint4, 16>(src, dst_base, dst_stride, mask, row_val, nbytes, lane); break;
    case 8: warp_copy_v<uint2, 4>(src, dst_base, dst_stride, mask, row_val, nbytes, lane); break;
    case 4: warp_copy_v<unsigned, 4>(src, dst_base, dst_stride, mask, row_val, nbytes, lane); break;
    case 2: warp_copy_v<unsigned short, 4>(src, dst_base, dst_stride, mask, row_val, nbytes, lane); break;
    default: warp_copy_v<unsigned char, 4>(src, dst_base, dst_stride, mask, row_val, nbytes, lane); break;
  }
}

// One row src -> dst.
JE_DEVICE void warp_copy1(const uint8_t* src, uint8_t* dst, int64_t nbytes, int lane) {
  warp_copy(src, dst, 0, 1u, 0, nbytes, lane);
}

// Zeroes the rows of `mask` (as above).
JE_DEVICE void warp_zero(uint8_t* dst_base, int64_t dst_stride, int64_t row, int64_t nbytes, int lane) {
  uint8_t* d = dst_base + row * dst_stride;
  const uint64_t a = reinterpret_cast<uint64_t>(d) | static_cast<uint64_t>(nbytes);
  if ((a & 15) == 0) {
    for (int64_t i = lane; i < nbytes / 16; i += 32) reinterpret_cast<uint4*>(d)[i] = make_uint4(0, 0, 0, 0);
  } else if ((a & 3) == 0) {
    for (int64_t i = lane; i < nbytes / 4; i += 32) reinterpret_cast<unsigned*>(d)[i] = 0u;
  } else {
    for (int64_t i = lane; i < nbytes; i += 32) d[i] = 0;
  }
}

}  // namespace jax_engram::ep
