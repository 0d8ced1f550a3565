// The background engine: Horovod's design on hybridpipe's allreduce algorithms.
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
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "p2p.h"
#include "ring_allreduce.h"
#include "shm_allreduce.h"

namespace hybridpipe {

constexpr int kQuietAfterIdleCycles = 20;
constexpr uint64_t kQuietPeriod = 16;  // a quiet group is negotiated on every kQuietPeriod-th cycle

struct EngineOptions {
  double cycle_time_ms = 0.5;
  // Time between negotiations once a group has been idle on every rank for kQuietAfterIdleCycles
  // cycles (capped at stall_check_seconds / 4); a submission or shutdown on this rank ends it early.
  double idle_cycle_time_ms = 25.0;
  double stall_check_seconds = 60.0;
  double stall_shutdown_seconds = 0.0;  // 0: off; else a tensor waiting this long stops the group
  // 0: never; else the communication thread aborts the job once one of its waits for other ranks (a
  // negotiation, a bucket's allreduce) has lasted this long (stall_shutdown_seconds, when set and
  // shorter, bounds them too): a dead, stopped or cut-off rank ends the job instead of hanging it.
  double timeout_seconds = 300.0;
  size_t fusion_threshold_bytes = 4 * 1024 * 1024;
  AllreduceOptions allreduce;
  // A thread blocked in wait() runs its group's bucket allreduces itself (at its own priority, testing
  // its requests without sleeping) while the engine thread waits for it, so one thread at a time still
  // makes the engine's MPI calls; false: never. Only for groups whose ranks share one host.
  bool waiters_help = true;
  bool record_events = false;  // keep phase timings for the timeline (EngineEvent)
  // Scheduling priority of the engine thread (Linux nice, 0..19 above the process's own): a
  // positive value lets compute threads preempt the ring on a host with no spare core, so the
  // reduction runs in the gaps (waits, step()) instead of slowing the backward pass.
  int thread_nice = 0;
};

// One timed phase of a group's work, for the timeline: "negotiate", "gather names", "pack",
// "ring" (a bucket's allreduce, whichever algorithm: ring, shared memory or the MPI library), "unpack". Times in seconds of the steady clock (= Python's time.monotonic()).
struct EngineEvent {
  std::string phase;
  double start = 0, end = 0;
  size_t bytes = 0;
  size_t tensors = 0;
};

struct EngineStats {
  uint64_t cycles = 0;          // negotiations completed (of this group)
  uint64_t slow_rounds = 0;     // negotiations that had to gather names
  uint64_t tensors = 0;         // buffers reduced
  uint64_t buckets = 0;         // allreduce calls made
  uint64_t shared_memory = 0;   // of those, through the group's shared-memory segment
  uint64_t helped = 0;          // of those, run by a thread blocked in wait()
  uint64_t bytes = 0;           // bytes reduced
  uint64_t stall_warnings = 0;
  uint64_t cuda_buckets = 0;    // buckets holding CUDA tensors, packed on the device (a CUDA build)
  uint64_t cuda_launches = 0;   // kernels and copies those buckets took (at most 2 each way per GPU)
  uint64_t cuda_aware_buckets = 0;  // of those, reduced in device memory by the group's device allreduce
};

// A group's allreduce of a CUDA buffer in device memory (`data`: `count` elements of `dtype` on GPU `gpu`), in
// place, for a CUDA-aware MPI: true when it reduced it, false when it does not take this buffer (the engine
// stages it through pinned host memory instead). Every rank must answer alike for alike buffers.
using DeviceAllreduce = std::function<bool(void* data, size_t count, DType dtype, ReduceOp op, int gpu)>;

// Why a handle failed, so that Python picks the exception class without reading the message.
// Refused: another rank's arguments failed its own checks (it raised them itself; see submit_refusal).
// Joined: a call (submit_call) on a group where some ranks have joined (submit_join): only allreduces
// of submit() complete with the joined ranks' zeros.
// Departed: a rank of the group has shut down (hp.shutdown) while this rank waits for it in a collective.
enum class ErrorKind : int {
  None = 0, Mismatch = 1, Stalled = 2, Stopped = 3, Failed = 4, Refused = 5, Joined = 6, Departed = 7
};

struct Announced;  // one rank's pending name as a slow round gathers it (engine_negotiation.cpp)

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
  std::vector<std::string> hosts() const { return hosts_; }
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
  EngineStats stats(int group);
  // Recorded events of `group` since the last call (empty unless options.record_events).
  std::vector<EngineEvent> take_events(int group);

