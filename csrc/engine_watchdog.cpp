// What the engine's thread is blocked on (see engine_watchdog.h): health probes, stall reports, aborts.
#include "engine_watchdog.h"

#include <unistd.h>  // _exit

#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

#include <algorithm>
#include <cstdio>
#include <thread>

#include "common.h"
#include "engine_group.h"
#include "engine_internal.h"

namespace hybridpipe {

using namespace engine_detail;

void Watchdog::open(MPI_Comm coordinator) {
  Probes& probes = probes_.get();
  HP_MPI(MPI_Comm_dup, coordinator, coordinator, &probes.health);
  MPI_Comm_set_errhandler(probes.health, MPI_ERRORS_RETURN);
  probes.coordinator = coordinator;
  MPI_Comm_rank(coordinator, &probes.me);
  int size = 1;
  MPI_Comm_size(coordinator, &size);
  char name[MPI_MAX_PROCESSOR_NAME + 1] = {0};
  int length = 0;
  MPI_Get_processor_name(name, &length);
  std::vector<char> names(static_cast<size_t>(size) * (MPI_MAX_PROCESSOR_NAME + 1));
  HP_MPI(MPI_Allgather, probes.health, name, MPI_MAX_PROCESSOR_NAME + 1, MPI_CHAR, names.data(),
         MPI_MAX_PROCESSOR_NAME + 1, MPI_CHAR, probes.health);
  hosts_.with([&](std::vector<std::string>& hosts) {
    for (int r = 0; r < size; ++r) hosts.emplace_back(names.data() + static_cast<size_t>(r) * (MPI_MAX_PROCESSOR_NAME + 1));
  });
}

void Watchdog::close() {
  Probes& probes = probes_.get();
  if (probes.health != MPI_COMM_NULL) MPI_Comm_free(&probes.health);
}

std::vector<std::string> Watchdog::hosts() const {
  return hosts_.with([](const std::vector<std::string>& hosts) { return hosts; });
}

std::string Watchdog::host_of(int rank) const {
  return hosts_.with([&](const std::vector<std::string>& hosts) {
    return rank >= 0 && rank < static_cast<int>(hosts.size()) ? hosts[static_cast<size_t>(rank)] : std::string("?");
  });
}

void Watchdog::block_on(const Group* group, const char* what) {
  Blocked& blocked = probes_->blocked;
  if (group == nullptr && blocked.probing) {  // a round in flight: its answers are ignored
    blocked.probing = false;
  }
  blocked.group = group;
  blocked.what = what;
  blocked.since = Clock::now();
  blocked.warned = blocked.aborting = false;
}

void Watchdog::start_probes() {
  Probes& probes = probes_.get();
  if (probes.health != MPI_COMM_NULL) {
    MPI_Irecv(probes.answer_message, 2, MPI_DOUBLE, MPI_ANY_SOURCE, kAnswerTag, probes.health, &probes.answer_request);
  }
}

void Watchdog::stop_probes() {
  Probes& probes = probes_.get();
  if (probes.answer_request != MPI_REQUEST_NULL) {
    MPI_Cancel(&probes.answer_request);
    MPI_Request_free(&probes.answer_request);
  }
  for (MPI_Request& request : probes.sent_answer_requests) {
    if (request != MPI_REQUEST_NULL) MPI_Request_free(&request);  // the buffers are leaked with them below
  }
  for (auto& buffer : probes.sent_answers) buffer.release();
}

double Watchdog::abort_after_seconds() const {
  double limit = options_.timeout_seconds > 0 ? options_.timeout_seconds : 0;
  if (options_.stall_shutdown_seconds > 0 && (limit == 0 || options_.stall_shutdown_seconds < limit)) {
    limit = options_.stall_shutdown_seconds;
  }
  return limit;
}

void Watchdog::answer_probes() {
  Probes& probes = probes_.get();
  if (probes.health == MPI_COMM_NULL) return;
  for (size_t i = 0; i < probes.sent_answer_requests.size();) {  // answers sent earlier: done?
    int flag = 0;
    if (MPI_Test(&probes.sent_answer_requests[i], &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag) {
      probes.sent_answer_requests.erase(probes.sent_answer_requests.begin() + static_cast<long>(i));
      probes.sent_answers.erase(probes.sent_answers.begin() + static_cast<long>(i));
    } else {
      ++i;
    }
  }
  while (true) {
    int flag = 0;
    MPI_Status status;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kProbeTag, probes.health, &flag, &status) != MPI_SUCCESS || !flag) break;
    int64_t probe[2];
    if (MPI_Recv(probe, 2, MPI_INT64_T, status.MPI_SOURCE, kProbeTag, probes.health, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
      break;
    }
    auto answer = std::make_unique<double[]>(2);
    answer[0] = static_cast<double>(probe[0]);
    answer[1] = probes.blocked.group ? std::chrono::duration<double>(Clock::now() - probes.blocked.since).count() : 0.0;
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Isend(answer.get(), 2, MPI_DOUBLE, status.MPI_SOURCE, kAnswerTag, probes.health, &request) == MPI_SUCCESS) {
      probes.sent_answers.push_back(std::move(answer));
      probes.sent_answer_requests.push_back(request);
    }
  }
}

