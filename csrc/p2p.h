// Non-blocking point-to-point transfers of raw byte buffers: the pipeline's activations and
// gradients. A buffer address may be host memory or, with a CUDA-aware MPI, device memory; the
// core only sees (address, bytes).
//
// Who makes the MPI calls: while a TransferQueue is installed (hp.init installs the engine's), every MPI
// call of a transfer is made under the queue's communication lock (mpi_lock()), the lock the engine's
// communication thread holds while it makes its own calls (engine.h says why one thread at a time). The
// requesting thread takes it only with a try-lock or a short timed wait: when it is free it posts the
// transfer itself, and a waiting thread tests its transfers itself; when the communication thread holds it,
// the transfer is queued and that thread posts and tests it (between the tests of its own waits and between
// cycles). Under the lock only non-blocking calls are made (post, test, cancel), so no thread ever waits on
// MPI while holding it. A submitting thread waits up to kSubmitLockWaitUs for it before it queues: the
// communication thread runs niced, and where it shares the submitter's core it is preempted inside its
// short hold whenever the compute thread wakes; queued behind it, a send would leave only when the compute
// thread next sleeps (measured: 12 of 30 sends of a 2-rank hop test queued, some 5 ms late). The timed wait
// sleeps, so the holder gets the core back and lets go. With no queue installed (the
// transport used on its own, without hp.init), the calling thread makes the calls itself.
//
// Buffers: a transfer holds `keep` (e.g. the Python object owning the memory) until MPI is done with
// it, so a request dropped while in flight never lets MPI read or write freed memory.
#pragma once

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"

namespace hybridpipe {

// One logical send or receive. Messages above kMaxPartBytes travel as several MPI messages of the
// same tag (MPI keeps their order), because MPI counts are int.
struct Transfer {
  static constexpr size_t kMaxPartBytes = size_t(1) << 30;

  bool receive = false;
  char* data = nullptr;
  size_t bytes = 0;
  int peer = 0, tag = 0;
  MPI_Comm comm = MPI_COMM_NULL;
  std::string what;            // "send of N bytes to rank R (tag T)"
  std::shared_ptr<void> keep;  // owns the buffer until the transfer is done
  std::vector<MPI_Request> parts;  // the thread that posted them owns them
  // outcome (guarded by the queue's mutex while queued)
  bool posted = false, done = false, cancel_requested = false, cancel_sent = false, cancelled = false;
  bool released = false;  // its P2PRequest is gone (no one will wait for it)
  size_t received_bytes = 0;
  std::string error;  // set with done when it failed
  int error_code = 0;

  // The calling thread's MPI calls (no queue): post, test, record the outcome.
  void post();  // throws MPICallError (parts posted before the failure are left to the caller)
  bool test_parts(std::string* error_out, int* code_out = nullptr);  // MPI_Testall; true when done
  void finish(const MPI_Status* statuses, size_t n);
};

// Transfers handed to one driving thread (the engine's communication thread).
class TransferQueue {
 public:
  // `wake` is called (without the queue's lock) after a submission or a cancel, to wake the driver.
  explicit TransferQueue(std::function<void()> wake) : wake_(std::move(wake)) {}

  // Requesting threads.
  // Queues `transfer` (throws if the driver has stopped) and, when the communication lock is free, posts
  // it (with anything queued before it, in order: MPI's message order is the order of the calls) and
  // tests what is in flight; returns false when the lock was taken (the driver posts it).
  bool submit(const std::shared_ptr<Transfer>& transfer);
  // Done? (throws its error). With `drive`, tests what is in flight first when the lock is free.
  bool test(Transfer& transfer, bool drive = true);
  // Blocks until all (any=false) or one (any=true) of `transfers` is done; returns the index of a
  // done one (any) or 0. Throws the error of a failed one. With timeout_s >= 0 it returns
  // transfers.size() when that many seconds passed first. The waiting thread tests the transfers in
  // flight itself whenever the communication lock is free: for policy.spin_us, then between sleeps
  // that back off to policy.max_sleep_us (it is woken early when the driver completes one).
  size_t wait(const std::vector<Transfer*>& transfers, bool any, double timeout_s = -1.0,
              const WaitPolicy& policy = {});
  void cancel(Transfer& transfer, const WaitPolicy& policy = {});  // blocks until withdrawn or done
  void release(const std::shared_ptr<Transfer>& transfer);     // its requester dropped it
  size_t released_in_flight();                                 // dropped ones MPI still holds

  // The communication lock: held by whichever thread makes MPI calls for this queue's owner. The driver
  // takes it blocking (the others hold it only for non-blocking calls); requesting threads only try it.
  std::timed_mutex& mpi_lock() { return mpi_; }
  // How long submit() waits for the communication lock before it queues the transfer (see the top).
  static constexpr int kSubmitLockWaitUs = 200;

