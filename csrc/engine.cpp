// The background engine; see engine.h.
#include "engine.h"

#include "fusion.h"

#include <unistd.h>  // gethostname

#ifdef __linux__
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#endif
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif
#if defined(HYBRIDPIPE_WITH_CUDA)
#include "cuda/cuda_kernels.h"
#endif

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace hybridpipe {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_now() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

constexpr uint64_t kAllCached = 1ull << 0;   // AND: no rank has an uncached ready name
constexpr uint64_t kNotStalled = 1ull << 1;  // AND: no rank has a name waiting past stall_check_seconds
constexpr uint64_t kWantStop = 1ull << 2;    // AND: every rank asked to stop and has nothing pending
constexpr uint64_t kIdle = 1ull << 3;        // AND: nobody has anything pending
constexpr uint64_t kNotExpired = 1ull << 4;  // AND: nothing waited past stall_shutdown_seconds
constexpr uint64_t kNoRegistration = 1ull << 5;  // AND (group 0 only): no rank has a group waiting to join
constexpr uint64_t kNobodyLeft = 1ull << 6;  // AND: no rank has asked to stop with nothing pending (hp.shutdown)

constexpr int kProbeTag = 1;   // on health_: "is your communication thread alive?" (round, 0)
constexpr int kAnswerTag = 2;  // on health_: "yes" (round, seconds my thread has been blocked)
constexpr double kProbeGraceSeconds = 1.0;  // a live thread answers within milliseconds

struct Announced {  // one pending name of one rank, as gathered in a slow round
  int rank;
  size_t count;
  int dtype;
  int op;
  bool stalled;
  double waited_s;
  std::string refusal;
  int device;
  bool join;
  bool call;
};

const char* const kJoinName = "hybridpipe.join";

void put(std::string& out, const void* data, size_t bytes) { out.append(static_cast<const char*>(data), bytes); }

template <typename T>
T take(const char*& cursor) {
  T value;
  std::memcpy(&value, cursor, sizeof(T));
  cursor += sizeof(T);
  return value;
}

std::string describe(const Announced& a) {
  static const char* const devices[] = {"", " device=cuda", " device=accelerator"};
  return "count=" + std::to_string(a.count) + " dtype=" + dtype_name(static_cast<DType>(a.dtype)) +
         " op=" + op_name(static_cast<ReduceOp>(a.op)) + devices[a.device >= 0 && a.device <= 2 ? a.device : 2];
}

}  // namespace

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
                        const Buffer& output, uintptr_t ready_event) {
  if (output.data && (output.count != buffer.count || output.dtype != buffer.dtype)) {
    throw std::invalid_argument("submit: the output of '" + name + "' differs from its input in count or dtype");
  }
  if (ready_event) cuda_event_done(ready_event);  // a driver that cannot be loaded fails here, in the caller
  return enqueue(group_id, name, buffer, op, nullptr, "", false, device, false,
                 output.data != buffer.data ? output : Buffer{}, ready_event);
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
                         bool join, const Buffer& output, uintptr_t ready_event) {
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
                                      nullptr, output, ready_event});
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
  progress_hook = {[](void* engine) { static_cast<Engine*>(engine)->service(); }, this};
  if (health_ != MPI_COMM_NULL) {
    MPI_Irecv(answer_message_, 2, MPI_DOUBLE, MPI_ANY_SOURCE, kAnswerTag, health_, &answer_request_);
  }
  // Between cycles, transfers in flight are tested as a waiting thread would test them itself (the
  // polite wait: spin_us, then sleeps backing off to max_sleep_us) while some thread waits for one;
  // otherwise every kIdleTransferPollUs (a stage that polls its receives posts their payload
  // receives once a header is in: headers must not wait for a whole cycle).
  const WaitPolicy transfer_wait = busy_wait;
  constexpr double kIdleTransferPollUs = 1000.0;
  std::string stopped_because = "it was shut down";
  try {
    while (true) {
      std::vector<int> order;
      service();
      {
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
        // with transfers in flight the wait is a polite poll of them (a completion is seen within
        // transfer_sleep_max_us); a submitted transfer wakes it at once
        double sleep_us = 2.0;
        auto eager_since = Clock::now();
        bool eager = false;
        // a transfer submitted while nothing is in flight ends the sleep too (its wake is a notify of
        // wake_): it must not wait for the next cycle, up to idle_cycle_time_ms away
        auto transfer_busy = [&] { return transfers && transfers->busy(); };
        while (!due()) {
          if (!transfer_busy()) {
            wake_.wait_until(lock, next_cycle, [&] { return due() || transfer_busy(); });
            continue;  // due: the cycle runs; a transfer came: the polite poll below
          }
          lock.unlock();
          const bool moved = transfers->progress();
          answer_probes();
          const bool wanted = transfers->wanted();
          lock.lock();
          if (due()) break;
          if (!wanted) {
            eager = false;
            wake_.wait_until(lock, std::min(next_cycle, Clock::now() + std::chrono::microseconds(
                                                                           static_cast<int64_t>(kIdleTransferPollUs))));
            continue;
          }
          const auto now = Clock::now();
          if (!eager || moved) {  // a waiter came, or something completed: spin again first
            eager = true;
            eager_since = now;
            sleep_us = 2.0;
          }
          if (transfer_wait.spin_us < 0 ||
              now - eager_since < std::chrono::nanoseconds(static_cast<int64_t>(transfer_wait.spin_us * 1000))) {
            continue;  // spinning: test again at once
          }
          wake_.wait_until(lock, std::min(next_cycle, now + std::chrono::nanoseconds(
                                                                static_cast<int64_t>(sleep_us * 1000))));
          sleep_us = std::min(sleep_us * 2, std::max(transfer_wait.max_sleep_us, 1.0));
        }
        for (size_t id = 0; id < groups_.size(); ++id) {  // one-rank groups added since: no agreement needed
          const int gid = static_cast<int>(id);
          if (groups_[id]->active && groups_[id]->size == 1 &&
              std::find(cycle_order_.begin(), cycle_order_.end(), gid) == cycle_order_.end() && !groups_[id]->finished) {
            cycle_order_.push_back(gid);
          }
        }
        order = cycle_order_;
        if (order.empty() && stop_requested_) break;
      }
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
    std::lock_guard<std::mutex> lock(mutex_);
    if (fatal_.empty()) fatal_ = error.what();
    stopped_because = "it failed: " + fatal_;
    for (auto& group : groups_) fail_pending(*group, "the background engine failed: " + fatal_, ErrorKind::Failed);
  } catch (const std::exception& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (fatal_.empty()) fatal_ = error.what();
    stopped_because = "it failed: " + fatal_;
    for (auto& group : groups_) fail_pending(*group, "the background engine failed: " + fatal_, ErrorKind::Failed);
  }
  progress_hook = {};
  if (transfers) transfers->stop(stopped_because);
  if (answer_request_ != MPI_REQUEST_NULL) {
    MPI_Cancel(&answer_request_);
    MPI_Request_free(&answer_request_);
  }
  for (MPI_Request& request : sent_answer_requests_) {
    if (request != MPI_REQUEST_NULL) MPI_Request_free(&request);  // the buffers are leaked with them below
  }
  for (auto& buffer : sent_answers_) buffer.release();
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& group : groups_) {  // never became active (its other ranks never registered it), or left over
    fail_pending(*group, "the background engine stopped before this tensor was reduced (group '" + group->label +
                             "' was " + (group->active ? "stopped" : "never registered by all of its ranks") + ")",
                 ErrorKind::Stopped);
  }
  thread_done_ = true;
  changed_.notify_all();
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

