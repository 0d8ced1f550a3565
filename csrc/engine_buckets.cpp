// The engine's buckets (see engine_buckets.h): fusion and the buckets' allreduces, CUDA buckets included.
#include "engine_buckets.h"

#include "engine_group.h"
#include "engine_internal.h"
#include "fusion.h"

#if defined(HYBRIDPIPE_WITH_CUDA)
#include "cuda/cuda_kernels.h"
#endif

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace hybridpipe {

using namespace engine_detail;

namespace {

// The engine's options with the wire format its bucket's entries were submitted with.
AllreduceOptions with_wire(const AllreduceOptions& options, const WireFormat& wire) {
  AllreduceOptions carried = options;
  carried.wire = wire;
  return carried;
}

}  // namespace

void BucketExecutor::reduce(Group& group, const std::function<void(const AllreduceOptions&)>& run) {
  auto run_here = [&] {
    watchdog_.block_on(&group, "finish an allreduce");
    run(options_.allreduce);
    watchdog_.block_on(nullptr);
  };
  if (!group.waiters_help) return run_here();
  // A thread leaving wait() usually comes back for its next handle within microseconds.
  const auto grace = std::chrono::microseconds(200);
  HelpJob job;
  {
    TensorQueue::Locked state = queue_.lock();
    GroupQueue& waiting = group.queue(state);
    if (waiting.idle_waiters == 0 && Clock::now() - waiting.last_wait_return > grace) {
      state.unlock();
      return run_here();
    }
    // Spin, with the same MPI calls as the engine thread's policy (another rank's engine thread may
    // run this bucket there). `run` outlives the job: this frame waits for it or takes it back.
    AllreduceOptions helped = options_.allreduce;
    helped.wait = spinning(helped.wait);
    job.work = [&run, helped] { run(helped); };
    waiting.offered = &job;
    const auto job_started = Clock::now();
    bool revoked = false;
    queue_.changed().notify_all();
    while (!job.done) {
      if (!job.taken && waiting.idle_waiters == 0 && Clock::now() - waiting.last_wait_return > grace) {  // nobody came
        waiting.offered = nullptr;
        state.unlock();
        return run_here();
      }
      if (job.taken) {  // a waiter runs it: no MPI calls here, only the timeout and failed peers
        state.wait_for(queue_.changed(), std::chrono::milliseconds(100));
        if (!job.done && !revoked && watchdog_.failure_known()) {  // the waiter's next test of it fails
          revoke(group.comm);
          revoked = true;
        }
        const double waited = std::chrono::duration<double>(Clock::now() - job_started).count();
        const double limit = watchdog_.abort_after_seconds();
        if (!job.done && limit > 0 && waited > limit) {
          char message[512];
          std::snprintf(message, sizeof message,
                        "hybridpipe ERROR: an allreduce of group '%s' (its ranks share this host) has waited %.1f s "
                        "for the other ranks (timeout_seconds=%g, stall_shutdown_seconds=%g): aborting the job",
                        group.label.c_str(), waited, options_.timeout_seconds, options_.stall_shutdown_seconds);
          state.unlock();
          watchdog_.abort_job(message);
        }
      } else {
        state.wait_for(queue_.changed(), grace);
      }
    }
  }
  if (!job.error.empty()) throw std::runtime_error(job.error);
  group.stats.with([](EngineStats& stats) { stats.helped++; });
}

void BucketExecutor::reduce_entries(Group& group, std::vector<Entry>& entries, size_t total_bytes) {
  const double started = seconds_now();
  if (reduce_cuda_bucket(group, entries, total_bytes, started)) return;
  GroupRound& round = group.round.get();
  Workspace& workspace = round.workspace;  // lent to a waiter that runs the allreduce
  const ReduceOp op = entries[0].op;
  const WireFormat wire = entries[0].wire;
  const bool forced = wire.narrows(entries[0].buffer.dtype) && wire.on_one_host;  // the ring, even on one host
  const bool streamed = group.shm && !forced && total_bytes > options_.allreduce.small_message_bytes;
  if (entries.size() == 1) {
    const Buffer& buffer = entries[0].buffer;
    const Buffer& output = entries[0].result();
    reduce(group, [&](const AllreduceOptions& options) {
      allreduce(buffer, output, op, group.comm, with_wire(options, wire), workspace);
    });
    events_.record(group.id, "ring", started, seconds_now(), total_bytes, 1);
  } else if (streamed) {
    // packed straight into the shared segment and unpacked straight from it: no fusion buffer
    std::vector<Buffer> buffers, outputs;
    for (const Entry& entry : entries) {
      buffers.push_back(entry.buffer);
      outputs.push_back(entry.result());
    }
    reduce(group, [&](const AllreduceOptions& options) { group.shm->allreduce(buffers, outputs, op, options.wait); });
    events_.record(group.id, "ring", started, seconds_now(), total_bytes, entries.size());
  } else {
    unsigned char* cursor = round.fusion.data();
    for (const Entry& entry : entries) {
      std::memcpy(cursor, entry.buffer.data, entry.buffer.bytes());
      cursor += entry.buffer.bytes();
    }
    const double packed = seconds_now();
    events_.record(group.id, "pack", started, packed, total_bytes, entries.size());
    const DType dtype = entries[0].buffer.dtype;
    const Buffer fused{round.fusion.data(), total_bytes / dtype_size(dtype), dtype};
    reduce(group, [&](const AllreduceOptions& options) {
      allreduce(fused, fused, op, group.comm, with_wire(options, wire), workspace);
    });
    const double reduced = seconds_now();
    events_.record(group.id, "ring", packed, reduced, total_bytes, entries.size());
    cursor = round.fusion.data();
    for (const Entry& entry : entries) {
      std::memcpy(entry.result().data, cursor, entry.buffer.bytes());
      cursor += entry.buffer.bytes();
    }
    events_.record(group.id, "unpack", reduced, seconds_now(), total_bytes, entries.size());
  }
  group.stats.with([&](EngineStats& stats) {
    stats.buckets++;
    if (streamed) stats.shared_memory++;
    stats.bytes += total_bytes;
    stats.tensors += entries.size();
  });
  queue_.complete(entries, "", started);
}

void BucketExecutor::execute(Group& group, std::vector<Entry>& ready) {
  const size_t threshold = std::max<size_t>(tuning_->fusion_threshold_bytes, 1);
  std::vector<unsigned char>& fusion = group.round->fusion;
  if (fusion.size() < threshold) fusion.resize(threshold);
  BucketCutter cutter(threshold, options_.allreduce, group.shm != nullptr);
  auto reduce_all = [&](const std::vector<Bucket>& buckets) {
    for (const Bucket& cut : buckets) {
      std::vector<Entry> entries;
      for (size_t i : cut.items) entries.push_back(ready[i]);
      reduce_entries(group, entries, cut.bytes);
    }
  };
  for (size_t i = 0; i < ready.size(); ++i) {
    Entry& entry = ready[i];
    if (entry.job) {  // a call: everything before it in the sequence first
      reduce_all(cutter.flush());
      const double started = seconds_now();
      entry.job();
      events_.record(group.id, "call", started, seconds_now(), 0, 1);
      queue_.complete({entry}, "", started);
      continue;
    }
    reduce_all(cutter.add(i, entry.buffer.bytes(), entry.buffer.dtype, entry.op, entry.wire));
  }
  reduce_all(cutter.flush());
}

bool BucketExecutor::reduce_cuda_bucket(Group& group, std::vector<Entry>& entries, size_t total_bytes, double started) {
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
    std::shared_ptr<void>& slot = cuda_->fusion[gpu];
    if (!slot) slot = std::shared_ptr<void>(std::make_shared<CudaFusion>(gpu));
    return *static_cast<CudaFusion*>(slot.get());
  };
  uint64_t launches = 0;
  const DType dtype = entries[0].buffer.dtype;
  const ReduceOp op = entries[0].op;
  auto finish = [&](bool device_memory) {
    group.stats.with([&](EngineStats& stats) {
      stats.buckets++;
      stats.bytes += total_bytes;
      stats.tensors += entries.size();
      stats.cuda_buckets++;
      stats.cuda_aware_buckets += device_memory ? 1 : 0;
      stats.cuda_launches += launches;
    });
    queue_.complete(entries, "", started);
  };
  // In device memory, where the group has a device allreduce (a CUDA-aware MPI) and every rank decides alike:
  // every entry a CUDA tensor on one GPU, and no rank has joined (a joined rank stands in with host zeros)
  const bool one_gpu = down.size() == 1 && std::none_of(gpus.begin(), gpus.end(), [](int g) { return g < 0; });
  const bool all_contribute = std::all_of(entries.begin(), entries.end(),
                                          [](const Entry& entry) { return entry.contributors == 0; });
  const DeviceAllreduce device_allreduce = group.device_allreduce.with([](DeviceAllreduce& set) { return set; });
  if (device_allreduce && one_gpu && all_contribute) {
    const int gpu = down.begin()->first;
    CudaFusion& fusion = fusion_on(gpu);
    const uint64_t before = fusion.launches();
    void* fused = fusion.gather_device(down[gpu], total_bytes);
    const double packed = seconds_now();
    if (device_allreduce(fused, total_bytes / dtype_size(dtype), dtype, op, gpu)) {
      const double reduced = seconds_now();
      fusion.scatter_device(up[gpu], total_bytes);
      launches += fusion.launches() - before;
      events_.record(group.id, "pack", started, packed, total_bytes, entries.size());
      events_.record(group.id, "ring", packed, reduced, total_bytes, entries.size());
      events_.record(group.id, "unpack", reduced, seconds_now(), total_bytes, entries.size());
      finish(true);
      return true;
    }
    launches += fusion.launches() - before;  // not taken: staged below
  }
  CudaStaging& staging = cuda_.get();
  if (staging.pinned_bytes < total_bytes) {  // the staged way's pinned host buffer, grown to the largest bucket
    staging.pinned.reset();
    staging.pinned_bytes = 0;
    staging.pinned = std::shared_ptr<void>(cuda_host_alloc(total_bytes), cuda_host_free);
    staging.pinned_bytes = total_bytes;
  }
  unsigned char* host = static_cast<unsigned char*>(staging.pinned.get());
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
  events_.record(group.id, "pack", started, packed, total_bytes, entries.size());
  const Buffer fused{host, total_bytes / dtype_size(dtype), dtype};
  Workspace& workspace = group.round->workspace;  // lent to a waiter that runs the allreduce
  reduce(group, [&](const AllreduceOptions& options) {
    allreduce(fused, fused, op, group.comm, with_wire(options, entries[0].wire), workspace);
  });
  const double reduced = seconds_now();
  events_.record(group.id, "ring", packed, reduced, total_bytes, entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    if (gpus[i] < 0) std::memcpy(entries[i].result().data, host + offsets[i], entries[i].buffer.bytes());
  }
  each_gpu(up, false);
  events_.record(group.id, "unpack", reduced, seconds_now(), total_bytes, entries.size());
  finish(false);
  return true;
#else
  (void)group, (void)entries, (void)total_bytes, (void)started;
  return false;
#endif
}

}  // namespace hybridpipe
