// Non-blocking point-to-point transfers; see p2p.h.
#include "p2p.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <stdexcept>

#include <sched.h>

namespace hybridpipe {

namespace {

// Counts a thread as waiting on a queue.
class Waiting {
 public:
  explicit Waiting(std::atomic<int>& waiters) : waiters_(waiters) { waiters_.fetch_add(1, std::memory_order_acq_rel); }
  ~Waiting() { waiters_.fetch_sub(1, std::memory_order_acq_rel); }

 private:
  std::atomic<int>& waiters_;
};

// Cuts the calling thread's timer slack to 1 us (once, on cut()) and restores it when it goes.
class TimerSlack {
 public:
  TimerSlack() = default;
  TimerSlack(const TimerSlack&) = delete;
  TimerSlack& operator=(const TimerSlack&) = delete;
  void cut() {
#ifdef __linux__
    if (old_ >= 0) return;
    old_ = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
#endif
  }
  ~TimerSlack() {
#ifdef __linux__
    if (old_ > 0) prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(old_), 0, 0, 0);
#endif
  }

 private:
  int old_ = -1;
};

std::string describe(const char* verb, size_t bytes, int peer, int tag) {
  return std::string(verb) + " of " + std::to_string(bytes) + " bytes " + (verb[0] == 's' ? "to" : "from") +
         " rank " + std::to_string(peer) + " (tag " + std::to_string(tag) + ")";
}

void check_tag(int tag, MPI_Comm comm) {
  void* upper = nullptr;
  int found = 0;
  HP_MPI(MPI_Comm_get_attr, comm, comm, MPI_TAG_UB, &upper, &found);  // a local query, no progress
  const int tag_ub = found ? *static_cast<int*>(upper) : 32767;
  if (tag < 0 || tag > tag_ub) {
    throw std::invalid_argument("p2p tag " + std::to_string(tag) + " is outside 0.." + std::to_string(tag_ub) +
                                " (MPI_TAG_UB of this MPI)");
  }
}

std::mutex installed_mutex;
std::shared_ptr<TransferQueue> installed;

// Sends dropped in flight with no queue installed: tested (and released once done) by later calls.
std::mutex orphans_mutex;
std::vector<std::shared_ptr<Transfer>> direct_orphans;

void reap_direct_orphans() {
  std::vector<std::shared_ptr<Transfer>> finished;  // released after the lock
  std::lock_guard<std::mutex> lock(orphans_mutex);
  for (auto& orphan : direct_orphans) {
    std::string error;
    if (orphan->test_parts(&error) || !error.empty()) finished.push_back(std::move(orphan));
  }
  direct_orphans.erase(std::remove(direct_orphans.begin(), direct_orphans.end(), nullptr), direct_orphans.end());
}

std::string mpi_error_text(int code, const std::string& call, MPI_Comm comm) {
  try {
    raise_mpi_error(code, call.c_str(), comm);
  } catch (const MPICallError& error) {
    return error.what();
  }
  return call + " failed";
}

// Cancels the posted, unfinished parts of a receive (a send cannot be cancelled portably).
void cancel_parts(Transfer& transfer) {
  for (MPI_Request& part : transfer.parts) {
    if (part != MPI_REQUEST_NULL) MPI_Cancel(&part);
  }
  transfer.cancel_sent = true;
}

}  // namespace

// ------------------------------------------------------------------ Transfer

void Transfer::post() {
  size_t left = bytes;
  char* cursor = data;
  do {
    const size_t part = std::min(left, kMaxPartBytes);
    parts.push_back(MPI_REQUEST_NULL);
    const int rc = receive ? MPI_Irecv(cursor, static_cast<int>(part), MPI_BYTE, peer, tag, comm, &parts.back())
                           : MPI_Isend(cursor, static_cast<int>(part), MPI_BYTE, peer, tag, comm, &parts.back());
    if (rc != MPI_SUCCESS) {
      parts.pop_back();
      raise_mpi_error(rc, receive ? "MPI_Irecv" : "MPI_Isend", comm);
    }
    cursor += part;
    left -= part;
  } while (left > 0);
  posted = true;
}