void Engine::negotiate(Group& group, const WaitPolicy& busy_wait, const WaitPolicy& idle_wait) {
  const double negotiation_start = seconds_now();
  start_negotiation(group);
  // polite: spin briefly, then sleep between tests (Python needs the cores). A negotiation waits only
  // for the other ranks' communication threads, which run whatever their training threads do: one
  // that never comes means a rank stopped, died or was cut off, and only a local timer can tell
  // (block_on: the probes and the timeout run inside the wait, see check_blocked).
  block_on(&group, "negotiate");
  HP_MPI(polite_wait, group.comm, [&](int* flag) { return MPI_Test(&group.request, flag, MPI_STATUS_IGNORE); },
         group.snapshot.empty() ? idle_wait : busy_wait);
  block_on(nullptr);
  if (!(group.vector[0] & kIdle)) record(group, "negotiate", negotiation_start, seconds_now(), 0, 0);
  finish_negotiation(group);
}

void Engine::block_on(const Group* group, const char* what) {
  if (group == nullptr && blocked_.probing) {  // a round in flight: its answers are ignored
    blocked_.probing = false;
  }
  blocked_.group = group;
  blocked_.what = what;
  blocked_.since = Clock::now();
  blocked_.warned = blocked_.aborting = false;
}

void Engine::service() {
  if (transfers_) {
    transfers_->progress();
    if (transfers_->saw_process_failure()) report_process_failure("a point-to-point transfer");
  }
  answer_probes();
  check_blocked();
}

double Engine::abort_after_seconds() const {
  double limit = options_.timeout_seconds > 0 ? options_.timeout_seconds : 0;
  if (options_.stall_shutdown_seconds > 0 && (limit == 0 || options_.stall_shutdown_seconds < limit)) {
    limit = options_.stall_shutdown_seconds;
  }
  return limit;
}

void Engine::answer_probes() {
  if (health_ == MPI_COMM_NULL) return;
  for (size_t i = 0; i < sent_answer_requests_.size();) {  // answers sent earlier: done?
    int flag = 0;
    if (MPI_Test(&sent_answer_requests_[i], &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag) {
      sent_answer_requests_.erase(sent_answer_requests_.begin() + static_cast<long>(i));
      sent_answers_.erase(sent_answers_.begin() + static_cast<long>(i));
    } else {
      ++i;
    }
  }
  while (true) {
    int flag = 0;
    MPI_Status status;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kProbeTag, health_, &flag, &status) != MPI_SUCCESS || !flag) break;
    int64_t probe[2];
    if (MPI_Recv(probe, 2, MPI_INT64_T, status.MPI_SOURCE, kProbeTag, health_, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
    auto answer = std::make_unique<double[]>(2);
    answer[0] = static_cast<double>(probe[0]);
    answer[1] = blocked_.group ? std::chrono::duration<double>(Clock::now() - blocked_.since).count() : 0.0;
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Isend(answer.get(), 2, MPI_DOUBLE, status.MPI_SOURCE, kAnswerTag, health_, &request) == MPI_SUCCESS) {
      sent_answers_.push_back(std::move(answer));
      sent_answer_requests_.push_back(request);
    }
  }
}

void Engine::check_blocked() {
  if (health_ != MPI_COMM_NULL && answer_request_ != MPI_REQUEST_NULL) {  // answers to my probes
    while (true) {
      int flag = 0;
      MPI_Status status;
      if (MPI_Test(&answer_request_, &flag, &status) != MPI_SUCCESS || !flag) break;
      if (blocked_.probing && static_cast<int64_t>(answer_message_[0]) == probe_round_) {
        for (size_t i = 0; i < blocked_.asked.size(); ++i) {
          if (blocked_.asked[i] == status.MPI_SOURCE) blocked_.answer[i] = answer_message_[1];
        }
      }
      MPI_Irecv(answer_message_, 2, MPI_DOUBLE, MPI_ANY_SOURCE, kAnswerTag, health_, &answer_request_);
    }
  }
  if (blocked_.group == nullptr) return;
  const auto now = Clock::now();
  if (blocked_.probing) {
    const bool all = std::all_of(blocked_.answer.begin(), blocked_.answer.end(), [](double a) { return a >= 0; });
    if (all || std::chrono::duration<double>(now - blocked_.probe_sent).count() > kProbeGraceSeconds) {
      finish_probe_round();
    }
    return;
  }
  const double waited = std::chrono::duration<double>(now - blocked_.since).count();
  const double limit = abort_after_seconds();
  const bool expired = limit > 0 && waited > limit;
  if (!expired && (blocked_.warned || waited <= options_.stall_check_seconds)) return;
  // ask every other rank whether its communication thread is alive: the rank this one waits for may
  // itself be waiting for a third one (a chain), and the report should name the one that is gone
  int me = -1;
  MPI_Comm_rank(groups_[0]->comm, &me);
  blocked_.asked.clear();
  for (int r = 0; r < static_cast<int>(hosts_.size()); ++r) {
    if (r != me) blocked_.asked.push_back(r);
  }
  blocked_.answer.assign(blocked_.asked.size(), -1.0);
  blocked_.probing = true;
  blocked_.aborting = expired;
  blocked_.probe_sent = now;
  probe_message_[0] = ++probe_round_;
  for (int rank : blocked_.asked) {
    MPI_Request request = MPI_REQUEST_NULL;
    if (health_ != MPI_COMM_NULL &&
        MPI_Isend(probe_message_, 2, MPI_INT64_T, rank, kProbeTag, health_, &request) == MPI_SUCCESS) {
      MPI_Request_free(&request);  // a small message; a peer that never takes it costs nothing
    }
  }
  if (blocked_.asked.empty()) finish_probe_round();
}

