// The background engine; see engine.h.
#include "engine.h"

#include <unistd.h>  // gethostname

#ifdef __linux__
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
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

struct Announced {  // one pending name of one rank, as gathered in a slow round
  int rank;
  size_t count;
  int dtype;
  int op;
  bool stalled;
  double waited_s;
};

void put(std::string& out, const void* data, size_t bytes) { out.append(static_cast<const char*>(data), bytes); }

template <typename T>
T take(const char*& cursor) {
  T value;
  std::memcpy(&value, cursor, sizeof(T));
  cursor += sizeof(T);
  return value;
}

std::string describe(const Announced& a) {
  return "count=" + std::to_string(a.count) + " dtype=" + dtype_name(static_cast<DType>(a.dtype)) +
         " op=" + op_name(static_cast<ReduceOp>(a.op));
}

}  // namespace

Engine::Engine(const EngineOptions& options) : options_(options) {
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

uint64_t Engine::submit(int group_id, const std::string& name, const Buffer& buffer, ReduceOp op) {
  return enqueue(group_id, name, buffer, op, nullptr);
}

uint64_t Engine::enqueue(int group_id, const std::string& name, const Buffer& buffer, ReduceOp op,
                         std::function<void()> job) {
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
  group.pending.push_back(Entry{handle, name, buffer, op, Clock::now(), false, std::move(job)});
  handles_[handle] = HandleState{group_id, false, "", ErrorKind::None};
  wake_.notify_one();
  return handle;
}

bool Engine::poll(uint64_t handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = handles_.find(handle);
  if (found == handles_.end()) throw std::invalid_argument("unknown or already waited-for handle");
  return found->second.done || thread_done_;
}

std::string Engine::wait(uint64_t handle, double* started, double* finished, ErrorKind* kind) {
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
  for (auto& group : groups_) {
    if (group->comm != MPI_COMM_NULL) MPI_Comm_free(&group->comm);
  }
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
    if (found != handles_.end()) {
      found->second.done = true;
      found->second.error = error;
      found->second.kind = error.empty() ? ErrorKind::None : kind;
      found->second.started = started;
      found->second.finished = started ? finished : 0;
    }
  }
  changed_.notify_all();
}