void Transfer::finish(const MPI_Status* statuses, size_t n) {
  received_bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    int count = 0;
    int was_cancelled = 0;
    if (receive && MPI_Test_cancelled(&statuses[i], &was_cancelled) == MPI_SUCCESS && was_cancelled) cancelled = true;
    if (statuses[i].MPI_SOURCE != MPI_PROC_NULL && statuses[i].MPI_SOURCE != MPI_ANY_SOURCE) {
      MPI_Get_count(&statuses[i], MPI_BYTE, &count);
    }
    if (count != MPI_UNDEFINED) received_bytes += static_cast<size_t>(count);
  }
  done = true;
}

bool Transfer::test_parts(std::string* error_out, int* code_out) {
  if (done) return true;
  int flag = 0;
  std::vector<MPI_Status> statuses(parts.size());
  const int rc = MPI_Testall(static_cast<int>(parts.size()), parts.data(), &flag, statuses.data());
  if (rc != MPI_SUCCESS) {
    int code = rc;
    if (rc == MPI_ERR_IN_STATUS) {
      for (const MPI_Status& status : statuses) {
        if (status.MPI_ERROR != MPI_SUCCESS && status.MPI_ERROR != MPI_ERR_PENDING) code = status.MPI_ERROR;
      }
    }
    *error_out = mpi_error_text(code, "MPI_Testall (" + what + ")", comm);
    if (code_out) *code_out = code;
    done = true;
    return true;
  }
  if (flag) finish(statuses.data(), statuses.size());
  return done;
}

// ------------------------------------------------------------------ TransferQueue

bool TransferQueue::submit(const std::shared_ptr<Transfer>& transfer) {
  // taken first (the lock order is mpi_, mutex_); a short sleeping wait lets a preempted holder finish (p2p.h)
  std::unique_lock<std::timed_mutex> mpi(mpi_, std::defer_lock);
  if (!mpi.try_lock()) (void)mpi.try_lock_for(std::chrono::microseconds(kSubmitLockWaitUs));
  bool was_idle = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) {
      throw std::runtime_error("cannot start the " + transfer->what + ": hybridpipe's communication thread has stopped" +
                               (stopped_because_.empty() ? std::string() : " (" + stopped_because_ + ")"));
    }
    queued_.push_back(transfer);
    was_idle = count_.fetch_add(1, std::memory_order_acq_rel) == 0;
  }
  const bool posted_here = mpi.owns_lock();
  if (posted_here) {
    progress(true);  // posts what was queued before it, then it, and tests what is in flight
    mpi.unlock();
    std::lock_guard<std::mutex> lock(mutex_);
    if (transfer->done || !was_idle) return true;  // the driver already polls what is in flight
  }
  // The driver posts it, or (posted here, still in flight) tests it in the background from now on: its idle
  // sleep ends only when it is woken.
  wake_();
  return posted_here;
}

bool TransferQueue::drive() {
  std::unique_lock<std::timed_mutex> mpi(mpi_, std::try_to_lock);
  if (!mpi.owns_lock()) return false;
  progress(true);
  return true;
}

template <class Finished>
bool TransferQueue::await(std::unique_lock<std::mutex>& lock, Finished finished, double timeout_s,
                          const WaitPolicy& policy) {
  using Clock = std::chrono::steady_clock;
  const auto now = Clock::now();
  const auto deadline = timeout_s < 0 ? Clock::time_point::max()
                                      : now + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(timeout_s));
  const double spin_us = policy.spin_us < 0 ? 50.0 : policy.spin_us;
  const auto spin_until = now + std::chrono::nanoseconds(static_cast<int64_t>(spin_us * 1000));
  const double max_sleep_us = std::max(policy.max_sleep_us, 1.0);
  double sleep_us = 2.0;
  TimerSlack slack;  // cut to 1 us while it sleeps: Linux's 50 us default would dwarf the short sleeps
  while (!finished()) {
    lock.unlock();
    drive();  // tests what is in flight here when the driver is not in MPI (else it does)
    lock.lock();
    if (finished()) return true;
    const auto at = Clock::now();
    if (at >= deadline) return false;
    if (at < spin_until) {
      lock.unlock();
      sched_yield();  // spinning: give a thread sharing this core (the peer rank, the driver) its turn
      lock.lock();
      continue;
    }
    // a completion by the driver wakes this sleep (changed_); else test again after the backoff
    slack.cut();
    const auto wake_at = std::min(deadline, at + std::chrono::nanoseconds(static_cast<int64_t>(sleep_us * 1000)));
    changed_.wait_until(lock, wake_at);
    sleep_us = std::min(sleep_us * 2, max_sleep_us);
  }
  return true;
}

