// Ordered worker thread (see ordered_worker.h).
#include "runtime/ordered_worker.h"

#include <pthread.h>

#include <chrono>

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
    ticket = ++submitted_;
  }
  work_cv_.notify_one();
  return ticket;
}

bool OrderedWorker::wait(uint64_t ticket, double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  return done_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return completed_ >= ticket; });
}

bool OrderedWorker::drain(double timeout_s) {
  uint64_t last;
  {
    std::lock_guard<std::mutex> lk(mu_);
    last = submitted_;
  }
  return wait(last, timeout_s);
}

uint64_t OrderedWorker::submitted() const {
  std::lock_guard<std::mutex> lk(mu_);
  return submitted_;
}

uint64_t OrderedWorker::completed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return completed_;
}

void OrderedWorker::run() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    work_cv_.wait(lk, [&] { return stopped_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopped and drained
    std::function<void()> task = std::move(queue_.front());
    queue_.pop_front();
    lk.unlock();
    try {
      task();
    } catch (...) {  // tasks report through their owner's state; never let one end the thread
    }
    lk.lock();
    ++completed_;
    done_cv_.notify_all();
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
