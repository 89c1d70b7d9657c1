// Host gather pool (see host_gather.h).
#include "runtime/host_gather.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <thread>

#include "jax_engram/engram_layout.h"
#include "runtime/env.h"
#include "runtime/spin.h"

namespace jax_engram {

// ------------------------------------------------------------------------------------------------ job
void HostGatherJob::prepare() {
  g.peers = peers.data();
  const int64_t chunks = num_chunks();
  chunk_left_.reset(new std::atomic<int64_t>[std::max<int64_t>(chunks, 1)]);
  for (int64_t c = 0; c < chunks; ++c)
    chunk_left_[c].store(std::min(chunk_items, num_items() - c * chunk_items), std::memory_order_relaxed);
}

void HostGatherJob::set_failed(const std::string& what) {
  std::lock_guard<std::mutex> lk(mu_);
  if (error_.empty()) error_ = what;
  failed_.store(true, std::memory_order_release);
}

std::string HostGatherJob::error() const {
  std::lock_guard<std::mutex> lk(mu_);
  return error_;
}

int64_t HostGatherJob::first_bad() const {
  const int64_t b = bad_.load(std::memory_order_acquire);
  return b == INT64_MAX ? -1 : b;
}

// Debug tracing only (never a tuning knob): JAX_ENGRAM_HOST_TRACE=1 prints every job's timing to stderr.
static bool host_trace() {
  static const bool on = env_int("JAX_ENGRAM_HOST_TRACE", 0, 0, 1) != 0;
  return on;
}
static int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

static inline void publish(uint32_t* flag, uint32_t v) { __atomic_store_n(flag, v, __ATOMIC_RELEASE); }

void HostGatherJob::run_item(int64_t item) {
  if (submit_ns_) {
    int64_t zero = 0;
    start_ns_.compare_exchange_strong(zero, now_ns(), std::memory_order_relaxed);
  }
  if (!failed()) {
    try {
      if (fail && item == 0)
        throw std::runtime_error("injected failure (test hook _test_fail_next_host_gather)");
      const int64_t b = item * item_rows, e = std::min(n, b + item_rows);
      const int64_t bad = cpu::engram_gather_rows(g, b, e);
      if (sf) cpu::engram_gather_sf_range(g, b, e);
      if (bad >= 0) {
        int64_t cur = bad_.load(std::memory_order_relaxed);
        while (bad < cur && !bad_.compare_exchange_weak(cur, bad, std::memory_order_acq_rel)) {
        }
      }
    } catch (const std::exception& ex) {
      set_failed(std::string("a host gather worker failed on work item ") + std::to_string(item) + ": " + ex.what());
    } catch (...) {
      set_failed("a host gather worker failed on work item " + std::to_string(item) + " (unknown exception)");
    }
  }
  const int64_t c = item / chunk_items;
  // The last chunk's flag is the finisher's (after the status word).
  if (chunk_left_[c].fetch_sub(1, std::memory_order_acq_rel) == 1) {
    if (submit_ns_ && c == 0) chunk0_ns_.store(now_ns(), std::memory_order_relaxed);
    if (flags && c + 1 < num_chunks()) publish(flags + c, seq);
  }
  if (done_items_.fetch_add(1, std::memory_order_acq_rel) + 1 == num_items()) finish();
}

void HostGatherJob::finish() {
  if (!failed()) {
    try {
      if (sf) cpu::engram_zero_sf_padding(g);
    } catch (const std::exception& ex) {
      set_failed(std::string("zeroing the scale factors' padding failed: ") + ex.what());
    }
  }
  if (status) {
    const int64_t bad = first_bad();
    *status = g.mode == engram::kModeChecked ? (bad >= 0 ? static_cast<int32_t>(bad) : engram::kNoBadPosition) : 0;
  }
  if (on_done) on_done(*this);
  if (flags) {
    // Set already unless an item never ran (a stopped pool); the last chunk's flag last of all.
    for (int64_t c = 0; c < num_chunks(); ++c)
      if (__atomic_load_n(flags + c, __ATOMIC_ACQUIRE) != seq) publish(flags + c, seq);
  }
  if (submit_ns_) {
    const int64_t end = now_ns(), start = start_ns_.load(std::memory_order_relaxed);
    const int64_t bytes = n * g.row_bytes;
    const int joined = std::min(joins_.load(std::memory_order_acquire), kTraceJoins);
    std::vector<int64_t> js(join_ns_, join_ns_ + joined);
    std::sort(js.begin(), js.end());
    auto at = [&](int64_t t) { return t ? (t - submit_ns_) / 1e3 : -1.0; };
    const int64_t c0 = chunk0_ns_.load(std::memory_order_relaxed);
    std::fprintf(stderr, "jax_engram host gather: %lld rows x %lld B = %.2f MiB, %lld items, %lld chunks; submit->first "
                 "item %.1f us, first item->done %.1f us (%.1f GB/s); %d workers joined at +%.1f / +%.1f / +%.1f us "
                 "(first / median / last), chunk 0 done +%.1f us, job done +%.1f us\n", static_cast<long long>(n),
                 static_cast<long long>(g.row_bytes), bytes / 1048576.0, static_cast<long long>(num_items()),
                 static_cast<long long>(num_chunks()), start ? (start - submit_ns_) / 1e3 : -1.0,
                 start ? (end - start) / 1e3 : -1.0, start && end > start ? bytes / double(end - start) : 0.0,
                 joined, joined ? at(js.front()) : -1.0, joined ? at(js[joined / 2]) : -1.0,
                 joined ? at(js.back()) : -1.0, at(c0), at(end));
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    finished_ = true;
  }
  cv_.notify_all();
}

void HostGatherJob::trace_join() {
  const int i = joins_.fetch_add(1, std::memory_order_acq_rel);
  if (i < kTraceJoins) join_ns_[i] = now_ns();
}

bool HostGatherJob::wait(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  return cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return finished_; });
}

