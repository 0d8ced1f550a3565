// What the engine is configured with and what it reports: its options, the timeline's events, the per-group
// counters, and why a handle failed. Shared by the engine's classes and the bindings.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "common.h"
#include "ring_allreduce.h"

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

// The options autotuning changes while the engine runs (Engine::submit_tuning): the communication thread's own.
struct Tuning {
  size_t fusion_threshold_bytes;
  double cycle_time_ms;
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
// RanksLost: a process of the job failed while the engine survives failures (set_survive_process_failures):
// the engine revoked its communicators and stopped; Engine::lost_ranks() says which ranks are gone.
enum class ErrorKind : int {
  None = 0, Mismatch = 1, Stalled = 2, Stopped = 3, Failed = 4, Refused = 5, Joined = 6, Departed = 7, RanksLost = 8
};

}  // namespace hybridpipe
