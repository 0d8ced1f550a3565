// The engine's queue (see engine_queue.h): submissions, handles, waits (with their help to the communication
// thread), completions.
#include "engine_queue.h"

#include <stdexcept>

#include "engine_group.h"
#include "engine_internal.h"

namespace hybridpipe {

using namespace engine_detail;

QueueState::QueueState() = default;
QueueState::~QueueState() = default;

Group& TensorQueue::group(Locked& state, int group_id, const char* what) {
  if (group_id < 0 || group_id >= static_cast<int>(state->groups.size())) {
    throw std::invalid_argument(what ? std::string(what) + ": no group " + std::to_string(group_id)
                                     : "unknown engine group " + std::to_string(group_id));
  }
  return *state->groups[static_cast<size_t>(group_id)];
}

uint64_t TensorQueue::enqueue(int group_id, Entry entry) {
  Locked state = lock();
  if (!state->fatal.empty()) throw std::runtime_error("the background engine stopped after an error: " + state->fatal);
  if (state->stop_requested) throw std::runtime_error("hybridpipe is shutting down: no new allreduce_async");
  Group& group = TensorQueue::group(state, group_id);
  GroupQueue& queue = group.queue(state);
  if (state->thread_done) throw std::runtime_error("the background engine's thread has stopped");
  if (queue.finished) {
    throw std::runtime_error("the background engine stopped group '" + group.label + "'" +
                             (queue.stopped_because.empty() ? std::string() : ": " + queue.stopped_because));
  }
  for (const Entry& pending : queue.pending) {
    if (pending.name == entry.name) {
      throw std::invalid_argument("a tensor named '" + entry.name + "' is already in flight on group '" + group.label +
                                  "': wait for its handle first, or give this one another name");
    }
  }
  const uint64_t handle = state->next_handle++;
  entry.handle = handle;
  entry.submitted = Clock::now();
  queue.pending.push_back(std::move(entry));
  state->handles[handle] = HandleState{group_id, false, "", ErrorKind::None};
  wake_.notify_one();
  return handle;
}

bool TensorQueue::poll(uint64_t handle) {
  Locked state = lock();
  auto found = state->handles.find(handle);
  if (found == state->handles.end()) throw std::invalid_argument("unknown or already waited-for handle");
  return found->second.done || state->thread_done;
}

std::string TensorQueue::wait(uint64_t handle, double* started, double* finished, ErrorKind* kind, int* contributors) {
  Locked state = lock();
  auto found = state->handles.find(handle);
  if (found == state->handles.end()) throw std::invalid_argument("unknown or already waited-for handle");
  HandleState* waited = &found->second;  // stays valid while other handles come and go
  GroupQueue& group = state->groups[static_cast<size_t>(waited->group)]->queue(state);
  ++group.idle_waiters;
  while (!(waited->done || state->thread_done)) {
    HelpJob* job = group.offered;  // this group's next allreduce: run it here, then look again
    if (job == nullptr) {
      state.wait(changed_);
      continue;
    }
    group.offered = nullptr;
    job->taken = true;
    --group.idle_waiters;
    state.unlock();
    std::string error;
    try {
      job->work();
    } catch (const std::exception& e) {
      error = e.what();
    }
    state.relock();
    job->error = error;
    job->done = true;
    ++group.idle_waiters;
    changed_.notify_all();
  }
  --group.idle_waiters;
  group.last_wait_return = Clock::now();
  const std::string& fatal = state->fatal;
  std::string error = waited->done ? waited->error
                                   : "the background engine stopped before this tensor was reduced" +
                                         (fatal.empty() ? std::string() : ": " + fatal);
  if (kind) *kind = waited->done ? waited->kind : (fatal.empty() ? ErrorKind::Stopped : ErrorKind::Failed);
  if (started) *started = waited->started;
  if (finished) *finished = waited->finished;
  if (contributors) *contributors = waited->contributors;
  state->handles.erase(handle);
  return error;
}

void TensorQueue::complete(const std::vector<Entry>& entries, const std::string& error, double started, ErrorKind kind) {
  const double finished = seconds_now();
  Locked state = lock();
  for (const Entry& entry : entries) {
    auto found = state->handles.find(entry.handle);
    if (found != state->handles.end() && entry.detached) {  // nobody waits for it
      state->handles.erase(found);
      continue;
    }
    if (found != state->handles.end()) {
      found->second.done = true;
      found->second.error = error;
      found->second.kind = error.empty() ? ErrorKind::None : kind;
      found->second.started = started;
      found->second.finished = started ? finished : 0;
      found->second.contributors = entry.contributors;
    }
  }
  changed_.notify_all();
}

void TensorQueue::fail_pending(Locked& state, GroupQueue& group, const std::string& error, ErrorKind kind) {
  for (const Entry& entry : group.pending) {
    auto found = state->handles.find(entry.handle);
    if (found != state->handles.end() && entry.detached) {
      state->handles.erase(found);
      continue;
    }
    if (found != state->handles.end() && !found->second.done) {
      found->second.done = true;
      found->second.error = error;
      found->second.kind = kind;
    }
  }
  group.pending.clear();
  changed_.notify_all();
}

std::vector<Entry> TensorQueue::ready_entries(GroupQueue& group) {
  std::vector<Entry> ready;
  ready.reserve(group.pending.size());
  for (Entry& entry : group.pending) {
    if (entry.ready_event && cuda_event_done(entry.ready_event)) entry.ready_event = 0;
    if (!entry.ready_event) ready.push_back(entry);
  }
  return ready;
}

}  // namespace hybridpipe
