// Engram fetch over NCCL GIN (see engram_gin.h). Request accounting is engram_gin_plan.h's, evaluated per id
// on the device: CTA p numbers its own requests in flat order with a block scan (k = slot - peer_offset[p]) and
// stages request k at engram::gin_staging_row(p, k, staging_rows) in round engram::gin_round(k, staging_rows),
// so the staging layout is the host plan's.
#include "kernels/cuda/engram_gin.h"

#if NCCL_VERSION_CODE >= 23004
#include <nccl_device.h>

#include <cub/block/block_scan.cuh>
#include <algorithm>
#include <type_traits>
#include <utility>

#include "kernels/cuda/sync.cuh"
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
                           ::cuda::memory_order_acquire, uint64_t{}))>> : std::true_type {};

template <class G>
__device__ __forceinline__ bool wait_peer(const G& gin, ncclGinRequest_t& req, uint64_t timeout_cycles) {
  if constexpr (HasTimedWait<G>::value) {
    if (timeout_cycles)
      return gin.wait(req, ncclCoopThread{}, ncclGin_None{}, ::cuda::memory_order_acquire, timeout_cycles) == ncclSuccess;
  }
  gin.wait(req);
  return true;
}

__device__ __forceinline__ bool owner_of(const EngramGinArgs& a, int64_t i, engram::GinOwner* o) {
  bool oor = false;
  return engram::gin_owner(engram::resolve_id(a.ids[i], a.geo.total(), a.mode, &oor), a.geo, o);
}

// ncclGin::get with the segment tag of the table window (host tables: the remote VA is HOST_NUMA, the staging
// VA device memory). Headers before segment tags are refused host tables at setup (cuda_gin.cc).
template <class G>
__device__ __forceinline__ void get_row(const G& gin, ncclTeam world, int peer, ncclWindow_t table, size_t off,
                                        ncclWindow_t staging, size_t soff, size_t bytes, bool host, uint32_t flags) {
#if JE_GIN_SEGMENT_TAGS
  if (host) {
    gin.get(world, peer, table, off, staging, soff, bytes, ncclCoopThread{}, ncclGin_None{}, flags,
            ncclGin_SegmentMixed{});
    return;
  }
#endif
  (void)host;
  gin.get(world, peer, table, off, staging, soff, bytes, ncclCoopThread{}, ncclGin_None{}, flags);
}

__global__ void __launch_bounds__(kThreads) engram_gin_fetch_kernel(ncclDevComm dc, ncclWindow_t table,
                                                                    ncclWindow_t staging, EngramGinArgs a) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ unsigned long long s_count;
  __shared__ long long s_last_i;  // the round's last request, issued alone to ring the doorbell for the batch
  __shared__ int s_failed;
  const int peer = blockIdx.x;
  if (peer / a.geo.ranks_per_node == a.my_node) return;  // same node: served by the intra-node path
  if (threadIdx.x == 0) s_count = 0, s_failed = 0;
  __syncthreads();
  unsigned long long mine = 0;
  for (int64_t i = threadIdx.x; i < a.n; i += kThreads) {
    engram::GinOwner o;
    mine += owner_of(a, i, &o) && o.rank == peer;
  }
  atomicAdd(&s_count, mine);
  __syncthreads();
  const int64_t count = static_cast<int64_t>(s_count), C = a.staging_rows;
  if (count == 0) return;
  const int64_t rb = a.geo.row_bytes;
  ncclGin gin(dc, peer % dc.ginContextCount);
  const ncclTeam world = ncclTeamWorld(dc);
  const uint64_t t0 = cuda::globaltimer_ns();
  for (int64_t round = 0; round * C < count; ++round) {
    const int64_t last_k = std::min(count, (round + 1) * C) - 1;
    for (int pass = 0; pass < 2; ++pass) {  // 0: issue this round's gets into staging; 1: staging -> out
      int64_t run = 0;  // requests of this peer before the current chunk of ids (k of the plan)
      for (int64_t c = 0; c < a.n; c += kThreads) {
        const int64_t i = c + threadIdx.x;
        engram::GinOwner o;
        const int is_mine = i < a.n && owner_of(a, i, &o) && o.rank == peer;
        int pre = 0, agg = 0;
        Scan(scan).ExclusiveSum(is_mine, pre, agg);
        const int64_t k = run + pre;
        if (is_mine && engram::gin_round(k, C) == round) {
          const int64_t srow = engram::gin_staging_row(peer, k, C);
          if (pass == 0) {
            if (k == last_k)
              s_last_i = i;
            else
              get_row(gin, world, peer, table, engram::gin_remote_offset(a.geo, o), staging, srow * rb, rb,
                      a.table_host, ncclGinOptFlagsAggregateRequests);
          } else if (rb % 16 == 0) {  // rows 16-byte aligned in both buffers (window and XLA buffers are)
            const uint4* src = reinterpret_cast<const uint4*>(a.staging + srow * rb);
            uint4* dst = reinterpret_cast<uint4*>(a.out + i * rb);
            for (int64_t b = 0; b < rb / 16; ++b) dst[b] = src[b];
          } else {
            const uint8_t* src = a.staging + srow * rb;
            uint8_t* dst = a.out + i * rb;
            for (int64_t b = 0; b < rb; ++b) dst[b] = src[b];
          }
        }
        run += agg;
        __syncthreads();  // scan storage reuse; s_last_i visible after the pass
      }
      if (pass == 0) {
        if (threadIdx.x == 0) {
          engram::GinOwner o;
          owner_of(a, s_last_i, &o);
          get_row(gin, world, peer, table, engram::gin_remote_offset(a.geo, o), staging,
                  engram::gin_staging_row(peer, last_k, C) * rb, rb, a.table_host, 0u);  // not aggregated: doorbell
          ncclGinRequest_t req;
          gin.flushAsync(world, peer, &req);  // completion of this peer's gets only
          if (!wait_peer(gin, req, a.timeout_cycles)) {
            s_failed = 1;
            cuda::record_error_device(a.err, kErrTimeout, kOpEngramFetch, a.rank, peer, count, round * C,
                                      static_cast<int64_t>(cuda::globaltimer_ns() - t0), last_k);
          }
        }
        __syncthreads();
        if (s_failed) return;  // the peer did not complete: leave out as is (the error record says which)
      }
    }
    __syncthreads();  // the staging slice is reused by the next round only after every thread copied out
  }
}

}  // namespace
#endif

std::string launch_engram_gin_fetch(const ncclDevComm& dc, ncclWindow_t table, ncclWindow_t staging,
                                    const EngramGinArgs& a, cudaStream_t stream) {
#if JE_GIN_COMPILED
  if (!table || !staging) return "engram GIN fetch: no NCCL window";
  if (a.staging_rows < 1) return "engram GIN fetch: a row does not fit the staging slice of a peer";
  if (a.table_host && !JE_GIN_SEGMENT_TAGS) return "engram GIN fetch: host tables need NCCL headers with segment tags";
  if (a.n == 0) return "";
  engram_gin_fetch_kernel<<<a.geo.nranks(), kThreads, 0, stream>>>(dc, table, staging, a);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : std::string("engram GIN fetch launch: ") + cudaGetErrorString(e);
#else
  (void)dc, (void)table, (void)staging, (void)a, (void)stream;
  return "jax_engram engram GIN fetch: " + engram_gin_absent_reason();
#endif
}

}  // namespace jax_engram
