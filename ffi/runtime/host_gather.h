// Host gather pool: the worker threads of one member that gather Engram rows of host-readable tables into a
// buffer (the CPU backend's fetch result, or the CUDA host path's pinned staging) with cpu::engram_gather_rows.
//
// Lifecycle: created at the member's first host gather (HostGatherPool::of), joined when the member is destroyed
// (Registry::destroy_member -> stop_host_gather, after the backend's quiesce: queued jobs still run to the end, so
// a stream waiting on their flags is released), never detached. Threads are named "je-hostgather".
// Waking: idle workers sleep on one futex word (the pool's epoch), which every submit and stop advances after
// releasing the pool's lock, so that one system call wakes them all in parallel; a condition variable signalled under
// the lock would have each woken worker take the lock in turn, a chain of wake-ups that in a VM costs tens of
// microseconds per worker. A worker takes that lock by spinning on try_lock first, for the same reason.
// Jobs: a fetch's rows cut into work items (item_rows rows, engram::host_gather_plan) that the workers pull in
// order, each item with its rows' scale factors; items form chunks (chunk_items items) whose completion is published
// by a flag store (flags[c] = seq), except the last chunk's: when every item is done the finisher writes the status
// word, runs on_done and then publishes the last chunk's flag, so that one wait for it covers the last rows and the
// status. The thread that submits a job may pull items too (HostGatherPool::help).
// A failing item (an exception inside a worker, or the test hook) marks the job failed; every flag is still set,
// so nothing waiting on them hangs, and the failure is reported by the job's owner (error / on_done).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/engram.h"
#include "runtime/runtime.h"

namespace jax_engram {

struct HostGatherJob {
  cpu::EngramGather g;                 // g.peers points into `peers`
  std::vector<uint8_t*> peers;         // the table's allocation on every rank (host-readable), owned here
  int64_t n = 0;                       // rows: T*E
  int64_t item_rows = 1;               // rows per work item
  int64_t chunk_items = 1;             // items per flagged chunk
  uint32_t* flags = nullptr;           // num_chunks() words (nullptr: none): chunk c done -> flags[c] = seq; the
  uint32_t seq = 0;                    // last chunk's once the whole job is done (status written, on_done run)
  int32_t* status = nullptr;           // written by the finisher (checked: first bad position or kNoBadPosition;
                                       // else 0); nullptr: none
  bool sf = false;                     // the items gather the scale factors too (g.sf_table host-readable)
  bool fail = false;                   // test hook: item 0 throws inside its worker
  std::function<void(HostGatherJob&)> on_done;  // run by the finisher before the last flag (failed() is final)

  int64_t num_items() const { return n == 0 ? 0 : (n + item_rows - 1) / item_rows; }
  int64_t num_chunks() const { return num_items() == 0 ? 0 : (num_items() + chunk_items - 1) / chunk_items; }
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  std::string error() const;
  int64_t first_bad() const;           // first out-of-range flat position, -1 if none
  // Marks the job failed with `why` (items not started yet are skipped; flags are still set).
  void abandon(const std::string& why) { set_failed(why); }
  // Blocks until the finisher ran or `timeout_s` passed; false on timeout.
  bool wait(double timeout_s);

 private:
  friend class HostGatherPool;
  void prepare();
  void run_item(int64_t item);
  void finish();
  void set_failed(const std::string& what);
  std::atomic<int64_t> next_{0}, done_items_{0}, bad_{INT64_MAX};
  // Debug tracing (JAX_ENGRAM_HOST_TRACE=1): steady-clock ns of submit and of the first item's start.
  // Also each worker's first item (join) and the first chunk's completion.
  int64_t submit_ns_ = 0;
  std::atomic<int64_t> start_ns_{0};
  static constexpr int kTraceJoins = 64;
  std::atomic<int> joins_{0};
  int64_t join_ns_[kTraceJoins] = {};
  std::atomic<int64_t> chunk0_ns_{0};
  void trace_join();
  std::unique_ptr<std::atomic<int64_t>[]> chunk_left_;
  std::atomic<bool> failed_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool finished_ = false;
  std::string error_;
};

class HostGatherPool {
 public:
  // The member's pool with at least `threads` workers (created, or grown, here). numa_node >= 0: workers are
  // pinned to that host NUMA node's CPUs (the GPU's, where known).
  static HostGatherPool* of(Member& m, int threads, int numa_node = -1);
  explicit HostGatherPool(std::string label) : label_(std::move(label)) {}
  ~HostGatherPool() { stop(); }
  HostGatherPool(const HostGatherPool&) = delete;
  HostGatherPool& operator=(const HostGatherPool&) = delete;

  // Queues a job (returns at once; safe from a CUDA host function: no CUDA call, no blocking beyond a mutex).
  // A stopped pool finishes the job at once as failed (flags set).
  void submit(std::shared_ptr<HostGatherJob> job);
  // The calling thread pulls items of a submitted job, as a worker does, while items below `limit` are left (it
  // is awake already, the workers are still waking). Returns the number of items it ran.
  static int64_t help(HostGatherJob& job, int64_t limit);
  // Adds workers up to `threads` (no-op once stopped).
  void grow(int threads);
  // Runs every queued job to the end and joins the workers.
  void stop();
  int threads() const;
  // Pins the workers started from now on to these CPUs (empty: no pinning).
  void set_cpus(std::vector<int> cpus);

 private:
  void worker();
  void wake_all();  // advances epoch_ and wakes its sleepers (never under mu_)
  std::string label_;
  std::atomic<uint32_t> epoch_{0};         // the futex word idle workers sleep on
  std::atomic<int> sleepers_{0};           // workers in (or entering) the futex wait
  mutable std::mutex mu_;
  std::deque<std::shared_ptr<HostGatherJob>> queue_;
  std::vector<std::thread> threads_;
  std::vector<int> cpus_;
  bool stopped_ = false;
};

// Measurement (the modules' host_gather_rate): `num_rows` random rows of a `table_bytes` table in plain host memory
// (2 MiB-aligned, huge pages advised) gathered by a pool of `threads` workers into a buffer; best of `repeats`.
// Each gather takes the next of several random id sets, whose rows together span 1 GiB: no repeat finds its rows
// in the host's caches.
// For several processes gathering at once: the timed window starts at `start_at_s` (wall clock, seconds since the
// epoch; 0 = as soon as the table is filled) and gathers repeat until it lasted `min_seconds` (and `repeats` ran);
// mean_gbps is the window's bytes over its length, [window_start_s, window_end_s] its wall-clock span.
struct HostGatherRate {
  double gather_gbps = 0, seconds = 0;
  double mean_gbps = 0, window_start_s = 0, window_end_s = 0;
  int64_t gathers = 0;
  std::string error;  // "" on success
};
HostGatherRate host_gather_rate(int64_t table_bytes, int64_t row_bytes, int64_t num_rows, int threads, int repeats,
                                double start_at_s = 0, double min_seconds = 0);

// Joins the member's pool (if any). Called by Registry::destroy_member after the backend's quiesce.
void stop_host_gather(Member& m);

// Default worker count for a backend's host gathers when the fetch asks for 0 (auto).
int host_gather_default_threads(bool cuda);

// The CPUs of host NUMA node `node` (/sys/devices/system/node/nodeN/cpulist); empty if unknown.
std::vector<int> numa_node_cpus(int node);

}  // namespace jax_engram
