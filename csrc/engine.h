// The background engine: Horovod's design on hybridpipe's allreduce algorithms. Engine owns the collaborating
// classes and wires them by reference, each in its own file with its lock rules in its types (engine_guard.h):
// TensorQueue (engine_queue.h: submissions and handles, behind one lock), Controller (engine_controller.h: the
// negotiation and registrations), ResponseCache (engine_cache.h), StallInspector (engine_stall.h), JoinTracker
// (engine_join.h: joins, refusals, departures), Watchdog (engine_watchdog.h: probes, reports, aborts),
// BucketExecutor (engine_buckets.h: fusion and the buckets' allreduces), EventLog (engine_events.h: the
// timeline); EngineOptions and what the engine reports in engine_options.h, a group in engine_group.h.
//
// ONE communication thread per process drives every group (communicator) of the engine. Each cycle
// it visits the active groups in one order that every rank shares (the order they were activated),
// and for each group:
//   1. negotiates which submitted names are ready on EVERY rank of the group. Steady state is one
//      MPI_Iallreduce(BAND) of a bit-vector: bit i = "cached name i is ready here", plus flag bits
//      (all my ready names are cached / nothing of mine is stalled / I want to stop). Names are
//      cached (given a bit) the first time all ranks have them with the same count, dtype and op.
//   2. only when some rank has an uncached name (or a stalled one) does the group gather every
//      rank's pending names (MPI_Allgatherv), check their metadata (a mismatch fails those handles
//      on every rank, kind Mismatch, with every rank's values), assign new bits, and warn about
//      names some ranks have waited on for longer than stall_check_seconds.
//   3. reduces the ready buffers in fused buckets (ring, shared memory or the MPI library) and runs
//      queued calls (direct collectives, submit_call), in the order of their bits, before it moves on
//      to the next group.
// A group idle on every rank for kQuietAfterIdleCycles visits becomes quiet: it is visited on every
// kQuietPeriod-th cycle only (the cycle count is the same on every rank).
// Why one thread: several threads each driving their own communicator stalled cross-host jobs for
// minutes over Open MPI (a pure mpi4py reproducer shows it without hybridpipe, and not with MPICH:
// docs/sharp_bits.md). Why it cannot deadlock: every rank of a group visits the group in the same
// cycles, so the k-th operation on a group is in the same cycle on all its ranks, and every rank runs
// its blocking operations in the same (cycle, group order) sequence; the rank whose operation is the
// earliest in that order among all ranks' waiting operations finds every peer at it or before it,
// and those before it are not blocked (docs/concepts.md has the argument in full).
// Point-to-point transfers (the pipeline's activations and gradients, p2p.h) follow the same rule once
// drive_transfers() installed its queue: their MPI calls are made under the queue's communication lock,
// which this thread holds whenever it is in MPI (always but in its sleeps between cycles). A thread that
// needs a transfer try-locks it and, when it is free, posts and tests the transfer itself; else this
// thread posts it as it comes and tests it inside every polite wait (negotiations, rings) and between
// cycles, so it never waits for a cycle to end. Under the lock only non-blocking calls are made and the
// other threads never wait for it, so the argument above is unchanged.
// Groups added after start() (user communicators) join at a cycle all ranks agree on: group 0 (the
// first added; its ranks include every other group's) gathers pending registrations when any rank
// has one, and a group becomes active, in the same cycle on each of its ranks, once all its ranks
// asked for it.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "engine_buckets.h"
#include "engine_controller.h"
#include "engine_events.h"
#include "engine_guard.h"
#include "engine_join.h"
#include "engine_options.h"
#include "engine_queue.h"
#include "engine_stall.h"
#include "engine_watchdog.h"
#include "p2p.h"
#include "ring_allreduce.h"
#include "shm_allreduce.h"