bool TransferQueue::test(Transfer& transfer, bool drive_first) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (transfer.done && !transfer.error.empty()) throw MPICallError(transfer.error);
    if (transfer.done || !drive_first) return transfer.done;
  }
  drive();
  std::lock_guard<std::mutex> lock(mutex_);
  if (transfer.done && !transfer.error.empty()) throw MPICallError(transfer.error);
  return transfer.done;
}

size_t TransferQueue::wait(const std::vector<Transfer*>& transfers, bool any, double timeout_s,
                           const WaitPolicy& policy) {
  Waiting waiting(waiters_);
  std::unique_lock<std::mutex> lock(mutex_);
  size_t index = 0;
  auto finished = [&] {
    bool all = true;
    for (size_t i = 0; i < transfers.size(); ++i) {
      if (transfers[i]->done) {
        if (any || !transfers[i]->error.empty()) {
          index = i;
          return true;
        }
      } else {
        all = false;
      }
    }
    return all;
  };
  if (!await(lock, finished, timeout_s, policy)) return transfers.size();
  if (!transfers.empty() && !transfers[index]->error.empty()) throw MPICallError(transfers[index]->error);
  return index;
}

void TransferQueue::cancel(Transfer& transfer, const WaitPolicy& policy) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (transfer.done) return;
    transfer.cancel_requested = true;
  }
  Waiting waiting(waiters_);
  wake_();
  std::unique_lock<std::mutex> lock(mutex_);
  await(lock, [&] { return transfer.done; }, -1.0, policy);
}

void TransferQueue::release(const std::shared_ptr<Transfer>& transfer) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (transfer->done) return;
    transfer->released = true;
    // a receive no one waits for is withdrawn; a send still goes out (its buffer is kept)
    if (transfer->receive) wake = transfer->cancel_requested = true;
  }
  if (wake) wake_();
}

size_t TransferQueue::released_in_flight() {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t count = 0;
  for (const auto& list : {&queued_, &in_flight_}) {
    for (const auto& transfer : *list) count += transfer->released && !transfer->done;
  }
  return count;
}

TransferQueue::Counts TransferQueue::counts() {
  std::lock_guard<std::mutex> lock(mutex_);
  return counts_;
}

bool TransferQueue::progress(bool requester) {
  if (!busy()) return false;
  std::vector<std::shared_ptr<Transfer>> finished;  // dropped after the lock: may release Python objects
  bool moved = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& transfer : queued_) {
      moved = true;
      if (transfer->cancel_requested) {  // withdrawn before it was posted
        transfer->done = transfer->cancelled = true;
        finished.push_back(std::move(transfer));
        continue;
      }
      try {
        transfer->post();
        ++(requester ? counts_.posted_here : counts_.posted_by_driver);
        in_flight_.push_back(std::move(transfer));
      } catch (const std::exception& error) {
        for (MPI_Request& part : transfer->parts) {  // parts posted before the failing one
          if (transfer->receive) MPI_Cancel(&part);
          MPI_Request_free(&part);
        }
        transfer->error = error.what();
        transfer->done = true;
        finished.push_back(std::move(transfer));
      }
    }
    queued_.clear();
    for (auto& transfer : in_flight_) {
      if (transfer->cancel_requested && !transfer->cancel_sent) cancel_parts(*transfer);
      std::string error;
      int code = 0;
      if (transfer->test_parts(&error, &code)) {
        transfer->error = error;
        transfer->error_code = code;
        if (is_process_failure(code)) process_failure_.store(true, std::memory_order_release);
        ++(requester ? counts_.completed_here : counts_.completed_by_driver);
        moved = true;
        finished.push_back(std::move(transfer));
      }
    }
    in_flight_.erase(std::remove(in_flight_.begin(), in_flight_.end(), nullptr), in_flight_.end());
    count_.store(static_cast<int>(in_flight_.size()), std::memory_order_release);
  }
  if (moved) changed_.notify_all();
  return moved;
}

void TransferQueue::stop(const std::string& why) {
  // MPI may still touch the buffers of what was in flight: they are never released.
  static auto* abandoned = new std::vector<std::shared_ptr<Transfer>>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopped_ = true;
    stopped_because_ = why;
    for (auto* list : {&queued_, &in_flight_}) {
      for (auto& transfer : *list) {
        for (MPI_Request& part : transfer->parts) {
          if (part == MPI_REQUEST_NULL) continue;
          if (transfer->receive) MPI_Cancel(&part);
          MPI_Request_free(&part);  // MPI completes (or drops) it on its own
        }
        transfer->error = "hybridpipe's communication thread stopped before the " + transfer->what + " completed" +
                          (why.empty() ? std::string() : ": " + why);
        transfer->done = true;
        abandoned->push_back(std::move(transfer));
      }
      list->clear();
    }
    count_.store(0, std::memory_order_release);
  }
  changed_.notify_all();
}

