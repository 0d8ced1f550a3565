// The background engine (see engine.h): construction, groups, submissions, handles, the thread's cycle
// loop and shutdown. The rest of Engine is in engine_negotiation.cpp (what is ready on every rank: the
// negotiation, its response cache, slow rounds, joins, departures, registrations), engine_inspection.cpp
// (what the thread is blocked on: health probes, stall reports, aborts) and engine_buckets.cpp (fusion
// and the buckets' allreduces, CUDA buckets included).
#include "engine.h"

#include "engine_internal.h"

#ifdef __linux__
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace hybridpipe {

using namespace engine_detail;

Engine::Engine(const EngineOptions& options) : options_(options) {
  tuned_fusion_ = options.fusion_threshold_bytes;
  tuned_cycle_ = options.cycle_time_ms;
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  if (provided != MPI_THREAD_MULTIPLE) {
    throw std::runtime_error("the background engine needs MPI initialized with MPI_THREAD_MULTIPLE (got level " +
                             std::to_string(provided) + "); do not set mpi4py.rc.thread_level below 'multiple'");
  }
}

Engine::~Engine() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) {  // MPI is gone: the thread cannot finish its protocol; leave it
    if (thread_.joinable()) thread_.detach();
    return;
  }
  shutdown();
}

int Engine::add_group(MPI_Comm comm, const std::string& label) {
  auto group = std::make_unique<Group>();
  HP_MPI(MPI_Comm_dup, comm, comm, &group->comm);
  MPI_Comm_set_errhandler(group->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(group->comm, &group->rank);
  MPI_Comm_size(group->comm, &group->size);
  group->label = label;
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    first = groups_.empty();
  }
  if (first) {  // group 0: every rank's host name, and a communicator for absent-rank probes
    HP_MPI(MPI_Comm_dup, group->comm, group->comm, &health_);
    MPI_Comm_set_errhandler(health_, MPI_ERRORS_RETURN);
    char name[MPI_MAX_PROCESSOR_NAME + 1] = {0};
    int length = 0;
    MPI_Get_processor_name(name, &length);
    std::vector<char> names(static_cast<size_t>(group->size) * (MPI_MAX_PROCESSOR_NAME + 1));
    HP_MPI(MPI_Allgather, health_, name, MPI_MAX_PROCESSOR_NAME + 1, MPI_CHAR, names.data(), MPI_MAX_PROCESSOR_NAME + 1,
           MPI_CHAR, health_);
    for (int r = 0; r < group->size; ++r) hosts_.emplace_back(names.data() + static_cast<size_t>(r) * (MPI_MAX_PROCESSOR_NAME + 1));
  }
  // A new group starts quiet, as if every rank had agreed on kQuietAfterIdleCycles idle cycles.
  group->idle_cycles = kQuietAfterIdleCycles + 1;
  group->shm = fused_shared_memory(group->comm, options_.allreduce);  // collective, like the dup
  group->waiters_help = options_.waiters_help && (group->shm != nullptr || group->size == 1 || on_one_host(group->comm));
  std::lock_guard<std::mutex> lock(mutex_);
  if (!groups_.empty()) {  // its ranks as ranks of group 0: the key all its ranks register it under
    MPI_Group mine, coordinator;
    MPI_Comm_group(group->comm, &mine);
    MPI_Comm_group(groups_[0]->comm, &coordinator);
    std::vector<int> ranks(group->size);
    for (int r = 0; r < group->size; ++r) ranks[r] = r;
    group->members.resize(group->size);
    MPI_Group_translate_ranks(mine, group->size, ranks.data(), coordinator, group->members.data());
    MPI_Group_free(&mine);
    MPI_Group_free(&coordinator);
    for (int member : group->members) {
      if (member == MPI_UNDEFINED) {
        MPI_Comm_free(&group->comm);
        throw std::invalid_argument("group '" + label + "' has ranks outside the engine's first group '" +
                                    groups_[0]->label + "': use a communicator made from hybridpipe's world");
      }
    }
    for (const auto& other : groups_) {
      if (other->members == group->members) group->registration++;
    }
  }
  if (stop_requested_) {
    MPI_Comm_free(&group->comm);
    throw std::runtime_error("engine is shutting down; cannot add group '" + label + "'");
  }
  // Before the thread starts every group is active from the first cycle on every rank; after it, a
  // group of one rank needs no agreement, the others join at a cycle their ranks agree on.
  group->active = !started_ || group->size == 1;
  if (!group->active) {
    registrations_pending_++;
    wake_.notify_all();
  }
  groups_.push_back(std::move(group));
  return static_cast<int>(groups_.size() - 1);
}