std::string Engine::describe_ranks(const std::vector<int>& ranks, const std::vector<double>* waits) const {
  constexpr size_t kListed = 16;  // a job of thousands of ranks gets a readable line
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i == kListed) {
      text += " and " + std::to_string(ranks.size() - kListed) + " more";
      break;
    }
    const int rank = ranks[i];
    text += (text.empty() ? "" : ", ") + std::to_string(rank) + " (host " +
            (rank >= 0 && rank < static_cast<int>(hosts_.size()) ? hosts_[rank] : std::string("?"));
    if (waits) {
      char waited[64];
      std::snprintf(waited, sizeof waited, ", blocked %.1f s", (*waits)[i]);
      text += waited;
    }
    text += ")";
  }
  return text;
}

void Engine::finish_probe_round() {
  blocked_.probing = false;
  const Group& group = *blocked_.group;
  const double waited = std::chrono::duration<double>(Clock::now() - blocked_.since).count();
  std::vector<int> missing, present;
  std::vector<double> present_waits;
  for (size_t i = 0; i < blocked_.asked.size(); ++i) {
    if (blocked_.answer[i] < 0) {
      missing.push_back(blocked_.asked[i]);
    } else {
      present.push_back(blocked_.asked[i]);
      present_waits.push_back(blocked_.answer[i]);
    }
  }
  int me = -1;
  MPI_Comm_rank(groups_[0]->comm, &me);
  std::string ranks;
  for (int member : group.members) ranks += (ranks.empty() ? "" : ", ") + std::to_string(member);
  char head[512];
  std::snprintf(head, sizeof head,
                "hybridpipe %s: rank %d (host %s): the communication thread has waited %.1f s for the other ranks of "
                "group '%s' (ranks [%s]) to %s; ",
                blocked_.aborting ? "ERROR" : "WARNING", me,
                me >= 0 && me < static_cast<int>(hosts_.size()) ? hosts_[me].c_str() : "?", waited,
                group.label.c_str(), ranks.empty() ? "all" : ranks.c_str(), blocked_.what);
  std::string message = head;
  if (!missing.empty()) {
    char grace[32];
    std::snprintf(grace, sizeof grace, "%g", kProbeGraceSeconds);
    message += std::string(missing.size() == 1 ? "rank " : "ranks ") + describe_ranks(missing, nullptr) +
               " did not answer within " + grace + " s: " + (missing.size() == 1 ? "it is" : "they are") +
               " stopped, dead, cut off, or stuck outside hybridpipe";
  } else {
    message += "every rank answered, so none is dead or cut off: one of them is stuck outside hybridpipe (a "
               "blocking call of its own?) or the ranks run different code";
  }
  if (!present.empty()) {
    message += std::string("; ") + (present.size() == 1 ? "rank " : "ranks ") + describe_ranks(present, &present_waits) +
               (present.size() == 1 ? " answered" : " answered");
  }
  char settings[160];
  std::snprintf(settings, sizeof settings, " (stall_check_seconds=%g, stall_shutdown_seconds=%g, timeout_seconds=%g)",
                options_.stall_check_seconds, options_.stall_shutdown_seconds, options_.timeout_seconds);
  message += settings;
  if (blocked_.aborting) abort_job(message + ": aborting the job");
  blocked_.warned = true;
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
}

void Engine::report_process_failure(const std::string& what) {
  std::vector<int> failed;
#if defined(OMPI_HAVE_MPI_EXT_FTMPI) && OMPI_HAVE_MPI_EXT_FTMPI
  if (health_ != MPI_COMM_NULL) {
    MPI_Group failed_group = MPI_GROUP_NULL, all = MPI_GROUP_NULL;
    if (MPIX_Comm_get_failed(health_, &failed_group) == MPI_SUCCESS && failed_group != MPI_GROUP_NULL) {
      int count = 0;
      MPI_Group_size(failed_group, &count);
      std::vector<int> ranks(static_cast<size_t>(count));
      for (int i = 0; i < count; ++i) ranks[static_cast<size_t>(i)] = i;
      failed.resize(static_cast<size_t>(count));
      MPI_Comm_group(health_, &all);
      MPI_Group_translate_ranks(failed_group, count, ranks.data(), all, failed.data());
      MPI_Group_free(&all);
      MPI_Group_free(&failed_group);
      std::sort(failed.begin(), failed.end());
    }
  }
#endif
  int me = -1;
  MPI_Comm_rank(groups_[0]->comm, &me);
  std::string message = "hybridpipe ERROR: rank " + std::to_string(me) + " (host " +
                        (me >= 0 && me < static_cast<int>(hosts_.size()) ? hosts_[me] : std::string("?")) + "): ";
  if (failed.empty()) {
    message += "a process of the job failed (MPI does not say which)";
  } else {
    message += std::string(failed.size() == 1 ? "rank " : "ranks ") + describe_ranks(failed, nullptr) +
               (failed.size() == 1 ? " is" : " are") + " gone (the process died: killed, crashed or out of memory)";
  }
  abort_job(message + "; MPI reported it in " + what + ": aborting the job");
}

void Engine::abort_job(const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  // MPI_Abort asks the launcher to end every rank; a rank cut off from it may wait there forever, so
  // this process ends itself shortly after in any case.
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::seconds(5));
    std::fprintf(stderr, "hybridpipe: MPI_Abort did not end this process within 5 s; exiting\n");
    std::fflush(stderr);
    _exit(1);
  }).detach();
  MPI_Abort(groups_[0]->comm, 1);
  _exit(1);
}

