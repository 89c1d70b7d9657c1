// Engram host path launcher (see engram_host.h).
#include "kernels/cuda/engram_host.h"

#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "jax_engram/engram_layout.h"
#include "kernels/cuda/engram_order.h"
#include "runtime/cuda_driver.h"
#include "runtime/cuda_member.h"
#include "runtime/env.h"
#include "runtime/host_gather.h"

namespace jax_engram {
namespace {

// Pinned staging of one stream. Grown (never shrunk) under HostFetchState::mu by the thread that enqueues a fetch on
// that stream. A grow never synchronizes (a stream may be waiting on a flag that only the enqueue thread's watch can
// let through) and never frees (cudaFreeHost synchronizes the device): the outgrown buffers, which earlier copies
// and workers may still use, are kept in `retired` until the member is destroyed. Capacities grow by at least half,
// so a warm-up retires a few buffers.
struct Staging {
  uint8_t* rows = nullptr;
  size_t rows_cap = 0;
  int32_t* ids = nullptr;
  size_t ids_cap = 0;
  uint32_t* flags = nullptr;      // mapped: [0, chunks) per chunk (the last one: job done); the second-to-last word:
  uint32_t* flags_dev = nullptr;  // the start flag (the ids are in pinned memory); the last word: status
  size_t flags_cap = 0;           // words, the start and status words included (last)
  uint32_t seq = 0;
  std::vector<void*> retired;

  void release() {
    for (void* p : {static_cast<void*>(rows), static_cast<void*>(ids), static_cast<void*>(flags)})
      if (p) cudaFreeHost(p);
    for (void* p : retired) cudaFreeHost(p);
    retired.clear();
    rows = nullptr;
    ids = nullptr;
    flags = nullptr;
    flags_dev = nullptr;
    rows_cap = ids_cap = flags_cap = 0;
  }
};

struct HostFetchState {
  std::mutex mu;
  std::map<cudaStream_t, Staging> streams;
  // Overlapped fetches queued on the enqueue thread (under enq_mu): fork events (one per queued fetch, back in
  // forks_free once the side stream waited for it), each slot's latest ticket, and enqueue failures not reported yet
  // (by slot).
  std::mutex enq_mu;
  std::vector<cudaEvent_t> forks_all, forks_free;
  std::map<int64_t, uint64_t> slot_ticket;
  std::map<int64_t, std::string> errors;
  ~HostFetchState() {  // the enqueue thread was joined before (destroy_member)
    for (auto& kv : streams) kv.second.release();
    for (cudaEvent_t ev : forks_all) cudaEventDestroy(ev);
  }
};

HostFetchState& host_fetch_state(CudaMemberState& st) {
  static std::mutex create_mu;
  std::lock_guard<std::mutex> lk(create_mu);
  if (!st.host_fetch) st.host_fetch = std::make_shared<HostFetchState>();
  return *static_cast<HostFetchState*>(st.host_fetch.get());
}

// Debug tracing only (never a tuning knob): JAX_ENGRAM_HOST_TRACE=1 prints the enqueue thread's time per fetch.
bool enqueue_trace() {
  static const bool on = env_int("JAX_ENGRAM_HOST_TRACE", 0, 0, 1) != 0;
  return on;
}

// Grows `cur` (cudaHostAlloc with `flags`) to at least `need` bytes (and by at least half); the outgrown buffer goes
// to `retired` (see Staging).
template <typename T>
cudaError_t grow(T** cur, size_t* cap, size_t need, unsigned flags, std::vector<void*>* retired) {
  if (*cap >= need) return cudaSuccess;
  const size_t bytes = std::max<size_t>({need, *cap + *cap / 2, 64});
  void* p = nullptr;
  cudaError_t e = cudaHostAlloc(&p, bytes, flags);
  if (e != cudaSuccess) return e;
  if (*cur) retired->push_back(*cur);
  *cur = static_cast<T*>(p);
  *cap = bytes;
  return cudaSuccess;
}

// Scale factors from the replicated sf table (device-readable wherever it lives): one thread per (flat position,
// pack); the col-major layout's padding is zeroed first.
__global__ void sf_gather_kernel(const int32_t* ids, int64_t n, int64_t E, int64_t T, int64_t total, int32_t mode,
                                 const uint32_t* sf_table, int64_t P, int32_t layout, uint32_t* sf_out) {
  const int64_t EP = E * P;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n * P;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = k / P, p = k % P;
    bool oob = false;
    const int64_t id = engram::resolve_id(ids[i], total, mode, &oob);
    const int64_t t = i / E, j = (i % E) * P + p;
    sf_out[engram::sf_out_index(t, j, T, EP, layout)] = id < 0 ? 0u : sf_table[id * P + p];
  }
}

// The synchronous fallback (no stream memory operations): a cudaLaunchHostFunc callback that gathers every item with
// the pool and waits for the job (never a CUDA call here).
struct Post {
  HostGatherPool* pool;
  std::shared_ptr<HostGatherJob> job;
  double timeout_s;
};

void CUDART_CB post_job_sync(void* arg) {
  std::unique_ptr<Post> p(static_cast<Post*>(arg));
  p->pool->submit(p->job);
  HostGatherPool::help(*p->job, p->job->num_items());
  if (!p->job->wait(p->timeout_s)) p->job->abandon("timed out");
}

OrderedWorker* enqueuer(CudaMemberState& st) {
  std::lock_guard<std::mutex> lk(st.enqueuer_mu);
  if (!st.enqueuer) st.enqueuer = std::make_unique<OrderedWorker>("je-enqueue");
  return st.enqueuer.get();
}

}  // namespace

