// Shared vocabulary of the C++ core: dtypes, reduction ops, buffer descriptors, errors.
//
// The core never sees a torch tensor: Python reduces tensors / numpy / cupy arrays to a
// Buffer (address, element count, dtype), so the extension does not link torch and survives
// torch upgrades.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifdef __linux__
#include <sys/prctl.h>
#endif

namespace hybridpipe {

enum class DType : int { Float32 = 0, Float64 = 1, Float16 = 2, BFloat16 = 3, Int32 = 4, Int64 = 5 };
enum class ReduceOp : int { Sum = 0, Average = 1, Min = 2, Max = 3 };

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
const char* op_name(ReduceOp op);
bool is_half(DType dtype);  // float16 / bfloat16: accumulated in float32
// Whether the CUDA event `event` (a CUevent / cudaEvent_t, e.g. torch.cuda.Event.cuda_event) has completed:
// cuEventQuery of the driver, loaded at first use (libcuda.so.1), so that the core needs no CUDA at build
// time. Throws std::runtime_error when no driver can be loaded or the event reports an error.
bool cuda_event_done(uintptr_t event);

struct Buffer {
  void* data = nullptr;
  size_t count = 0;  // elements
  DType dtype = DType::Float32;
  size_t bytes() const { return count * dtype_size(dtype); }
};

// An MPI call failed: the message names the rank, the call and MPI's error string.
class MPICallError : public std::runtime_error {
 public:
  explicit MPICallError(const std::string& message, int code = 0) : std::runtime_error(message), code_(code) {}
  int code() const { return code_; }  // MPI's error code (0 when not known)

