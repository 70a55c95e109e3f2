// A thread-safe FIFO with blocking, timed and non-blocking reads: the queues between the main thread and the draft
// worker (Python's queue.Queue in runtime/mirror.py). Nothing busy-waits.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>

#include "settings.hpp"

namespace mirrorsd {

template <typename T>
class Mailbox {
 public:
  void put(T item) {
    {
      std::lock_guard<std::mutex> guard(lock_);
      items_.push_back(std::move(item));
    }
    ready_.notify_one();
  }

  T get() {
    std::unique_lock<std::mutex> guard(lock_);
    ready_.wait(guard, [this] { return !items_.empty(); });
    return take();
  }

  // Waits at most `seconds`; from settings::kDraftTimeoutNeverS up (or infinity) without a limit (a longer wait
  // would overflow the clock's duration).
  std::optional<T> get_for(double seconds) {
    if (!(seconds < settings::kDraftTimeoutNeverS)) return get();
    std::unique_lock<std::mutex> guard(lock_);
    if (!ready_.wait_for(guard, std::chrono::duration<double>(seconds), [this] { return !items_.empty(); }))
      return std::nullopt;
    return take();
  }

  std::optional<T> poll() {
    std::lock_guard<std::mutex> guard(lock_);
    if (items_.empty()) return std::nullopt;
    return take();
  }

 private:
  T take() {
    T item = std::move(items_.front());
    items_.pop_front();
    return item;
  }

  std::mutex lock_;
  std::condition_variable ready_;
  std::deque<T> items_;
};

}  // namespace mirrorsd