cudaError_t launch_engram_host_fetch(const EngramHostFetchArgs& a, cudaStream_t stream, std::string* what) {
  Member& m = *a.member;
  CudaMemberState& st = *a.state;
  const int64_t n = a.T * a.E;
  const int64_t rb = a.row_bytes;
  const int64_t total = static_cast<int64_t>(m.nranks) * a.num_entries;
  const bool sf_any = a.sf_table && a.P > 0;
  const int64_t sf_words = sf_any ? engram::sf_out_elems(a.T, a.E * a.P, a.sf_layout) : 0;
  const int threads = a.threads > 0 ? a.threads : host_gather_default_threads(true);
  const engram::HostGatherPlan plan = engram::host_gather_plan(n, rb, threads);
  const int64_t item_rows = plan.item_rows, chunk_items = plan.chunk_items;
  const int64_t items = n == 0 ? 0 : (n + item_rows - 1) / item_rows;
  const int64_t chunks = items == 0 ? 0 : (items + chunk_items - 1) / chunk_items;
  const size_t flag_words = static_cast<size_t>(chunks + 2);  // chunks, start, status
  // Gated: the copies wait for the chunks' flags, and the job starts when the enqueue thread sees the start flag.
  const CudaDriver* drv = cuda_driver(nullptr);
  const bool gate = st.stream_wait_value && drv && drv->cuStreamWriteValue32;

  Staging* sg;
  HostFetchState* hs = &host_fetch_state(st);
  std::lock_guard<std::mutex> lk(hs->mu);
  sg = &hs->streams[stream];
  cudaError_t e = cudaSuccess;
  e = grow(&sg->rows, &sg->rows_cap, static_cast<size_t>(n * rb), cudaHostAllocPortable, &sg->retired);
  if (e == cudaSuccess)
    e = grow(&sg->ids, &sg->ids_cap, static_cast<size_t>(n) * 4, cudaHostAllocPortable, &sg->retired);
  if (e == cudaSuccess && sg->flags_cap < flag_words * 4) {
    e = grow(&sg->flags, &sg->flags_cap, flag_words * 4, cudaHostAllocMapped | cudaHostAllocPortable, &sg->retired);
    if (e == cudaSuccess) {
      std::fill(sg->flags, sg->flags + sg->flags_cap / 4, 0u);
      void* dp = nullptr;
      e = cudaHostGetDevicePointer(&dp, sg->flags, 0);
      sg->flags_dev = static_cast<uint32_t*>(dp);
    }
  }
  if (e != cudaSuccess) {
    *what = "allocating the host-path staging (pinned, " + std::to_string(n * rb) + " bytes)";
    return e;
  }
  if (n == 0) {  // nothing to gather: the status of an empty fetch (checked: kNoBadPosition = 0x7f7f7f7f)
    if ((e = cudaMemsetAsync(a.status, a.mode == engram::kModeChecked ? 0x7f : 0, 4, stream)) != cudaSuccess)
      *what = "writing the status word";
    if (e == cudaSuccess && sf_any && sf_words &&
        (e = cudaMemsetAsync(a.sf_out, 0, static_cast<size_t>(sf_words) * 4, stream)) != cudaSuccess)
      *what = "zeroing the sf result";
    return e;
  }
  if (++sg->seq == 0) sg->seq = 1;  // flags start at 0: never wait for 0
  const uint32_t seq = sg->seq;
  uint32_t* status_word = sg->flags + (sg->flags_cap / 4 - 1);
  uint32_t* start_word = sg->flags + (sg->flags_cap / 4 - 2);
  uint32_t* start_dev = sg->flags_dev + (sg->flags_cap / 4 - 2);
  int32_t* status_host = reinterpret_cast<int32_t*>(status_word);

  // 1. ids -> pinned
  if ((e = cudaMemcpyAsync(sg->ids, a.ids, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToHost, stream)) !=
               cudaSuccess) {
    *what = "copying the ids to pinned memory";
    return e;
  }
  // 2. the job
  auto job = std::make_shared<HostGatherJob>();
  cpu::EngramGather& g = job->g;
  g.ids = sg->ids;
  g.T = a.T;
  g.E = a.E;
  g.num_entries = a.num_entries;
  g.nranks = m.nranks;
  g.offset = a.offset;
  g.row_bytes = rb;
  g.mode = a.mode;
  g.out = sg->rows;
  g.streaming = true;
  g.sf_table = nullptr;  // the scale factors: the small GPU gather above (a few bytes per row, wherever they live)
  g.P = 0;
  job->peers = a.table->peers;
  job->n = n;
  job->item_rows = item_rows;
  job->chunk_items = chunk_items;
  job->flags = gate ? sg->flags : nullptr;
  job->seq = seq;
  job->status = status_host;
  job->fail = m.host_gather_fail_next.exchange(false);
  ErrorRecord* rec = m.error_host;
  const int32_t rank = m.rank;
  job->on_done = [rec, rank](HostGatherJob& j) {
    if (j.failed()) record_error(rec, kErrHostGather, kOpEngramFetch, rank, -1, 0, 0, 0, j.num_items());
  };
  HostGatherPool* pool = HostGatherPool::of(m, threads, st.host_numa_id);
  if (gate) {
    // The stream writes the start flag once the ids are in pinned memory; the member's enqueue thread, which spins
    // on it, submits the job and gathers items of the first chunk itself while the workers wake (the stream waits
    // for that chunk next anyway). A host function would start the job too, but its thread is woken by the driver,
    // which takes up to hundreds of microseconds in a VM: a small fetch's whole gather.
    CUresult r = drv->cuStreamWriteValue32(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(start_dev),
                                           seq, CU_STREAM_WRITE_VALUE_DEFAULT);
    if (r != CUDA_SUCCESS) {
      *what = "cuStreamWriteValue32 of the host gather's start flag: " + cu_error_string(r);
      return cudaErrorUnknown;
    }
    OrderedWorker* w = enqueuer(st);
    const auto deadline = OrderedWorker::Clock::now() + std::chrono::duration_cast<OrderedWorker::Clock::duration>(
                                                            std::chrono::duration<double>(m.timeout_s));
    const double timeout_s = m.timeout_s;
    auto arm = [w, pool, job, start_word, seq, deadline, timeout_s] {
      w->watch([start_word, seq] { return __atomic_load_n(start_word, __ATOMIC_ACQUIRE) == seq; },
               [pool, job, timeout_s](bool timed_out) {
                 if (timed_out)  // the job still runs (skipping its items) and sets every flag: nothing hangs
                   job->abandon("the stream did not reach the fetch within the context timeout (" +
                                std::to_string(timeout_s) + " s)");
                 pool->submit(job);
                 if (!timed_out) HostGatherPool::help(*job, job->chunk_items);
               },
               deadline);
    };
    if (!w->submit(arm)) {
      *what = "arming the host gather's start (the enqueue thread is stopped: the context is closing)";
      return cudaErrorNotReady;
    }
  } else {
    auto* post = new Post{pool, job, m.timeout_s};
    if ((e = cudaLaunchHostFunc(stream, post_job_sync, post)) != cudaSuccess) {
      delete post;
      *what = "enqueuing the host gather (cudaLaunchHostFunc)";
      return e;
    }
  }
  // the scale factors: a small kernel (reads the ids on the device; independent of the rows), after the host function
  // so that it runs while the CPU gathers instead of delaying the gather's start
  if (sf_any) {
    if (a.sf_layout == engram::kSfTmaColMajor &&
        (e = cudaMemsetAsync(a.sf_out, 0, static_cast<size_t>(sf_words) * 4, stream)) != cudaSuccess) {
      *what = "zeroing the sf result";
      return e;
    }
    const int64_t work = n * a.P;
    const int blocks = static_cast<int>(std::min<int64_t>((work + 255) / 256, 1024));
    sf_gather_kernel<<<blocks, 256, 0, stream>>>(a.ids, n, a.E, a.T, total, a.mode, a.sf_table, a.P, a.sf_layout,
                                                 a.sf_out);
    if ((e = cudaGetLastError()) != cudaSuccess) {
      *what = "launching the scale-factor gather kernel";
      return e;
    }
  }
  // 3. per chunk: wait for its flag, copy it
  const int64_t chunk_rows = item_rows * chunk_items;
  auto wait_flag = [&](int64_t c) -> cudaError_t {
    const CUresult r = drv->cuStreamWaitValue32(reinterpret_cast<CUstream>(stream),
                                                reinterpret_cast<CUdeviceptr>(sg->flags_dev + c), seq,
                                                CU_STREAM_WAIT_VALUE_EQ);
    if (r != CUDA_SUCCESS) {
      *what = "cuStreamWaitValue32 on the host gather's chunk flag: " + cu_error_string(r);
      return cudaErrorUnknown;
    }
    return cudaSuccess;
  };
  for (int64_t c = 0; c < (gate ? chunks : 1); ++c) {
    const int64_t r0 = gate ? c * chunk_rows : 0, r1 = gate ? std::min(n, r0 + chunk_rows) : n;
    if (gate && (e = wait_flag(c)) != cudaSuccess) return e;
    if ((e = cudaMemcpyAsync(a.out + r0 * rb, sg->rows + r0 * rb, static_cast<size_t>((r1 - r0) * rb),
                             cudaMemcpyHostToDevice, stream)) != cudaSuccess) {
      *what = "copying a chunk of gathered rows to the GPU";
      return e;
    }
  }
  // 4. the status: the last chunk's flag (waited for above) is set after it
  if ((e = cudaMemcpyAsync(a.status, status_host, 4, cudaMemcpyHostToDevice, stream)) != cudaSuccess) {
    *what = "copying the status word";
    return e;
  }
  return cudaSuccess;
}