void install_transfer_queue(std::shared_ptr<TransferQueue> queue) {
  std::lock_guard<std::mutex> lock(installed_mutex);
  installed = std::move(queue);
}

std::shared_ptr<TransferQueue> installed_transfer_queue() {
  std::lock_guard<std::mutex> lock(installed_mutex);
  return installed;
}

// ------------------------------------------------------------------ P2PRequest

P2PRequest::~P2PRequest() {
  if (queue_) {
    queue_->release(transfer_);
    return;
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (transfer_->done || finalized) return;
  if (transfer_->receive) {  // its buffer may be freed by the caller next: withdraw it now
    for (MPI_Request& part : transfer_->parts) {
      if (part == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&part);
      MPI_Wait(&part, MPI_STATUS_IGNORE);
    }
    return;
  }
  std::lock_guard<std::mutex> lock(orphans_mutex);  // a send: kept (with its buffer) until sent
  direct_orphans.push_back(transfer_);
}

bool P2PRequest::test() {
  if (queue_) return queue_->test(*transfer_);
  std::string error;
  transfer_->test_parts(&error);
  if (!error.empty()) throw MPICallError(error);
  return transfer_->done;
}

void P2PRequest::wait(const WaitPolicy& policy) {
  if (queue_) {
    queue_->wait({transfer_.get()}, false, -1.0, policy);
    return;
  }
  Transfer& t = *transfer_;
  if (t.done) return;
  std::vector<MPI_Status> statuses(t.parts.size());
  int rc = wait_all(static_cast<int>(t.parts.size()), t.parts.data(), statuses.data(), policy);
  if (rc != MPI_SUCCESS) {
    int code = rc;
    if (rc == MPI_ERR_IN_STATUS) {
      for (const MPI_Status& status : statuses) {
        if (status.MPI_ERROR != MPI_SUCCESS && status.MPI_ERROR != MPI_ERR_PENDING) code = status.MPI_ERROR;
      }
    }
    raise_mpi_error(code, ("MPI_Waitall (" + t.what + ")").c_str(), t.comm);
  }
  t.finish(statuses.data(), statuses.size());
}

bool P2PRequest::wait_for(double timeout_s, const WaitPolicy& policy) {
  if (queue_) return queue_->wait({transfer_.get()}, false, timeout_s, policy) == 0;
  if (transfer_->done) return true;
  return hybridpipe::wait_any({this}, policy, timeout_s) == 0;
}

void P2PRequest::cancel() {
  if (queue_) {
    queue_->cancel(*transfer_);
    return;
  }
  Transfer& t = *transfer_;
  if (t.done) return;
  for (MPI_Request& part : t.parts) {
    if (part != MPI_REQUEST_NULL) HP_MPI(MPI_Cancel, t.comm, &part);
  }
  std::vector<MPI_Status> statuses(t.parts.size());
  HP_MPI(MPI_Waitall, t.comm, static_cast<int>(t.parts.size()), t.parts.data(), statuses.data());
  t.done = true;
}

bool P2PRequest::done() {
  if (queue_) {
    try {
      return queue_->test(*transfer_, false);
    } catch (const MPICallError&) {
      return true;
    }
  }
  return transfer_->done;
}

size_t P2PRequest::received_bytes() {
  if (queue_) queue_->test(*transfer_, false);  // synchronizes with the driving thread
  return transfer_->received_bytes;
}

// ------------------------------------------------------------------ entry points

namespace {

P2PRequest* start(bool receive, void* data, size_t bytes, int peer, int tag, MPI_Comm comm,
                  std::shared_ptr<void> keep) {
  check_tag(tag, comm);
  auto transfer = std::make_shared<Transfer>();
  transfer->receive = receive;
  transfer->data = static_cast<char*>(data);
  transfer->bytes = bytes;
  transfer->peer = peer;
  transfer->tag = tag;
  transfer->comm = comm;
  transfer->what = describe(receive ? "receive" : "send", bytes, peer, tag);
  transfer->keep = std::move(keep);
  std::shared_ptr<TransferQueue> queue = installed_transfer_queue();
  if (queue) {
    // A send the communication thread posts (it held the communication lock): when it shares this thread's
    // core (a rank bound to one core, as mpirun binds them by default), the scheduler may let this thread run
    // on for its whole slice (milliseconds) before the woken communication thread gets the core, and the
    // peer waits that long for the message: give the core up once, so the send is posted now.
    if (!queue->submit(transfer) && !receive) sched_yield();
  } else {
    reap_direct_orphans();
    try {
      transfer->post();
    } catch (...) {
      for (MPI_Request& part : transfer->parts) {
        if (receive) MPI_Cancel(&part);
        MPI_Request_free(&part);
      }
      throw;
    }
  }
  return new P2PRequest(std::move(transfer), std::move(queue));
}

}  // namespace

P2PRequest* isend(const void* data, size_t bytes, int dest, int tag, MPI_Comm comm, std::shared_ptr<void> keep) {
  return start(false, const_cast<void*>(data), bytes, dest, tag, comm, std::move(keep));
}

P2PRequest* irecv(void* data, size_t bytes, int source, int tag, MPI_Comm comm, std::shared_ptr<void> keep) {
  return start(true, data, bytes, source, tag, comm, std::move(keep));
}

P2PRequest* isend_copy(const void* header, size_t header_bytes, const void* data, size_t bytes, int dest, int tag,
                       MPI_Comm comm) {
  std::shared_ptr<char> message(new char[header_bytes + bytes], std::default_delete<char[]>());
  if (header_bytes) std::memcpy(message.get(), header, header_bytes);
  if (bytes) std::memcpy(message.get() + header_bytes, data, bytes);
  char* address = message.get();
  return start(false, address, header_bytes + bytes, dest, tag, comm, std::move(message));
}

size_t wait_any(const std::vector<P2PRequest*>& requests, const WaitPolicy& policy, double timeout_s) {
  if (requests.empty()) throw std::invalid_argument("wait_any: no requests");
  TransferQueue* queue = requests[0]->queue();
  for (P2PRequest* request : requests) {
    if (request->queue() != queue) {
      throw std::invalid_argument("wait_any: " + request->what() +
                                  " was started under another communication thread than " + requests[0]->what());
    }
  }
  if (queue) {
    std::vector<Transfer*> transfers;
    for (P2PRequest* request : requests) transfers.push_back(&request->transfer());
    return queue->wait(transfers, true, timeout_s, policy);
  }
  std::vector<MPI_Request> handles;
  for (size_t i = 0; i < requests.size(); ++i) {
    Transfer& t = requests[i]->transfer();
    if (t.done) return i;
    if (t.parts.size() != 1) {
      throw std::invalid_argument("wait_any: " + t.what + " has several parts (only messages up to 1 GiB)");
    }
    handles.push_back(t.parts[0]);
  }
  int index = MPI_UNDEFINED;
  MPI_Status status;
  if (timeout_s < 0) {
    HP_MPI(wait_any, requests[0]->comm(), static_cast<int>(handles.size()), handles.data(), &index, &status, policy);
  } else {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                                 std::chrono::duration<double>(timeout_s));
    bool timed_out = false;
    HP_MPI(polite_wait, requests[0]->comm(), [&](int* flag) {
      const int rc = MPI_Testany(static_cast<int>(handles.size()), handles.data(), &index, flag, &status);
      if (rc == MPI_SUCCESS && !*flag && std::chrono::steady_clock::now() >= deadline) *flag = timed_out = true;
      return rc;
    }, policy.spin_us < 0 ? WaitPolicy{0.0, 1000.0} : policy);
    if (timed_out) return requests.size();
  }
  if (index == MPI_UNDEFINED) throw std::logic_error("wait_any: every request was inactive");
  Transfer& t = requests[index]->transfer();
  t.parts[0] = handles[index];  // MPI_REQUEST_NULL now
  t.finish(&status, 1);
  return static_cast<size_t>(index);
}

size_t orphaned_transfers() {
  reap_direct_orphans();
  size_t count = 0;
  {
    std::lock_guard<std::mutex> lock(orphans_mutex);
    count = direct_orphans.size();
  }
  if (auto queue = installed_transfer_queue()) count += queue->released_in_flight();
  return count;
}

}  // namespace hybridpipe