// ----------------------------------------------------------------------------------------------- pool
namespace {

// The futex of a 32-bit atomic (std::atomic<uint32_t> is a plain aligned word on Linux; C++17 has no atomic wait).
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) && std::atomic<uint32_t>::is_always_lock_free,
              "the pool's futex word must be a plain 32-bit word");
inline uint32_t* futex_word(std::atomic<uint32_t>* a) { return reinterpret_cast<uint32_t*>(a); }
void futex_wait(std::atomic<uint32_t>* a, uint32_t expected) {
  syscall(SYS_futex, futex_word(a), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);  // EAGAIN / EINTR: re-checked
}
void futex_wake_all(std::atomic<uint32_t>* a) {
  syscall(SYS_futex, futex_word(a), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

// Takes `mu` spinning on try_lock first: its critical sections are a few instructions, and a worker that went to
// sleep on it would need its own wake-up (see host_gather.h, Waking).
std::unique_lock<std::mutex> lock_spinning(std::mutex& mu) {
  for (int i = 0; i < 4096; ++i) {
    if (mu.try_lock()) return std::unique_lock<std::mutex>(mu, std::adopt_lock);
    cpu_relax();
  }
  return std::unique_lock<std::mutex>(mu);
}

}  // namespace

HostGatherPool* HostGatherPool::of(Member& m, int threads, int numa_node) {
  std::lock_guard<std::mutex> lk(m.host_gather_mu);
  if (!m.host_gather) {
    m.host_gather = std::make_shared<HostGatherPool>(m.label + " rank " + std::to_string(m.rank));
    m.host_gather->set_cpus(numa_node_cpus(numa_node));
  }
  m.host_gather->grow(std::max(threads, 1));
  return m.host_gather.get();
}

int HostGatherPool::threads() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int>(threads_.size());
}

void HostGatherPool::set_cpus(std::vector<int> cpus) {
  std::lock_guard<std::mutex> lk(mu_);
  cpus_ = std::move(cpus);
}

void HostGatherPool::grow(int threads) {
  std::lock_guard<std::mutex> lk(mu_);
  if (stopped_) return;
  while (static_cast<int>(threads_.size()) < threads) {
    threads_.emplace_back([this] { worker(); });
    pthread_setname_np(threads_.back().native_handle(), "je-hostgather");
    if (!cpus_.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int c : cpus_)
        if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
      pthread_setaffinity_np(threads_.back().native_handle(), sizeof(set), &set);  // best effort
    }
  }
}

