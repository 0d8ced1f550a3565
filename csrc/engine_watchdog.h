// What the communication thread is blocked on (see engine.h): past stall_check_seconds it asks the group's other
// ranks (a probe on a private duplicate of group 0) whether their threads are alive, and names those that did not
// answer; past the timeout, or when MPI reports a failed process, it aborts the job with that report. The probes
// are the communication thread's own; every rank's host name (gathered when group 0 was added) any thread reads.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine_guard.h"
#include "engine_options.h"

namespace hybridpipe {

class Group;

class Watchdog {
 public:
  Watchdog(const EngineOptions& options, const CommThread& thread) : options_(options), probes_(thread) {}
  // Group 0 was added (collective over it): a communicator for probes, every rank's host name.
  void open(MPI_Comm coordinator);
  void close();  // after the thread ended
  std::vector<std::string> hosts() const;

  // The communication thread. `group` nullptr: not blocked any more.
  void block_on(const Group* group, const char* what = "");
  // The receive of answers to this rank's probes (posted when the thread starts), and its end with the answers
  // still in flight (when it stops).
  void start_probes();
  void stop_probes();
  // Inside any wait of the thread: answer other ranks' probes; check what this one waits for.
  void answer_probes();
  void check_blocked();
  double abort_after_seconds() const;  // 0: never
  [[noreturn]] void abort_job(const std::string& message);  // prints it, then MPI_Abort (or _exit)
  // A fault-tolerant MPI reported a failed process (`what`: the failing call): names the failed ranks and their
  // hosts (MPIX_Comm_get_failed where the MPI has it) and aborts the job; while the process survives failures
  // (survive_process_failures()) it records them instead (lost_ranks) and returns the report.
  std::string report_process_failure(const std::string& what);
  // While surviving failures: whether MPI knows of a failed rank of group 0 now (asked at most every 10 ms).
  bool failure_known();
  // Ranks of group 0 reported lost (ascending; empty while none is), from any thread.
  std::vector<int> lost_ranks() const;
  // Revokes the probes' communicator (after a failure: a peer's probe waits end).
  void revoke_probes();

 private:
  struct Blocked {
    const Group* group = nullptr;
    const char* what = "";  // "negotiate", "finish an allreduce"
    std::chrono::steady_clock::time_point since;
    bool warned = false;
    bool probing = false;
    bool aborting = false;  // the round in flight ends in an abort
    std::chrono::steady_clock::time_point probe_sent;
    std::vector<int> asked;      // ranks of group 0
    std::vector<double> answer;  // per asked rank: seconds its thread had been waiting, or -1 (no answer)
  };
  struct Probes {
    MPI_Comm health = MPI_COMM_NULL;       // a private duplicate of group 0
    MPI_Comm coordinator = MPI_COMM_NULL;  // group 0's communicator (to abort the job)
    int me = -1;                           // this rank in group 0
    Blocked blocked;
    int64_t round = 0;
    int64_t message[2] = {0, 0};                    // (round, 0): what a probe carries
    MPI_Request answer_request = MPI_REQUEST_NULL;  // the receive of the next answer
    double answer_message[2] = {0, 0};              // (round, seconds the answerer waited)
    std::vector<std::unique_ptr<double[]>> sent_answers;  // buffers of answers in flight
    std::vector<MPI_Request> sent_answer_requests;
    std::chrono::steady_clock::time_point last_failure_check{};  // failure_known's last question to MPI
  };
  void finish_probe_round(Probes& probes);
  std::string describe_ranks(const std::vector<int>& ranks, const std::vector<double>* waits) const;
  std::string host_of(int rank) const;

  const EngineOptions& options_;
  CommThreadOnly<Probes> probes_;
  Guarded<std::vector<int>> lost_;               // ranks of group 0 reported lost while surviving failures
  Guarded<std::vector<std::string>> hosts_;  // MPI_Get_processor_name of every rank of group 0, in its order
};

}  // namespace hybridpipe
