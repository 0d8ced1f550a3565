// The background engine; see engine.h.
#include "engine.h"

#ifdef __linux__
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace hybridpipe {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_now() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

constexpr uint64_t kAllCached = 1ull << 0;   // AND: no rank has an uncached ready name
constexpr uint64_t kNotStalled = 1ull << 1;  // AND: no rank has a name waiting past stall_check_seconds
constexpr uint64_t kWantStop = 1ull << 2;    // AND: every rank asked to stop and has nothing pending
constexpr uint64_t kIdle = 1ull << 3;        // AND: nobody has anything pending
constexpr uint64_t kNotExpired = 1ull << 4;  // AND: nothing waited past stall_shutdown_seconds

struct Announced {  // one pending name of one rank, as gathered in a slow round
  int rank;
  size_t count;
  int dtype;
  int op;
  bool stalled;
  double waited_s;
};

void put(std::string& out, const void* data, size_t bytes) { out.append(static_cast<const char*>(data), bytes); }

template <typename T>
T take(const char*& cursor) {
  T value;
  std::memcpy(&value, cursor, sizeof(T));
  cursor += sizeof(T);
  return value;
}

std::string describe(const Announced& a) {
  return "count=" + std::to_string(a.count) + " dtype=" + dtype_name(static_cast<DType>(a.dtype)) +
         " op=" + op_name(static_cast<ReduceOp>(a.op));
}

}  // namespace

Engine::Engine(const EngineOptions& options) : options_(options) {
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  if (provided != MPI_THREAD_MULTIPLE) {
    throw std::runtime_error("the background engine needs MPI initialized with MPI_THREAD_MULTIPLE (got level " +
                             std::to_string(provided) + "); do not set mpi4py.rc.thread_level below 'multiple'");
  }
}

Engine::~Engine() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) {  // MPI is gone: the threads cannot finish their protocol; leave them
    for (auto& group : groups_) {
      if (group->thread.joinable()) group->thread.detach();
    }
    return;
  }
  shutdown();
}

int Engine::add_group(MPI_Comm comm, const std::string& label, bool start) {
  auto group = std::make_unique<Group>();
  HP_MPI(MPI_Comm_dup, comm, comm, &group->comm);
  MPI_Comm_set_errhandler(group->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(group->comm, &group->rank);
  MPI_Comm_size(group->comm, &group->size);
  group->label = label;
  // A new group starts quiet, as if every rank had agreed on kQuietAfterIdleCycles idle cycles: it
  // negotiates on its first local submission (or stop, or after the idle cycle time). A burst of
  // negotiations right after hp.init would meet the communicators a script creates then (a
  // PipelineModel's duplicate, say); with ranks on several hosts, Open MPI's context-id agreement for
  // a new communicator took 5-58 s here beside them, and 0.03-0.05 s beside quiet groups.
  group->idle_cycles = kQuietAfterIdleCycles + 1;
  group->next_cycle = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(quiet_cycle_ms() * 1000));
  group->shm = fused_shared_memory(group->comm, options_.allreduce);  // collective, like the dup
  group->waiters_help = options_.waiters_help && (group->shm != nullptr || group->size == 1 || on_one_host(group->comm));
  std::lock_guard<std::mutex> lock(mutex_);
  if (stop_requested_) {
    MPI_Comm_free(&group->comm);
    throw std::runtime_error("engine is shutting down; cannot add group '" + label + "'");
  }
  Group* raw = group.get();
  groups_.push_back(std::move(group));
  if (start) start_thread(*raw);
  return static_cast<int>(groups_.size() - 1);
}

void Engine::start() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& group : groups_) {
    if (!group->thread.joinable()) start_thread(*group);
  }
}

double Engine::quiet_cycle_ms() const {
  return std::min(options_.idle_cycle_time_ms, options_.stall_check_seconds * 250);
}

void Engine::start_thread(Group& group) {
  Group* raw = &group;
  raw->thread = std::thread([this, raw] {
#ifdef __linux__
    if (options_.thread_nice > 0) {  // per thread on Linux: the thread id names the thread
      const int base = getpriority(PRIO_PROCESS, 0);
      setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), std::min(base + options_.thread_nice, 19));
    }
#endif
    run(*raw);
  });
}

