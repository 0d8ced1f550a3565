// Joins, refusals and departures (see engine_join.h).
#include "engine_join.h"

#include <algorithm>
#include <memory>

#include "engine_group.h"
#include "engine_internal.h"

namespace hybridpipe {

using namespace engine_detail;

int JoinTracker::joined_ranks(const Announcements& by_name, int group_size, std::vector<bool>& joined) {
  joined.assign(static_cast<size_t>(group_size), false);
  int joined_count = 0;
  auto join = by_name.find(kJoinName);
  if (join != by_name.end()) {
    for (const Announced& a : join->second) {
      if (a.join) {
        joined[a.rank] = true;
        ++joined_count;
      }
    }
  }
  return joined_count;
}

void JoinTracker::settle_join(Group& group, const std::vector<Announced>& ranks, int joined_count, Entry* mine,
                              std::vector<Failure>& failed) {
  const std::string refusals = refusals_of(ranks);
  if (!refusals.empty() && static_cast<int>(ranks.size()) == group.size) {
    if (mine) failed.push_back(Failure{*mine, refusals + " (so the join failed on every rank of group '" + group.label +
                                                  "')", ErrorKind::Refused});
    return;
  }
  if (joined_count == group.size && mine) {  // everyone joined: the last one is the latest to come
    int last = ranks[0].rank;
    double newest = ranks[0].waited_s;
    for (const Announced& a : ranks) {
      if (a.waited_s < newest || (a.waited_s == newest && a.rank > last)) {
        newest = a.waited_s;
        last = a.rank;
      }
    }
    {
      TensorQueue::Locked state = queue_.lock();
      group.queue(state).last_joined = last;
    }
    failed.push_back(Failure{*mine, "", ErrorKind::None});  // done (no error)
  }
}

bool JoinTracker::reduce_with_joined(Group& group, const std::string& name, const std::vector<Announced>& ranks,
                                     const std::vector<bool>& joined, int joined_count, Entry* mine,
                                     std::chrono::steady_clock::time_point now, std::vector<Entry>& ready,
                                     std::vector<Failure>& failed) const {
  int covered = 0;
  for (const Announced& a : ranks) covered += joined[a.rank] ? 0 : 1;
  if (covered != static_cast<int>(ranks.size()) || covered + joined_count != group.size) return false;
  // every rank that has not joined submitted it: the joined ones take part with zeros
  const bool call = std::any_of(ranks.begin(), ranks.end(), [](const Announced& a) { return a.call; });
  if (call || !same_metadata(ranks)) {
    if (mine) {
      std::string joined_list;
      for (int r = 0; r < group.size; ++r) {
        if (joined[r]) joined_list += (joined_list.empty() ? "" : ", ") + std::to_string(r);
      }
      failed.push_back(Failure{*mine,
                               call ? "ranks [" + joined_list + "] of group '" + group.label +
                                          "' have joined (hp.join): until every rank joined, only allreduces complete "
                                          "(with their contributions as zeros); this collective cannot"
                                    : disagreement(name, group.label, ranks),
                               call ? ErrorKind::Joined : ErrorKind::Mismatch});
    }
    return true;
  }
  const Announced& meta = ranks[0];
  group.round->cache.remember(name, meta);
  Entry entry;
  if (mine) {
    entry = *mine;
  } else {  // this rank joined: zeros of the same size stand in for its tensor
    entry.handle = 0;
    entry.name = name;
    entry.zeros = std::make_shared<std::vector<unsigned char>>(meta.count * dtype_size(static_cast<DType>(meta.dtype)), 0);
    entry.buffer = Buffer{entry.zeros->data(), meta.count, static_cast<DType>(meta.dtype)};
    entry.wire = meta.wire;
    entry.submitted = now;
  }
  // an Average is a sum here, divided by the contributors afterwards (wait's contributors)
  const ReduceOp op = static_cast<ReduceOp>(meta.op);
  entry.op = op == ReduceOp::Average ? ReduceOp::Sum : op;
  entry.contributors = covered;
  ready.push_back(entry);
  return true;
}

bool JoinTracker::refuse(Group& group, const std::string& name, const std::vector<Announced>& ranks, Entry* mine,
                         std::vector<Failure>& failed) const {
  const std::string refusals = refusals_of(ranks);
  if (!refusals.empty()) {  // every rank sees the same refusals: the operation fails everywhere
    if (mine) {
      failed.push_back(Failure{*mine, refusals + " (so no rank of group '" + group.label +
                                          "' ran its part; fix the arguments there)", ErrorKind::Refused});
    }
    return true;
  }
  if (!same_metadata(ranks)) {
    if (mine) failed.push_back(Failure{*mine, disagreement(name, group.label, ranks), ErrorKind::Mismatch});
    return true;
  }
  return false;
}

void JoinTracker::fail_departed(Group& group) {
  int mine;
  {
    TensorQueue::Locked state = queue_.lock();
    mine = state->stop_requested && group.queue(state).pending.empty() ? (state->failed ? 2 : 1) : 0;
  }
  std::vector<int> left(group.size, 0);
  HP_MPI(MPI_Allgather, group.comm, &mine, 1, MPI_INT, left.data(), 1, MPI_INT, group.comm);
  TensorQueue::Locked state = queue_.lock();
  GroupQueue& queue = group.queue(state);
  if (queue.pending.empty()) return;
  std::string ranks, names;
  int count = 0;
  bool failed = false;
  for (int r = 0; r < group.size; ++r) {
    if (!left[r]) continue;
    failed = failed || left[r] == 2;
    ranks += (ranks.empty() ? "" : ", ") + std::to_string(group.members.empty() ? r : group.members[r]);
    ++count;
  }
  size_t listed = 0;
  for (const Entry& entry : queue.pending) {
    if (listed++ == 3) {
      names += ", ...";
      break;
    }
    names += (names.empty() ? "'" : ", '") + entry.name + "'";
  }
  const int me = group.members.empty() ? group.rank : group.members[group.rank];
  const std::string who = std::string(count == 1 ? "rank " : "ranks ") + ranks;
  const std::string waits = " while this rank (rank " + std::to_string(me) + ") waits for " +
                            (count == 1 ? "it" : "them") + " in a collective on group '" + group.label + "' (" + names +
                            "): ";
  if (failed) {
    queue_.fail_pending(state, queue,
                        who + " failed with an uncaught exception (its traceback is in its output)" + waits +
                            "fix the error that rank reports",
                        ErrorKind::Departed);
    return;
  }
  queue_.fail_pending(state, queue,
                      who + (count == 1 ? " has" : " have") + " shut down (hp.shutdown)" + waits +
                          "the ranks made different numbers of collective calls. Usually uneven data: one rank ran out "
                          "of batches first; give every rank the same number of batches (drop_last=True, or a sampler "
                          "that pads), or call hp.join() on a rank that runs out of data",
                      ErrorKind::Departed);
}

}  // namespace hybridpipe
