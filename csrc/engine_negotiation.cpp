// The engine's negotiation (see engine.h): which submitted names are ready on every rank of a group, the
// response cache that makes that one bit-vector allreduce in the steady state, the slow rounds that gather
// names (metadata checks, refusals, joins, stall warnings), departed ranks, and registrations of groups.
#include "engine.h"

#include "engine_internal.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace hybridpipe {

using namespace engine_detail;

struct Announced {  // one pending name of one rank, as gathered in a slow round (declared in engine.h)
  int rank;
  size_t count;
  int dtype;
  int op;
  bool stalled;
  double waited_s;
  std::string refusal;
  int device;
  bool join;
  bool call;
  WireFormat wire;
};

namespace {

void put(std::string& out, const void* data, size_t bytes) { out.append(static_cast<const char*>(data), bytes); }

template <typename T>
T take(const char*& cursor) {
  T value;
  std::memcpy(&value, cursor, sizeof(T));
  cursor += sizeof(T);
  return value;
}

std::string describe(const Announced& a) {
  static const char* const devices[] = {"", " device=cuda", " device=accelerator"};
  return "count=" + std::to_string(a.count) + " dtype=" + dtype_name(static_cast<DType>(a.dtype)) +
         " op=" + op_name(static_cast<ReduceOp>(a.op)) + devices[a.device >= 0 && a.device <= 2 ? a.device : 2] +
         (a.wire.dtype < 0 ? "" : std::string(" wire=") + dtype_name(static_cast<DType>(a.wire.dtype))) +
         (a.wire.on_one_host ? " (on one host too)" : "");
}

// "rank 1 raised TypeError: ...; rank 3 raised ...": the ranks that refused the operation (submit_refusal).
std::string refusals_of(const std::vector<Announced>& ranks) {
  std::string refusals;
  for (const Announced& a : ranks) {
    if (!a.refusal.empty()) refusals += (refusals.empty() ? "" : "; ") + ("rank " + std::to_string(a.rank) + " raised " + a.refusal);
  }
  return refusals;
}

// Whether the ranks agree on what they submitted under one name.
bool same_metadata(const std::vector<Announced>& ranks) {
  return std::all_of(ranks.begin(), ranks.end(), [&](const Announced& a) {
    return a.count == ranks[0].count && a.dtype == ranks[0].dtype && a.op == ranks[0].op && a.device == ranks[0].device &&
           a.wire == ranks[0].wire;
  });
}

// The error of a name the ranks disagree on, with every rank's values.
std::string disagreement(const std::string& name, const std::string& group, const std::vector<Announced>& ranks) {
  std::string listing;
  for (const Announced& a : ranks) listing += (listing.empty() ? "" : "; ") + ("rank " + std::to_string(a.rank) + ": " + describe(a));
  return "allreduce_async '" + name + "' on group '" + group + "': ranks disagree (" + listing +
         "); every rank must submit the same count, dtype, op, device and compression under one name";
}

}  // namespace

void Engine::negotiate(Group& group, const WaitPolicy& busy_wait, const WaitPolicy& idle_wait) {
  const double negotiation_start = seconds_now();
  start_negotiation(group);
  // polite: spin briefly, then sleep between tests (Python needs the cores). A negotiation waits only
  // for the other ranks' communication threads, which run whatever their training threads do: one
  // that never comes means a rank stopped, died or was cut off, and only a local timer can tell
  // (block_on: the probes and the timeout run inside the wait, see check_blocked).
  block_on(&group, "negotiate");
  HP_MPI(polite_wait, group.comm, [&](int* flag) { return MPI_Test(&group.request, flag, MPI_STATUS_IGNORE); },
         group.snapshot.empty() ? idle_wait : busy_wait);
  block_on(nullptr);
  if (!(group.vector[0] & kIdle)) record(group, "negotiate", negotiation_start, seconds_now(), 0, 0);
  finish_negotiation(group);
}