void Engine::drive_transfers() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (stop_requested_) throw std::runtime_error("engine is shutting down; it cannot drive transfers");
  if (started_) throw std::logic_error("Engine::drive_transfers() must come before start()");
  if (!transfers_) {
    transfers_ = std::make_shared<TransferQueue>([this] {
      std::lock_guard<std::mutex> wake_lock(mutex_);
      wake_.notify_all();
    });
  }
  install_transfer_queue(transfers_);
}

void Engine::start() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (started_) return;
  started_ = true;
  for (size_t id = 0; id < groups_.size(); ++id) cycle_order_.push_back(static_cast<int>(id));
  thread_ = std::thread([this] {
#ifdef __linux__
    if (options_.thread_nice > 0) {  // per thread on Linux: the thread id names the thread
      const int base = getpriority(PRIO_PROCESS, 0);
      setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), std::min(base + options_.thread_nice, 19));
    }
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // short sleeps while transfers are in flight stay short
#endif
    run();
  });
}

double Engine::quiet_cycle_ms() const {
  return std::min(options_.idle_cycle_time_ms, options_.stall_check_seconds * 250);
}

uint64_t Engine::submit_call(int group_id, const std::string& name, int kind, std::function<void()> job) {
  // the kind travels as the element count: ranks that queued different kinds disagree on it
  return enqueue(group_id, name, Buffer{nullptr, static_cast<size_t>(kind), DType::Int64}, ReduceOp::Max,
                 std::move(job));
}

uint64_t Engine::submit_tuning(int group_id, const std::string& name, size_t fusion_threshold_bytes,
                               double cycle_time_ms) {
  if (fusion_threshold_bytes < 1 || !(cycle_time_ms > 0)) {
    throw std::invalid_argument("submit_tuning: the fusion threshold must be >= 1 byte and the cycle time > 0 ms");
  }
  constexpr int kTuningKind = 0x7475;  // "tu": ranks tuning while others call something else disagree
  return submit_call(group_id, name, kTuningKind, [this, fusion_threshold_bytes, cycle_time_ms] {
    options_.fusion_threshold_bytes = fusion_threshold_bytes;  // the thread's own: read only by it
    options_.cycle_time_ms = cycle_time_ms;
    tuned_fusion_ = fusion_threshold_bytes;
    tuned_cycle_ = cycle_time_ms;
  });
}

uint64_t Engine::submit_collective(int group_id, const std::string& name, int kind, Collective work) {
  Group* group = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (group_id < 0 || group_id >= static_cast<int>(groups_.size())) {
      throw std::invalid_argument("unknown engine group " + std::to_string(group_id));
    }
    group = groups_[group_id].get();  // groups are never removed: the pointer outlives the entry
  }
  return submit_call(group_id, name, kind, [this, group, work = std::move(work)] {
    reduce_bucket(*group, [&](const AllreduceOptions& options) { work(group->comm, group->workspace, options); });
  });
}

uint64_t Engine::submit_refusal(int group_id, const std::string& name, const std::string& refusal, bool detached) {
  const uint64_t handle = enqueue(group_id, name, Buffer{nullptr, 0, DType::Int64}, ReduceOp::Max, nullptr,
                                  refusal.empty() ? std::string("invalid arguments") : refusal, detached);
  return detached ? 0 : handle;
}