void HostGatherPool::submit(std::shared_ptr<HostGatherJob> job) {
  job->prepare();
  if (host_trace()) job->submit_ns_ = now_ns();
  if (job->num_items() == 0) {
    job->finish();
    return;
  }
  bool queued = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!stopped_ && !threads_.empty()) {
      queue_.push_back(job);
      queued = true;
    }
  }
  if (queued) {
    wake_all();
    return;
  }
  job->set_failed("the host gather pool of " + label_ + " is stopped (the context is closing)");
  job->next_.store(job->num_items());  // nothing left to pull (help)
  job->done_items_.store(job->num_items());
  job->finish();
}

void HostGatherPool::worker() {
  for (;;) {
    const uint32_t seen = epoch_.load(std::memory_order_acquire);
    std::shared_ptr<HostGatherJob> job;
    bool stopped;
    {
      auto lk = lock_spinning(mu_);
      if (!queue_.empty()) job = queue_.front();
      stopped = stopped_;
    }
    if (job) {
      // Items are claimed without the pool's lock: one atomic increment each.
      bool first = true;
      for (int64_t item; (item = job->next_.fetch_add(1, std::memory_order_relaxed)) < job->num_items();) {
        if (first && job->submit_ns_) job->trace_join();
        first = false;
        job->run_item(item);
      }
      auto lk = lock_spinning(mu_);
      if (!queue_.empty() && queue_.front() == job) queue_.pop_front();  // every item is taken: the next job may start
      continue;
    }
    if (stopped) return;  // stopped and drained
    // Idle: sleep until the epoch moves (a submit or stop).
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    if (epoch_.load(std::memory_order_seq_cst) == seen) futex_wait(&epoch_, seen);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
  }
}

void HostGatherPool::wake_all() {
  epoch_.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&epoch_);
}

int64_t HostGatherPool::help(HostGatherJob& job, int64_t limit) {
  limit = std::min(limit, job.num_items());
  int64_t ran = 0;
  int64_t item = job.next_.load(std::memory_order_relaxed);
  while (item < limit) {
    if (job.next_.compare_exchange_weak(item, item + 1, std::memory_order_relaxed)) {
      job.run_item(item);
      ++ran;
      item = job.next_.load(std::memory_order_relaxed);
    }
  }
  return ran;
}

void HostGatherPool::stop() {
  std::vector<std::thread> ts;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopped_ = true;
    ts.swap(threads_);
  }
  wake_all();
  for (auto& t : ts) t.join();
}

void stop_host_gather(Member& m) {
  // The pool stays with the member, stopped (one is made if none was): a late caller, such as an enqueue-thread task
  // that outlived a timed-out quiesce, finds it and has its job failed at once (flags set) instead of starting a
  // pool that nobody would join.
  std::shared_ptr<HostGatherPool> p;
  {
    std::lock_guard<std::mutex> lk(m.host_gather_mu);
    if (!m.host_gather) m.host_gather = std::make_shared<HostGatherPool>(m.label + " rank " + std::to_string(m.rank));
    p = m.host_gather;
  }
  p->stop();
}

int host_gather_default_threads(bool cuda) {
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // CUDA: the host-memory-bound gather + copy pipeline gains up to about 12 threads on a 16-core host (three
  // quarters of the cores, leaving the rest to XLA's own threads); CPU backend: a few threads keep CI light while
  // still running the pool concurrently.
  return cuda ? std::max(1, std::min(12, hw * 3 / 4)) : std::min(4, hw);
}

std::vector<int> numa_node_cpus(int node) {
  std::vector<int> cpus;
  if (node < 0) return cpus;
  const std::string path = "/sys/devices/system/node/node" + std::to_string(node) + "/cpulist";
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return cpus;
  char buf[4096] = {};
  const size_t len = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[len] = 0;
  // "0-7,16-23"
  const char* p = buf;
  while (*p) {
    char* end = nullptr;
    const long a = std::strtol(p, &end, 10);
    if (end == p) break;
    long b = a;
    p = end;
    if (*p == '-') {
      b = std::strtol(p + 1, &end, 10);
      p = end;
    }
    for (long c = a; c <= b && c < 4096; ++c) cpus.push_back(static_cast<int>(c));
    while (*p == ',' || *p == '\n' || *p == ' ') ++p;
  }
  return cpus;
}

}  // namespace jax_engram

