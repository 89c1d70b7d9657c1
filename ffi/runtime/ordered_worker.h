// One named worker thread that runs submitted tasks one after another, in submission order, and between tasks
// polls the watches its tasks left: a watch is a condition (e.g. a flag in pinned memory that a GPU stream writes)
// and what to run once it holds, or once its deadline passed. Each task gets a ticket (1, 2, ...); a caller can
// wait, bounded, until a ticket's task and every earlier one have run, or until the worker is idle (no task queued,
// no watch left).
//
// While a watch is left the thread spins on it (a pause instruction between polls): the lowest latency a host can
// have for "the GPU reached this point", at the price of one core while it waits. With no watch it sleeps.
//
// Lifecycle: the thread starts in the constructor (its owner creates the worker at first use) and is joined by
// stop() or the destructor, after the queued tasks ran and every watch fired. Never detached. A task or callback
// must not throw (an exception that escapes is caught and dropped: the owner reports failures through its own
// state).
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace jax_engram {

class OrderedWorker {
 public:
  using Clock = std::chrono::steady_clock;

  // `name`: the thread's name (at most 15 characters, shown in /proc/<pid>/task/*/comm).
  explicit OrderedWorker(const std::string& name);
  ~OrderedWorker() { stop(); }
  OrderedWorker(const OrderedWorker&) = delete;
  OrderedWorker& operator=(const OrderedWorker&) = delete;

  // Queues `task`; returns its ticket, or 0 once stopped (the task is dropped).
  uint64_t submit(std::function<void()> task);
  // From inside a task only (the worker's own thread): after this task, the worker polls `ready` between tasks
  // until it returns true and then runs fire(false), or runs fire(true) once `deadline` passed first.
  void watch(std::function<bool()> ready, std::function<void(bool timed_out)> fire, Clock::time_point deadline);
  // Blocks until the task of `ticket` and every earlier one have run; false when `timeout_s` passed first.
  bool wait(uint64_t ticket, double timeout_s);
  // Blocks until every task submitted so far has run and no watch is left; false when `timeout_s` passed first.
  bool drain(double timeout_s);
  uint64_t submitted() const;
  uint64_t completed() const;
  int watches() const { return watching_.load(std::memory_order_acquire); }
  // Runs the queued tasks and the watches to the end and joins the thread; later submits return 0.
  void stop();

 private:
  struct Watch {
    std::function<bool()> ready;
    std::function<void(bool)> fire;
    Clock::time_point deadline;
  };
  void run();
  bool poll_watches();  // one pass; true if a watch fired
  mutable std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::function<void()>> queue_;
  std::atomic<size_t> queued_{0};   // queue_.size(), read without the lock while spinning
  std::vector<Watch> watches_;      // the worker thread's own (no lock)
  std::atomic<int> watching_{0};
  uint64_t submitted_ = 0, completed_ = 0;
  bool stopped_ = false;
  std::thread::id self_;
  std::thread thread_;
};

}  // namespace jax_engram