std::string enqueue_engram_host_fetch(const EngramHostFetchArgs& a, cudaStream_t stream, int64_t slot) {
  Member& m = *a.member;
  CudaMemberState& st = *a.state;
  HostFetchState& hs = host_fetch_state(st);
  OrderedWorker* worker = enqueuer(st);
  cudaEvent_t fork = nullptr;
  {
    std::lock_guard<std::mutex> lk(hs.enq_mu);
    if (!hs.forks_free.empty()) {
      fork = hs.forks_free.back();
      hs.forks_free.pop_back();
    }
  }
  cudaError_t e = cudaSuccess;
  if (!fork) {
    if ((e = cudaEventCreateWithFlags(&fork, cudaEventDisableTiming)) != cudaSuccess)
      return "creating the fetch's fork event failed: " + cuda_error_string(e);
    std::lock_guard<std::mutex> lk(hs.enq_mu);
    hs.forks_all.push_back(fork);
  }
  auto give_back = [&hs](cudaEvent_t ev) {
    std::lock_guard<std::mutex> lk(hs.enq_mu);
    hs.forks_free.push_back(ev);
  };
  if ((e = cudaEventRecord(fork, stream)) != cudaSuccess) {
    give_back(fork);
    return "recording the fetch's fork event on XLA's stream failed: " + cuda_error_string(e);
  }
  const cudaStream_t side = st.side_stream;
  const EngramHostFetchArgs args = a;
  // The task runs on the enqueue thread: everything the handler would have enqueued, on the side stream.
  auto task = [args, &st, &hs, fork, slot, side, give_back]() {
    const auto t0 = std::chrono::steady_clock::now();
    std::string what;
    cudaError_t e = cudaSuccess;
    CudaDeviceGuard g(st.device);
    if ((e = g.status()) != cudaSuccess) what = "cudaSetDevice on the enqueue thread";
    if (e == cudaSuccess && (e = cudaStreamWaitEvent(side, fork, 0)) != cudaSuccess)
      what = "ordering the side stream after XLA's stream (fork event)";
    give_back(fork);  // the wait took the event's state: it may be recorded again
    std::string fail;
    if (e == cudaSuccess && args.member->host_enqueue_fail_next.exchange(false))
      fail = "injected failure (test hook _test_fail_next_host_enqueue)";
    if (e == cudaSuccess && fail.empty()) e = launch_engram_host_fetch(args, side, &what);
    if (e == cudaSuccess && fail.empty() && slot > 0) e = engram_slot_record(st, slot, side, &what);
    if (e != cudaSuccess) fail = "the host path (" + what + ") failed: " + cuda_error_string(e);
    if (!fail.empty()) {
      std::lock_guard<std::mutex> lk(hs.enq_mu);
      hs.errors.emplace(slot, "rank " + std::to_string(args.member->rank) + ": enqueuing the overlapped fetch (slot " +
                                  std::to_string(slot) + ") on the side stream: " + fail);
    }
    if (enqueue_trace())
      std::fprintf(stderr, "jax_engram host path: rank %d slot %lld enqueued on the enqueue thread in %.1f us%s\n",
                   args.member->rank, static_cast<long long>(slot),
                   std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count(),
                   fail.empty() ? "" : " (failed)");
  };
  std::lock_guard<std::mutex> lk(hs.enq_mu);  // the ticket is in slot_ticket before a wait can look for it
  const uint64_t ticket = worker->submit(std::move(task));
  if (!ticket) {
    hs.forks_free.push_back(fork);
    return "the enqueue thread of " + m.label + " is stopped (the context is closing)";
  }
  hs.slot_ticket[slot] = ticket;
  return "";
}

