// The background engine: Horovod's design on hybridpipe's ring allreduce.
//
// Python submits named buffers (allreduce_async); a background thread, every cycle and per group:
//   1. negotiates which submitted names are ready on EVERY rank of the group. Steady state is one
//      non-blocking MPI_Iallreduce(BAND) of a bit-vector: bit i = "cached name i is ready here",
//      plus flag bits (all my ready names are cached / nothing of mine is stalled / I want to shut
//      down). Names are cached (given a bit) the first time all ranks have them with the same
//      count, dtype and op, so a repeated training step never gathers names again.
//   2. only when some rank has an uncached name (or a stalled one) does the group gather every
//      rank's pending names (MPI_Allgatherv) to find the common ones, check their metadata
//      (a mismatch fails those handles on every rank with every rank's values), assign new bits,
//      and warn about names some ranks have waited on for longer than stall_check_seconds.
//   3. packs the ready buffers into the fusion buffer, up to fusion_threshold_bytes per bucket of
//      one dtype and op, reduces each bucket with the segmented ring, and unpacks.
// Each group has its own thread (and fusion buffer), so groups progress independently: the
// data-parallel reduction of one pipeline stage never waits for another stage's ranks, and the
// blocking collectives of two groups can never be ordered differently on two ranks.
#pragma once

#include <mpi.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "ring_allreduce.h"
#include "shm_allreduce.h"

namespace hybridpipe {

constexpr int kQuietAfterIdleCycles = 20;

struct EngineOptions {
  double cycle_time_ms = 0.5;
  // Time between negotiations once a group has been idle on every rank for kQuietAfterIdleCycles
  // cycles (capped at stall_check_seconds / 4); a submission or shutdown on this rank ends it early.
  double idle_cycle_time_ms = 1000.0;
  double stall_check_seconds = 60.0;
  double stall_shutdown_seconds = 0.0;  // 0: off; else a tensor waiting this long stops the group
  size_t fusion_threshold_bytes = 4 * 1024 * 1024;
  AllreduceOptions allreduce;
  // A thread blocked in wait() runs its group's bucket allreduces itself (at its own priority, testing
  // its requests without sleeping) instead of leaving them to the niced engine thread; false: never.
  // Only for groups whose ranks share one host: over Open MPI's TCP transport, a waiter spinning in
  // MPI beside the niced engine threads stalled a 4-rank, 2-host job for minutes (tests/test_multihost.py).
  bool waiters_help = true;
  bool record_events = false;  // keep phase timings for the timeline (EngineEvent)
  // Scheduling priority of the engine threads (Linux nice, 0..19 above the process's own): a
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
  uint64_t cycles = 0;          // negotiations completed
  uint64_t slow_rounds = 0;     // negotiations that had to gather names
  uint64_t tensors = 0;         // buffers reduced
  uint64_t buckets = 0;         // allreduce calls made
  uint64_t shared_memory = 0;   // of those, through the group's shared-memory segment
  uint64_t helped = 0;          // of those, run by a thread blocked in wait()
  uint64_t bytes = 0;           // bytes reduced
  uint64_t stall_warnings = 0;
};

class Engine {
 public:
  explicit Engine(const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Registers a communicator (hybridpipe duplicates it first); returns its group id. Every rank of
  // `comm` must register it (in the same order relative to its other groups). With start = false
  // the group's thread waits for start(): make all communicators first, then start the threads, so
  // that no engine thread is in MPI while the process creates communicators (with ranks on several
  // hosts, Open MPI's context-id agreement for a new communicator then took up to 41 s here).
  int add_group(MPI_Comm comm, const std::string& label, bool start = true);
  // Starts the threads of the groups added with start = false.
  void start();
  // Queues an in-place allreduce of `buffer` over group `group`; returns a handle id.
  uint64_t submit(int group, const std::string& name, const Buffer& buffer, ReduceOp op);
  bool poll(uint64_t handle);
  // Blocks until done; returns "" on success or the error message (the handle is then released).
  // `started` / `finished`: when its bucket's allreduce began and ended, in seconds of the steady
  // clock (CLOCK_MONOTONIC on Linux, the clock of Python's time.monotonic()); 0 if it never ran.
  std::string wait(uint64_t handle, double* started = nullptr, double* finished = nullptr);
  // Coordinated stop: returns once every rank of every group asked for it and nothing is pending.
  void shutdown();
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
  };
  struct CacheEntry {
    std::string name;
    size_t count;
    DType dtype;
    ReduceOp op;
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
    std::chrono::steady_clock::time_point next_cycle;
    int idle_cycles = 0;
    bool finished = false;       // the ranks agreed to stop (engine thread of the group only)
    bool thread_done = false;    // guarded by Engine::mutex_
    EngineStats stats;
    std::vector<EngineEvent> events;  // guarded by Engine::mutex_
    Workspace workspace;
    std::vector<unsigned char> fusion;
    SharedMemoryAllreduce* shm = nullptr;  // the group's segment when its ranks share a host (owned by comm)
    bool waiters_help = true;  // waiters may run its buckets: options.waiters_help and all ranks on one host
    std::thread thread;
    std::condition_variable wake;  // (with Engine::mutex_) a submission to this group, or a stop
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
    double started = 0, finished = 0;
  };

  void start_thread(Group& group);  // with mutex_ held or before any thread runs
  // Time between negotiations of a quiet group: idle_cycle_time_ms, at most a quarter of the stall
  // check (the timer is what lets a rank that never submits be reported).
  double quiet_cycle_ms() const;
  void run(Group& group);
  void run_single(Group& group);
  void start_negotiation(Group& group);
  void finish_negotiation(Group& group);
  void slow_round(Group& group, std::vector<Entry>& ready, std::vector<std::pair<Entry, std::string>>& failed);
  void execute(Group& group, std::vector<Entry>& ready);
  void complete(const std::vector<Entry>& entries, const std::string& error, double started = 0);
  // Runs one bucket's allreduce, `work(options)`: on a thread blocked in wait() when there is one (it
  // has nothing else to do and runs at the process's own priority), else on the calling engine thread.
  void reduce_bucket(Group& group, const std::function<void(const AllreduceOptions&)>& work);
  void record(Group& group, const char* phase, double start, double end, size_t bytes, size_t tensors);

  EngineOptions options_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::unique_ptr<Group>> groups_;
  std::unordered_map<uint64_t, HandleState> handles_;
  uint64_t next_handle_ = 1;
  bool stop_requested_ = false;
  bool shut_down_ = false;
  std::string fatal_;
};

}  // namespace hybridpipe
