// The engine's controller (see engine.h): a group's negotiation — which submitted names are ready on every rank,
// one bit-vector allreduce against the response cache in the steady state, a slow round gathering names when some
// rank has an uncached, stalled or refused one — and the registrations of groups added after the start. It runs
// on the communication thread and hands what is ready to the bucket executor.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "engine_announce.h"
#include "engine_buckets.h"
#include "engine_events.h"
#include "engine_join.h"
#include "engine_options.h"
#include "engine_queue.h"
#include "engine_stall.h"
#include "engine_watchdog.h"

namespace hybridpipe {

class Group;

class Controller {
 public:
  Controller(const EngineOptions& options, TensorQueue& queue, StallInspector& stalls, JoinTracker& joins,
             BucketExecutor& buckets, EventLog& events, Watchdog& watchdog)
      : options_(options), queue_(queue), stalls_(stalls), joins_(joins), buckets_(buckets), events_(events),
        watchdog_(watchdog) {}
  // One visit of `group`: its negotiation (polite: `busy_wait` when this rank has something ready, else
  // `idle_wait`), then what every rank has ready.
  void negotiate(Group& group, const WaitPolicy& busy_wait, const WaitPolicy& idle_wait);
  // Whether the latest negotiation of group 0 says some rank has a registration pending.
  static bool registration_pending(const Group& coordinator);
  // Group 0's part of a cycle: every rank of group 0 gathers the pending registrations, and the groups all of
  // whose ranks asked become active. Returns their ids, in the order every rank adds them to its cycle.
  std::vector<int> activate_registrations(Group& coordinator);

 private:
  void start_negotiation(Group& group);
  void finish_negotiation(Group& group);
  // Returns "" or, when a name waited past stall_shutdown_seconds, the message the group stops with.
  std::string slow_round(Group& group, std::vector<Entry>& ready, std::vector<Failure>& failed);
  Announcements gather_names(Group& group, std::chrono::steady_clock::time_point now);
  // Takes the ready and failed entries off the group's queue (the rest wait for the next cycle), keeping which
  // stalls were reported.
  void dequeue(Group& group, const std::vector<Entry>& ready, const std::vector<Failure>& failed);

  const EngineOptions& options_;
  TensorQueue& queue_;
  StallInspector& stalls_;
  JoinTracker& joins_;
  BucketExecutor& buckets_;
  EventLog& events_;
  Watchdog& watchdog_;
};

}  // namespace hybridpipe
