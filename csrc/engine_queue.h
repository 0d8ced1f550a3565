// The engine's queue (see engine.h): what the ranks' threads submit, per group, until the communication thread
// takes it; the handles they wait for; the engine's life-cycle flags. All of it sits behind one lock, in the
// type: QueueState is only reachable through TensorQueue::lock(), a group's part of it (GroupQueue) only
// through Group::queue(), which asks for that lock.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "engine_guard.h"
#include "engine_options.h"

namespace hybridpipe {

class Group;

// One submission (Engine::submit, submit_call, submit_refusal, submit_join).
struct Entry {
  uint64_t handle;
  std::string name;
  Buffer buffer;
  ReduceOp op;
  std::chrono::steady_clock::time_point submitted;
  bool warned = false;
  std::function<void()> job;  // a call (submit_call) instead of an allreduce of `buffer`
  std::string refusal;        // non-empty: a stand-in for a refused operation (submit_refusal)
  bool detached = false;      // nobody waits for its handle: released when done
  int device = 0;             // see Engine::submit()
  bool join = false;          // submit_join's entry
  int contributors = 0;       // ran while ranks had joined: how many ranks contributed (0: all)
  std::shared_ptr<std::vector<unsigned char>> zeros;  // a joined rank's stand-in buffer
  Buffer output;              // out of place (submit's output); data == nullptr: in place, into `buffer`
  uintptr_t ready_event = 0;  // see Engine::submit(); cleared once the event has completed
  WireFormat wire;            // see Engine::submit()
  const Buffer& result() const { return output.data ? output : buffer; }
};

struct HandleState {
  int group = 0;
  bool done = false;
  std::string error;
  ErrorKind kind = ErrorKind::None;
  double started = 0, finished = 0;
  int contributors = 0;
};

// An allreduce the communication thread hands to a thread blocked in wait() (BucketExecutor::reduce).
struct HelpJob {
  std::function<void()> work;
  bool taken = false, done = false;
  std::string error;
};

// One group's part of the queue.
struct GroupQueue {
  std::vector<Entry> pending;
  bool active = false;          // negotiated every cycle
  bool finished = false;        // the ranks agreed to stop, or stalled past stall_shutdown
  std::string stopped_because;  // why a finished group refuses submissions
  int last_joined = -1;         // the rank that joined last in the latest completed join
  // Helping: only threads waiting for this group's handles run its allreduces, so a waiter is never held up
  // by another group's ring.
  HelpJob* offered = nullptr;
  int idle_waiters = 0;  // threads blocked in wait() on this group's handles, not running a HelpJob
  std::chrono::steady_clock::time_point last_wait_return{};  // a thread that just returned often waits again
};

struct QueueState {
  QueueState();
  ~QueueState();  // engine_queue.cpp, where Group is complete
  std::vector<std::unique_ptr<Group>> groups;  // by group id; never removed (a Group* outlives the lock)
  std::unordered_map<uint64_t, HandleState> handles;
  uint64_t next_handle = 1;
  std::thread thread;             // the communication thread
  bool started = false;
  bool thread_done = false;
  int registrations_pending = 0;  // groups added after start, not yet active
  bool stop_requested = false;
  bool shut_down = false;
  bool failed = false;  // leave_failed() was called
  std::string fatal;
};

class TensorQueue {
 public:
  using Locked = Guarded<QueueState>::Locked;

  Locked lock() { return state_.lock(); }
  // A submission or a registration for the communication thread (`wake`), a completion for waiters (`changed`).
  Signal& wake() { return wake_; }
  Signal& changed() { return changed_; }

  // Queues `entry` on group `group_id` (its handle and submission time set here); returns the handle.
  uint64_t enqueue(int group_id, Entry entry);
  // The group of that id (throws invalid_argument naming `what` for an unknown one).
  static Group& group(Locked& state, int group_id, const char* what = nullptr);
  bool poll(uint64_t handle);
  // See Engine::wait: blocks until done, running the group's offered allreduces meanwhile.
  std::string wait(uint64_t handle, double* started, double* finished, ErrorKind* kind, int* contributors);
  void complete(const std::vector<Entry>& entries, const std::string& error, double started = 0,
                ErrorKind kind = ErrorKind::None);
  // Fails every pending entry of `group` (the caller holds the lock).
  void fail_pending(Locked& state, GroupQueue& group, const std::string& error, ErrorKind kind);
  // The pending entries of `group` whose ready events have completed: those a cycle may announce; the others
  // wait in `pending` for a later cycle.
  static std::vector<Entry> ready_entries(GroupQueue& group);

 private:
  Guarded<QueueState> state_;
  Signal changed_;
  Signal wake_;
};

}  // namespace hybridpipe