void Engine::activate_registrations(Group& coordinator) {
  // every rank of group 0 is here in the same cycle: gather (members, n) of each pending registration
  std::vector<int> mine;
  std::vector<Group*> waiting;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& group : groups_) {
      if (group->active || group->finished) continue;
      waiting.push_back(group.get());
      mine.push_back(static_cast<int>(group->members.size()));
      mine.insert(mine.end(), group->members.begin(), group->members.end());
      mine.push_back(group->registration);
    }
  }
  int my_length = static_cast<int>(mine.size());
  std::vector<int> lengths(coordinator.size), offsets(coordinator.size, 0);
  HP_MPI(MPI_Allgather, coordinator.comm, &my_length, 1, MPI_INT, lengths.data(), 1, MPI_INT, coordinator.comm);
  for (int r = 1; r < coordinator.size; ++r) offsets[r] = offsets[r - 1] + lengths[r - 1];
  std::vector<int> everyone(static_cast<size_t>(offsets.back() + lengths.back()) + 1);
  HP_MPI(MPI_Allgatherv, coordinator.comm, mine.data(), my_length, MPI_INT, everyone.data(), lengths.data(),
         offsets.data(), MPI_INT, coordinator.comm);
  std::map<std::vector<int>, std::vector<int>> asked;  // key (members..., n) -> ranks that asked; sorted
  for (int r = 0; r < coordinator.size; ++r) {
    size_t at = static_cast<size_t>(offsets[r]);
    const size_t end = at + static_cast<size_t>(lengths[r]);
    while (at < end) {
      const size_t count = static_cast<size_t>(everyone[at]);
      std::vector<int> key(everyone.begin() + at + 1, everyone.begin() + at + 1 + count + 1);
      asked[key].push_back(r);
      at += count + 2;
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& item : asked) {  // the same order on every rank: a group's ranks add it in the same place
    std::vector<int> members(item.first.begin(), item.first.end() - 1);
    std::vector<int> sorted_members = members, sorted_asked = item.second;
    std::sort(sorted_members.begin(), sorted_members.end());
    if (sorted_members != sorted_asked) continue;  // not every rank of it has registered it yet
    for (Group* group : waiting) {
      if (group->members == members && group->registration == item.first.back()) {
        group->active = true;
        registrations_pending_--;
        cycle_order_.push_back(static_cast<int>(
            std::find_if(groups_.begin(), groups_.end(), [&](const auto& g) { return g.get() == group; }) -
            groups_.begin()));
      }
    }
  }
}

void Engine::start_negotiation(Group& group) {
  bool stop;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    group.snapshot = ready_entries(group);
    stop = stop_requested_ && group.snapshot.size() == group.pending.size();
  }
  const auto now = Clock::now();
  const auto stall = std::chrono::duration<double>(options_.stall_check_seconds);
  uint64_t flags = kAllCached | kNotStalled | kNotExpired;
  const auto expiry = std::chrono::duration<double>(options_.stall_shutdown_seconds);
  if (group.snapshot.empty()) flags |= kIdle | (stop ? kWantStop : 0);
  if (!(group.snapshot.empty() && stop)) flags |= kNobodyLeft;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (&group != groups_[0].get() || registrations_pending_ == 0) flags |= kNoRegistration;
  }
  group.vector.assign(1 + (group.cache.size() + 63) / 64, 0);
  for (const Entry& entry : group.snapshot) {
    auto bit = group.bits.find(entry.name);
    const bool cached = entry.refusal.empty() && bit != group.bits.end() &&
                        group.cache[bit->second].count == entry.buffer.count &&
                        group.cache[bit->second].dtype == entry.buffer.dtype && group.cache[bit->second].op == entry.op &&
                        group.cache[bit->second].device == entry.device;
    if (cached) {
      group.vector[1 + bit->second / 64] |= 1ull << (bit->second % 64);
    } else {
      flags &= ~kAllCached;
    }
    if (entry.join) flags &= ~kAllCached;  // while a rank has joined, every round gathers names (and counts)
    if (!entry.warned && now - entry.submitted > stall) flags &= ~kNotStalled;
    if (options_.stall_shutdown_seconds > 0 && now - entry.submitted > expiry) flags &= ~kNotExpired;
  }
  group.vector[0] = flags;
  HP_MPI(MPI_Iallreduce, group.comm, MPI_IN_PLACE, group.vector.data(), static_cast<int>(group.vector.size()),
         MPI_UINT64_T, MPI_BAND, group.comm, &group.request);
}

void Engine::finish_negotiation(Group& group) {
  group.stats.cycles++;
  const uint64_t flags = group.vector[0];
  std::vector<Entry> ready;
  std::vector<Failure> failed;
  std::string expired;
  if ((flags & kAllCached) && (flags & kNotStalled) && (flags & kNotExpired)) {
    for (const Entry& entry : group.snapshot) {
      auto bit = group.bits.find(entry.name);
      if (bit == group.bits.end()) continue;
      if (group.vector[1 + bit->second / 64] & (1ull << (bit->second % 64))) ready.push_back(entry);
    }
  } else {
    group.stats.slow_rounds++;
    const double gather_start = seconds_now();
    expired = slow_round(group, ready, failed);
    record(group, "gather names", gather_start, seconds_now(), 0, 0);
  }
  if (!expired.empty()) {  // every rank of the group saw the same ages: they all stop it in this cycle
    std::lock_guard<std::mutex> lock(mutex_);
    group.finished = true;
    group.stopped_because = expired;
    // the thread goes on driving the other groups (their ranks would wait for it), but takes no new work
    if (fatal_.empty()) fatal_ = expired;
    fail_pending(group, expired, ErrorKind::Stalled);
    group.snapshot.clear();
    return;
  }
  std::sort(ready.begin(), ready.end(),
            [&](const Entry& a, const Entry& b) { return group.bits.at(a.name) < group.bits.at(b.name); });
  {  // those leave the queue; the rest wait for the next cycle
    std::lock_guard<std::mutex> lock(mutex_);
    auto gone = [&](const Entry& entry) {
      for (const Entry& r : ready) if (r.handle == entry.handle) return true;
      for (const auto& f : failed) if (f.entry.handle == entry.handle) return true;
      return false;
    };
    group.pending.erase(std::remove_if(group.pending.begin(), group.pending.end(), gone), group.pending.end());
    for (Entry& entry : group.pending) {  // remember which stalls were reported
      for (const Entry& seen : group.snapshot) {
        if (seen.handle == entry.handle && seen.warned) entry.warned = true;
      }
    }
  }
  for (const auto& item : failed) complete({item.entry}, item.error, 0, item.kind);
  if (!ready.empty()) execute(group, ready);
  if ((flags & kWantStop) && ready.empty() && failed.empty()) {
    std::lock_guard<std::mutex> lock(mutex_);
    group.finished = true;
  }
  // Some ranks have left (hp.shutdown, nothing pending: they will submit nothing more) while others wait:
  // what those wait for can never complete, so it fails now instead of hanging. Every rank sees the same
  // flags, so all ranks of the group gather who left in the same cycle.
  if (!(flags & kNobodyLeft) && !(flags & kWantStop) && !(flags & kIdle)) fail_departed(group);
  group.idle_cycles = (flags & kIdle) ? group.idle_cycles + 1 : 0;
  group.snapshot.clear();
}

