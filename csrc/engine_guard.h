// The engine's lock rules, written in types (the engine's classes hold their shared mutable state only in these):
//   Guarded<T>         a value reachable only while its lock is held: with([&](T&) {...}), or lock(), whose Locked
//                      holds a std::unique_lock and is the only way to the value (and to wait on a Signal).
//   Signal             a condition variable that can only be waited on through a Locked of a Guarded value.
//   CommThreadOnly<T>  state the communication thread alone touches once it runs (before it starts and after it
//                      ended, the thread that set the engine up or shuts it down). Builds without NDEBUG check the
//                      calling thread on every access. A bucket the thread hands to a thread blocked in wait() reaches
//                      it through references the communication thread took, while it waits for that bucket.
// This is the only engine file that names std::mutex or std::condition_variable.
#pragma once

#include <atomic>
#include <cassert>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>

namespace hybridpipe {

// A condition variable: notify from anywhere; wait only through Guarded<T>::Locked (which holds the lock).
class Signal {
 public:
  void notify_one() { condition_.notify_one(); }
  void notify_all() { condition_.notify_all(); }

 private:
  template <typename T>
  friend class Guarded;
  std::condition_variable condition_;
};

template <typename T>
class Guarded {
 public:
  // The value while the lock is held. unlock() / relock() for the stretches that must run without it (the value
  // is unreachable meanwhile: a build without NDEBUG checks it).
  class Locked {
   public:
    explicit Locked(Guarded& owner) : lock_(owner.mutex_), value_(&owner.value_) {}
    T* operator->() const {
      assert(lock_.owns_lock() && "Guarded value used without its lock");
      return value_;
    }
    T& operator*() const { return *operator->(); }
    void unlock() { lock_.unlock(); }
    void relock() { lock_.lock(); }
    void wait(Signal& signal) { signal.condition_.wait(lock_); }
    template <typename Predicate>
    void wait(Signal& signal, Predicate ready) {
      signal.condition_.wait(lock_, std::move(ready));
    }
    template <typename TimePoint>
    void wait_until(Signal& signal, const TimePoint& until) {
      signal.condition_.wait_until(lock_, until);
    }
    template <typename TimePoint, typename Predicate>
    bool wait_until(Signal& signal, const TimePoint& until, Predicate ready) {
      return signal.condition_.wait_until(lock_, until, std::move(ready));
    }
    template <typename Duration>
    void wait_for(Signal& signal, const Duration& duration) {
      signal.condition_.wait_for(lock_, duration);
    }

   private:
    std::unique_lock<std::mutex> lock_;
    T* value_;
  };

  Guarded() = default;
  explicit Guarded(T value) : value_(std::move(value)) {}
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;

  Locked lock() { return Locked(*this); }
  template <typename F>
  decltype(auto) with(F&& f) {
    std::lock_guard<std::mutex> hold(mutex_);
    return std::forward<F>(f)(value_);
  }
  template <typename F>
  decltype(auto) with(F&& f) const {
    std::lock_guard<std::mutex> hold(mutex_);
    return std::forward<F>(f)(static_cast<const T&>(value_));
  }

 private:
  mutable std::mutex mutex_;
  T value_;
};

// Which thread is an engine's communication thread: the thread itself enters on start and leaves as it ends.
class CommThread {
 public:
  void enter() { id_.store(std::this_thread::get_id()); }
  void leave() { id_.store(std::thread::id()); }
  // The calling thread may touch the thread's state: it is the thread, or the thread is not running.
  bool here() const {
    const std::thread::id running = id_.load();
    return running == std::thread::id() || running == std::this_thread::get_id();
  }

 private:
  std::atomic<std::thread::id> id_{};
};

template <typename T>
class CommThreadOnly {
 public:
  explicit CommThreadOnly(const CommThread& thread, T value = T()) : thread_(&thread), value_(std::move(value)) {}
  CommThreadOnly(const CommThreadOnly&) = delete;
  CommThreadOnly& operator=(const CommThreadOnly&) = delete;

  T& get() {
    check();
    return value_;
  }
  const T& get() const {
    check();
    return value_;
  }
  T* operator->() { return &get(); }
  const T* operator->() const { return &get(); }

 private:
  void check() const { assert(thread_->here() && "communication-thread state used on another thread"); }
  const CommThread* thread_;
  T value_;
};

}  // namespace hybridpipe
