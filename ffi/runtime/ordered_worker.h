// One named worker thread that runs submitted tasks one after another, in submission order. Each task gets a ticket
// (1, 2, ...); a caller can wait, bounded, until a ticket's task and every earlier one have run.
//
// Lifecycle: the thread starts in the constructor (its owner creates the worker at first use) and is joined by
// stop() or the destructor, after the queued tasks ran. Never detached. A task must not throw (an exception that
// escapes is caught and dropped: the owner reports failures through its own state).
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace jax_engram {

class OrderedWorker {
 public:
  // `name`: the thread's name (at most 15 characters, shown in /proc/<pid>/task/*/comm).
  explicit OrderedWorker(const std::string& name);
  ~OrderedWorker() { stop(); }
  OrderedWorker(const OrderedWorker&) = delete;
  OrderedWorker& operator=(const OrderedWorker&) = delete;

  // Queues `task`; returns its ticket, or 0 once stopped (the task is dropped).
  uint64_t submit(std::function<void()> task);
  // Blocks until the task of `ticket` and every earlier one have run; false when `timeout_s` passed first.
  bool wait(uint64_t ticket, double timeout_s);
  // Blocks until every task submitted so far has run (wait(last ticket)).
  bool drain(double timeout_s);
  uint64_t submitted() const;
  uint64_t completed() const;
  // Runs the queued tasks to the end and joins the thread; later submits return 0.
  void stop();

 private:
  void run();
  mutable std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::function<void()>> queue_;
  uint64_t submitted_ = 0, completed_ = 0;
  bool stopped_ = false;
  std::thread thread_;
};

}  // namespace jax_engram