void Engine::fail_departed(Group& group) {
  int mine;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    mine = stop_requested_ && group.pending.empty() ? (failed_ ? 2 : 1) : 0;
  }
  std::vector<int> left(group.size, 0);
  HP_MPI(MPI_Allgather, group.comm, &mine, 1, MPI_INT, left.data(), 1, MPI_INT, group.comm);
  std::lock_guard<std::mutex> lock(mutex_);
  if (group.pending.empty()) return;
  std::string ranks, names;
  int count = 0;
  bool failed = false;
  for (int r = 0; r < group.size; ++r) {
    if (!left[r]) continue;
    failed = failed || left[r] == 2;
    ranks += (ranks.empty() ? "" : ", ") + std::to_string(group.members.empty() ? r : group.members[r]);
    ++count;
  }
  size_t listed = 0;
  for (const Entry& entry : group.pending) {
    if (listed++ == 3) {
      names += ", ...";
      break;
    }
    names += (names.empty() ? "'" : ", '") + entry.name + "'";
  }
  const int me = group.members.empty() ? group.rank : group.members[group.rank];
  const std::string who = std::string(count == 1 ? "rank " : "ranks ") + ranks;
  const std::string waits = " while this rank (rank " + std::to_string(me) + ") waits for " +
                            (count == 1 ? "it" : "them") + " in a collective on group '" + group.label + "' (" + names +
                            "): ";
  if (failed) {
    fail_pending(group,
                 who + " failed with an uncaught exception (its traceback is in its output)" + waits +
                     "fix the error that rank reports",
                 ErrorKind::Departed);
    return;
  }
  fail_pending(group,
               who + (count == 1 ? " has" : " have") + " shut down (hp.shutdown)" + waits +
                   "the ranks made different numbers of collective calls. Usually uneven data: one rank ran out "
                   "of batches first; give every rank the same number of batches (drop_last=True, or a sampler "
                   "that pads), or call hp.join() on a rank that runs out of data",
               ErrorKind::Departed);
}

