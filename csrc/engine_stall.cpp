// The stall inspector (see engine_stall.h).
#include "engine_stall.h"

#include <algorithm>
#include <cstdio>

#include "engine_group.h"

namespace hybridpipe {

bool StallInspector::stalled(const Entry& entry, std::chrono::steady_clock::time_point now) const {
  return !entry.warned && now - entry.submitted > std::chrono::duration<double>(options_.stall_check_seconds);
}

bool StallInspector::expired(const Entry& entry, std::chrono::steady_clock::time_point now) const {
  return options_.stall_shutdown_seconds > 0 &&
         now - entry.submitted > std::chrono::duration<double>(options_.stall_shutdown_seconds);
}

std::string StallInspector::inspect(Group& group, const std::string& name, const std::vector<Announced>& ranks,
                                    Entry* mine) const {
  bool stalled = false;
  double waited = 0;
  for (const Announced& a : ranks) {
    stalled = stalled || a.stalled;
    waited = std::max(waited, a.waited_s);
  }
  if (options_.stall_shutdown_seconds > 0 && waited > options_.stall_shutdown_seconds) {
    // every rank of the group sees the same gathered ages, so every rank stops here together
    std::string have;
    for (const Announced& a : ranks) have += (have.empty() ? "" : ", ") + std::to_string(a.rank);
    char text[160];
    std::snprintf(text, sizeof text, "' waited %.1f s for the ranks of the group that never submitted it", waited);
    char limit[64];
    std::snprintf(limit, sizeof limit, "%g", options_.stall_shutdown_seconds);
    return "allreduce '" + name + text + " (only ranks [" + have + "] did); stall_shutdown_seconds=" + limit +
           " stopped the engine (group '" + group.label + "')";
  }
  if (!stalled) return "";
  if (mine) mine->warned = true;
  if (group.rank == ranks[0].rank) {  // the lowest rank that has it reports
    std::string have, missing;
    size_t next = 0;
    for (int r = 0; r < group.size; ++r) {
      const bool has = next < ranks.size() && ranks[next].rank == r;
      if (has) ++next;
      std::string& list = has ? have : missing;
      list += (list.empty() ? "" : ", ") + std::to_string(r);
    }
    std::fprintf(stderr,
                 "hybridpipe WARNING: allreduce '%s' on group '%s' has waited %.1f s: ranks [%s] of the group "
                 "submitted it, ranks [%s] did not (stall_check_seconds=%g). A rank skipped a step, a parameter "
                 "got no gradient there, or the ranks run different code.\n",
                 name.c_str(), group.label.c_str(), waited, have.c_str(), missing.c_str(),
                 options_.stall_check_seconds);
    std::fflush(stderr);
    group.stats.with([](EngineStats& stats) { stats.stall_warnings++; });
  }
  return "";
}

}  // namespace hybridpipe