void Watchdog::check_blocked() {
  Probes& probes = probes_.get();
  Blocked& blocked = probes.blocked;
  if (probes.health != MPI_COMM_NULL && probes.answer_request != MPI_REQUEST_NULL) {  // answers to my probes
    while (true) {
      int flag = 0;
      MPI_Status status;
      if (MPI_Test(&probes.answer_request, &flag, &status) != MPI_SUCCESS || !flag) break;
      if (blocked.probing && static_cast<int64_t>(probes.answer_message[0]) == probes.round) {
        for (size_t i = 0; i < blocked.asked.size(); ++i) {
          if (blocked.asked[i] == status.MPI_SOURCE) blocked.answer[i] = probes.answer_message[1];
        }
      }
      MPI_Irecv(probes.answer_message, 2, MPI_DOUBLE, MPI_ANY_SOURCE, kAnswerTag, probes.health, &probes.answer_request);
    }
  }
  if (blocked.group == nullptr) return;
  const auto now = Clock::now();
  if (blocked.probing) {
    const bool all = std::all_of(blocked.answer.begin(), blocked.answer.end(), [](double a) { return a >= 0; });
    if (all || std::chrono::duration<double>(now - blocked.probe_sent).count() > kProbeGraceSeconds) {
      finish_probe_round(probes);
    }
    return;
  }
  const double waited = std::chrono::duration<double>(now - blocked.since).count();
  const double limit = abort_after_seconds();
  const bool expired = limit > 0 && waited > limit;
  if (!expired && (blocked.warned || waited <= options_.stall_check_seconds)) return;
  // ask every other rank whether its communication thread is alive: the rank this one waits for may
  // itself be waiting for a third one (a chain), and the report should name the one that is gone
  const int ranks = hosts_.with([](const std::vector<std::string>& hosts) { return static_cast<int>(hosts.size()); });
  blocked.asked.clear();
  for (int r = 0; r < ranks; ++r) {
    if (r != probes.me) blocked.asked.push_back(r);
  }
  blocked.answer.assign(blocked.asked.size(), -1.0);
  blocked.probing = true;
  blocked.aborting = expired;
  blocked.probe_sent = now;
  probes.message[0] = ++probes.round;
  for (int rank : blocked.asked) {
    MPI_Request request = MPI_REQUEST_NULL;
    if (probes.health != MPI_COMM_NULL &&
        MPI_Isend(probes.message, 2, MPI_INT64_T, rank, kProbeTag, probes.health, &request) == MPI_SUCCESS) {
      MPI_Request_free(&request);  // a small message; a peer that never takes it costs nothing
    }
  }
  if (blocked.asked.empty()) finish_probe_round(probes);
}

std::string Watchdog::describe_ranks(const std::vector<int>& ranks, const std::vector<double>* waits) const {
  constexpr size_t kListed = 16;  // a job of thousands of ranks gets a readable line
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i == kListed) {
      text += " and " + std::to_string(ranks.size() - kListed) + " more";
      break;
    }
    const int rank = ranks[i];
    text += (text.empty() ? "" : ", ") + std::to_string(rank) + " (host " + host_of(rank);
    if (waits) {
      char waited[64];
      std::snprintf(waited, sizeof waited, ", blocked %.1f s", (*waits)[i]);
      text += waited;
    }
    text += ")";
  }
  return text;
}