  // The driving thread (or a requesting thread that holds the communication lock).
  // Posts queued transfers and tests the ones in flight; true if something was posted or finished.
  // `requester`: a requesting thread calls it (counted apart in counts()).
  bool progress(bool requester = false);
  // Transfers posted and completed by requesting threads and by the driver, since the queue was made.
  struct Counts {
    uint64_t posted_here = 0, posted_by_driver = 0, completed_here = 0, completed_by_driver = 0;
  };
  Counts counts();
  bool busy() const { return count_.load(std::memory_order_acquire) > 0; }  // queued or in flight
  // Whether a thread waits for a transfer now (it tests them itself while the lock is free).
  bool wanted() const { return waiters_.load(std::memory_order_acquire) > 0; }
  // Whether a transfer failed because its peer's process failed (the driver reports the lost ranks).
  bool saw_process_failure() const { return process_failure_.load(std::memory_order_acquire); }
  // The driver stops: what is left fails with `why` (receives are cancelled, sends freed). The caller
  // holds the communication lock.
  void stop(const std::string& why);

 private:
  bool drive();  // try-locks the communication lock and runs progress(); false when it was taken
  // Waits until `finished()` (called under mutex_) holds, driving meanwhile; false at the deadline.
  template <class Finished>
  bool await(std::unique_lock<std::mutex>& lock, Finished finished, double timeout_s, const WaitPolicy& policy);

  std::timed_mutex mpi_;  // the communication lock (taken before mutex_, never the other way round)
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::shared_ptr<Transfer>> queued_, in_flight_;
  std::atomic<int> count_{0};
  std::atomic<int> waiters_{0};            // threads blocked in wait() / cancel()
  std::atomic<bool> process_failure_{false};
  Counts counts_;  // guarded by mutex_
  bool stopped_ = false;
  std::string stopped_because_;
  std::function<void()> wake_;
};

// The queue new requests go to; nullptr (the default): the calling thread makes the MPI calls.
void install_transfer_queue(std::shared_ptr<TransferQueue> queue);
std::shared_ptr<TransferQueue> installed_transfer_queue();

// A transfer as its requester sees it (what Python holds).
class P2PRequest {
 public:
  P2PRequest(std::shared_ptr<Transfer> transfer, std::shared_ptr<TransferQueue> queue)
      : transfer_(std::move(transfer)), queue_(std::move(queue)) {}
  P2PRequest(const P2PRequest&) = delete;
  P2PRequest& operator=(const P2PRequest&) = delete;
  ~P2PRequest();

  bool test();                               // true once every part completed
  void wait(const WaitPolicy& policy = {});  // blocks until every part completed
  // Blocks until done or timeout_s seconds passed (false then); the fast first wait of a hop.
  bool wait_for(double timeout_s, const WaitPolicy& policy = {});
  void cancel();                             // cancels a receive that has not matched (no-op once done)
  bool done();
  size_t received_bytes();                   // a receive, once done
  const std::string& what() const { return transfer_->what; }
  MPI_Comm comm() const { return transfer_->comm; }
  Transfer& transfer() { return *transfer_; }
  TransferQueue* queue() const { return queue_.get(); }

 private:
  std::shared_ptr<Transfer> transfer_;
  std::shared_ptr<TransferQueue> queue_;  // null: this thread makes the MPI calls
};

// Starts sending `bytes` bytes at `data` to rank `dest` of `comm` with `tag`; `keep` owns the buffer.
P2PRequest* isend(const void* data, size_t bytes, int dest, int tag, MPI_Comm comm, std::shared_ptr<void> keep = {});
// Starts sending one message: `header_bytes` bytes at `header` followed by `bytes` bytes at `data`, both
// copied first (the caller may change them at once). A hop's description and its small tensor thus travel as
// one MPI message instead of two.
P2PRequest* isend_copy(const void* header, size_t header_bytes, const void* data, size_t bytes, int dest, int tag,
                       MPI_Comm comm);
// Starts receiving at most `bytes` bytes into `data` from rank `source` of `comm` with `tag`.
// A message larger than 1 GiB must be received with the exact size it was sent with.
P2PRequest* irecv(void* data, size_t bytes, int source, int tag, MPI_Comm comm, std::shared_ptr<void> keep = {});
// Blocks until one of `requests` (not yet done) completes; returns its index, or requests.size() when
// timeout_s >= 0 seconds passed first (the caller bounds its waits: stall warnings, timeouts).
size_t wait_any(const std::vector<P2PRequest*>& requests, const WaitPolicy& policy = {}, double timeout_s = -1.0);
// Dropped requests whose buffers MPI may still use (they are kept until it is done).
size_t orphaned_transfers();

}  // namespace hybridpipe
