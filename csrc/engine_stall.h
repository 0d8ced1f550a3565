// The engine's stall inspector (see engine.h): which pending names have waited past stall_check_seconds (a
// warning naming the ranks that never submitted them) or stall_shutdown_seconds (the group stops). It keeps no
// state of its own: what it reads is the negotiation's (the communication thread's).
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "engine_announce.h"
#include "engine_options.h"

namespace hybridpipe {

class Group;

class StallInspector {
 public:
  explicit StallInspector(const EngineOptions& options) : options_(options) {}
  // In a negotiation's flags: `entry` has waited past the stall check and was not reported yet / past the
  // stall shutdown.
  bool stalled(const Entry& entry, std::chrono::steady_clock::time_point now) const;
  bool expired(const Entry& entry, std::chrono::steady_clock::time_point now) const;
  // A name only some ranks announced: warns once it waited past stall_check_seconds (the lowest rank that has
  // it reports; `mine` is marked warned); returns the message the group stops with past stall_shutdown_seconds,
  // else "".
  std::string inspect(Group& group, const std::string& name, const std::vector<Announced>& ranks, Entry* mine) const;

 private:
  const EngineOptions& options_;
};

}  // namespace hybridpipe