void Watchdog::finish_probe_round(Probes& probes) {
  Blocked& blocked = probes.blocked;
  blocked.probing = false;
  const Group& group = *blocked.group;
  const double waited = std::chrono::duration<double>(Clock::now() - blocked.since).count();
  std::vector<int> missing, present;
  std::vector<double> present_waits;
  for (size_t i = 0; i < blocked.asked.size(); ++i) {
    if (blocked.answer[i] < 0) {
      missing.push_back(blocked.asked[i]);
    } else {
      present.push_back(blocked.asked[i]);
      present_waits.push_back(blocked.answer[i]);
    }
  }
  const int me = probes.me;
  std::string ranks;
  for (int member : group.members) ranks += (ranks.empty() ? "" : ", ") + std::to_string(member);
  char head[512];
  std::snprintf(head, sizeof head,
                "hybridpipe %s: rank %d (host %s): the communication thread has waited %.1f s for the other ranks of "
                "group '%s' (ranks [%s]) to %s; ",
                blocked.aborting ? "ERROR" : "WARNING", me, host_of(me).c_str(), waited, group.label.c_str(),
                ranks.empty() ? "all" : ranks.c_str(), blocked.what);
  std::string message = head;
  if (!missing.empty()) {
    char grace[32];
    std::snprintf(grace, sizeof grace, "%g", kProbeGraceSeconds);
    message += std::string(missing.size() == 1 ? "rank " : "ranks ") + describe_ranks(missing, nullptr) +
               " did not answer within " + grace + " s: " + (missing.size() == 1 ? "it is" : "they are") +
               " stopped, dead, cut off, or stuck outside hybridpipe";
  } else {
    message += "every rank answered, so none is dead or cut off: one of them is stuck outside hybridpipe (a "
               "blocking call of its own?) or the ranks run different code";
  }
  if (!present.empty()) {
    message += std::string("; ") + (present.size() == 1 ? "rank " : "ranks ") + describe_ranks(present, &present_waits) +
               (present.size() == 1 ? " answered" : " answered");
  }
  char settings[160];
  std::snprintf(settings, sizeof settings, " (stall_check_seconds=%g, stall_shutdown_seconds=%g, timeout_seconds=%g)",
                options_.stall_check_seconds, options_.stall_shutdown_seconds, options_.timeout_seconds);
  message += settings;
  if (blocked.aborting) abort_job(message + ": aborting the job");
  blocked.warned = true;
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
}

std::string Watchdog::report_process_failure(const std::string& what) {
  Probes& probes = probes_.get();
  std::vector<int> failed = failed_ranks(probes.health);
  const int me = probes.me;
  std::string message = "hybridpipe ERROR: rank " + std::to_string(me) + " (host " + host_of(me) + "): ";
  if (failed.empty()) {
    message += "a process of the job failed (MPI does not say which)";
  } else {
    message += std::string(failed.size() == 1 ? "rank " : "ranks ") + describe_ranks(failed, nullptr) +
               (failed.size() == 1 ? " is" : " are") + " gone (the process died: killed, crashed or out of memory)";
  }
  if (!survive_process_failures()) abort_job(message + "; MPI reported it in " + what + ": aborting the job");
  lost_.with([&](std::vector<int>& lost) { lost = failed; });
  return message + "; MPI reported it in " + what;
}

bool Watchdog::failure_known() {
  if (!survive_process_failures()) return false;
  Probes& probes = probes_.get();
  const auto now = Clock::now();
  if (now - probes.last_failure_check < std::chrono::milliseconds(10)) return false;
  probes.last_failure_check = now;
  return !failed_ranks(probes.health).empty();
}

std::vector<int> Watchdog::lost_ranks() const {
  return lost_.with([](const std::vector<int>& lost) { return lost; });
}

void Watchdog::revoke_probes() { revoke(probes_->health); }

void Watchdog::abort_job(const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  // MPI_Abort asks the launcher to end every rank; a rank cut off from it may wait there forever, so
  // this process ends itself shortly after in any case.
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::seconds(5));
    std::fprintf(stderr, "hybridpipe: MPI_Abort did not end this process within 5 s; exiting\n");
    std::fflush(stderr);
    _exit(1);
  }).detach();
  MPI_Abort(probes_->coordinator, 1);
  _exit(1);
}

}  // namespace hybridpipe