void Engine::fail_pending(Group& group, const std::string& error, ErrorKind kind) {
  for (const Entry& entry : group.pending) {
    auto found = handles_.find(entry.handle);
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
  if (transfers) {
    progress_hook = {[](void* queue) { static_cast<TransferQueue*>(queue)->progress(); }, transfers};
  }
  // between cycles, transfers in flight are tested with sleeps backing off to this
  const double transfer_sleep_max_us = std::min(std::max(busy_wait.max_sleep_us, 1.0), 50.0);
  std::string stopped_because = "it was shut down";
  try {
    while (true) {
      std::vector<int> order;
      if (transfers) transfers->progress();
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
        while (!due()) {
          if (!(transfers && transfers->busy())) {
            wake_.wait_until(lock, next_cycle, due);
            break;
          }
          lock.unlock();
          if (transfers->progress()) sleep_us = 2.0;
          lock.lock();
          if (due()) break;
          wake_.wait_until(lock, std::min(next_cycle, Clock::now() + std::chrono::nanoseconds(
                                                                          static_cast<int64_t>(sleep_us * 1000))));
          sleep_us = std::min(sleep_us * 2, transfer_sleep_max_us);
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
  } catch (const std::exception& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (fatal_.empty()) fatal_ = error.what();
    stopped_because = "it failed: " + fatal_;
    for (auto& group : groups_) fail_pending(*group, "the background engine failed: " + fatal_, ErrorKind::Failed);
  }
  if (transfers) {
    progress_hook = {};
    transfers->stop(stopped_because);
  }
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
    ready.swap(group.pending);
    if (ready.empty() && stop_requested_) group.finished = true;
  }
  group.stats.tensors += ready.size();
  for (const Entry& entry : ready) {
    const double started = seconds_now();
    if (entry.job) entry.job();
    complete({entry}, "", started);
  }
}

void Engine::negotiate(Group& group, const WaitPolicy& busy_wait, const WaitPolicy& idle_wait) {
  const double negotiation_start = seconds_now();
  start_negotiation(group);
  // polite: spin briefly, then sleep between tests (Python needs the cores). A negotiation waits only
  // for the other ranks' communication threads, which run whatever their training threads do: one
  // that never comes means a rank stopped, died or was cut off, and only a local timer can tell.
  const auto started = Clock::now();
  bool warned = false;
  auto test = [&](int* flag) {
    const int rc = MPI_Test(&group.request, flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS || *flag) return rc;
    const double waited = std::chrono::duration<double>(Clock::now() - started).count();
    const bool expired = options_.stall_shutdown_seconds > 0 && waited > options_.stall_shutdown_seconds;
    if ((waited > options_.stall_check_seconds && !warned) || expired) {
      warned = true;
      report_absent(group, waited, expired);
    }
    return rc;
  };
  HP_MPI(polite_wait, group.comm, test, group.snapshot.empty() ? idle_wait : busy_wait);
  if (!(group.vector[0] & kIdle)) record(group, "negotiate", negotiation_start, seconds_now(), 0, 0);
  finish_negotiation(group);
}

void Engine::report_absent(const Group& group, double waited, bool abort_job) {
  int world_rank = -1;
  MPI_Comm_rank(groups_[0]->comm, &world_rank);
  char host[256] = "?";
  gethostname(host, sizeof host - 1);
  std::string ranks;
  for (int member : group.members) ranks += (ranks.empty() ? "" : ", ") + std::to_string(member);
  std::fprintf(stderr,
               "hybridpipe %s: rank %d (host %s): the communication thread has waited %.1f s for the other ranks "
               "of group '%s' (ranks [%s]) to negotiate; one of them is stopped, dead, cut off, or stuck outside "
               "hybridpipe (stall_check_seconds=%g, stall_shutdown_seconds=%g)%s\n",
               abort_job ? "ERROR" : "WARNING", world_rank, host, waited, group.label.c_str(),
               ranks.empty() ? "all" : ranks.c_str(), options_.stall_check_seconds, options_.stall_shutdown_seconds,
               abort_job ? ": aborting the job" : "");
  std::fflush(stderr);
  if (abort_job) MPI_Abort(groups_[0]->comm, 1);
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
    group.snapshot = group.pending;
    stop = stop_requested_;
  }
  const auto now = Clock::now();
  const auto stall = std::chrono::duration<double>(options_.stall_check_seconds);
  uint64_t flags = kAllCached | kNotStalled | kNotExpired;
  const auto expiry = std::chrono::duration<double>(options_.stall_shutdown_seconds);
  if (group.snapshot.empty()) flags |= kIdle | (stop ? kWantStop : 0);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (&group != groups_[0].get() || registrations_pending_ == 0) flags |= kNoRegistration;
  }
  group.vector.assign(1 + (group.cache.size() + 63) / 64, 0);
  for (const Entry& entry : group.snapshot) {
    auto bit = group.bits.find(entry.name);
    const bool cached = bit != group.bits.end() && group.cache[bit->second].count == entry.buffer.count &&
                        group.cache[bit->second].dtype == entry.buffer.dtype && group.cache[bit->second].op == entry.op;
    if (cached) {
      group.vector[1 + bit->second / 64] |= 1ull << (bit->second % 64);
    } else {
      flags &= ~kAllCached;
    }
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
  std::vector<std::pair<Entry, std::string>> failed;
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
      for (const auto& f : failed) if (f.first.handle == entry.handle) return true;
      return false;
    };
    group.pending.erase(std::remove_if(group.pending.begin(), group.pending.end(), gone), group.pending.end());
    for (Entry& entry : group.pending) {  // remember which stalls were reported
      for (const Entry& seen : group.snapshot) {
        if (seen.handle == entry.handle && seen.warned) entry.warned = true;
      }
    }
  }
  for (const auto& item : failed) complete({item.first}, item.second, 0, ErrorKind::Mismatch);
  if (!ready.empty()) execute(group, ready);
  if ((flags & kWantStop) && ready.empty() && failed.empty()) {
    std::lock_guard<std::mutex> lock(mutex_);
    group.finished = true;
  }
  group.idle_cycles = (flags & kIdle) ? group.idle_cycles + 1 : 0;
  group.snapshot.clear();
}