uint64_t Engine::submit(int group_id, const std::string& name, const Buffer& buffer, ReduceOp op) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!fatal_.empty()) throw std::runtime_error("the background engine stopped after an error: " + fatal_);
  if (stop_requested_) throw std::runtime_error("hybridpipe is shutting down: no new allreduce_async");
  if (group_id < 0 || group_id >= static_cast<int>(groups_.size())) {
    throw std::invalid_argument("unknown engine group " + std::to_string(group_id));
  }
  Group& group = *groups_[group_id];
  if (group.thread_done) throw std::runtime_error("the engine thread of group '" + group.label + "' has stopped");
  for (const Entry& entry : group.pending) {
    if (entry.name == name) {
      throw std::invalid_argument("a tensor named '" + name + "' is already in flight on group '" + group.label +
                                  "': wait for its handle first, or give this one another name");
    }
  }
  const uint64_t handle = next_handle_++;
  group.pending.push_back(Entry{handle, name, buffer, op, Clock::now(), false});
  handles_[handle] = HandleState{group_id, false, ""};
  group.wake.notify_one();  // only this group's thread: other threads have no use for a submission
  return handle;
}

bool Engine::poll(uint64_t handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = handles_.find(handle);
  if (found == handles_.end()) throw std::invalid_argument("unknown or already waited-for handle");
  return found->second.done || groups_[found->second.group]->thread_done;
}

std::string Engine::wait(uint64_t handle, double* started, double* finished) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto found = handles_.find(handle);
  if (found == handles_.end()) throw std::invalid_argument("unknown or already waited-for handle");
  Group& group = *groups_[found->second.group];
  ++group.idle_waiters;
  while (!(found->second.done || group.thread_done)) {
    Job* job = group.offered;  // this group's next allreduce: run it here, then look again
    if (job == nullptr) {
      changed_.wait(lock);
      continue;
    }
    group.offered = nullptr;
    job->taken = true;
    --group.idle_waiters;
    lock.unlock();
    std::string error;
    try {
      job->work();
    } catch (const std::exception& e) {
      error = e.what();
    }
    lock.lock();
    job->error = error;
    job->done = true;
    ++group.idle_waiters;
    changed_.notify_all();
  }
  --group.idle_waiters;
  group.last_wait_return = Clock::now();
  std::string error = found->second.done ? found->second.error
                                         : "the background engine stopped before this tensor was reduced" +
                                               (fatal_.empty() ? std::string() : ": " + fatal_);
  if (started) *started = found->second.started;
  if (finished) *finished = found->second.finished;
  handles_.erase(found);
  return error;
}

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (shut_down_) return;
    shut_down_ = true;
    stop_requested_ = true;
    for (auto& group : groups_) {  // the stop is agreed by every group's thread: start any not yet running
      if (!group->thread.joinable()) start_thread(*group);
    }
    changed_.notify_all();
    for (auto& group : groups_) group->wake.notify_all();
  }
  for (auto& group : groups_) {
    if (group->thread.joinable()) group->thread.join();
  }
  for (auto& group : groups_) {
    if (group->comm != MPI_COMM_NULL) MPI_Comm_free(&group->comm);
  }
}

EngineStats Engine::stats(int group_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (group_id < 0 || group_id >= static_cast<int>(groups_.size())) {
    throw std::invalid_argument("unknown engine group " + std::to_string(group_id));
  }
  return groups_[group_id]->stats;
}

void Engine::complete(const std::vector<Entry>& entries, const std::string& error, double started) {
  const double finished = seconds_now();
  std::lock_guard<std::mutex> lock(mutex_);
  for (const Entry& entry : entries) {
    auto found = handles_.find(entry.handle);
    if (found != handles_.end()) {
      found->second.done = true;
      found->second.error = error;
      found->second.started = started;
      found->second.finished = started ? finished : 0;
    }
  }
  changed_.notify_all();
}

std::vector<EngineEvent> Engine::take_events(int group_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (group_id < 0 || group_id >= static_cast<int>(groups_.size())) {
    throw std::invalid_argument("unknown engine group " + std::to_string(group_id));
  }
  std::vector<EngineEvent> events;
  events.swap(groups_[group_id]->events);
  return events;
}

void Engine::record(Group& group, const char* phase, double start, double end, size_t bytes, size_t tensors) {
  if (!options_.record_events) return;
  std::lock_guard<std::mutex> lock(mutex_);
  group.events.push_back(EngineEvent{phase, start, end, bytes, tensors});
}