void Engine::activate_registrations(Group& coordinator) {
  // every rank of group 0 is here in the same cycle: gather (members, n) of each pending registration
  std::vector<int> mine;
  std::vector<Group*> waiting;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& group : groups_) {
      if (group->active || group->finished) continue;
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
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& item : asked) {  // the same order on every rank: a group's ranks add it in the same place
    std::vector<int> members(item.first.begin(), item.first.end() - 1);
    std::vector<int> sorted_members = members, sorted_asked = item.second;
    std::sort(sorted_members.begin(), sorted_members.end());
    if (sorted_members != sorted_asked) continue;  // not every rank of it has registered it yet
    for (Group* group : waiting) {
      if (group->members == members && group->registration == item.first.back()) {
        group->active = true;
        registrations_pending_--;
        cycle_order_.push_back(static_cast<int>(
            std::find_if(groups_.begin(), groups_.end(), [&](const auto& g) { return g.get() == group; }) -
            groups_.begin()));
      }
    }
  }
}

void Engine::start_negotiation(Group& group) {
  bool stop;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    group.snapshot = ready_entries(group);
    stop = stop_requested_ && group.snapshot.size() == group.pending.size();
  }
  const auto now = Clock::now();
  const auto stall = std::chrono::duration<double>(options_.stall_check_seconds);
  uint64_t flags = kAllCached | kNotStalled | kNotExpired;
  const auto expiry = std::chrono::duration<double>(options_.stall_shutdown_seconds);
  if (group.snapshot.empty()) flags |= kIdle | (stop ? kWantStop : 0);
  if (!(group.snapshot.empty() && stop)) flags |= kNobodyLeft;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (&group != groups_[0].get() || registrations_pending_ == 0) flags |= kNoRegistration;
  }
  group.vector.assign(1 + (group.cache.size() + 63) / 64, 0);
  for (const Entry& entry : group.snapshot) {
    auto bit = group.bits.find(entry.name);
    const bool cached = entry.refusal.empty() && bit != group.bits.end() &&
                        group.cache[bit->second].count == entry.buffer.count &&
                        group.cache[bit->second].dtype == entry.buffer.dtype && group.cache[bit->second].op == entry.op &&
                        group.cache[bit->second].device == entry.device && group.cache[bit->second].wire == entry.wire;
    if (cached) {
      group.vector[1 + bit->second / 64] |= 1ull << (bit->second % 64);
    } else {
      flags &= ~kAllCached;
    }
    if (entry.join) flags &= ~kAllCached;  // while a rank has joined, every round gathers names (and counts)
    if (!entry.warned && now - entry.submitted > stall) flags &= ~kNotStalled;
    if (options_.stall_shutdown_seconds > 0 && now - entry.submitted > expiry) flags &= ~kNotExpired;
  }
  group.vector[0] = flags;
  HP_MPI(MPI_Iallreduce, group.comm, MPI_IN_PLACE, group.vector.data(), static_cast<int>(group.vector.size()),
         MPI_UINT64_T, MPI_BAND, group.comm, &group.request);
}

void Engine::finish_negotiation(Group& group) {
  group.stats.cycles++;
  const uint64_t flags = group.vector[0];
  std::vector<Entry> ready;
  std::vector<Failure> failed;
  std::string expired;
  if ((flags & kAllCached) && (flags & kNotStalled) && (flags & kNotExpired)) {
    for (const Entry& entry : group.snapshot) {
      auto bit = group.bits.find(entry.name);
      if (bit == group.bits.end()) continue;
      if (group.vector[1 + bit->second / 64] & (1ull << (bit->second % 64))) ready.push_back(entry);
    }
  } else {
    group.stats.slow_rounds++;
    const double gather_start = seconds_now();
    expired = slow_round(group, ready, failed);
    record(group, "gather names", gather_start, seconds_now(), 0, 0);
  }
  if (!expired.empty()) {  // every rank of the group saw the same ages: they all stop it in this cycle
    std::lock_guard<std::mutex> lock(mutex_);
    group.finished = true;
    group.stopped_because = expired;
    // the thread goes on driving the other groups (their ranks would wait for it), but takes no new work
    if (fatal_.empty()) fatal_ = expired;
    fail_pending(group, expired, ErrorKind::Stalled);
    group.snapshot.clear();
    return;
  }
  std::sort(ready.begin(), ready.end(),
            [&](const Entry& a, const Entry& b) { return group.bits.at(a.name) < group.bits.at(b.name); });
  {  // those leave the queue; the rest wait for the next cycle
    std::lock_guard<std::mutex> lock(mutex_);
    auto gone = [&](const Entry& entry) {
      for (const Entry& r : ready) if (r.handle == entry.handle) return true;
      for (const auto& f : failed) if (f.entry.handle == entry.handle) return true;
      return false;
    };
    group.pending.erase(std::remove_if(group.pending.begin(), group.pending.end(), gone), group.pending.end());
    for (Entry& entry : group.pending) {  // remember which stalls were reported
      for (const Entry& seen : group.snapshot) {
        if (seen.handle == entry.handle && seen.warned) entry.warned = true;
      }
    }
  }
  for (const auto& item : failed) complete({item.entry}, item.error, 0, item.kind);
  if (!ready.empty()) execute(group, ready);
  if ((flags & kWantStop) && ready.empty() && failed.empty()) {
    std::lock_guard<std::mutex> lock(mutex_);
    group.finished = true;
  }
  // Some ranks have left (hp.shutdown, nothing pending: they will submit nothing more) while others wait:
  // what those wait for can never complete, so it fails now instead of hanging. Every rank sees the same
  // flags, so all ranks of the group gather who left in the same cycle.
  if (!(flags & kNobodyLeft) && !(flags & kWantStop) && !(flags & kIdle)) fail_departed(group);
  group.idle_cycles = (flags & kIdle) ? group.idle_cycles + 1 : 0;
  group.snapshot.clear();
}