namespace jax_engram {

HostGatherRate host_gather_rate(int64_t table_bytes, int64_t row_bytes, int64_t num_rows, int threads, int repeats,
                                double start_at_s, double min_seconds) {
  HostGatherRate r;
  row_bytes = std::max<int64_t>(row_bytes, 1);
  const int64_t rows = std::max<int64_t>(table_bytes / row_bytes, 1);
  table_bytes = rows * row_bytes;
  num_rows = std::max<int64_t>(num_rows, 1);
  constexpr size_t kHuge = size_t{2} << 20;
  auto round_up = [&](size_t b) { return (b + kHuge - 1) / kHuge * kHuge; };
  void* tab = std::aligned_alloc(kHuge, round_up(static_cast<size_t>(table_bytes)));
  void* out = std::aligned_alloc(kHuge, round_up(static_cast<size_t>(num_rows * row_bytes)));
  if (!tab || !out) {
    std::free(tab);
    std::free(out);
    r.error = "cannot allocate " + std::to_string(table_bytes) + " + " + std::to_string(num_rows * row_bytes) +
              " bytes";
    return r;
  }
#ifdef MADV_HUGEPAGE
  madvise(tab, round_up(static_cast<size_t>(table_bytes)), MADV_HUGEPAGE);  // as the cuMem host segments' 2 MiB pages
#endif
  std::memset(tab, 1, static_cast<size_t>(table_bytes));
  std::memset(out, 0, static_cast<size_t>(num_rows * row_bytes));
  // Every gather reads fresh rows, as a model's steps do: the gathers cycle through `sets` id sets whose rows
  // together span kFreshBytes, far more than any host's last-level cache, so a small gather is not served from the
  // cache that its own previous repeat filled.
  constexpr int64_t kFreshBytes = int64_t{1} << 30;
  constexpr int64_t kMaxIds = int64_t{16} << 20;  // 64 MiB of ids at most (tiny rows)
  const int64_t sets = std::max<int64_t>(
      1, std::min((kFreshBytes + num_rows * row_bytes - 1) / (num_rows * row_bytes), kMaxIds / num_rows));
  std::vector<int32_t> ids(static_cast<size_t>(sets * num_rows));
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (auto& id : ids) {  // xorshift: uniform random rows
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    id = static_cast<int32_t>(x % static_cast<uint64_t>(std::min<int64_t>(rows, INT32_MAX)));
  }
  HostGatherPool pool("host_gather_rate");
  pool.grow(std::max(threads, 1));
  uint8_t* peer = static_cast<uint8_t*>(tab);
  double best = 1e30;
  auto wall_s = [] {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  };
  while (start_at_s > 0 && wall_s() < start_at_s) std::this_thread::sleep_for(std::chrono::microseconds(100));
  const double w0 = wall_s();
  const auto s0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count(); };
  int64_t gathers = 0;
  for (int rep = 0; rep < std::max(repeats, 1) || elapsed() < min_seconds; ++rep, ++gathers) {
    auto job = std::make_shared<HostGatherJob>();
    job->g.ids = ids.data() + (gathers % sets) * num_rows;
    job->g.T = num_rows;
    job->g.E = 1;
    job->g.num_entries = std::min<int64_t>(rows, INT32_MAX);
    job->g.nranks = 1;
    job->g.row_bytes = row_bytes;
    job->g.out = static_cast<uint8_t*>(out);
    job->peers = {peer};
    job->n = num_rows;
    job->item_rows = engram::host_gather_plan(num_rows, row_bytes, threads).item_rows;
    job->chunk_items = 1;
    const auto t0 = std::chrono::steady_clock::now();
    pool.submit(job);
    job->wait(3600.0);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double window = elapsed();
  pool.stop();
  std::free(tab);
  std::free(out);
  r.gather_gbps = static_cast<double>(num_rows * row_bytes) / best / 1e9;
  r.seconds = best;
  r.gathers = gathers;
  r.mean_gbps = static_cast<double>(gathers) * static_cast<double>(num_rows * row_bytes) / window / 1e9;
  r.window_start_s = w0;
  r.window_end_s = w0 + window;
  return r;
}

}  // namespace jax_engram