void Engine::run(Group& group) {
  try {
    if (group.size == 1) {
      run_single(group);
    } else {
      WaitPolicy negotiation_wait = options_.allreduce.wait;
      if (negotiation_wait.spin_us < 0) negotiation_wait = WaitPolicy{0.0, options_.cycle_time_ms * 250 + 20};
      // With nothing of its own to reduce, a rank has no reason to spin: it sleeps between tests
      // from the start, so idle negotiations do not take the cores from a busy group's ring.
      const WaitPolicy idle_wait{0.0, negotiation_wait.max_sleep_us};
      while (!group.finished) {
        {
          std::unique_lock<std::mutex> lock(mutex_);
          // sleep until the next cycle; a submission or a stop request wakes an idle group early
          group.wake.wait_until(lock, group.next_cycle, [&] {
            return Clock::now() >= group.next_cycle ||
                   (group.idle_cycles > 0 && (!group.pending.empty() || stop_requested_));
          });
        }
        const double negotiation_start = seconds_now();
        start_negotiation(group);
        // polite: spin briefly, then sleep between tests (other groups' threads and Python need the cores)
        HP_MPI(wait_all, group.comm, 1, &group.request, MPI_STATUSES_IGNORE,
               group.snapshot.empty() ? idle_wait : negotiation_wait);
        if (!(group.vector[0] & kIdle)) record(group, "negotiate", negotiation_start, seconds_now(), 0, 0);
        finish_negotiation(group);
      }
    }
  } catch (const std::exception& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (fatal_.empty()) fatal_ = "group '" + group.label + "': " + error.what();
    for (const Entry& entry : group.pending) {
      auto found = handles_.find(entry.handle);
      if (found != handles_.end() && !found->second.done) {
        found->second.done = true;
        found->second.error = "the background engine failed: " + fatal_;
      }
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  group.thread_done = true;
  changed_.notify_all();
}

void Engine::run_single(Group& group) {  // an allreduce over one rank is the identity
  while (true) {
    std::vector<Entry> ready;
    bool stop;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      group.wake.wait(lock, [&] { return !group.pending.empty() || stop_requested_; });
      ready.swap(group.pending);
      stop = stop_requested_;
    }
    group.stats.tensors += ready.size();
    complete(ready, "", seconds_now());
    if (stop && ready.empty()) return;
  }
}

void Engine::start_negotiation(Group& group) {
  bool stop;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    group.snapshot = group.pending;
    stop = stop_requested_;
  }
  const auto now = Clock::now();
  const auto stall = std::chrono::duration<double>(options_.stall_check_seconds);
  uint64_t flags = kAllCached | kNotStalled | kNotExpired;
  const auto expiry = std::chrono::duration<double>(options_.stall_shutdown_seconds);
  if (group.snapshot.empty()) flags |= kIdle | (stop ? kWantStop : 0);
  group.vector.assign(1 + (group.cache.size() + 63) / 64, 0);
  for (const Entry& entry : group.snapshot) {
    auto bit = group.bits.find(entry.name);
    const bool cached = bit != group.bits.end() && group.cache[bit->second].count == entry.buffer.count &&
                        group.cache[bit->second].dtype == entry.buffer.dtype && group.cache[bit->second].op == entry.op;
    if (cached) {
      group.vector[1 + bit->second / 64] |= 1ull << (bit->second % 64);
    } else {
      flags &= ~kAllCached;
    }
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
  std::vector<std::pair<Entry, std::string>> failed;
  if ((flags & kAllCached) && (flags & kNotStalled) && (flags & kNotExpired)) {
    for (const Entry& entry : group.snapshot) {
      auto bit = group.bits.find(entry.name);
      if (bit == group.bits.end()) continue;
      if (group.vector[1 + bit->second / 64] & (1ull << (bit->second % 64))) ready.push_back(entry);
    }
  } else {
    group.stats.slow_rounds++;
    const double gather_start = seconds_now();
    slow_round(group, ready, failed);
    record(group, "gather names", gather_start, seconds_now(), 0, 0);
  }
  std::sort(ready.begin(), ready.end(),
            [&](const Entry& a, const Entry& b) { return group.bits.at(a.name) < group.bits.at(b.name); });
  {  // those leave the queue; the rest wait for the next cycle
    std::lock_guard<std::mutex> lock(mutex_);
    auto gone = [&](const Entry& entry) {
      for (const Entry& r : ready) if (r.handle == entry.handle) return true;
      for (const auto& f : failed) if (f.first.handle == entry.handle) return true;
      return false;
    };
    group.pending.erase(std::remove_if(group.pending.begin(), group.pending.end(), gone), group.pending.end());
    for (Entry& entry : group.pending) {  // remember which stalls were reported
      for (const Entry& seen : group.snapshot) {
        if (seen.handle == entry.handle && seen.warned) entry.warned = true;
      }
    }
  }
  for (const auto& item : failed) complete({item.first}, item.second);
  if (!ready.empty()) execute(group, ready);
  if ((flags & kWantStop) && ready.empty() && failed.empty()) group.finished = true;
  group.idle_cycles = (flags & kIdle) ? group.idle_cycles + 1 : 0;
  // After a few agreed idle cycles the group goes quiet: its next negotiation comes only when a tensor
  // is submitted here, on stop, or after the idle cycle time. Every rank sees the same flags, so all
  // ranks go quiet together and their idle timers stay in step (see quiet_cycle_ms).
  const double wait_ms = group.idle_cycles > kQuietAfterIdleCycles ? quiet_cycle_ms() : options_.cycle_time_ms;
  group.next_cycle = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(wait_ms * 1000));
  group.snapshot.clear();
}

