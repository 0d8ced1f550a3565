// The engine's timeline (see engine_events.h).
#include "engine_events.h"

namespace hybridpipe {

void EventLog::record(int group, const char* phase, double start, double end, size_t bytes, size_t tensors) {
  if (!enabled_) return;
  events_.with([&](std::map<int, std::vector<EngineEvent>>& events) {
    events[group].push_back(EngineEvent{phase, start, end, bytes, tensors});
  });
}

std::vector<EngineEvent> EventLog::take(int group) {
  std::vector<EngineEvent> taken;
  events_.with([&](std::map<int, std::vector<EngineEvent>>& events) {
    auto found = events.find(group);
    if (found != events.end()) taken.swap(found->second);
  });
  return taken;
}

}  // namespace hybridpipe