std::string Engine::slow_round(Group& group, std::vector<Entry>& ready,
                               std::vector<std::pair<Entry, std::string>>& failed) {
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
      by_name[name].push_back(a);
    }
  }
  auto my_entry = [&](const std::string& name) -> Entry* {
    for (Entry& entry : group.snapshot) if (entry.name == name) return &entry;
    return nullptr;
  };
  for (auto& item : by_name) {
    const std::string& name = item.first;
    const std::vector<Announced>& ranks = item.second;
    Entry* mine_entry = my_entry(name);
    if (static_cast<int>(ranks.size()) == group.size) {
      bool same = true;
      for (const Announced& a : ranks) {
        same = same && a.count == ranks[0].count && a.dtype == ranks[0].dtype && a.op == ranks[0].op;
      }
      if (!same) {
        std::string listing;
        for (const Announced& a : ranks) listing += (listing.empty() ? "" : "; ") + ("rank " + std::to_string(a.rank) + ": " + describe(a));
        if (mine_entry) {
          failed.emplace_back(*mine_entry, "allreduce_async '" + name + "' on group '" + group.label +
                                               "': ranks disagree (" + listing +
                                               "); every rank must submit the same count, dtype and op under one name");
        }
        continue;
      }
      auto bit = group.bits.find(name);
      const CacheEntry meta{name, ranks[0].count, static_cast<DType>(ranks[0].dtype), static_cast<ReduceOp>(ranks[0].op)};
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
  auto run_here = [&] { run(options_.allreduce); };
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
    changed_.notify_all();
    while (!job.done) {
      if (!job.taken && group.idle_waiters == 0 && Clock::now() - group.last_wait_return > grace) {  // nobody came
        group.offered = nullptr;
        lock.unlock();
        return run_here();
      }
      if (job.taken) {
        changed_.wait(lock);
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
  std::vector<Entry> bucket;
  size_t bucket_bytes = 0;
  // Reduces `entries` (one alone, in place; several packed into the fusion buffer) and completes them.
  auto reduce = [&](std::vector<Entry>& entries, size_t total_bytes) {
    const double started = seconds_now();
    const ReduceOp op = entries[0].op;
    const bool streamed = group.shm && total_bytes > options_.allreduce.small_message_bytes;
    if (entries.size() == 1) {
      const Buffer& buffer = entries[0].buffer;
      reduce_bucket(group, [&](const AllreduceOptions& options) {
        allreduce(buffer, buffer, op, group.comm, options, group.workspace);
      });
      record(group, "ring", started, seconds_now(), total_bytes, 1);
    } else if (streamed) {
      // packed straight into the shared segment and unpacked straight from it: no fusion buffer
      std::vector<Buffer> buffers;
      for (const Entry& entry : entries) buffers.push_back(entry.buffer);
      reduce_bucket(group, [&](const AllreduceOptions& options) {
        group.shm->allreduce(buffers, buffers, op, options.wait);
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
        std::memcpy(entry.buffer.data, cursor, entry.buffer.bytes());
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
  auto flush = [&]() {
    if (bucket.empty()) return;
    reduce(bucket, bucket_bytes);
    bucket.clear();
    bucket_bytes = 0;
  };
  for (Entry& entry : ready) {
    if (entry.job) {  // a call: everything before it in the sequence first
      flush();
      const double started = seconds_now();
      entry.job();
      record(group, "call", started, seconds_now(), 0, 1);
      complete({entry}, "", started);
      continue;
    }
    const size_t bytes = entry.buffer.bytes();
    if (reduced_alone(bytes, threshold, options_.allreduce, group.shm != nullptr)) {  // in place, alone; the bucket stays open
      std::vector<Entry> alone{entry};
      reduce(alone, bytes);
      continue;
    }
    if (!bucket.empty() && (entry.buffer.dtype != bucket[0].buffer.dtype || entry.op != bucket[0].op ||
                            bucket_bytes + bytes > threshold)) {
      flush();
    }
    bucket.push_back(entry);
    bucket_bytes += bytes;
  }
  flush();
}

}  // namespace hybridpipe
