// The engine's join and refusal tracker (see engine.h): Horovod's join (a rank out of data takes part in the
// others' allreduces with zeros until every rank joined), refusals (a rank whose arguments failed its own checks
// makes the others' operation under that name fail), and departures (ranks that shut down while others wait for
// them). It works on a slow round's announcements, on the communication thread; what it keeps is the group's
// (last_joined, in the queue).
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "engine_announce.h"
#include "engine_queue.h"

namespace hybridpipe {

class Group;

class JoinTracker {
 public:
  explicit JoinTracker(TensorQueue& queue) : queue_(queue) {}
  // Ranks waiting in join (they stand in with zeros), from a slow round's announcements: per rank, and how many.
  static int joined_ranks(const Announcements& by_name, int group_size, std::vector<bool>& joined);
  // The join entries (`ranks`: those that announced the join name): refused, done once all joined, or waiting.
  void settle_join(Group& group, const std::vector<Announced>& ranks, int joined_count, Entry* mine,
                   std::vector<Failure>& failed);
  // A name every rank that has not joined announced: reduced with the joined ranks' zeros (or failed: a call,
  // or a mismatch). False when some rank that has not joined lacks it.
  bool reduce_with_joined(Group& group, const std::string& name, const std::vector<Announced>& ranks,
                          const std::vector<bool>& joined, int joined_count, Entry* mine,
                          std::chrono::steady_clock::time_point now, std::vector<Entry>& ready,
                          std::vector<Failure>& failed) const;
  // A name every rank announced that some rank refused, or on which they disagree: `mine` fails (true), else false.
  bool refuse(Group& group, const std::string& name, const std::vector<Announced>& ranks, Entry* mine,
              std::vector<Failure>& failed) const;
  // Some rank of the group left while this one has pending work: fails it (collective over the group).
  void fail_departed(Group& group);

 private:
  TensorQueue& queue_;
};

}  // namespace hybridpipe