std::string Engine::slow_round(Group& group, std::vector<Entry>& ready, std::vector<Failure>& failed) {
  const auto now = Clock::now();
  std::string mine;
  for (const Entry& entry : group.snapshot) {
    const uint32_t length = static_cast<uint32_t>(entry.name.size());
    const uint64_t count = entry.buffer.count;
    const int32_t dtype = static_cast<int32_t>(entry.buffer.dtype), op = static_cast<int32_t>(entry.op);
    const double waited = std::chrono::duration<double>(now - entry.submitted).count();
    const uint8_t stalled = !entry.warned && waited > options_.stall_check_seconds;
    put(mine, &length, sizeof length);
    put(mine, entry.name.data(), length);
    put(mine, &count, sizeof count);
    put(mine, &dtype, sizeof dtype);
    put(mine, &op, sizeof op);
    put(mine, &stalled, sizeof stalled);
    put(mine, &waited, sizeof waited);
    const uint32_t refusal_length = static_cast<uint32_t>(entry.refusal.size());
    put(mine, &refusal_length, sizeof refusal_length);
    put(mine, entry.refusal.data(), refusal_length);
    const int32_t device = entry.device;
    put(mine, &device, sizeof device);
    const uint8_t join = entry.join, call = entry.job != nullptr;
    put(mine, &join, sizeof join);
    put(mine, &call, sizeof call);
  }
  int my_length = static_cast<int>(mine.size());
  std::vector<int> lengths(group.size), offsets(group.size, 0);
  HP_MPI(MPI_Allgather, group.comm, &my_length, 1, MPI_INT, lengths.data(), 1, MPI_INT, group.comm);
  for (int r = 1; r < group.size; ++r) offsets[r] = offsets[r - 1] + lengths[r - 1];
  std::string everyone(static_cast<size_t>(offsets.back() + lengths.back()), '\0');
  HP_MPI(MPI_Allgatherv, group.comm, mine.data(), my_length, MPI_BYTE, everyone.data(), lengths.data(),
         offsets.data(), MPI_BYTE, group.comm);

  std::map<std::string, std::vector<Announced>> by_name;  // sorted: the same order on every rank
  for (int r = 0; r < group.size; ++r) {
    const char* cursor = everyone.data() + offsets[r];
    const char* end = cursor + lengths[r];
    while (cursor < end) {
      const uint32_t length = take<uint32_t>(cursor);
      std::string name(cursor, length);
      cursor += length;
      Announced a{};
      a.rank = r;
      a.count = static_cast<size_t>(take<uint64_t>(cursor));
      a.dtype = take<int32_t>(cursor);
      a.op = take<int32_t>(cursor);
      a.stalled = take<uint8_t>(cursor) != 0;
      a.waited_s = take<double>(cursor);
      const uint32_t refusal_length = take<uint32_t>(cursor);
      a.refusal.assign(cursor, refusal_length);
      cursor += refusal_length;
      a.device = take<int32_t>(cursor);
      a.join = take<uint8_t>(cursor) != 0;
      a.call = take<uint8_t>(cursor) != 0;
      by_name[name].push_back(std::move(a));
    }
  }
  auto my_entry = [&](const std::string& name) -> Entry* {
    for (Entry& entry : group.snapshot) if (entry.name == name) return &entry;
    return nullptr;
  };
  std::vector<bool> joined(group.size, false);  // ranks waiting in join: they stand in with zeros
  int joined_count = 0;
  {
    auto found = by_name.find(kJoinName);
    if (found != by_name.end()) {
      for (const Announced& a : found->second) {
        if (a.join) {
          joined[a.rank] = true;
          ++joined_count;
        }
      }
    }
  }
  for (auto& item : by_name) {
    const std::string& name = item.first;
    const std::vector<Announced>& ranks = item.second;
    Entry* mine_entry = my_entry(name);
    if (joined_count > 0 && name == kJoinName) {
      std::string refusals;
      for (const Announced& a : ranks) {
        if (!a.refusal.empty()) refusals += (refusals.empty() ? "" : "; ") + ("rank " + std::to_string(a.rank) + " raised " + a.refusal);
      }
      if (!refusals.empty() && static_cast<int>(ranks.size()) == group.size) {
        if (mine_entry) failed.push_back(Failure{*mine_entry, refusals + " (so the join failed on every rank of group '" +
                                                                  group.label + "')", ErrorKind::Refused});
        continue;
      }
      if (joined_count == group.size && mine_entry) {  // everyone joined: the last one is the latest to come
        int last = ranks[0].rank;
        double newest = ranks[0].waited_s;
        for (const Announced& a : ranks) {
          if (a.waited_s < newest || (a.waited_s == newest && a.rank > last)) {
            newest = a.waited_s;
            last = a.rank;
          }
        }
        {
          std::lock_guard<std::mutex> lock(mutex_);
          group.last_joined = last;
        }
        failed.push_back(Failure{*mine_entry, "", ErrorKind::None});  // done (no error)
      }
      continue;
    }
    if (joined_count > 0 && static_cast<int>(ranks.size()) < group.size) {
      int covered = 0;
      for (const Announced& a : ranks) covered += joined[a.rank] ? 0 : 1;
      if (covered == static_cast<int>(ranks.size()) && covered + joined_count == group.size) {
        // every rank that has not joined submitted it: the joined ones take part with zeros
        std::string listing, joined_list;
        bool same = true, call = false;
        for (const Announced& a : ranks) {
          same = same && a.count == ranks[0].count && a.dtype == ranks[0].dtype && a.op == ranks[0].op &&
                 a.device == ranks[0].device;
          call = call || a.call;
          listing += (listing.empty() ? "" : "; ") + ("rank " + std::to_string(a.rank) + ": " + describe(a));
        }
        for (int r = 0; r < group.size; ++r) {
          if (joined[r]) joined_list += (joined_list.empty() ? "" : ", ") + std::to_string(r);
        }
        if (call || !same) {
          if (mine_entry) {
            failed.push_back(Failure{
                *mine_entry,
                call ? "ranks [" + joined_list + "] of group '" + group.label +
                           "' have joined (hp.join): until every rank joined, only allreduces complete (with their "
                           "contributions as zeros); this collective cannot"
                     : "allreduce_async '" + name + "' on group '" + group.label + "': ranks disagree (" + listing +
                           "); every rank must submit the same count, dtype, op and device under one name",
                call ? ErrorKind::Joined : ErrorKind::Mismatch});
          }
          continue;
        }
        const Announced& meta = ranks[0];
        const ReduceOp op = static_cast<ReduceOp>(meta.op) == ReduceOp::Average ? ReduceOp::Sum
                                                                                 : static_cast<ReduceOp>(meta.op);
        auto bit = group.bits.find(name);
        const CacheEntry cached{name, meta.count, static_cast<DType>(meta.dtype), static_cast<ReduceOp>(meta.op),
                                meta.device};
        if (bit == group.bits.end()) {
          group.bits[name] = group.cache.size();
          group.cache.push_back(cached);
        } else {
          group.cache[bit->second] = cached;
        }
        Entry entry;
        if (mine_entry) {
          entry = *mine_entry;
        } else {  // this rank joined: zeros of the same size stand in for its tensor
          entry.handle = 0;
          entry.name = name;
          entry.zeros = std::make_shared<std::vector<unsigned char>>(
              meta.count * dtype_size(static_cast<DType>(meta.dtype)), 0);
          entry.buffer = Buffer{entry.zeros->data(), meta.count, static_cast<DType>(meta.dtype)};
          entry.submitted = now;
        }
        entry.op = op;  // an Average is a sum here, divided by the contributors afterwards (wait's contributors)
        entry.contributors = covered;
        ready.push_back(entry);
        continue;
      }
    }
    if (static_cast<int>(ranks.size()) == group.size) {
      std::string refusals;
      for (const Announced& a : ranks) {
        if (!a.refusal.empty()) refusals += (refusals.empty() ? "" : "; ") + ("rank " + std::to_string(a.rank) + " raised " + a.refusal);
      }
      if (!refusals.empty()) {  // every rank sees the same refusals: the operation fails everywhere
        if (mine_entry) {
          failed.push_back(Failure{*mine_entry, refusals + " (so no rank of group '" + group.label +
                                                    "' ran its part; fix the arguments there)", ErrorKind::Refused});
        }
        continue;
      }
      bool same = true;
      for (const Announced& a : ranks) {
        same = same && a.count == ranks[0].count && a.dtype == ranks[0].dtype && a.op == ranks[0].op &&
               a.device == ranks[0].device;
      }
      if (!same) {
        std::string listing;
        for (const Announced& a : ranks) listing += (listing.empty() ? "" : "; ") + ("rank " + std::to_string(a.rank) + ": " + describe(a));
        if (mine_entry) {
          failed.push_back(Failure{*mine_entry,
                                   "allreduce_async '" + name + "' on group '" + group.label + "': ranks disagree (" +
                                       listing + "); every rank must submit the same count, dtype, op and device under one name",
                                   ErrorKind::Mismatch});
        }
        continue;
      }
      auto bit = group.bits.find(name);
      const CacheEntry meta{name, ranks[0].count, static_cast<DType>(ranks[0].dtype), static_cast<ReduceOp>(ranks[0].op),
                            ranks[0].device};
      if (bit == group.bits.end()) {
        group.bits[name] = group.cache.size();
        group.cache.push_back(meta);
      } else {
        group.cache[bit->second] = meta;
      }
      if (mine_entry) ready.push_back(*mine_entry);
      continue;
    }
    bool stalled = false;
    double waited = 0;
    for (const Announced& a : ranks) {
      stalled = stalled || a.stalled;
      waited = std::max(waited, a.waited_s);
    }
    if (options_.stall_shutdown_seconds > 0 && waited > options_.stall_shutdown_seconds) {
      // every rank of the group sees the same gathered ages, so every rank stops here together
      std::string have;
      for (const Announced& a : ranks) have += (have.empty() ? "" : ", ") + std::to_string(a.rank);
      char text[160];
      std::snprintf(text, sizeof text, "' waited %.1f s for the ranks of the group that never submitted it",
                    waited);
      char limit[64];
      std::snprintf(limit, sizeof limit, "%g", options_.stall_shutdown_seconds);
      return "allreduce '" + name + text + " (only ranks [" + have + "] did); stall_shutdown_seconds=" + limit +
             " stopped the engine (group '" + group.label + "')";
    }
    if (!stalled) continue;
    if (mine_entry) mine_entry->warned = true;
    if (group.rank == ranks[0].rank) {  // the lowest rank that has it reports
      std::string have, missing;
      size_t next = 0;
      for (int r = 0; r < group.size; ++r) {
        const bool has = next < ranks.size() && ranks[next].rank == r;
        if (has) ++next;
        std::string& list = has ? have : missing;
        list += (list.empty() ? "" : ", ") + std::to_string(r);
      }
      std::fprintf(stderr,
                   "hybridpipe WARNING: allreduce '%s' on group '%s' has waited %.1f s: ranks [%s] of the group "
                   "submitted it, ranks [%s] did not (stall_check_seconds=%g). A rank skipped a step, a parameter "
                   "got no gradient there, or the ranks run different code.\n",
                   name.c_str(), group.label.c_str(), waited, have.c_str(), missing.c_str(),
                   options_.stall_check_seconds);
      std::fflush(stderr);
      group.stats.stall_warnings++;
    }
  }
  return "";
}

