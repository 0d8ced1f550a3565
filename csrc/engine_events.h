// The engine's timeline (see engine.h): the timed phases of each group's work, kept when options.record_events
// asks for them, until Engine::take_events takes them. Its own lock, taken alone (never while waiting for another).
#pragma once

#include <cstddef>
#include <map>
#include <vector>

#include "engine_guard.h"
#include "engine_options.h"

namespace hybridpipe {

class EventLog {
 public:
  explicit EventLog(bool enabled) : enabled_(enabled) {}
  void record(int group, const char* phase, double start, double end, size_t bytes, size_t tensors);
  // `group`'s events since the last call (empty unless enabled).
  std::vector<EngineEvent> take(int group);

 private:
  const bool enabled_;
  Guarded<std::map<int, std::vector<EngineEvent>>> events_;  // by group id
};

}  // namespace hybridpipe
