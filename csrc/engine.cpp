// The background engine (see engine.h): the owner of its collaborating classes. Construction, groups,
// submissions, the thread's cycle loop and shutdown; the queue, the negotiation, the buckets, the watchdog and
// the others are in their own files (engine.h lists them).
#include "engine.h"

#include "engine_group.h"
#include "engine_internal.h"

#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

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

namespace {
#if defined(MPIX_ERR_PROC_FAILED)
constexpr int kProcessFailedCode = MPIX_ERR_PROC_FAILED;
#else
constexpr int kProcessFailedCode = MPI_ERR_OTHER;
#endif
// A failed process the watchdog has reported already (its text is the report), thrown out of the thread's waits.
class ReportedProcessFailure : public MPICallError {
 public:
  explicit ReportedProcessFailure(const std::string& report) : MPICallError(report, kProcessFailedCode) {}
};
}  // namespace

Engine::Engine(const EngineOptions& options)
    : options_(options),
      tuning_(thread_, Tuning{options.fusion_threshold_bytes, options.cycle_time_ms}),
      events_(options.record_events),
      watchdog_(options_, thread_),
      buckets_(options_, tuning_, queue_, events_, watchdog_, thread_),
      stalls_(options_),
      joins_(queue_),
      controller_(options_, queue_, stalls_, joins_, buckets_, events_, watchdog_),
      cycle_order_(thread_),
      loop_(thread_) {
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
    TensorQueue::Locked state = queue_.lock();
    if (state->thread.joinable()) state->thread.detach();
    return;
  }
  shutdown();
}

Group& Engine::group(int group_id) {
  TensorQueue::Locked state = queue_.lock();
  return TensorQueue::group(state, group_id);  // groups are never removed: the reference outlives the lock
}

int Engine::add_group(MPI_Comm comm, const std::string& label) {
  MPI_Comm dup = MPI_COMM_NULL;
  HP_MPI(MPI_Comm_dup, comm, comm, &dup);
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  int rank = 0, size = 1;
  MPI_Comm_rank(dup, &rank);
  MPI_Comm_size(dup, &size);
  const bool first = queue_.lock()->groups.empty();
  if (first) watchdog_.open(dup);  // group 0: every rank's host name, and a communicator for absent-rank probes
  SharedMemoryAllreduce* shm = fused_shared_memory(dup, options_.allreduce);  // collective, like the dup
  const bool waiters_help = options_.waiters_help && (shm != nullptr || size == 1 || on_one_host(dup));
  TensorQueue::Locked state = queue_.lock();
  std::vector<int> members;
  int registration = 0;
  if (!state->groups.empty()) {  // its ranks as ranks of group 0: the key all its ranks register it under
    MPI_Group mine, coordinator;
    MPI_Comm_group(dup, &mine);
    MPI_Comm_group(state->groups[0]->comm, &coordinator);
    std::vector<int> ranks(size);
    for (int r = 0; r < size; ++r) ranks[r] = r;
    members.resize(size);
    MPI_Group_translate_ranks(mine, size, ranks.data(), coordinator, members.data());
    MPI_Group_free(&mine);
    MPI_Group_free(&coordinator);
    for (int member : members) {
      if (member == MPI_UNDEFINED) {
        MPI_Comm_free(&dup);
        throw std::invalid_argument("group '" + label + "' has ranks outside the engine's first group '" +
                                    state->groups[0]->label + "': use a communicator made from hybridpipe's world");
      }
    }
    for (const auto& other : state->groups) {
      if (other->members == members) registration++;
    }
  }
  if (state->stop_requested) {
    MPI_Comm_free(&dup);
    throw std::runtime_error("engine is shutting down; cannot add group '" + label + "'");
  }
  // Before the thread starts every group is active from the first cycle on every rank; after it, a
  // group of one rank needs no agreement, the others join at a cycle their ranks agree on.
  const bool active = !state->started || size == 1;
  if (!active) {
    state->registrations_pending++;
    queue_.wake().notify_all();
  }
  const int id = static_cast<int>(state->groups.size());
  state->groups.push_back(std::make_unique<Group>(
      GroupSetup{id, dup, label, rank, size, members, registration, shm, waiters_help}, thread_, active));
  return id;
}