void Engine::reduce_bucket(Group& group, const std::function<void(const AllreduceOptions&)>& run) {
  auto run_here = [&] {
    block_on(&group, "finish an allreduce");
    run(options_.allreduce);
    block_on(nullptr);
  };
  if (!group.waiters_help) return run_here();
  // A thread leaving wait() usually comes back for its next handle within microseconds.
  const auto grace = std::chrono::microseconds(200);
  Job job;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (group.idle_waiters == 0 && Clock::now() - group.last_wait_return > grace) {
      lock.unlock();
      return run_here();
    }
    // Spin, with the same MPI calls as the engine thread's policy (another rank's engine thread may
    // run this bucket there). `run` outlives the job: this frame waits for it or takes it back.
    AllreduceOptions helped = options_.allreduce;
    helped.wait = spinning(helped.wait);
    job.work = [&run, helped] { run(helped); };
    group.offered = &job;
    const auto job_started = Clock::now();
    changed_.notify_all();
    while (!job.done) {
      if (!job.taken && group.idle_waiters == 0 && Clock::now() - group.last_wait_return > grace) {  // nobody came
        group.offered = nullptr;
        lock.unlock();
        return run_here();
      }
      if (job.taken) {  // a waiter runs it: no MPI calls here, only the timeout
        changed_.wait_for(lock, std::chrono::milliseconds(100));
        const double waited = std::chrono::duration<double>(Clock::now() - job_started).count();
        const double limit = abort_after_seconds();
        if (!job.done && limit > 0 && waited > limit) {
          char message[512];
          std::snprintf(message, sizeof message,
                        "hybridpipe ERROR: an allreduce of group '%s' (its ranks share this host) has waited %.1f s "
                        "for the other ranks (timeout_seconds=%g, stall_shutdown_seconds=%g): aborting the job",
                        group.label.c_str(), waited, options_.timeout_seconds, options_.stall_shutdown_seconds);
          lock.unlock();
          abort_job(message);
        }
      } else {
        changed_.wait_for(lock, grace);
      }
    }
  }
  if (!job.error.empty()) throw std::runtime_error(job.error);
  group.stats.helped++;
}

void Engine::execute(Group& group, std::vector<Entry>& ready) {
  const size_t threshold = std::max<size_t>(options_.fusion_threshold_bytes, 1);
  std::vector<unsigned char>& fusion_ = group.fusion;
  if (fusion_.size() < threshold) fusion_.resize(threshold);
  // Reduces `entries` (one alone, in place; several packed into the fusion buffer) and completes them.
  auto reduce = [&](std::vector<Entry>& entries, size_t total_bytes) {
    const double started = seconds_now();
    if (reduce_cuda_bucket(group, entries, total_bytes, started)) return;
    const ReduceOp op = entries[0].op;
    const bool streamed = group.shm && total_bytes > options_.allreduce.small_message_bytes;
    if (entries.size() == 1) {
      const Buffer& buffer = entries[0].buffer;
      const Buffer& output = entries[0].result();
      reduce_bucket(group, [&](const AllreduceOptions& options) {
        allreduce(buffer, output, op, group.comm, options, group.workspace);
      });
      record(group, "ring", started, seconds_now(), total_bytes, 1);
    } else if (streamed) {
      // packed straight into the shared segment and unpacked straight from it: no fusion buffer
      std::vector<Buffer> buffers, outputs;
      for (const Entry& entry : entries) {
        buffers.push_back(entry.buffer);
        outputs.push_back(entry.result());
      }
      reduce_bucket(group, [&](const AllreduceOptions& options) {
        group.shm->allreduce(buffers, outputs, op, options.wait);
      });
      record(group, "ring", started, seconds_now(), total_bytes, entries.size());
    } else {
      unsigned char* cursor = fusion_.data();
      for (const Entry& entry : entries) {
        std::memcpy(cursor, entry.buffer.data, entry.buffer.bytes());
        cursor += entry.buffer.bytes();
      }
      const double packed = seconds_now();
      record(group, "pack", started, packed, total_bytes, entries.size());
      const DType dtype = entries[0].buffer.dtype;
      const Buffer fused{fusion_.data(), total_bytes / dtype_size(dtype), dtype};
      reduce_bucket(group, [&](const AllreduceOptions& options) {
        allreduce(fused, fused, op, group.comm, options, group.workspace);
      });
      const double reduced = seconds_now();
      record(group, "ring", packed, reduced, total_bytes, entries.size());
      cursor = fusion_.data();
      for (const Entry& entry : entries) {
        std::memcpy(entry.result().data, cursor, entry.buffer.bytes());
        cursor += entry.buffer.bytes();
      }
      record(group, "unpack", reduced, seconds_now(), total_bytes, entries.size());
    }
    group.stats.buckets++;
    if (streamed) group.stats.shared_memory++;
    group.stats.bytes += total_bytes;
    group.stats.tensors += entries.size();
    complete(entries, "", started);
  };
  BucketCutter cutter(threshold, options_.allreduce, group.shm != nullptr);
  auto reduce_all = [&](const std::vector<Bucket>& buckets) {
    for (const Bucket& cut : buckets) {
      std::vector<Entry> entries;
      for (size_t i : cut.items) entries.push_back(ready[i]);
      reduce(entries, cut.bytes);
    }
  };
  for (size_t i = 0; i < ready.size(); ++i) {
    Entry& entry = ready[i];
    if (entry.job) {  // a call: everything before it in the sequence first
      reduce_all(cutter.flush());
      const double started = seconds_now();
      entry.job();
      record(group, "call", started, seconds_now(), 0, 1);
      complete({entry}, "", started);
      continue;
    }
    reduce_all(cutter.add(i, entry.buffer.bytes(), entry.buffer.dtype, entry.op));
  }
  reduce_all(cutter.flush());
}