void Engine::set_device_allreduce(int group_id, DeviceAllreduce reduce) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (group_id < 0 || group_id >= static_cast<int>(groups_.size())) {
    throw std::invalid_argument("set_device_allreduce: no group " + std::to_string(group_id));
  }
  groups_[group_id]->device_allreduce = std::move(reduce);
}

uint64_t Engine::submit(int group_id, const std::string& name, const Buffer& buffer, ReduceOp op, int device,
                        const Buffer& output, uintptr_t ready_event, const WireFormat& wire) {
  if (wire.dtype >= 0 && !is_half(static_cast<DType>(wire.dtype))) {
    throw std::invalid_argument("submit: the wire dtype of '" + name + "' must be float16 or bfloat16 (code " +
                                std::to_string(wire.dtype) + ")");
  }
  if (output.data && (output.count != buffer.count || output.dtype != buffer.dtype)) {
    throw std::invalid_argument("submit: the output of '" + name + "' differs from its input in count or dtype");
  }
  if (ready_event) cuda_event_done(ready_event);  // a driver that cannot be loaded fails here, in the caller
  return enqueue(group_id, name, buffer, op, nullptr, "", false, device, false,
                 output.data != buffer.data ? output : Buffer{}, ready_event, wire);
}

std::vector<Engine::Entry> Engine::ready_entries(Group& group) {
  std::vector<Entry> ready;
  ready.reserve(group.pending.size());
  for (Entry& entry : group.pending) {
    if (entry.ready_event && cuda_event_done(entry.ready_event)) entry.ready_event = 0;
    if (!entry.ready_event) ready.push_back(entry);
  }
  return ready;
}

uint64_t Engine::enqueue(int group_id, const std::string& name, const Buffer& buffer, ReduceOp op,
                         std::function<void()> job, const std::string& refusal, bool detached, int device,
                         bool join, const Buffer& output, uintptr_t ready_event, const WireFormat& wire) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!fatal_.empty()) throw std::runtime_error("the background engine stopped after an error: " + fatal_);
  if (stop_requested_) throw std::runtime_error("hybridpipe is shutting down: no new allreduce_async");
  if (group_id < 0 || group_id >= static_cast<int>(groups_.size())) {
    throw std::invalid_argument("unknown engine group " + std::to_string(group_id));
  }
  Group& group = *groups_[group_id];
  if (thread_done_) throw std::runtime_error("the background engine's thread has stopped");
  if (group.finished) {
    throw std::runtime_error("the background engine stopped group '" + group.label + "'" +
                             (group.stopped_because.empty() ? std::string() : ": " + group.stopped_because));
  }
  for (const Entry& entry : group.pending) {
    if (entry.name == name) {
      throw std::invalid_argument("a tensor named '" + name + "' is already in flight on group '" + group.label +
                                  "': wait for its handle first, or give this one another name");
    }
  }
  const uint64_t handle = next_handle_++;
  group.pending.push_back(Entry{handle, name, buffer, op, Clock::now(), false, std::move(job), refusal, detached, device, join, 0,
                                      nullptr, output, ready_event, wire});
  handles_[handle] = HandleState{group_id, false, "", ErrorKind::None};
  wake_.notify_one();
  return handle;
}

uint64_t Engine::submit_join(int group_id) {
  return enqueue(group_id, kJoinName, Buffer{nullptr, 0, DType::Int64}, ReduceOp::Max, nullptr, "", false, 0, true);
}

int Engine::last_joined(int group_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (group_id < 0 || group_id >= static_cast<int>(groups_.size())) {
    throw std::invalid_argument("unknown engine group " + std::to_string(group_id));
  }
  return groups_[group_id]->last_joined;
}

bool Engine::poll(uint64_t handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = handles_.find(handle);
  if (found == handles_.end()) throw std::invalid_argument("unknown or already waited-for handle");
  return found->second.done || thread_done_;
}