void Engine::fail_departed(Group& group) {
  int mine;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    mine = stop_requested_ && group.pending.empty() ? (failed_ ? 2 : 1) : 0;
  }
  std::vector<int> left(group.size, 0);
  HP_MPI(MPI_Allgather, group.comm, &mine, 1, MPI_INT, left.data(), 1, MPI_INT, group.comm);
  std::lock_guard<std::mutex> lock(mutex_);
  if (group.pending.empty()) return;
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
  for (const Entry& entry : group.pending) {
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
    fail_pending(group,
                 who + " failed with an uncaught exception (its traceback is in its output)" + waits +
                     "fix the error that rank reports",
                 ErrorKind::Departed);
    return;
  }
  fail_pending(group,
               who + (count == 1 ? " has" : " have") + " shut down (hp.shutdown)" + waits +
                   "the ranks made different numbers of collective calls. Usually uneven data: one rank ran out "
                   "of batches first; give every rank the same number of batches (drop_last=True, or a sampler "
                   "that pads), or call hp.join() on a rank that runs out of data",
               ErrorKind::Departed);
}

Engine::Announcements Engine::gather_names(Group& group, std::chrono::steady_clock::time_point now) {
  std::string mine;
  for (const Entry& entry : group.snapshot) {
    const uint32_t length = static_cast<uint32_t>(entry.name.size());
    const uint64_t count = entry.buffer.count;
    const int32_t dtype = static_cast<int32_t>(entry.buffer.dtype), op = static_cast<int32_t>(entry.op);
    const double waited = std::chrono::duration<double>(now - entry.submitted).count();
    const uint8_t stalled = !entry.warned && waited > options_.stall_check_seconds;
    put(mine, &length, sizeof length);
    put(mine, entry.name.data(), length);
    put(mine, &count, sizeof count);
    put(mine, &dtype, sizeof dtype);
    put(mine, &op, sizeof op);
    put(mine, &stalled, sizeof stalled);
    put(mine, &waited, sizeof waited);
    const uint32_t refusal_length = static_cast<uint32_t>(entry.refusal.size());
    put(mine, &refusal_length, sizeof refusal_length);
    put(mine, entry.refusal.data(), refusal_length);
    const int32_t device = entry.device;
    put(mine, &device, sizeof device);
    const uint8_t join = entry.join, call = entry.job != nullptr;
    put(mine, &join, sizeof join);
    put(mine, &call, sizeof call);
    const int32_t wire_dtype = entry.wire.dtype;
    const uint8_t wire_on_one_host = entry.wire.on_one_host;
    put(mine, &wire_dtype, sizeof wire_dtype);
    put(mine, &wire_on_one_host, sizeof wire_on_one_host);
  }
  int my_length = static_cast<int>(mine.size());
  std::vector<int> lengths(group.size), offsets(group.size, 0);
  HP_MPI(MPI_Allgather, group.comm, &my_length, 1, MPI_INT, lengths.data(), 1, MPI_INT, group.comm);
  for (int r = 1; r < group.size; ++r) offsets[r] = offsets[r - 1] + lengths[r - 1];
  std::string everyone(static_cast<size_t>(offsets.back() + lengths.back()), '\0');
  HP_MPI(MPI_Allgatherv, group.comm, mine.data(), my_length, MPI_BYTE, everyone.data(), lengths.data(),
         offsets.data(), MPI_BYTE, group.comm);

  Announcements by_name;  // sorted: the same order on every rank
  for (int r = 0; r < group.size; ++r) {
    const char* cursor = everyone.data() + offsets[r];
    const char* end = cursor + lengths[r];
    while (cursor < end) {
      const uint32_t length = take<uint32_t>(cursor);
      std::string name(cursor, length);
      cursor += length;
      Announced a{};
      a.rank = r;
      a.count = static_cast<size_t>(take<uint64_t>(cursor));
      a.dtype = take<int32_t>(cursor);
      a.op = take<int32_t>(cursor);
      a.stalled = take<uint8_t>(cursor) != 0;
      a.waited_s = take<double>(cursor);
      const uint32_t refusal_length = take<uint32_t>(cursor);
      a.refusal.assign(cursor, refusal_length);
      cursor += refusal_length;
      a.device = take<int32_t>(cursor);
      a.join = take<uint8_t>(cursor) != 0;
      a.call = take<uint8_t>(cursor) != 0;
      a.wire.dtype = take<int32_t>(cursor);
      a.wire.on_one_host = take<uint8_t>(cursor) != 0;
      by_name[name].push_back(std::move(a));
    }
  }
  return by_name;
}