bool Engine::reduce_cuda_bucket(Group& group, std::vector<Entry>& entries, size_t total_bytes, double started) {
#if defined(HYBRIDPIPE_WITH_CUDA)
  // Which GPU each entry's memory is on: -1 for host memory (a build without kernels never gets here with
  // device memory; a rank that joined stands in with host zeros under the others' device code)
  std::vector<int> gpus;
  bool any = false;
  for (const Entry& entry : entries) {
    gpus.push_back(entry.device == 1 && !entry.zeros ? cuda_pointer_device(entry.buffer.data) : -1);
    any = any || gpus.back() >= 0;
  }
  if (!any) return false;
  std::map<int, std::vector<DevicePiece>> down, up;  // per GPU: its entries' inputs and results
  std::vector<size_t> offsets;
  size_t offset = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const size_t bytes = entries[i].buffer.bytes();
    offsets.push_back(offset);
    if (gpus[i] >= 0) {
      down[gpus[i]].push_back(DevicePiece{entries[i].buffer.data, offset, bytes});
      up[gpus[i]].push_back(DevicePiece{entries[i].result().data, offset, bytes});
    }
    offset += bytes;
  }
  auto fusion_on = [&](int gpu) -> CudaFusion& {
    std::shared_ptr<void>& slot = cuda_fusion_[gpu];
    if (!slot) slot = std::shared_ptr<void>(std::make_shared<CudaFusion>(gpu));
    return *static_cast<CudaFusion*>(slot.get());
  };
  uint64_t launches = 0;
  const DType dtype = entries[0].buffer.dtype;
  const ReduceOp op = entries[0].op;
  auto finish = [&](bool device_memory) {
    group.stats.buckets++;
    group.stats.bytes += total_bytes;
    group.stats.tensors += entries.size();
    group.stats.cuda_buckets++;
    group.stats.cuda_aware_buckets += device_memory ? 1 : 0;
    group.stats.cuda_launches += launches;
    complete(entries, "", started);
  };
  // In device memory, where the group has a device allreduce (a CUDA-aware MPI) and every rank decides alike:
  // every entry a CUDA tensor on one GPU, and no rank has joined (a joined rank stands in with host zeros)
  const bool one_gpu = down.size() == 1 && std::none_of(gpus.begin(), gpus.end(), [](int g) { return g < 0; });
  const bool all_contribute = std::all_of(entries.begin(), entries.end(),
                                          [](const Entry& entry) { return entry.contributors == 0; });
  if (group.device_allreduce && one_gpu && all_contribute) {
    const int gpu = down.begin()->first;
    CudaFusion& fusion = fusion_on(gpu);
    const uint64_t before = fusion.launches();
    void* fused = fusion.gather_device(down[gpu], total_bytes);
    const double packed = seconds_now();
    if (group.device_allreduce(fused, total_bytes / dtype_size(dtype), dtype, op, gpu)) {
      const double reduced = seconds_now();
      fusion.scatter_device(up[gpu], total_bytes);
      launches += fusion.launches() - before;
      record(group, "pack", started, packed, total_bytes, entries.size());
      record(group, "ring", packed, reduced, total_bytes, entries.size());
      record(group, "unpack", reduced, seconds_now(), total_bytes, entries.size());
      finish(true);
      return true;
    }
    launches += fusion.launches() - before;  // not taken: staged below
  }
  if (pinned_bytes_ < total_bytes) {  // the staged way's pinned host buffer, grown to the largest bucket
    pinned_.reset();
    pinned_bytes_ = 0;
    pinned_ = std::shared_ptr<void>(cuda_host_alloc(total_bytes), cuda_host_free);
    pinned_bytes_ = total_bytes;
  }
  unsigned char* host = static_cast<unsigned char*>(pinned_.get());
  // One GPU (the usual case): one gather of all its pieces. Several: each piece straight down, since a
  // gather copies the whole span down and would overwrite the other GPUs' pieces.
  auto each_gpu = [&](std::map<int, std::vector<DevicePiece>>& pieces, bool gather) {
    for (auto& [gpu, list] : pieces) {
      CudaFusion& fusion = fusion_on(gpu);
      const uint64_t before = fusion.launches();
      if (pieces.size() == 1 || list.size() == 1) {
        gather ? fusion.gather(list, host, total_bytes) : fusion.scatter(list, host, total_bytes);
      } else {
        for (const DevicePiece& piece : list) {
          gather ? fusion.gather({piece}, host, total_bytes) : fusion.scatter({piece}, host, total_bytes);
        }
      }
      launches += fusion.launches() - before;
    }
  };
  each_gpu(down, true);
  for (size_t i = 0; i < entries.size(); ++i) {  // host entries after the gathers, which may cover their bytes
    if (gpus[i] < 0) std::memcpy(host + offsets[i], entries[i].buffer.data, entries[i].buffer.bytes());
  }
  const double packed = seconds_now();
  record(group, "pack", started, packed, total_bytes, entries.size());
  const Buffer fused{host, total_bytes / dtype_size(dtype), dtype};
  reduce_bucket(group, [&](const AllreduceOptions& options) {
    allreduce(fused, fused, op, group.comm, options, group.workspace);
  });
  const double reduced = seconds_now();
  record(group, "ring", packed, reduced, total_bytes, entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    if (gpus[i] < 0) std::memcpy(entries[i].result().data, host + offsets[i], entries[i].buffer.bytes());
  }
  each_gpu(up, false);
  record(group, "unpack", reduced, seconds_now(), total_bytes, entries.size());
  finish(false);
  return true;
#else
  (void)group, (void)entries, (void)total_bytes, (void)started;
  return false;
#endif
}

}  // namespace hybridpipe