std::string Engine::wait(uint64_t handle, double* started, double* finished, ErrorKind* kind, int* contributors) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto found = handles_.find(handle);
  if (found == handles_.end()) throw std::invalid_argument("unknown or already waited-for handle");
  Group& group = *groups_[found->second.group];
  ++group.idle_waiters;
  while (!(found->second.done || thread_done_)) {
    Job* job = group.offered;  // this group's next allreduce: run it here, then look again
    if (job == nullptr) {
      changed_.wait(lock);
      continue;
    }
    group.offered = nullptr;
    job->taken = true;
    --group.idle_waiters;
    lock.unlock();
    std::string error;
    try {
      job->work();
    } catch (const std::exception& e) {
      error = e.what();
    }
    lock.lock();
    job->error = error;
    job->done = true;
    ++group.idle_waiters;
    changed_.notify_all();
  }
  --group.idle_waiters;
  group.last_wait_return = Clock::now();
  std::string error = found->second.done ? found->second.error
                                         : "the background engine stopped before this tensor was reduced" +
                                               (fatal_.empty() ? std::string() : ": " + fatal_);
  if (kind) *kind = found->second.done ? found->second.kind : (fatal_.empty() ? ErrorKind::Stopped : ErrorKind::Failed);
  if (started) *started = found->second.started;
  if (finished) *finished = found->second.finished;
  if (contributors) *contributors = found->second.contributors;
  handles_.erase(found);
  return error;
}

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (shut_down_) return;
    shut_down_ = true;
    stop_requested_ = true;
    wake_.notify_all();
    changed_.notify_all();
  }
  start();  // the stop is agreed by the thread: start it if it never ran
  if (thread_.joinable()) thread_.join();
  if (transfers_ && installed_transfer_queue() == transfers_) install_transfer_queue(nullptr);
  if (health_ != MPI_COMM_NULL) MPI_Comm_free(&health_);
  for (auto& group : groups_) {
    if (group->comm != MPI_COMM_NULL) MPI_Comm_free(&group->comm);
  }
}

void Engine::leave_failed() {
  std::lock_guard<std::mutex> lock(mutex_);
  failed_ = true;
  stop_requested_ = true;
  wake_.notify_all();
}

EngineStats Engine::stats(int group_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (group_id < 0 || group_id >= static_cast<int>(groups_.size())) {
    throw std::invalid_argument("unknown engine group " + std::to_string(group_id));
  }
  return groups_[group_id]->stats;
}