void Engine::remember(Group& group, const std::string& name, const Announced& meta) {
  const CacheEntry cached{name, meta.count, static_cast<DType>(meta.dtype), static_cast<ReduceOp>(meta.op),
                          meta.device, meta.wire};
  auto bit = group.bits.find(name);
  if (bit == group.bits.end()) {
    group.bits[name] = group.cache.size();
    group.cache.push_back(cached);
  } else {
    group.cache[bit->second] = cached;
  }
}

void Engine::settle_join(Group& group, const std::vector<Announced>& ranks, int joined_count, Entry* mine,
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
      std::lock_guard<std::mutex> lock(mutex_);
      group.last_joined = last;
    }
    failed.push_back(Failure{*mine, "", ErrorKind::None});  // done (no error)
  }
}

bool Engine::reduce_with_joined(Group& group, const std::string& name, const std::vector<Announced>& ranks,
                                const std::vector<bool>& joined, int joined_count, Entry* mine,
                                std::chrono::steady_clock::time_point now, std::vector<Entry>& ready,
                                std::vector<Failure>& failed) {
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
  remember(group, name, meta);
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

std::string Engine::check_stall(Group& group, const std::string& name, const std::vector<Announced>& ranks,
                                Entry* mine) {
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
    group.stats.stall_warnings++;
  }
  return "";
}

std::string Engine::slow_round(Group& group, std::vector<Entry>& ready, std::vector<Failure>& failed) {
  const auto now = Clock::now();
  const Announcements by_name = gather_names(group, now);
  auto my_entry = [&](const std::string& name) -> Entry* {
    for (Entry& entry : group.snapshot) if (entry.name == name) return &entry;
    return nullptr;
  };
  std::vector<bool> joined(group.size, false);  // ranks waiting in join: they stand in with zeros
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
  for (const auto& [name, ranks] : by_name) {
    Entry* mine = my_entry(name);
    if (joined_count > 0 && name == kJoinName) {
      settle_join(group, ranks, joined_count, mine, failed);
      continue;
    }
    if (joined_count > 0 && static_cast<int>(ranks.size()) < group.size &&
        reduce_with_joined(group, name, ranks, joined, joined_count, mine, now, ready, failed)) {
      continue;
    }
    if (static_cast<int>(ranks.size()) == group.size) {
      const std::string refusals = refusals_of(ranks);
      if (!refusals.empty()) {  // every rank sees the same refusals: the operation fails everywhere
        if (mine) {
          failed.push_back(Failure{*mine, refusals + " (so no rank of group '" + group.label +
                                              "' ran its part; fix the arguments there)", ErrorKind::Refused});
        }
      } else if (!same_metadata(ranks)) {
        if (mine) failed.push_back(Failure{*mine, disagreement(name, group.label, ranks), ErrorKind::Mismatch});
      } else {
        remember(group, name, ranks[0]);
        if (mine) ready.push_back(*mine);
      }
      continue;
    }
    const std::string expired = check_stall(group, name, ranks, mine);
    if (!expired.empty()) return expired;
  }
  return "";
}

}  // namespace hybridpipe
