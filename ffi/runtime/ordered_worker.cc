// Ordered worker thread (see ordered_worker.h).
#include "runtime/ordered_worker.h"

#include <pthread.h>

#include <stdexcept>

#include "runtime/spin.h"

namespace jax_engram {

OrderedWorker::OrderedWorker(const std::string& name) {
  thread_ = std::thread([this] { run(); });
  pthread_setname_np(thread_.native_handle(), name.substr(0, 15).c_str());
}

uint64_t OrderedWorker::submit(std::function<void()> task) {
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopped_) return 0;
    queue_.push_back(std::move(task));
    queued_.fetch_add(1, std::memory_order_release);
    ticket = ++submitted_;
  }
  work_cv_.notify_one();
  return ticket;
}

void OrderedWorker::watch(std::function<bool()> ready, std::function<void(bool)> fire, Clock::time_point deadline) {
  if (std::this_thread::get_id() != self_) throw std::logic_error("OrderedWorker::watch outside the worker's tasks");
  watches_.push_back({std::move(ready), std::move(fire), deadline});
  watching_.fetch_add(1, std::memory_order_acq_rel);
}

bool OrderedWorker::wait(uint64_t ticket, double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  return done_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return completed_ >= ticket; });
}

bool OrderedWorker::drain(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  const uint64_t last = submitted_;
  return done_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] {
    return completed_ >= last && watching_.load(std::memory_order_acquire) == 0;
  });
}

uint64_t OrderedWorker::submitted() const {
  std::lock_guard<std::mutex> lk(mu_);
  return submitted_;
}

uint64_t OrderedWorker::completed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return completed_;
}

bool OrderedWorker::poll_watches() {
  bool fired = false;
  const Clock::time_point now = Clock::now();
  for (size_t i = 0; i < watches_.size();) {
    bool ready = false, expired = false;
    try {
      ready = watches_[i].ready();
    } catch (...) {
      expired = true;  // a condition that cannot be read fails like one that never holds
    }
    if (!ready && !expired) expired = now >= watches_[i].deadline;
    if (!ready && !expired) {
      ++i;
      continue;
    }
    Watch w = std::move(watches_[i]);
    watches_.erase(watches_.begin() + static_cast<std::ptrdiff_t>(i));
    try {
      w.fire(!ready);
    } catch (...) {
    }
    watching_.fetch_sub(1, std::memory_order_acq_rel);
    fired = true;
  }
  return fired;
}

void OrderedWorker::run() {
  self_ = std::this_thread::get_id();
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    if (!queue_.empty()) {
      std::function<void()> task = std::move(queue_.front());
      queue_.pop_front();
      queued_.fetch_sub(1, std::memory_order_release);
      lk.unlock();
      try {
        task();
      } catch (...) {  // tasks report through their owner's state; never let one end the thread
      }
      task = nullptr;  // destroyed without mu_ (a Python task's destructor takes the GIL, which submit() may hold)
      lk.lock();
      ++completed_;
      done_cv_.notify_all();
      continue;
    }
    if (!watches_.empty()) {
      // Spin on the watches, without the lock, until one fires or a task arrives.
      lk.unlock();
      bool fired = false;
      while (!fired && queued_.load(std::memory_order_acquire) == 0) {
        fired = poll_watches();
        if (!fired) cpu_relax();
      }
      lk.lock();
      if (fired) done_cv_.notify_all();
      continue;
    }
    if (stopped_) return;  // nothing queued, nothing watched
    work_cv_.wait(lk, [&] { return stopped_ || !queue_.empty(); });
  }
}

void OrderedWorker::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopped_ = true;
  }
  work_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

}  // namespace jax_engram