void Engine::slow_round(Group& group, std::vector<Entry>& ready, std::vector<std::pair<Entry, std::string>>& failed) {
  const auto now = Clock::now();
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
  }
  int my_length = static_cast<int>(mine.size());
  std::vector<int> lengths(group.size), offsets(group.size, 0);
  HP_MPI(MPI_Allgather, group.comm, &my_length, 1, MPI_INT, lengths.data(), 1, MPI_INT, group.comm);
  for (int r = 1; r < group.size; ++r) offsets[r] = offsets[r - 1] + lengths[r - 1];
  std::string everyone(static_cast<size_t>(offsets.back() + lengths.back()), '\0');
  HP_MPI(MPI_Allgatherv, group.comm, mine.data(), my_length, MPI_BYTE, everyone.data(), lengths.data(),
         offsets.data(), MPI_BYTE, group.comm);

  std::map<std::string, std::vector<Announced>> by_name;  // sorted: the same order on every rank
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
      by_name[name].push_back(a);
    }
  }
  auto my_entry = [&](const std::string& name) -> Entry* {
    for (Entry& entry : group.snapshot) if (entry.name == name) return &entry;
    return nullptr;
  };
  for (auto& item : by_name) {
    const std::string& name = item.first;
    const std::vector<Announced>& ranks = item.second;
    Entry* mine_entry = my_entry(name);
    if (static_cast<int>(ranks.size()) == group.size) {
      bool same = true;
      for (const Announced& a : ranks) {
        same = same && a.count == ranks[0].count && a.dtype == ranks[0].dtype && a.op == ranks[0].op;
      }
      if (!same) {
        std::string listing;
        for (const Announced& a : ranks) listing += (listing.empty() ? "" : "; ") + ("rank " + std::to_string(a.rank) + ": " + describe(a));
        if (mine_entry) {
          failed.emplace_back(*mine_entry, "allreduce_async '" + name + "' on group '" + group.label +
                                               "': ranks disagree (" + listing +
                                               "); every rank must submit the same count, dtype and op under one name");
        }
        continue;
      }
      auto bit = group.bits.find(name);
      const CacheEntry meta{name, ranks[0].count, static_cast<DType>(ranks[0].dtype), static_cast<ReduceOp>(ranks[0].op)};
      if (bit == group.bits.end()) {
        group.bits[name] = group.cache.size();
        group.cache.push_back(meta);
      } else {
        group.cache[bit->second] = meta;
      }
      if (mine_entry) ready.push_back(*mine_entry);
      continue;
    }
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
      std::snprintf(text, sizeof text, "' waited %.1f s for the ranks of the group that never submitted it",
                    waited);
      char limit[64];
      std::snprintf(limit, sizeof limit, "%g", options_.stall_shutdown_seconds);
      throw std::runtime_error("allreduce '" + name + text + " (only ranks [" + have +
                               "] did); stall_shutdown_seconds=" + limit + " stopped the engine");
    }
    if (!stalled) continue;
    if (mine_entry) mine_entry->warned = true;
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
  }
}