 private:
  int code_;
};

// Whether MPI error `code` says a process of the communicator failed (a fault-tolerant MPI, e.g. Open
// MPI started with --with-ft ulfm, reports a dead peer this way instead of aborting).
bool is_process_failure(int code);

// Survival of a failed peer (hp.elastic.run under a fault-tolerant MPI): while it is on, a process failure that
// MPI reports fails the engine's operations (ErrorKind RanksLost) and revokes its communicators instead of
// aborting the job, and waits that MPI cannot end (shared memory) watch for it. Process-wide: any thread's
// waits read it. Turning it on needs an MPI built with ULFM (ulfm_compiled).
void set_survive_process_failures(bool on);
bool survive_process_failures();
// After ranks of the job died (ULFM): ends this process with `code` (printing `message` on stderr) when it is still
// alive `seconds` from now. Armed at interpreter exit by the survivors: Open MPI 5's MPI_Finalize runs a PMIx fence
// over every process the job started, which at times waits for ever for the dead one (open-mpi/ompi#11404); by then
// the program has ended, its output is flushed and every survivor is past its last MPI call. A native thread that
// touches neither Python nor MPI.
void exit_if_alive_after(double seconds, const std::string& message, int code);
bool ulfm_compiled();  // the MPI this module was built with has ULFM's MPIX_Comm_revoke / MPIX_Comm_get_failed
// MPIX_Comm_revoke where the MPI has it (a no-op elsewhere): every pending and later operation on `comm` fails, on
// every rank of it.
void revoke(MPI_Comm comm);
// The ranks of `comm` that MPI knows have failed (MPIX_Comm_get_failed), ascending; empty without ULFM.
std::vector<int> failed_ranks(MPI_Comm comm);

// Raises MPICallError for a non-success return code of `call` on communicator `comm`.
void raise_mpi_error(int code, const char* call, MPI_Comm comm);

// How a thread waits for MPI requests. MPI's own MPI_Wait* spins on the core until the message
// arrives (Open MPI: 100 % of a core even with mpi_yield_when_idle). That is the lowest latency on
// an idle core, but on a busy host the spinning thread takes the core from compute threads: the
// engine thread from the backward pass, a pipeline stage waiting for activations from its
// neighbour stage's process. A polite wait tests for `spin_us` microseconds, then sleeps between
// tests, backing off from a few microseconds to `max_sleep_us`.
struct WaitPolicy {
  double spin_us = -1.0;       // < 0: MPI's own blocking wait (spins); >= 0: polite
  double max_sleep_us = 100.0;  // longest sleep between two tests in the polite wait
};

// Run between the tests of a polite wait on the thread that set it: the communication thread keeps
// the pipeline's point-to-point transfers moving while it waits for a negotiation or a collective.
// `sleeping(arg, true)` is called before each sleep of the wait and `sleeping(arg, false)` after it: the
// communication thread lets go of its communication lock (p2p.h) while it sleeps.
struct ProgressHook {
  void (*call)(void*) = nullptr;
  void* arg = nullptr;
  void (*sleeping)(void*, bool) = nullptr;
};
extern thread_local ProgressHook progress_hook;

// Tests with `test(&flag)` until it sets flag or fails: spins for policy.spin_us, then sleeps with
// an exponential backoff. While sleeping, the thread's timer slack is cut to 1 us (Linux's 50 us
// default would turn every short sleep into 60 us) and restored afterwards.
template <class Test>
int polite_wait(Test test, const WaitPolicy& policy) {
  using Clock = std::chrono::steady_clock;
  int flag = 0;
  int rc = test(&flag);
  if (rc != MPI_SUCCESS || flag) return rc;
  const auto spin_until = Clock::now() + std::chrono::nanoseconds(static_cast<int64_t>(policy.spin_us * 1000));
  double sleep_us = 2.0;
  const double max_sleep_us = std::max(policy.max_sleep_us, 1.0);
#ifdef __linux__
  int old_slack = -1;
#endif
  while (true) {
    rc = test(&flag);
    if (rc != MPI_SUCCESS || flag) break;
    if (progress_hook.call) progress_hook.call(progress_hook.arg);
    if (Clock::now() < spin_until) continue;
#ifdef __linux__
    if (old_slack < 0) {
      old_slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
      prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    }
#endif
    if (progress_hook.sleeping) progress_hook.sleeping(progress_hook.arg, true);
    std::this_thread::sleep_for(std::chrono::nanoseconds(static_cast<int64_t>(sleep_us * 1000)));
    if (progress_hook.sleeping) progress_hook.sleeping(progress_hook.arg, false);
    sleep_us = std::min(sleep_us * 2, max_sleep_us);
  }
#ifdef __linux__
  if (old_slack > 0) prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(old_slack), 0, 0, 0);
#endif
  return rc;
}

// `policy` without its sleeps: a polite policy becomes one that tests until done, so it still makes
// the same MPI calls (a blocking collective on one rank does not match a nonblocking one on
// another); MPI's own wait (spin_us < 0) stays as it is.
WaitPolicy spinning(const WaitPolicy& policy);

// MPI_Waitall under `policy`; returns MPI's return code (statuses may be MPI_STATUSES_IGNORE).
int wait_all(int count, MPI_Request* requests, MPI_Status* statuses, const WaitPolicy& policy);
// MPI_Waitany under `policy`; returns MPI's return code.
int wait_any(int count, MPI_Request* requests, int* index, MPI_Status* status, const WaitPolicy& policy);

// MPI_Allreduce under `policy`: MPI's own blocking call, or MPI_Iallreduce and a polite wait (so a
// collective made beside busy engine threads does not spin them off the core). Returns MPI's code.
int allreduce_waiting(const void* send, void* receive, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm,
                      const WaitPolicy& policy);

// HP_MPI(MPI_Isend, comm, buf, ...) calls MPI_Isend(buf, ...) and raises with its name on failure.
#define HP_MPI(fn, comm, ...)                                                      \
  do {                                                                             \
    int hp_rc_ = fn(__VA_ARGS__);                                                  \
    if (hp_rc_ != MPI_SUCCESS) ::hybridpipe::raise_mpi_error(hp_rc_, #fn, comm);   \
  } while (0)

}  // namespace hybridpipe