void Engine::complete(const std::vector<Entry>& entries, const std::string& error, double started, ErrorKind kind) {
  const double finished = seconds_now();
  std::lock_guard<std::mutex> lock(mutex_);
  for (const Entry& entry : entries) {
    auto found = handles_.find(entry.handle);
    if (found != handles_.end() && entry.detached) {  // nobody waits for it
      handles_.erase(found);
      continue;
    }
    if (found != handles_.end()) {
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

void Engine::fail_pending(Group& group, const std::string& error, ErrorKind kind) {
  for (const Entry& entry : group.pending) {
    auto found = handles_.find(entry.handle);
    if (found != handles_.end() && entry.detached) {
      handles_.erase(found);
      continue;
    }
    if (found != handles_.end() && !found->second.done) {
      found->second.done = true;
      found->second.error = error;
      found->second.kind = kind;
    }
  }
  group.pending.clear();
  changed_.notify_all();
}

std::vector<EngineEvent> Engine::take_events(int group_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (group_id < 0 || group_id >= static_cast<int>(groups_.size())) {
    throw std::invalid_argument("unknown engine group " + std::to_string(group_id));
  }
  std::vector<EngineEvent> events;
  events.swap(groups_[group_id]->events);
  return events;
}

void Engine::record(Group& group, const char* phase, double start, double end, size_t bytes, size_t tensors) {
  if (!options_.record_events) return;
  std::lock_guard<std::mutex> lock(mutex_);
  group.events.push_back(EngineEvent{phase, start, end, bytes, tensors});
}

void Engine::run() {
  WaitPolicy busy_wait = options_.allreduce.wait;
  if (busy_wait.spin_us < 0) busy_wait = WaitPolicy{0.0, options_.cycle_time_ms * 250 + 20};
  // With nothing of its own to reduce, a rank has no reason to spin: it sleeps between tests from the
  // start, so idle negotiations do not take the cores from the compute threads.
  const WaitPolicy idle_wait{0.0, busy_wait.max_sleep_us};
  auto next_cycle = Clock::now();
  bool last_cycle_idle = true;
  uint64_t cycle = 0;  // the same count on every rank: each group's visits fall on the same cycles everywhere
  TransferQueue* transfers = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    transfers = transfers_.get();
  }
  // inside every polite wait of this thread: transfers, probes from other ranks, its own timer
  // The communication lock (p2p.h): held while this thread makes MPI calls, i.e. always but in its sleeps
  // (between cycles, and between the tests of its polite waits), where a thread that needs a transfer may
  // take it and make the calls itself. It is re-taken blocking whatever else this thread holds: a thread
  // that holds it makes a few nonblocking calls and waits for nothing else meanwhile.
  std::unique_lock<std::timed_mutex> mpi;
  if (transfers) mpi = std::unique_lock<std::timed_mutex>(transfers->mpi_lock());
  mpi_held_ = transfers ? &mpi : nullptr;
  progress_hook = {[](void* engine) { static_cast<Engine*>(engine)->service(); }, this,
                   [](void* engine, bool asleep) {
                     std::unique_lock<std::timed_mutex>* mpi = static_cast<Engine*>(engine)->mpi_held_;
                     if (mpi == nullptr) return;
                     if (asleep && mpi->owns_lock()) mpi->unlock();
                     if (!asleep && !mpi->owns_lock()) mpi->lock();
                   }};
  start_probes();
  std::string stopped_because = "it was shut down";
  try {
    while (true) {
      std::vector<int> order;
      service();
      if (!await_cycle(next_cycle, last_cycle_idle, transfers, mpi, order)) break;
      bool idle = true, quiet = true, visited = false;
      for (int id : order) {
        Group& group = *groups_[id];
        if (group.size == 1) {
          cycle_single(group);
          continue;
        }
        // A quiet group (idle on every rank for a while) is visited on every kQuietPeriod-th cycle only,
        // so that one busy group's ranks are not held in step with all ranks every cycle.
        if (group.idle_cycles > kQuietAfterIdleCycles && cycle % kQuietPeriod != 0) continue;
        visited = true;
        negotiate(group, busy_wait, idle_wait);
        idle = idle && group.idle_cycles > 0;
        if (id == 0 && !(group.vector[0] & kNoRegistration)) activate_registrations(group);
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        cycle_order_.erase(std::remove_if(cycle_order_.begin(), cycle_order_.end(),
                                          [&](int id) { return groups_[id]->finished; }),
                           cycle_order_.end());
        if (cycle_order_.empty() && stop_requested_) break;
      }
      // After a few agreed idle cycles of every group the thread goes quiet: its next cycle comes when
      // something is submitted here, on stop, or after the quiet cycle time. Every rank of a group sees
      // the same flags, so the ranks' idle timers stay in step (see quiet_cycle_ms).
      ++cycle;
      if (!visited) {  // a cycle with nothing to visit costs nothing: go on to the next at once
        next_cycle = Clock::now();
        continue;
      }
      for (int id : order) {
        const Group& group = *groups_[id];
        if (group.size > 1 && !group.finished) quiet = quiet && group.idle_cycles > kQuietAfterIdleCycles;
      }
      last_cycle_idle = idle;
      next_cycle = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(
                                      (quiet ? quiet_cycle_ms() : options_.cycle_time_ms) * 1000));
    }
  } catch (const MPICallError& error) {
    if (is_process_failure(error.code())) report_process_failure(error.what());
    stopped_because = fail_engine(error.what());
  } catch (const std::exception& error) {
    stopped_because = fail_engine(error.what());
  }
  progress_hook = {};
  mpi_held_ = nullptr;
  if (transfers && !mpi.owns_lock()) mpi.lock();
  if (transfers) transfers->stop(stopped_because);
  stop_probes();
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& group : groups_) {  // never became active (its other ranks never registered it), or left over
    fail_pending(*group, "the background engine stopped before this tensor was reduced (group '" + group->label +
                             "' was " + (group->active ? "stopped" : "never registered by all of its ranks") + ")",
                 ErrorKind::Stopped);
  }
  thread_done_ = true;
  changed_.notify_all();
}