void Engine::reduce_bucket(Group& group, const std::function<void(const AllreduceOptions&)>& run) {
  auto run_here = [&] { run(options_.allreduce); };
  if (!group.waiters_help) return run_here();
  // A thread leaving wait() usually comes back for its next handle within microseconds.
  const auto grace = std::chrono::microseconds(200);
  Job job;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (group.idle_waiters == 0 && Clock::now() - group.last_wait_return > grace) {
      lock.unlock();
      return run_here();
    }
    // Spin, with the same MPI calls as the engine thread's policy (another rank's engine thread may
    // run this bucket there). `run` outlives the job: this frame waits for it or takes it back.
    AllreduceOptions helped = options_.allreduce;
    helped.wait = spinning(helped.wait);
    job.work = [&run, helped] { run(helped); };
    group.offered = &job;
    changed_.notify_all();
    while (!job.done) {
      if (!job.taken && group.idle_waiters == 0 && Clock::now() - group.last_wait_return > grace) {  // nobody came
        group.offered = nullptr;
        lock.unlock();
        return run_here();
      }
      if (job.taken) {
        changed_.wait(lock);
      } else {
        changed_.wait_for(lock, grace);
      }
    }
  }
  if (!job.error.empty()) throw std::runtime_error(job.error);
  group.stats.helped++;
}

void Engine::execute(Group& group, std::vector<Entry>& ready) {
  const size_t threshold = std::max<size_t>(options_.fusion_threshold_bytes, 1);
  std::vector<unsigned char>& fusion_ = group.fusion;
  if (fusion_.size() < threshold) fusion_.resize(threshold);
  std::vector<Entry> bucket;
  size_t bucket_bytes = 0;
  // Reduces `entries` (one alone, in place; several packed into the fusion buffer) and completes them.
  auto reduce = [&](std::vector<Entry>& entries, size_t total_bytes) {
    const double started = seconds_now();
    const ReduceOp op = entries[0].op;
    const bool streamed = group.shm && total_bytes > options_.allreduce.small_message_bytes;
    if (entries.size() == 1) {
      const Buffer& buffer = entries[0].buffer;
      reduce_bucket(group, [&](const AllreduceOptions& options) {
        allreduce(buffer, buffer, op, group.comm, options, group.workspace);
      });
      record(group, "ring", started, seconds_now(), total_bytes, 1);
    } else if (streamed) {
      // packed straight into the shared segment and unpacked straight from it: no fusion buffer
      std::vector<Buffer> buffers;
      for (const Entry& entry : entries) buffers.push_back(entry.buffer);
      reduce_bucket(group, [&](const AllreduceOptions& options) {
        group.shm->allreduce(buffers, buffers, op, options.wait);
      });
      record(group, "ring", started, seconds_now(), total_bytes, entries.size());
    } else {
      unsigned char* cursor = fusion_.data();
      for (const Entry& entry : entries) {
        std::memcpy(cursor, entry.buffer.data, entry.buffer.bytes());
        cursor += entry.buffer.bytes();
      }
      const double packed = seconds_now();
      record(group, "pack", started, packed, total_bytes, entries.size());
      const DType dtype = entries[0].buffer.dtype;
      const Buffer fused{fusion_.data(), total_bytes / dtype_size(dtype), dtype};
      reduce_bucket(group, [&](const AllreduceOptions& options) {
        allreduce(fused, fused, op, group.comm, options, group.workspace);
      });
      const double reduced = seconds_now();
      record(group, "ring", packed, reduced, total_bytes, entries.size());
      cursor = fusion_.data();
      for (const Entry& entry : entries) {
        std::memcpy(entry.buffer.data, cursor, entry.buffer.bytes());
        cursor += entry.buffer.bytes();
      }
      record(group, "unpack", reduced, seconds_now(), total_bytes, entries.size());
    }
    group.stats.buckets++;
    if (streamed) group.stats.shared_memory++;
    group.stats.bytes += total_bytes;
    group.stats.tensors += entries.size();
    complete(entries, "", started);
  };
  auto flush = [&]() {
    if (bucket.empty()) return;
    reduce(bucket, bucket_bytes);
    bucket.clear();
    bucket_bytes = 0;
  };
  for (Entry& entry : ready) {
    const size_t bytes = entry.buffer.bytes();
    if (reduced_alone(bytes, threshold, options_.allreduce, group.shm != nullptr)) {  // in place, alone; the bucket stays open
      std::vector<Entry> alone{entry};
      reduce(alone, bytes);
      continue;
    }
    if (!bucket.empty() && (entry.buffer.dtype != bucket[0].buffer.dtype || entry.op != bucket[0].op ||
                            bucket_bytes + bytes > threshold)) {
      flush();
    }
    bucket.push_back(entry);
    bucket_bytes += bytes;
  }
  flush();
}

}  // namespace hybridpipe