 private:
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
    int device = 0;             // see submit()
    bool join = false;          // submit_join's entry
    int contributors = 0;       // ran while ranks had joined: how many ranks contributed (0: all)
    std::shared_ptr<std::vector<unsigned char>> zeros;  // a joined rank's stand-in buffer
    Buffer output;              // out of place (submit's output); data == nullptr: in place, into `buffer`
    uintptr_t ready_event = 0;  // see submit(); cleared once the event has completed
    WireFormat wire;            // see submit()
    const Buffer& result() const { return output.data ? output : buffer; }
  };
  struct CacheEntry {
    std::string name;
    size_t count;
    DType dtype;
    ReduceOp op;
    int device;
    WireFormat wire;
  };
  // An allreduce an engine thread hands to a thread blocked in wait() (see reduce_bucket).
  struct Job {
    std::function<void()> work;
    bool taken = false, done = false;
    std::string error;
  };
  struct Group {
    MPI_Comm comm;
    std::string label;
    int rank = 0, size = 1;
    std::vector<Entry> pending;                     // guarded by Engine::mutex_
    std::vector<CacheEntry> cache;                  // engine thread only
    std::unordered_map<std::string, size_t> bits;   // name -> cache index
    MPI_Request request = MPI_REQUEST_NULL;
    std::vector<uint64_t> vector;
    std::vector<Entry> snapshot;                    // pending entries the in-flight vector describes
    int idle_cycles = 0;
    bool active = false;         // negotiated every cycle (guarded by Engine::mutex_)
    bool finished = false;       // the ranks agreed to stop, or stalled past stall_shutdown (guarded by mutex_)
    std::string stopped_because;  // why a finished group refuses submissions (guarded by mutex_)
    int last_joined = -1;        // the rank that joined last in the latest completed join
    std::vector<int> members;    // ranks in group 0, in this group's rank order (registration key)
    int registration = 0;        // n-th registration of these members on this rank (registration key)
    EngineStats stats;
    std::vector<EngineEvent> events;  // guarded by Engine::mutex_
    Workspace workspace;
    std::vector<unsigned char> fusion;
    DeviceAllreduce device_allreduce;      // see set_device_allreduce (engine thread reads it)
    SharedMemoryAllreduce* shm = nullptr;  // the group's segment when its ranks share a host (owned by comm)
    bool waiters_help = true;  // waiters may run its buckets: options.waiters_help and all ranks on one host
    // Helping (guarded by Engine::mutex_): only threads waiting for this group's handles run its
    // allreduces, so a waiter is never held up by another group's ring.
    Job* offered = nullptr;
    int idle_waiters = 0;  // threads blocked in wait() on this group's handles, not running a Job
    std::chrono::steady_clock::time_point last_wait_return{};  // a thread that just returned often waits again
  };
  struct HandleState {
    int group = 0;
    bool done = false;
    std::string error;
    ErrorKind kind = ErrorKind::None;
    double started = 0, finished = 0;
    int contributors = 0;
  };

  uint64_t enqueue(int group, const std::string& name, const Buffer& buffer, ReduceOp op, std::function<void()> job,
                   const std::string& refusal = "", bool detached = false, int device = 0, bool join = false,
                   const Buffer& output = Buffer{}, uintptr_t ready_event = 0, const WireFormat& wire = WireFormat{});
  struct Failure {
    Entry entry;
    std::string error;
    ErrorKind kind;
  };
  // Time between cycles once every active group is quiet: idle_cycle_time_ms, at most a quarter of the
  // stall check (the timer is what lets a rank that never submits be reported).
  double quiet_cycle_ms() const;
  void run();
  // The thread's sleep until its next cycle is due (`next_cycle`, or earlier after an idle cycle when
  // something comes), polling point-to-point transfers meanwhile; then `order`: the groups to visit. False
  // when the thread should end (stopped, nothing left to visit).
  bool await_cycle(std::chrono::steady_clock::time_point next_cycle, bool last_cycle_idle, TransferQueue* transfers,
                   std::unique_lock<std::timed_mutex>& mpi, std::vector<int>& order);
  // The thread failed with `what`: every pending handle fails (kind Failed); returns why it stopped.
  std::string fail_engine(const std::string& what);
  void cycle_single(Group& group);  // a group of one rank: no MPI
  void negotiate(Group& group, const WaitPolicy& busy_wait, const WaitPolicy& idle_wait);
  // Group 0's part of a cycle: when some rank has a registration pending, every rank of group 0
  // gathers them, and the groups all of whose ranks asked become active.
  void activate_registrations(Group& coordinator);
  void fail_pending(Group& group, const std::string& error, ErrorKind kind);  // with mutex_ held
  // Some rank of the group left while this one has pending work: fails it (collective over the group).
  void fail_departed(Group& group);
  // What the thread is blocked on (engine thread only), for the absent-rank reports: past
  // stall_check_seconds it asks the group's other ranks (a probe on health_) whether their threads
  // are alive, and names those that did not answer; past the timeout it aborts with that list.
  struct Blocked {
    const Group* group = nullptr;
    const char* what = "";  // "negotiate", "finish an allreduce"
    std::chrono::steady_clock::time_point since;
    bool warned = false;
    bool probing = false;
    bool aborting = false;  // the round in flight ends in an abort
    std::chrono::steady_clock::time_point probe_sent;
    std::vector<int> asked;      // ranks of group 0
    std::vector<double> answer;  // per asked rank: seconds its thread had been waiting, or -1 (no answer)
  };
  void block_on(const Group* group, const char* what = "");  // nullptr: not blocked any more
  // The receive of answers to this rank's probes (posted when the thread starts), and its end with the
  // answers still in flight (when it stops).
  void start_probes();
  void stop_probes();
  // The thread's chores inside any wait: post/test transfers, answer probes, check what it waits for.
  void service();
  void answer_probes();
  void check_blocked();
  void finish_probe_round();
  double abort_after_seconds() const;  // 0: never
  std::string describe_ranks(const std::vector<int>& ranks, const std::vector<double>* waits) const;
  [[noreturn]] void abort_job(const std::string& message);  // prints it, then MPI_Abort (or _exit)
  // A fault-tolerant MPI reported a failed process (`what`: the failing call): names the failed ranks
  // and their hosts (MPIX_Comm_get_failed where the MPI has it) and aborts the job.
  [[noreturn]] void report_process_failure(const std::string& what);
  void start_negotiation(Group& group);
  void finish_negotiation(Group& group);
  // Returns "" or, when a name waited past stall_shutdown_seconds, the message the group stops with.
  std::string slow_round(Group& group, std::vector<Entry>& ready, std::vector<Failure>& failed);
  // The slow round's parts. Every rank's pending names (the snapshot), by name: the same map on every rank.
  using Announcements = std::map<std::string, std::vector<Announced>>;
  Announcements gather_names(Group& group, std::chrono::steady_clock::time_point now);
  // The response cache: `name` gets (or keeps) its bit, with the metadata every rank agreed on.
  void remember(Group& group, const std::string& name, const Announced& meta);
  // The join entries (`ranks`: those that announced the join name): refused, done once all joined, or waiting.
  void settle_join(Group& group, const std::vector<Announced>& ranks, int joined_count, Entry* mine,
                   std::vector<Failure>& failed);
  // A name every rank that has not joined announced: reduced with the joined ranks' zeros (or failed: a call,
  // or a mismatch). False when some rank that has not joined lacks it.
  bool reduce_with_joined(Group& group, const std::string& name, const std::vector<Announced>& ranks,
                          const std::vector<bool>& joined, int joined_count, Entry* mine,
                          std::chrono::steady_clock::time_point now, std::vector<Entry>& ready,
                          std::vector<Failure>& failed);
  // A name only some ranks announced: warns once it waited past stall_check_seconds; returns the message
  // the group stops with past stall_shutdown_seconds, else "".
  std::string check_stall(Group& group, const std::string& name, const std::vector<Announced>& ranks, Entry* mine);
  // The pending entries of `group` whose ready events have completed (caller holds mutex_): those a cycle
  // may announce; the others wait in `pending` for a later cycle.
  std::vector<Entry> ready_entries(Group& group);
  void execute(Group& group, std::vector<Entry>& ready);
  void complete(const std::vector<Entry>& entries, const std::string& error, double started = 0,
                ErrorKind kind = ErrorKind::None);
  // Runs one bucket's allreduce, `work(options)`: on a thread blocked in wait() when there is one (it
  // has nothing else to do and runs at the process's own priority), else on the calling engine thread.
  void reduce_bucket(Group& group, const std::function<void(const AllreduceOptions&)>& work);
  void record(Group& group, const char* phase, double start, double end, size_t bytes, size_t tensors);
  // A CUDA build: reduces a bucket holding CUDA tensors (device pointers; see submit). With the group's device
  // allreduce (a CUDA-aware MPI), when it takes the bucket, in device memory: gathered by one kernel, reduced,
  // scattered by one kernel. Else through pinned host memory, gathering them on each GPU with one kernel and
  // one copy down, and scattering the result with one copy up and one kernel (csrc/cuda/fusion.cu). False
  // (nothing done) when no entry is device memory.
  bool reduce_cuda_bucket(Group& group, std::vector<Entry>& entries, size_t total_bytes, double started);

  EngineOptions options_;
  std::atomic<size_t> tuned_fusion_{0};  // copies of options_'s tunables for tuning() (written by the thread)
  std::atomic<double> tuned_cycle_{0};
  std::mutex mutex_;
  std::condition_variable changed_;
  std::condition_variable wake_;  // (with mutex_) a submission, a registration or a stop for the thread
  std::vector<std::unique_ptr<Group>> groups_;
  std::vector<int> cycle_order_;  // active groups, in the order every rank visits them (thread only)
  std::thread thread_;
  bool started_ = false;
  bool thread_done_ = false;      // guarded by mutex_
  int registrations_pending_ = 0; // added after start, not yet active (guarded by mutex_)
  bool quiet_ = false;            // every active group idle long enough (thread only)
  std::unordered_map<uint64_t, HandleState> handles_;
  uint64_t next_handle_ = 1;
  bool stop_requested_ = false;
  bool shut_down_ = false;
  bool failed_ = false;  // leave_failed() was called (guarded by mutex_)
  std::string fatal_;
  std::shared_ptr<TransferQueue> transfers_;  // point-to-point transfers this thread drives (or null)
  std::unique_lock<std::timed_mutex>* mpi_held_ = nullptr;  // the thread's hold on transfers_'s communication lock
  // Absent ranks: a private duplicate of group 0 for probes and answers, and every rank's host name.
  MPI_Comm health_ = MPI_COMM_NULL;
  std::vector<std::string> hosts_;
  Blocked blocked_;
  int64_t probe_round_ = 0;
  int64_t probe_message_[2] = {0, 0};                        // (round, 0): what a probe carries
  MPI_Request answer_request_ = MPI_REQUEST_NULL;            // the receive of the next answer
  double answer_message_[2] = {0, 0};                        // (round, seconds the answerer waited)
  std::vector<std::unique_ptr<double[]>> sent_answers_;      // buffers of answers in flight
  std::vector<MPI_Request> sent_answer_requests_;
  // Device-side fusion (engine thread only): one CudaFusion per GPU, and the pinned host buffer the buckets
  // of CUDA tensors are reduced in (a CUDA build; unused otherwise).
  std::map<int, std::shared_ptr<void>> cuda_fusion_;
  std::shared_ptr<void> pinned_;
  size_t pinned_bytes_ = 0;
};

}  // namespace hybridpipe