bool Engine::await_cycle(std::chrono::steady_clock::time_point next_cycle, bool last_cycle_idle,
                         TransferQueue* transfers, std::unique_lock<std::timed_mutex>& mpi, std::vector<int>& order) {
  // Between cycles this thread holds the communication lock only to test the transfers in flight, every
  // kIdleTransferPollUs while some are (their background progress: a dropped send, a rendezvous the
  // sender must move on, a header a polling stage has not looked at). A thread that waits for a transfer
  // tests it itself meanwhile (TransferQueue::wait), with the lock free.
  constexpr double kIdleTransferPollUs = 1000.0;
  if (mpi.owns_lock()) mpi.unlock();
  std::unique_lock<std::mutex> lock(mutex_);
  // sleep until the next cycle; after an idle cycle, a submission, registration or stop wakes it early
  auto due = [&] {
    if (Clock::now() >= next_cycle) return true;
    if (!last_cycle_idle) return false;
    if (stop_requested_ || registrations_pending_ > 0) return true;
    for (int id : cycle_order_) {
      if (!groups_[id]->pending.empty()) return true;
    }
    return false;
  };
  // a transfer submitted while nothing is in flight ends the sleep too (its wake is a notify of
  // wake_): it must not wait for the next cycle, up to idle_cycle_time_ms away
  auto transfer_busy = [&] { return transfers && transfers->busy(); };
  while (!due()) {
    if (!transfer_busy()) {
      wake_.wait_until(lock, next_cycle, [&] { return due() || transfer_busy(); });
      continue;  // due: the cycle runs; a transfer came: the poll below
    }
    lock.unlock();
    // a waiting thread tests them itself; one that holds the lock makes progress meanwhile
    if (!transfers->wanted() && mpi.try_lock()) {
      transfers->progress();
      answer_probes();
      mpi.unlock();
    }
    lock.lock();
    if (due()) break;
    wake_.wait_until(lock, std::min(next_cycle, Clock::now() + std::chrono::microseconds(
                                                                static_cast<int64_t>(kIdleTransferPollUs))));
  }
  for (size_t id = 0; id < groups_.size(); ++id) {  // one-rank groups added since: no agreement needed
    const int gid = static_cast<int>(id);
    if (groups_[id]->active && groups_[id]->size == 1 &&
        std::find(cycle_order_.begin(), cycle_order_.end(), gid) == cycle_order_.end() && !groups_[id]->finished) {
      cycle_order_.push_back(gid);
    }
  }
  order = cycle_order_;
  const bool go_on = !(order.empty() && stop_requested_);
  lock.unlock();
  if (transfers) mpi.lock();
  return go_on;
}

std::string Engine::fail_engine(const std::string& what) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fatal_.empty()) fatal_ = what;
  for (auto& group : groups_) fail_pending(*group, "the background engine failed: " + fatal_, ErrorKind::Failed);
  return "it failed: " + fatal_;
}

void Engine::cycle_single(Group& group) {  // an allreduce over one rank is the identity
  std::vector<Entry> ready;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ready = ready_entries(group);
    auto taken = [&](const Entry& entry) { return !entry.ready_event; };
    group.pending.erase(std::remove_if(group.pending.begin(), group.pending.end(), taken), group.pending.end());
    if (ready.empty() && group.pending.empty() && stop_requested_) group.finished = true;
  }
  group.stats.tensors += ready.size();
  for (const Entry& entry : ready) {
    const double started = seconds_now();
    if (entry.job && entry.refusal.empty()) entry.job();
    if (entry.output.data && entry.buffer.data) std::memcpy(entry.output.data, entry.buffer.data, entry.buffer.bytes());
    complete({entry}, "", started);
  }
}

}  // namespace hybridpipe