std::string engram_host_enqueued(Member& m, CudaMemberState& st, int64_t slot, bool take_errors) {
  OrderedWorker* worker;
  {
    std::lock_guard<std::mutex> lk(st.enqueuer_mu);
    worker = st.enqueuer.get();
  }
  if (!worker || !st.host_fetch) return "";  // nothing was ever queued
  HostFetchState& hs = *static_cast<HostFetchState*>(st.host_fetch.get());
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lk(hs.enq_mu);
    if (slot > 0) {
      auto it = hs.slot_ticket.find(slot);
      ticket = it == hs.slot_ticket.end() ? 0 : it->second;
    } else {
      ticket = worker->submitted();
    }
  }
  if (ticket && !worker->wait(ticket, m.timeout_s))
    return "rank " + std::to_string(m.rank) + ": the enqueue thread did not enqueue the overlapped fetch (slot " +
           std::to_string(slot) + ") on the side stream within the context timeout (" + std::to_string(m.timeout_s) +
           " s)";
  if (!take_errors) return "";
  std::lock_guard<std::mutex> lk(hs.enq_mu);
  auto it = slot > 0 ? hs.errors.find(slot) : hs.errors.begin();
  if (it == hs.errors.end()) return "";
  std::string msg = std::move(it->second);
  hs.errors.erase(it);
  return msg;
}

}  // namespace jax_engram