void Engine::drive_transfers() {
  TensorQueue::Locked state = queue_.lock();
  if (state->stop_requested) throw std::runtime_error("engine is shutting down; it cannot drive transfers");
  if (state->started) throw std::logic_error("Engine::drive_transfers() must come before start()");
  transfers_.with([&](std::shared_ptr<TransferQueue>& transfers) {
    if (!transfers) {
      transfers = std::make_shared<TransferQueue>([this] {
        TensorQueue::Locked wake_lock = queue_.lock();
        queue_.wake().notify_all();
      });
    }
    install_transfer_queue(transfers);
  });
}

void Engine::start() {
  TensorQueue::Locked state = queue_.lock();
  if (state->started) return;
  state->started = true;
  for (size_t id = 0; id < state->groups.size(); ++id) cycle_order_->push_back(static_cast<int>(id));
  state->thread = std::thread([this] {
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
  return enqueue(group_id, Entry{0, name, Buffer{nullptr, static_cast<size_t>(kind), DType::Int64}, ReduceOp::Max, {},
                                 false, std::move(job)});
}

uint64_t Engine::submit_tuning(int group_id, const std::string& name, size_t fusion_threshold_bytes,
                               double cycle_time_ms) {
  if (fusion_threshold_bytes < 1 || !(cycle_time_ms > 0)) {
    throw std::invalid_argument("submit_tuning: the fusion threshold must be >= 1 byte and the cycle time > 0 ms");
  }
  constexpr int kTuningKind = 0x7475;  // "tu": ranks tuning while others call something else disagree
  return submit_call(group_id, name, kTuningKind, [this, fusion_threshold_bytes, cycle_time_ms] {
    tuning_->fusion_threshold_bytes = fusion_threshold_bytes;  // runs on the communication thread
    tuning_->cycle_time_ms = cycle_time_ms;
    tuned_fusion_ = fusion_threshold_bytes;
    tuned_cycle_ = cycle_time_ms;
  });
}

uint64_t Engine::submit_collective(int group_id, const std::string& name, int kind, Collective work) {
  Group* group = &this->group(group_id);  // groups are never removed: the pointer outlives the entry
  return submit_call(group_id, name, kind, [this, group, work = std::move(work)] {
    Workspace& workspace = group->round->workspace;  // lent to a waiter that runs the bucket
    buckets_.reduce(*group, [&](const AllreduceOptions& options) { work(group->comm, workspace, options); });
  });
}

uint64_t Engine::submit_refusal(int group_id, const std::string& name, const std::string& refusal, bool detached) {
  const uint64_t handle =
      enqueue(group_id, Entry{0, name, Buffer{nullptr, 0, DType::Int64}, ReduceOp::Max, {}, false, nullptr,
                              refusal.empty() ? std::string("invalid arguments") : refusal, detached});
  return detached ? 0 : handle;
}

void Engine::set_device_allreduce(int group_id, DeviceAllreduce reduce) {
  TensorQueue::Locked state = queue_.lock();
  TensorQueue::group(state, group_id, "set_device_allreduce")
      .device_allreduce.with([&](DeviceAllreduce& device_allreduce) { device_allreduce = std::move(reduce); });
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
  return enqueue(group_id, Entry{0, name, buffer, op, {}, false, nullptr, "", false, device, false, 0, nullptr,
                                 output.data != buffer.data ? output : Buffer{}, ready_event, wire});
}

uint64_t Engine::submit_join(int group_id) {
  return enqueue(group_id, Entry{0, kJoinName, Buffer{nullptr, 0, DType::Int64}, ReduceOp::Max, {}, false, nullptr, "",
                                 false, 0, true});
}

int Engine::last_joined(int group_id) {
  TensorQueue::Locked state = queue_.lock();
  return TensorQueue::group(state, group_id).queue(state).last_joined;
}

bool Engine::poll(uint64_t handle) { return queue_.poll(handle); }

std::string Engine::wait(uint64_t handle, double* started, double* finished, ErrorKind* kind, int* contributors) {
  return queue_.wait(handle, started, finished, kind, contributors);
}

void Engine::shutdown() {
  {
    TensorQueue::Locked state = queue_.lock();
    if (state->shut_down) return;
    state->shut_down = true;
    state->stop_requested = true;
    queue_.wake().notify_all();
    queue_.changed().notify_all();
  }
  start();  // the stop is agreed by the thread: start it if it never ran
  std::thread thread = std::move(queue_.lock()->thread);
  if (thread.joinable()) thread.join();
  const std::shared_ptr<TransferQueue> transfers =
      transfers_.with([](std::shared_ptr<TransferQueue>& driven) { return driven; });
  if (transfers && installed_transfer_queue() == transfers) install_transfer_queue(nullptr);
  watchdog_.close();
  std::vector<MPI_Comm> comms;
  {
    TensorQueue::Locked state = queue_.lock();
    for (const auto& group : state->groups) comms.push_back(group->comm);
  }
  for (MPI_Comm comm : comms) {
    if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
}

void Engine::leave_failed() {
  TensorQueue::Locked state = queue_.lock();
  state->failed = true;
  state->stop_requested = true;
  queue_.wake().notify_all();
}

EngineStats Engine::stats(int group_id) {
  return group(group_id).stats.with([](const EngineStats& stats) { return stats; });
}

std::vector<EngineEvent> Engine::take_events(int group_id) {
  group(group_id);  // an unknown group throws
  return events_.take(group_id);
}

void Engine::service() {
  TransferQueue* transfers = loop_->transfers;
  if (transfers) {
    transfers->progress();
    if (transfers->saw_process_failure()) throw_process_failure("a point-to-point transfer");
  }
  if (watchdog_.failure_known()) throw_process_failure("its failure detector (MPIX_Comm_get_failed)");
  watchdog_.answer_probes();
  watchdog_.check_blocked();
}

void Engine::run() {
  thread_.enter();
  WaitPolicy busy_wait = options_.allreduce.wait;
  if (busy_wait.spin_us < 0) busy_wait = WaitPolicy{0.0, options_.cycle_time_ms * 250 + 20};
  // With nothing of its own to reduce, a rank has no reason to spin: it sleeps between tests from the
  // start, so idle negotiations do not take the cores from the compute threads.
  const WaitPolicy idle_wait{0.0, busy_wait.max_sleep_us};
  auto next_cycle = Clock::now();
  bool last_cycle_idle = true;
  uint64_t cycle = 0;  // the same count on every rank: each group's visits fall on the same cycles everywhere
  Loop& loop = loop_.get();
  loop.transfers = transfers_.with([](std::shared_ptr<TransferQueue>& driven) { return driven.get(); });
  // inside every polite wait of this thread: transfers, probes from other ranks, its own timer
  // The communication lock (p2p.h): held while this thread makes MPI calls, i.e. always but in its sleeps
  // (between cycles, and between the tests of its polite waits), where a thread that needs a transfer may
  // take it and make the calls itself. It is re-taken blocking whatever else this thread holds: a thread
  // that holds it makes a few nonblocking calls and waits for nothing else meanwhile.
  std::unique_lock<std::timed_mutex> mpi;
  if (loop.transfers) mpi = std::unique_lock<std::timed_mutex>(loop.transfers->mpi_lock());
  loop.mpi_held = loop.transfers ? &mpi : nullptr;
  progress_hook = {[](void* engine) { static_cast<Engine*>(engine)->service(); }, this,
                   [](void* engine, bool asleep) {
                     std::unique_lock<std::timed_mutex>* mpi = static_cast<Engine*>(engine)->loop_->mpi_held;
                     if (mpi == nullptr) return;
                     if (asleep && mpi->owns_lock()) mpi->unlock();
                     if (!asleep && !mpi->owns_lock()) mpi->lock();
                   }};
  watchdog_.start_probes();
  std::string stopped_because = "it was shut down";
  try {
    while (true) {
      std::vector<Group*> order;
      service();
      if (!await_cycle(next_cycle, last_cycle_idle, mpi, order)) break;
      bool idle = true, quiet = true;
      const bool visited = visit(order, cycle, busy_wait, idle_wait, idle);
      {
        TensorQueue::Locked state = queue_.lock();
        std::vector<int>& cycle_order = cycle_order_.get();
        cycle_order.erase(std::remove_if(cycle_order.begin(), cycle_order.end(),
                                         [&](int id) { return state->groups[id]->queue(state).finished; }),
                          cycle_order.end());
        if (cycle_order.empty() && state->stop_requested) break;
        for (Group* group : order) {
          if (group->size > 1 && !group->queue(state).finished) {
            quiet = quiet && group->round->idle_cycles > kQuietAfterIdleCycles;
          }
        }
      }
      // After a few agreed idle cycles of every group the thread goes quiet: its next cycle comes when
      // something is submitted here, on stop, or after the quiet cycle time. Every rank of a group sees
      // the same flags, so the ranks' idle timers stay in step (see quiet_cycle_ms).
      ++cycle;
      if (!visited) {  // a cycle with nothing to visit costs nothing: go on to the next at once
        next_cycle = Clock::now();
        continue;
      }
      last_cycle_idle = idle;
      next_cycle = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(
                                      (quiet ? quiet_cycle_ms() : tuning_->cycle_time_ms) * 1000));
    }
  } catch (const ReportedProcessFailure& failure) {
    stopped_because = lose_ranks(failure.what());
  } catch (const MPICallError& error) {
    const bool lost = is_process_failure(error.code()) || (survive_process_failures() && failure_seen());
    stopped_because = lost ? lose_ranks(watchdog_.report_process_failure(error.what())) : fail_engine(error.what());
  } catch (const std::exception& error) {  // e.g. a helping waiter's allreduce that a revoke ended
    const bool lost = survive_process_failures() && failure_seen();
    stopped_because = lost ? lose_ranks(watchdog_.report_process_failure(error.what())) : fail_engine(error.what());
  }
  progress_hook = {};
  loop.mpi_held = nullptr;
  if (loop.transfers && !mpi.owns_lock()) mpi.lock();
  if (loop.transfers) loop.transfers->stop(stopped_because);
  watchdog_.stop_probes();
  thread_.leave();
  TensorQueue::Locked state = queue_.lock();
  for (auto& group : state->groups) {  // never became active (its other ranks never registered it), or left over
    GroupQueue& queue = group->queue(state);
    queue_.fail_pending(state, queue,
                        "the background engine stopped before this tensor was reduced (group '" + group->label +
                            "' was " + (queue.active ? "stopped" : "never registered by all of its ranks") + ")",
                        ErrorKind::Stopped);
  }
  state->thread_done = true;
  queue_.changed().notify_all();
}

bool Engine::visit(const std::vector<Group*>& order, uint64_t cycle, const WaitPolicy& busy_wait,
                   const WaitPolicy& idle_wait, bool& idle) {
  bool visited = false, in_step = false;  // in_step: a group of several ranks, whose cycles the ranks share
  for (Group* group : order) {
    if (group->size == 1) {
      cycle_single(*group);
      continue;
    }
    in_step = true;
    const GroupRound& round = group->round.get();
    // A quiet group (idle on every rank for a while) is visited on every kQuietPeriod-th cycle only,
    // so that one busy group's ranks are not held in step with all ranks every cycle.
    if (round.idle_cycles > kQuietAfterIdleCycles && cycle % kQuietPeriod != 0) continue;
    visited = true;
    controller_.negotiate(*group, busy_wait, idle_wait);
    idle = idle && round.idle_cycles > 0;
    if (group->id == 0 && Controller::registration_pending(*group)) {
      const std::vector<int> activated = controller_.activate_registrations(*group);
      cycle_order_->insert(cycle_order_->end(), activated.begin(), activated.end());
    }
  }
  // Only groups of one rank (a job of one process): no cycle count to keep in step with other ranks, so the
  // thread sleeps to its next cycle (woken by a submission) rather than spinning through empty cycles.
  return visited || !in_step;
}

bool Engine::await_cycle(std::chrono::steady_clock::time_point next_cycle, bool last_cycle_idle,
                         std::unique_lock<std::timed_mutex>& mpi, std::vector<Group*>& order) {
  // Between cycles this thread holds the communication lock only to test the transfers in flight, every
  // kIdleTransferPollUs while some are (their background progress: a dropped send, a rendezvous the
  // sender must move on, a header a polling stage has not looked at). A thread that waits for a transfer
  // tests it itself meanwhile (TransferQueue::wait), with the lock free.
  constexpr double kIdleTransferPollUs = 1000.0;
  TransferQueue* transfers = loop_->transfers;
  std::vector<int>& cycle_order = cycle_order_.get();
  if (mpi.owns_lock()) mpi.unlock();
  TensorQueue::Locked state = queue_.lock();
  // sleep until the next cycle; after an idle cycle, a submission, registration or stop wakes it early
  auto due = [&] {
    if (Clock::now() >= next_cycle) return true;
    if (!last_cycle_idle) return false;
    if (state->stop_requested || state->registrations_pending > 0) return true;
    for (int id : cycle_order) {
      if (!state->groups[id]->queue(state).pending.empty()) return true;
    }
    return false;
  };
  // a transfer submitted while nothing is in flight ends the sleep too (its wake is a notify of
  // the queue's wake signal): it must not wait for the next cycle, up to idle_cycle_time_ms away
  auto transfer_busy = [&] { return transfers && transfers->busy(); };
  while (!due()) {
    if (!transfer_busy()) {
      state.wait_until(queue_.wake(), next_cycle, [&] { return due() || transfer_busy(); });
      continue;  // due: the cycle runs; a transfer came: the poll below
    }
    state.unlock();
    // a waiting thread tests them itself; one that holds the lock makes progress meanwhile
    if (!transfers->wanted() && mpi.try_lock()) {
      transfers->progress();
      watchdog_.answer_probes();
      mpi.unlock();
    }
    state.relock();
    if (due()) break;
    state.wait_until(queue_.wake(), std::min(next_cycle, Clock::now() + std::chrono::microseconds(
                                                                          static_cast<int64_t>(kIdleTransferPollUs))));
  }
  for (size_t id = 0; id < state->groups.size(); ++id) {  // one-rank groups added since: no agreement needed
    const int gid = static_cast<int>(id);
    const Group& group = *state->groups[id];
    const GroupQueue& queue = state->groups[id]->queue(state);
    if (queue.active && group.size == 1 && std::find(cycle_order.begin(), cycle_order.end(), gid) == cycle_order.end() &&
        !queue.finished) {
      cycle_order.push_back(gid);
    }
  }
  for (int id : cycle_order) order.push_back(state->groups[id].get());
  const bool go_on = !(order.empty() && state->stop_requested);
  state.unlock();
  if (transfers) mpi.lock();
  return go_on;
}

std::string Engine::fail_engine(const std::string& what) {
  TensorQueue::Locked state = queue_.lock();
  if (state->fatal.empty()) state->fatal = what;
  for (auto& group : state->groups) {
    queue_.fail_pending(state, group->queue(state), "the background engine failed: " + state->fatal, ErrorKind::Failed);
  }
  return "it failed: " + state->fatal;
}

void Engine::throw_process_failure(const char* where) {
  // while surviving failures this ends the thread's loop (run() catches it); otherwise report_process_failure aborts
  const std::string report = watchdog_.report_process_failure(where);
  throw ReportedProcessFailure(report);
}

bool Engine::failure_seen() {
  return !watchdog_.lost_ranks().empty() || !failed_ranks(group(0).comm).empty();
}

void Engine::revoke_groups() {
  std::vector<MPI_Comm> comms;
  {
    TensorQueue::Locked state = queue_.lock();
    for (const auto& group : state->groups) comms.push_back(group->comm);
  }
  for (MPI_Comm comm : comms) revoke(comm);
}

std::string Engine::lose_ranks(const std::string& report) {
  revoke_groups();  // every survivor's engine fails too, whatever it waits for
  watchdog_.revoke_probes();
  ranks_lost_ = true;
  TensorQueue::Locked state = queue_.lock();
  if (state->fatal.empty()) state->fatal = report;
  for (auto& group : state->groups) queue_.fail_pending(state, group->queue(state), state->fatal, ErrorKind::RanksLost);
  return "ranks were lost: " + state->fatal;
}

std::vector<int> Engine::lost_ranks() const { return watchdog_.lost_ranks(); }

void Engine::abandon() {
  revoke_groups();  // the thread's next MPI call fails: it stops without its peers
  shutdown();
}

void Engine::cycle_single(Group& group) {  // an allreduce over one rank is the identity
  std::vector<Entry> ready;
  {
    TensorQueue::Locked state = queue_.lock();
    GroupQueue& queue = group.queue(state);
    ready = TensorQueue::ready_entries(queue);
    auto taken = [&](const Entry& entry) { return !entry.ready_event; };
    queue.pending.erase(std::remove_if(queue.pending.begin(), queue.pending.end(), taken), queue.pending.end());
    if (ready.empty() && queue.pending.empty() && state->stop_requested) queue.finished = true;
  }
  group.stats.with([&](EngineStats& stats) { stats.tensors += ready.size(); });
  for (const Entry& entry : ready) {
    const double started = seconds_now();
    if (entry.job && entry.refusal.empty()) entry.job();
    if (entry.output.data && entry.buffer.data) std::memcpy(entry.output.data, entry.buffer.data, entry.buffer.bytes());
    queue_.complete({entry}, "", started);
  }
}

}  // namespace hybridpipe
