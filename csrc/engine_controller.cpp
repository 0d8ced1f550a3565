// The engine's negotiation (see engine_controller.h): what is ready on every rank of a group, slow rounds, and
// registrations of groups.
#include "engine_controller.h"

#include <algorithm>
#include <map>

#include "engine_group.h"
#include "engine_internal.h"

namespace hybridpipe {

using namespace engine_detail;

void Controller::negotiate(Group& group, const WaitPolicy& busy_wait, const WaitPolicy& idle_wait) {
  GroupRound& round = group.round.get();
  const double negotiation_start = seconds_now();
  start_negotiation(group);
  // polite: spin briefly, then sleep between tests (Python needs the cores). A negotiation waits only
  // for the other ranks' communication threads, which run whatever their training threads do: one
  // that never comes means a rank stopped, died or was cut off, and only a local timer can tell
  // (block_on: the probes and the timeout run inside the wait, see Watchdog::check_blocked).
  watchdog_.block_on(&group, "negotiate");
  HP_MPI(polite_wait, group.comm, [&](int* flag) { return MPI_Test(&round.request, flag, MPI_STATUS_IGNORE); },
         round.snapshot.empty() ? idle_wait : busy_wait);
  watchdog_.block_on(nullptr);
  if (!(round.vector[0] & kIdle)) events_.record(group.id, "negotiate", negotiation_start, seconds_now(), 0, 0);
  finish_negotiation(group);
}

bool Controller::registration_pending(const Group& coordinator) {
  return !(coordinator.round->vector[0] & kNoRegistration);
}

std::vector<int> Controller::activate_registrations(Group& coordinator) {
  // every rank of group 0 is here in the same cycle: gather (members, n) of each pending registration
  std::vector<int> mine;
  std::vector<Group*> waiting;
  {
    TensorQueue::Locked state = queue_.lock();
    for (auto& group : state->groups) {
      const GroupQueue& queue = group->queue(state);
      if (queue.active || queue.finished) continue;
      waiting.push_back(group.get());
      mine.push_back(static_cast<int>(group->members.size()));
      mine.insert(mine.end(), group->members.begin(), group->members.end());
      mine.push_back(group->registration);
    }
  }
  int my_length = static_cast<int>(mine.size());
  std::vector<int> lengths(coordinator.size), offsets(coordinator.size, 0);
  HP_MPI(MPI_Allgather, coordinator.comm, &my_length, 1, MPI_INT, lengths.data(), 1, MPI_INT, coordinator.comm);
  for (int r = 1; r < coordinator.size; ++r) offsets[r] = offsets[r - 1] + lengths[r - 1];
  std::vector<int> everyone(static_cast<size_t>(offsets.back() + lengths.back()) + 1);
  HP_MPI(MPI_Allgatherv, coordinator.comm, mine.data(), my_length, MPI_INT, everyone.data(), lengths.data(),
         offsets.data(), MPI_INT, coordinator.comm);
  std::map<std::vector<int>, std::vector<int>> asked;  // key (members..., n) -> ranks that asked; sorted
  for (int r = 0; r < coordinator.size; ++r) {
    size_t at = static_cast<size_t>(offsets[r]);
    const size_t end = at + static_cast<size_t>(lengths[r]);
    while (at < end) {
      const size_t count = static_cast<size_t>(everyone[at]);
      std::vector<int> key(everyone.begin() + at + 1, everyone.begin() + at + 1 + count + 1);
      asked[key].push_back(r);
      at += count + 2;
    }
  }
  std::vector<int> activated;
  TensorQueue::Locked state = queue_.lock();
  for (const auto& item : asked) {  // the same order on every rank: a group's ranks add it in the same place
    std::vector<int> members(item.first.begin(), item.first.end() - 1);
    std::vector<int> sorted_members = members, sorted_asked = item.second;
    std::sort(sorted_members.begin(), sorted_members.end());
    if (sorted_members != sorted_asked) continue;  // not every rank of it has registered it yet
    for (Group* group : waiting) {
      if (group->members == members && group->registration == item.first.back()) {
        group->queue(state).active = true;
        state->registrations_pending--;
        activated.push_back(group->id);
      }
    }
  }
  return activated;
}

void Controller::start_negotiation(Group& group) {
  GroupRound& round = group.round.get();
  bool stop;
  uint64_t flags = kAllCached | kNotStalled | kNotExpired;
  {
    TensorQueue::Locked state = queue_.lock();
    GroupQueue& queue = group.queue(state);
    round.snapshot = TensorQueue::ready_entries(queue);
    stop = state->stop_requested && round.snapshot.size() == queue.pending.size();
    if (group.id != 0 || state->registrations_pending == 0) flags |= kNoRegistration;
  }
  const auto now = Clock::now();
  if (round.snapshot.empty()) flags |= kIdle | (stop ? kWantStop : 0);
  if (!(round.snapshot.empty() && stop)) flags |= kNobodyLeft;
  round.vector.assign(round.cache.words(), 0);
  for (const Entry& entry : round.snapshot) {
    const size_t bit = round.cache.cached_bit(entry);
    if (bit != ResponseCache::kNone) {
      round.vector[1 + bit / 64] |= 1ull << (bit % 64);
    } else {
      flags &= ~kAllCached;
    }
    if (entry.join) flags &= ~kAllCached;  // while a rank has joined, every round gathers names (and counts)
    if (stalls_.stalled(entry, now)) flags &= ~kNotStalled;
    if (stalls_.expired(entry, now)) flags &= ~kNotExpired;
  }
  round.vector[0] = flags;
  HP_MPI(MPI_Iallreduce, group.comm, MPI_IN_PLACE, round.vector.data(), static_cast<int>(round.vector.size()),
         MPI_UINT64_T, MPI_BAND, group.comm, &round.request);
}

void Controller::dequeue(Group& group, const std::vector<Entry>& ready, const std::vector<Failure>& failed) {
  const GroupRound& round = group.round.get();
  TensorQueue::Locked state = queue_.lock();
  GroupQueue& queue = group.queue(state);
  auto gone = [&](const Entry& entry) {
    for (const Entry& r : ready) if (r.handle == entry.handle) return true;
    for (const auto& f : failed) if (f.entry.handle == entry.handle) return true;
    return false;
  };
  queue.pending.erase(std::remove_if(queue.pending.begin(), queue.pending.end(), gone), queue.pending.end());
  for (Entry& entry : queue.pending) {  // remember which stalls were reported
    for (const Entry& seen : round.snapshot) {
      if (seen.handle == entry.handle && seen.warned) entry.warned = true;
    }
  }
}

void Controller::finish_negotiation(Group& group) {
  GroupRound& round = group.round.get();
  const uint64_t flags = round.vector[0];
  std::vector<Entry> ready;
  std::vector<Failure> failed;
  std::string expired;
  const bool fast = (flags & kAllCached) && (flags & kNotStalled) && (flags & kNotExpired);
  group.stats.with([&](EngineStats& stats) {
    stats.cycles++;
    if (!fast) stats.slow_rounds++;
  });
  if (fast) {
    for (const Entry& entry : round.snapshot) {
      const size_t bit = round.cache.bit(entry.name);
      if (bit == ResponseCache::kNone) continue;
      if (round.vector[1 + bit / 64] & (1ull << (bit % 64))) ready.push_back(entry);
    }
  } else {
    const double gather_start = seconds_now();
    expired = slow_round(group, ready, failed);
    events_.record(group.id, "gather names", gather_start, seconds_now(), 0, 0);
  }
  if (!expired.empty()) {  // every rank of the group saw the same ages: they all stop it in this cycle
    TensorQueue::Locked state = queue_.lock();
    GroupQueue& queue = group.queue(state);
    queue.finished = true;
    queue.stopped_because = expired;
    // the thread goes on driving the other groups (their ranks would wait for it), but takes no new work
    if (state->fatal.empty()) state->fatal = expired;
    queue_.fail_pending(state, queue, expired, ErrorKind::Stalled);
    round.snapshot.clear();
    return;
  }
  std::sort(ready.begin(), ready.end(), [&](const Entry& a, const Entry& b) {
    return round.cache.bit(a.name) < round.cache.bit(b.name);
  });
  dequeue(group, ready, failed);
  for (const auto& item : failed) queue_.complete({item.entry}, item.error, 0, item.kind);
  if (!ready.empty()) buckets_.execute(group, ready);
  if ((flags & kWantStop) && ready.empty() && failed.empty()) {
    TensorQueue::Locked state = queue_.lock();
    group.queue(state).finished = true;
  }
  // Some ranks have left (hp.shutdown, nothing pending: they will submit nothing more) while others wait:
  // what those wait for can never complete, so it fails now instead of hanging. Every rank sees the same
  // flags, so all ranks of the group gather who left in the same cycle.
  if (!(flags & kNobodyLeft) && !(flags & kWantStop) && !(flags & kIdle)) joins_.fail_departed(group);
  round.idle_cycles = (flags & kIdle) ? round.idle_cycles + 1 : 0;
  round.snapshot.clear();
}

Announcements Controller::gather_names(Group& group, std::chrono::steady_clock::time_point now) {
  const std::string mine = encode_announcements(group.round->snapshot, now, options_.stall_check_seconds);
  int my_length = static_cast<int>(mine.size());
  std::vector<int> lengths(group.size), offsets(group.size, 0);
  HP_MPI(MPI_Allgather, group.comm, &my_length, 1, MPI_INT, lengths.data(), 1, MPI_INT, group.comm);
  for (int r = 1; r < group.size; ++r) offsets[r] = offsets[r - 1] + lengths[r - 1];
  std::string everyone(static_cast<size_t>(offsets.back() + lengths.back()), '\0');
  HP_MPI(MPI_Allgatherv, group.comm, mine.data(), my_length, MPI_BYTE, everyone.data(), lengths.data(),
         offsets.data(), MPI_BYTE, group.comm);
  return decode_announcements(everyone, lengths, offsets);
}

std::string Controller::slow_round(Group& group, std::vector<Entry>& ready, std::vector<Failure>& failed) {
  const auto now = Clock::now();
  const Announcements by_name = gather_names(group, now);
  GroupRound& round = group.round.get();
  auto my_entry = [&](const std::string& name) -> Entry* {
    for (Entry& entry : round.snapshot) if (entry.name == name) return &entry;
    return nullptr;
  };
  std::vector<bool> joined;  // ranks waiting in join: they stand in with zeros
  const int joined_count = JoinTracker::joined_ranks(by_name, group.size, joined);
  for (const auto& [name, ranks] : by_name) {
    Entry* mine = my_entry(name);
    if (joined_count > 0 && name == kJoinName) {
      joins_.settle_join(group, ranks, joined_count, mine, failed);
      continue;
    }
    if (joined_count > 0 && static_cast<int>(ranks.size()) < group.size &&
        joins_.reduce_with_joined(group, name, ranks, joined, joined_count, mine, now, ready, failed)) {
      continue;
    }
    if (static_cast<int>(ranks.size()) == group.size) {
      if (!joins_.refuse(group, name, ranks, mine, failed)) {
        round.cache.remember(name, ranks[0]);
        if (mine) ready.push_back(*mine);
      }
      continue;
    }
    const std::string expired = stalls_.inspect(group, name, ranks, mine);
    if (!expired.empty()) return expired;
  }
  return "";
}

}  // namespace hybridpipe