namespace hybridpipe {

class Engine {
 public:
  explicit Engine(const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Registers a communicator (hybridpipe duplicates it first); returns its group id. Collective over
  // `comm`: every rank of it registers it, in the same order relative to its other groups. Groups
  // added before start() are active from the first cycle; later ones join at an agreed cycle (see
  // above), and their ranks must all belong to group 0.
  int add_group(MPI_Comm comm, const std::string& label);
  // Starts the communication thread.
  void start();
  // Buckets of CUDA tensors of `group` go to `reduce` in device memory, gathered there by one kernel and
  // scattered back by one (a build with the CUDA kernels; see reduce_cuda_bucket). Set it on every rank of the
  // group before its first such bucket (hybridpipe sets it when the group is added).
  void set_device_allreduce(int group, DeviceAllreduce reduce);
  // From now on the communication thread makes the MPI calls of every point-to-point transfer
  // (isend / irecv in p2p.h) of this process: installs its queue (before start()). Uninstalled at
  // shutdown.
  void drive_transfers();
  // Queues an in-place allreduce of `buffer` over group `group`; returns a handle id. `device`: where the
  // caller's tensor lives (0 host, 1 CUDA, 2 another accelerator): ranks must agree on it, as on count, dtype
  // and op. With device 1 `buffer` (and `output`) may be the tensor's device memory in a build with the CUDA
  // kernels: its bucket is then packed on the GPU (reduce_cuda_bucket); else `buffer` is host memory.
  // `output`: where the result goes (data == nullptr: into `buffer`, in place); `buffer` is then only read.
  // `ready_event`: a CUDA event (CUevent, e.g. torch.cuda.Event.cuda_event) recorded after the work that fills
  // `buffer`; the tensor is announced to the other ranks only once it has completed (polled each cycle with
  // cuEventQuery, never waited on), as Horovod's ready events. 0: ready now.
  // `wire`: what a float32 buffer travels as (ring_allreduce.h's WireFormat); ranks must agree on it too, and
  // buckets hold entries of one wire format.
  uint64_t submit(int group, const std::string& name, const Buffer& buffer, ReduceOp op, int device = 0,
                  const Buffer& output = Buffer{}, uintptr_t ready_event = 0, const WireFormat& wire = WireFormat{});
  // Queues `job`, to be run by the communication thread once every rank of `group` has queued a call
  // under `name` with the same `kind`, at the same point of the thread's sequence on each of them: a
  // blocking collective made this way is ordered with the engine's own operations on every rank, and
  // the process keeps one thread in MPI. Ranks that queued different kinds fail it (ErrorKind
  // Mismatch). `job` must not throw.
  uint64_t submit_call(int group, const std::string& name, int kind, std::function<void()> job);
  // Queues `work` as submit_call does (same agreement on `name` and `kind`), run as one of the group's
  // bucket operations: on the engine thread (or a thread blocked in wait() on this group, as a bucket's
  // allreduce), with the group's communicator, its workspace and the engine's allreduce options, under
  // the engine's timeout. The sharded optimizer's fused reduce-scatters and allgathers go this way, in
  // the same sequence as the gradients' allreduces. `work` may throw only for MPI failures (they stop
  // the engine, as a failing allreduce does).
  using Collective = std::function<void(MPI_Comm, Workspace&, const AllreduceOptions&)>;
  uint64_t submit_collective(int group, const std::string& name, int kind, Collective work);
  // Autotuning: sets the fusion threshold and the cycle time from a call queued on `group` like submit_call
  // (so every rank switches between the same two operations of the engine's sequence: a bucket is cut
  // with the same threshold everywhere). The returned handle completes once it is in effect.
  uint64_t submit_tuning(int group, const std::string& name, size_t fusion_threshold_bytes, double cycle_time_ms);
  // The fusion threshold and cycle time in effect (any thread).
  std::pair<size_t, double> tuning() const { return {tuned_fusion_.load(), tuned_cycle_.load()}; }
  // Stands in for an operation this rank could not submit because its arguments failed its own checks
  // (`refusal`: what it raised, e.g. "TypeError: ..."): once every rank of `group` has something under
  // `name`, the operations of the others fail (ErrorKind Refused) with every refusing rank's text, so a
  // rank-local error raises everywhere instead of leaving the others waiting. Returns a handle to wait
  // for (it fails the same way), or 0 when `detached` (nobody waits; it is released when done).
  uint64_t submit_refusal(int group, const std::string& name, const std::string& refusal, bool detached);
  // Horovod's join: this rank has no more data. Until every rank of `group` has joined, it takes part in
  // the other ranks' allreduces (submit) with zeros of their count and dtype, and an Average among them
  // is summed and divided by the ranks that contributed (wait's `contributors`); calls (submit_call)
  // fail with ErrorKind Joined meanwhile. The handle is done once every rank joined; last_joined(group)
  // then says which rank joined last.
  uint64_t submit_join(int group);
  int last_joined(int group);
  // MPI_Get_processor_name of every rank of group 0, in its rank order (gathered when it was added).
  std::vector<std::string> hosts() const { return watchdog_.hosts(); }
  bool poll(uint64_t handle);
  // Blocks until done; returns "" on success or the error message (the handle is then released);
  // `kind` says why it failed.
  // `started` / `finished`: when its bucket's allreduce began and ended, in seconds of the steady
  // clock (CLOCK_MONOTONIC on Linux, the clock of Python's time.monotonic()); 0 if it never ran.
  // `contributors`: 0, or (an allreduce that ran while ranks had joined) how many ranks contributed.
  std::string wait(uint64_t handle, double* started = nullptr, double* finished = nullptr,
                   ErrorKind* kind = nullptr, int* contributors = nullptr);
  // Coordinated stop: returns once every rank of every group asked for it and nothing is pending.
  // Handles of a group that never became active fail (kind Stopped).
  void shutdown();
  // This rank leaves because of an uncaught exception (python -m hybridpipe before its abort, or hp.shutdown
  // at interpreter exit): it takes no new work, and the ranks of its groups that wait for it in a collective
  // fail at once (kind Departed), told that it failed. The thread goes on until shutdown() or the abort.
  void leave_failed();
  // Ranks of group 0 this engine reported lost while surviving failures (set_survive_process_failures): its
  // handles then fail with ErrorKind RanksLost. Empty while none is.
  std::vector<int> lost_ranks() const;
  bool ranks_were_lost() const { return ranks_lost_.load(); }  // it stopped so (lost_ranks may not know whom yet)
  // Ends the engine without its peers (after ranks were lost): revokes its communicators, so that the thread's
  // next MPI call fails and it stops, then joins it as shutdown() does.
  void abandon();
  EngineStats stats(int group);
  // Recorded events of `group` since the last call (empty unless options.record_events).
  std::vector<EngineEvent> take_events(int group);


 private:
  // What the thread's cycle loop carries (its own): the transfers it drives and its hold on their lock.
  struct Loop {
    TransferQueue* transfers = nullptr;
    std::unique_lock<std::timed_mutex>* mpi_held = nullptr;  // the thread's hold on the communication lock
  };
  // Time between cycles once every active group is quiet: idle_cycle_time_ms, at most a quarter of the
  // stall check (the timer is what lets a rank that never submits be reported).
  double quiet_cycle_ms() const;
  void run();
  // One cycle's visits of `order`; false when no group of several ranks was due (quiet ones skipped), so that the
  // next cycle comes at once; true with only one-rank groups (the thread then sleeps to its next cycle).
  // `idle`: every visited group was idle.
  bool visit(const std::vector<Group*>& order, uint64_t cycle, const WaitPolicy& busy_wait,
             const WaitPolicy& idle_wait, bool& idle);
  // The thread's sleep until its next cycle is due (`next_cycle`, or earlier after an idle cycle when
  // something comes), polling point-to-point transfers meanwhile; then `order`: the groups to visit. False
  // when the thread should end (stopped, nothing left to visit).
  bool await_cycle(std::chrono::steady_clock::time_point next_cycle, bool last_cycle_idle,
                   std::unique_lock<std::timed_mutex>& mpi, std::vector<Group*>& order);
  // The thread failed with `what`: every pending handle fails (kind Failed); returns why it stopped.
  std::string fail_engine(const std::string& what);
  // Surviving failures: `report` (the watchdog's) fails every pending handle (kind RanksLost) after revoking
  // every group's communicator; returns why the thread stopped.
  std::string lose_ranks(const std::string& report);
  void revoke_groups();  // MPIX_Comm_revoke on every group's communicator (a no-op without ULFM)
  [[noreturn]] void throw_process_failure(const char* where);  // reports it; aborts unless surviving failures
  bool failure_seen();  // a failed rank is recorded or known to MPI on group 0
  void cycle_single(Group& group);  // a group of one rank: no MPI
  // The thread's chores inside any wait: post/test transfers, answer probes, check what it waits for.
  void service();
  Group& group(int group_id);  // throws for an unknown id
  uint64_t enqueue(int group_id, Entry entry) { return queue_.enqueue(group_id, std::move(entry)); }

  const EngineOptions options_;  // as constructed; what autotuning changes is in tuning_
  CommThread thread_;            // which thread the communication thread is
  CommThreadOnly<Tuning> tuning_;
  std::atomic<size_t> tuned_fusion_{0};  // copies of tuning_ for tuning() (written by the thread)
  std::atomic<double> tuned_cycle_{0};
  std::atomic<bool> ranks_lost_{false};  // lose_ranks ran
  TensorQueue queue_;
  EventLog events_;
  Watchdog watchdog_;
  BucketExecutor buckets_;
  StallInspector stalls_;
  JoinTracker joins_;
  Controller controller_;
  CommThreadOnly<std::vector<int>> cycle_order_;  // active groups, in the order every rank visits them
  CommThreadOnly<Loop> loop_;
  Guarded<std::shared_ptr<TransferQueue>> transfers_;  // point-to-point transfers this thread drives (or null)
};

}  // namespace hybridpipe
