// Engram fetch over NCCL GIN (see engram_gin.h). Request accounting is engram_gin_plan.h's, evaluated per id
// on the device: CTA p counts the requests of lower ranks (= peer_offset[p]) and numbers its own requests in
// flat order with a block scan (= slot), so the staging layout is the host plan's.
#include "kernels/cuda/engram_gin.h"

#if NCCL_VERSION_CODE >= 23004
#include <nccl_device.h>

#include <cub/block/block_scan.cuh>
#include <type_traits>
#include <utility>
#define JE_GIN_COMPILED 1
#else
#define JE_GIN_COMPILED 0
#endif

namespace jax_engram {

bool engram_gin_compiled() { return JE_GIN_COMPILED != 0; }

std::string engram_gin_absent_reason() {
  if (JE_GIN_COMPILED) return "";
  const int v = NCCL_VERSION_CODE;
  return "GIN not compiled in (NCCL " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100) + " headers; needs >= 2.30.4)";
}

#if JE_GIN_COMPILED
namespace {

constexpr int kThreads = 256;

// ncclGin::wait with a cycle bound (newer headers) or without (2.30.x: bounded only by the communicator's abort
// flag). Returns false when the bound passed.
template <class G, class = void>
struct HasTimedWait : std::false_type {};
template <class G>
struct HasTimedWait<G, std::void_t<decltype(std::declval<const G&>().wait(
                           std::declval<ncclGinRequest_t&>(), ncclCoopThread{}, ncclGin_None{},
                           cuda::memory_order_acquire, uint64_t{}))>> : std::true_type {};

template <class G>
__device__ __forceinline__ bool wait_peer(const G& gin, ncclGinRequest_t& req, uint64_t timeout_cycles) {
  if constexpr (HasTimedWait<G>::value) {
    if (timeout_cycles)
      return gin.wait(req, ncclCoopThread{}, ncclGin_None{}, cuda::memory_order_acquire, timeout_cycles) == ncclSuccess;
  }
  gin.wait(req);
  return true;
}

__device__ __forceinline__ bool owner_of(const EngramGinArgs& a, int64_t i, engram::GinOwner* o) {
  bool oor = false;
  return engram::gin_owner(engram::resolve_id(a.ids[i], a.geo.total(), a.mode, &oor), a.geo, o);
}

__global__ void __launch_bounds__(kThreads) engram_gin_fetch_kernel(ncclDevComm dc, ncclWindow_t win,
                                                                    EngramGinArgs a) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ unsigned long long s_base, s_count;
  __shared__ long long s_last_i;  // the peer's last request, issued alone to ring the doorbell for the batch
  const int peer = blockIdx.x;
  if (peer / a.geo.ranks_per_node == a.my_node) return;  // same node: served by the intra-node path
  if (threadIdx.x == 0) s_base = s_count = 0;
  __syncthreads();
  unsigned long long below = 0, mine = 0;
  for (int64_t i = threadIdx.x; i < a.n; i += kThreads) {
    engram::GinOwner o;
    if (owner_of(a, i, &o)) below += o.rank < peer, mine += o.rank == peer;
  }
  atomicAdd(&s_base, below);
  atomicAdd(&s_count, mine);
  __syncthreads();
  const int64_t base = static_cast<int64_t>(s_base), count = static_cast<int64_t>(s_count);
  if (count == 0) return;
  const int64_t rb = a.geo.row_bytes;
  ncclGin gin(dc, peer % dc.ginContextCount);
  const ncclTeam world = ncclTeamWorld(dc);
  for (int pass = 0; pass < 2; ++pass) {  // 0: issue gets into staging; 1: staging -> out
    int64_t run = base;
    for (int64_t c = 0; c < a.n; c += kThreads) {
      const int64_t i = c + threadIdx.x;
      engram::GinOwner o;
      const int is_mine = i < a.n && owner_of(a, i, &o) && o.rank == peer;
      int pre = 0, agg = 0;
      Scan(scan).ExclusiveSum(is_mine, pre, agg);
      if (is_mine) {
        const int64_t slot = run + pre;
        if (pass == 0) {
          if (slot == base + count - 1) {
            s_last_i = i;
          } else {
            gin.get(world, peer, win, engram::gin_remote_offset(a.geo, o.row), win, a.staging_offset + slot * rb, rb,
                    ncclCoopThread{}, ncclGin_None{}, ncclGinOptFlagsAggregateRequests);
          }
        } else {
          if (rb % 16 == 0) {  // rows 16-byte aligned in both buffers (window and XLA buffers are)
            const uint4* src = reinterpret_cast<const uint4*>(a.staging + slot * rb);
            uint4* dst = reinterpret_cast<uint4*>(a.out + i * rb);
            for (int64_t b = 0; b < rb / 16; ++b) dst[b] = src[b];
          } else {
            const uint8_t* src = a.staging + slot * rb;
            uint8_t* dst = a.out + i * rb;
            for (int64_t b = 0; b < rb; ++b) dst[b] = src[b];
          }
        }
      }
      run += agg;
      __syncthreads();  // scan storage reuse
    }
    if (pass == 0) {
      if (threadIdx.x == 0) {
        engram::GinOwner o;
        owner_of(a, s_last_i, &o);
        gin.get(world, peer, win, engram::gin_remote_offset(a.geo, o.row), win,
                a.staging_offset + (base + count - 1) * rb, rb);  // no aggregation flag: rings the doorbell
        ncclGinRequest_t req;
        gin.flushAsync(world, peer, &req);  // completion of this peer's gets only
        if (!wait_peer(gin, req, a.timeout_cycles) && a.status) atomicCAS(a.status, 0, 1 + peer);
      }
      __syncthreads();
      if (a.status && *reinterpret_cast<volatile int32_t*>(a.status) != 0) return;  // a peer timed out: leave out as is
    }
  }
}

}  // namespace
#endif

std::string launch_engram_gin_fetch(const ncclDevComm& dc, ncclWindow_t window, const EngramGinArgs& a,
                                    cudaStream_t stream) {
#if JE_GIN_COMPILED
  if (!window) return "engram GIN fetch: no NCCL window";
  if (a.n == 0) return "";
  engram_gin_fetch_kernel<<<a.geo.nranks(), kThreads, 0, stream>>>(dc, window, a);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : std::string("engram GIN fetch launch: ") + cudaGetErrorString(e);
#else
  (void)dc, (void)window, (void)a, (void)stream;
  return "jax_engram engram GIN fetch: " + engram_gin_absent_reason();
#endif
}

}  // namespace jax_engram
