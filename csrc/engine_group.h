// One group (communicator) of the engine, as its classes share it: what is fixed once it is added (any thread
// reads it), its negotiation's state (the communication thread's own), its queue (only under the queue's lock),
// and its counters and device allreduce (each behind its own lock, taken alone).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "engine_cache.h"
#include "engine_guard.h"
#include "engine_options.h"
#include "engine_queue.h"
#include "ring_allreduce.h"
#include "shm_allreduce.h"

namespace hybridpipe {

// What a group's negotiation carries from cycle to cycle (the communication thread's own).
struct GroupRound {
  ResponseCache cache;
  MPI_Request request = MPI_REQUEST_NULL;
  std::vector<uint64_t> vector;
  std::vector<Entry> snapshot;  // pending entries the in-flight vector describes
  int idle_cycles = 0;
  Workspace workspace;               // lent to a waiter that runs one of the group's buckets
  std::vector<unsigned char> fusion;
};

struct GroupSetup {
  int id;
  MPI_Comm comm;
  std::string label;
  int rank, size;
  std::vector<int> members;  // ranks in group 0, in this group's rank order (registration key)
  int registration;          // n-th registration of these members on this rank (registration key)
  SharedMemoryAllreduce* shm;  // the group's segment when its ranks share a host (owned by comm)
  bool waiters_help;           // waiters may run its buckets: options.waiters_help and all ranks on one host
};

class Group {
 public:
  Group(const GroupSetup& setup, const CommThread& thread, bool active)
      : id(setup.id), comm(setup.comm), label(setup.label), rank(setup.rank), size(setup.size),
        members(setup.members), registration(setup.registration), shm(setup.shm), waiters_help(setup.waiters_help),
        // a new group starts quiet, as if every rank had agreed on kQuietAfterIdleCycles idle cycles
        round(thread, GroupRound{{}, MPI_REQUEST_NULL, {}, {}, kQuietAfterIdleCycles + 1, {}, {}}) {
    queue_.active = active;
  }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  const int id;
  const MPI_Comm comm;
  const std::string label;
  const int rank, size;
  const std::vector<int> members;
  const int registration;
  SharedMemoryAllreduce* const shm;
  const bool waiters_help;

  CommThreadOnly<GroupRound> round;
  Guarded<EngineStats> stats;
  Guarded<DeviceAllreduce> device_allreduce;  // see Engine::set_device_allreduce

  // The group's part of the queue, only with the queue's lock held (`held` is that lock).
  GroupQueue& queue(const TensorQueue::Locked& held) {
    (void)held;
    return queue_;
  }

 private:
  GroupQueue queue_;
};

}  // namespace hybridpipe
