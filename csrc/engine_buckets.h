// The engine's buckets (see engine.h): ready entries cut into fused buckets, each reduced by the communication
// thread or by a thread blocked in wait() on the group (the queue's helping slot), in host memory or (a CUDA
// build) packed on the GPU. Its buffers are the communication thread's own.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "engine_events.h"
#include "engine_guard.h"
#include "engine_options.h"
#include "engine_queue.h"
#include "engine_watchdog.h"

namespace hybridpipe {

class Group;

class BucketExecutor {
 public:
  BucketExecutor(const EngineOptions& options, const CommThreadOnly<Tuning>& tuning, TensorQueue& queue,
                 EventLog& events, Watchdog& watchdog, const CommThread& thread)
      : options_(options), tuning_(tuning), queue_(queue), events_(events), watchdog_(watchdog), cuda_(thread) {}
  // Reduces `ready` (in the order of their bits) in fused buckets and runs its calls in sequence; completes them.
  void execute(Group& group, std::vector<Entry>& ready);
  // Runs one bucket's allreduce, `work(options)`: on a thread blocked in wait() when there is one (it has nothing
  // else to do and runs at the process's own priority), else on the calling communication thread.
  void reduce(Group& group, const std::function<void(const AllreduceOptions&)>& work);

 private:
  // Reduces `entries` (one alone, in place; several packed into the fusion buffer) and completes them.
  void reduce_entries(Group& group, std::vector<Entry>& entries, size_t total_bytes);
  // A CUDA build: reduces a bucket holding CUDA tensors (device pointers; see Engine::submit). With the group's
  // device allreduce (a CUDA-aware MPI), when it takes the bucket, in device memory: gathered by one kernel,
  // reduced, scattered by one kernel. Else through pinned host memory, gathering them on each GPU with one kernel
  // and one copy down, and scattering the result with one copy up and one kernel (csrc/cuda/fusion.cu). False
  // (nothing done) when no entry is device memory.
  bool reduce_cuda_bucket(Group& group, std::vector<Entry>& entries, size_t total_bytes, double started);

  // Device-side fusion: one CudaFusion per GPU, and the pinned host buffer the buckets of CUDA tensors are
  // reduced in (a CUDA build; unused otherwise).
  struct CudaStaging {
    std::map<int, std::shared_ptr<void>> fusion;
    std::shared_ptr<void> pinned;
    size_t pinned_bytes = 0;
  };

  const EngineOptions& options_;
  const CommThreadOnly<Tuning>& tuning_;
  TensorQueue& queue_;
  EventLog& events_;
  Watchdog& watchdog_;
  CommThreadOnly<CudaStaging> cuda_;
};

}  // namespace hybridpipe
