// What the engine's thread is blocked on (see engine.h): past stall_check_seconds it asks the other ranks
// whether their threads are alive (health probes) and reports those that are gone; past the timeout, or
// when MPI reports a failed process, it aborts the job with that report.
#include "engine.h"

#include "engine_internal.h"

#include <unistd.h>  // _exit

#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

#include <algorithm>
#include <cstdio>

namespace hybridpipe {

using namespace engine_detail;

void Engine::block_on(const Group* group, const char* what) {
  if (group == nullptr && blocked_.probing) {  // a round in flight: its answers are ignored
    blocked_.probing = false;
  }
  blocked_.group = group;
  blocked_.what = what;
  blocked_.since = Clock::now();
  blocked_.warned = blocked_.aborting = false;
}

void Engine::start_probes() {
  if (health_ != MPI_COMM_NULL) {
    MPI_Irecv(answer_message_, 2, MPI_DOUBLE, MPI_ANY_SOURCE, kAnswerTag, health_, &answer_request_);
  }
}

void Engine::stop_probes() {
  if (answer_request_ != MPI_REQUEST_NULL) {
    MPI_Cancel(&answer_request_);
    MPI_Request_free(&answer_request_);
  }
  for (MPI_Request& request : sent_answer_requests_) {
    if (request != MPI_REQUEST_NULL) MPI_Request_free(&request);  // the buffers are leaked with them below
  }
  for (auto& buffer : sent_answers_) buffer.release();
}

void Engine::service() {
  if (transfers_) {
    transfers_->progress();
    if (transfers_->saw_process_failure()) report_process_failure("a point-to-point transfer");
  }
  answer_probes();
  check_blocked();
}

double Engine::abort_after_seconds() const {
  double limit = options_.timeout_seconds > 0 ? options_.timeout_seconds : 0;
  if (options_.stall_shutdown_seconds > 0 && (limit == 0 || options_.stall_shutdown_seconds < limit)) {
    limit = options_.stall_shutdown_seconds;
  }
  return limit;
}

void Engine::answer_probes() {
  if (health_ == MPI_COMM_NULL) return;
  for (size_t i = 0; i < sent_answer_requests_.size();) {  // answers sent earlier: done?
    int flag = 0;
    if (MPI_Test(&sent_answer_requests_[i], &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag) {
      sent_answer_requests_.erase(sent_answer_requests_.begin() + static_cast<long>(i));
      sent_answers_.erase(sent_answers_.begin() + static_cast<long>(i));
    } else {
      ++i;
    }
  }
  while (true) {
    int flag = 0;
    MPI_Status status;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kProbeTag, health_, &flag, &status) != MPI_SUCCESS || !flag) break;
    int64_t probe[2];
    if (MPI_Recv(probe, 2, MPI_INT64_T, status.MPI_SOURCE, kProbeTag, health_, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
    auto answer = std::make_unique<double[]>(2);
    answer[0] = static_cast<double>(probe[0]);
    answer[1] = blocked_.group ? std::chrono::duration<double>(Clock::now() - blocked_.since).count() : 0.0;
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Isend(answer.get(), 2, MPI_DOUBLE, status.MPI_SOURCE, kAnswerTag, health_, &request) == MPI_SUCCESS) {
      sent_answers_.push_back(std::move(answer));
      sent_answer_requests_.push_back(request);
    }
  }
}

void Engine::check_blocked() {
  if (health_ != MPI_COMM_NULL && answer_request_ != MPI_REQUEST_NULL) {  // answers to my probes
    while (true) {
      int flag = 0;
      MPI_Status status;
      if (MPI_Test(&answer_request_, &flag, &status) != MPI_SUCCESS || !flag) break;
      if (blocked_.probing && static_cast<int64_t>(answer_message_[0]) == probe_round_) {
        for (size_t i = 0; i < blocked_.asked.size(); ++i) {
          if (blocked_.asked[i] == status.MPI_SOURCE) blocked_.answer[i] = answer_message_[1];
        }
      }
      MPI_Irecv(answer_message_, 2, MPI_DOUBLE, MPI_ANY_SOURCE, kAnswerTag, health_, &answer_request_);
    }
  }
  if (blocked_.group == nullptr) return;
  const auto now = Clock::now();
  if (blocked_.probing) {
    const bool all = std::all_of(blocked_.answer.begin(), blocked_.answer.end(), [](double a) { return a >= 0; });
    if (all || std::chrono::duration<double>(now - blocked_.probe_sent).count() > kProbeGraceSeconds) {
      finish_probe_round();
    }
    return;
  }
  const double waited = std::chrono::duration<double>(now - blocked_.since).count();
  const double limit = abort_after_seconds();
  const bool expired = limit > 0 && waited > limit;
  if (!expired && (blocked_.warned || waited <= options_.stall_check_seconds)) return;
  // ask every other rank whether its communication thread is alive: the rank this one waits for may
  // itself be waiting for a third one (a chain), and the report should name the one that is gone
  int me = -1;
  MPI_Comm_rank(groups_[0]->comm, &me);
  blocked_.asked.clear();
  for (int r = 0; r < static_cast<int>(hosts_.size()); ++r) {
    if (r != me) blocked_.asked.push_back(r);
  }
  blocked_.answer.assign(blocked_.asked.size(), -1.0);
  blocked_.probing = true;
  blocked_.aborting = expired;
  blocked_.probe_sent = now;
  probe_message_[0] = ++probe_round_;
  for (int rank : blocked_.asked) {
    MPI_Request request = MPI_REQUEST_NULL;
    if (health_ != MPI_COMM_NULL &&
        MPI_Isend(probe_message_, 2, MPI_INT64_T, rank, kProbeTag, health_, &request) == MPI_SUCCESS) {
      MPI_Request_free(&request);  // a small message; a peer that never takes it costs nothing
    }
  }
  if (blocked_.asked.empty()) finish_probe_round();
}

std::string Engine::describe_ranks(const std::vector<int>& ranks, const std::vector<double>* waits) const {
  constexpr size_t kListed = 16;  // a job of thousands of ranks gets a readable line
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i == kListed) {
      text += " and " + std::to_string(ranks.size() - kListed) + " more";
      break;
    }
    const int rank = ranks[i];
    text += (text.empty() ? "" : ", ") + std::to_string(rank) + " (host " +
            (rank >= 0 && rank < static_cast<int>(hosts_.size()) ? hosts_[rank] : std::string("?"));
    if (waits) {
      char waited[64];
      std::snprintf(waited, sizeof waited, ", blocked %.1f s", (*waits)[i]);
      text += waited;
    }
    text += ")";
  }
  return text;
}

void Engine::finish_probe_round() {
  blocked_.probing = false;
  const Group& group = *blocked_.group;
  const double waited = std::chrono::duration<double>(Clock::now() - blocked_.since).count();
  std::vector<int> missing, present;
  std::vector<double> present_waits;
  for (size_t i = 0; i < blocked_.asked.size(); ++i) {
    if (blocked_.answer[i] < 0) {
      missing.push_back(blocked_.asked[i]);
    } else {
      present.push_back(blocked_.asked[i]);
      present_waits.push_back(blocked_.answer[i]);
    }
  }
  int me = -1;
  MPI_Comm_rank(groups_[0]->comm, &me);
  std::string ranks;
  for (int member : group.members) ranks += (ranks.empty() ? "" : ", ") + std::to_string(member);
  char head[512];
  std::snprintf(head, sizeof head,
                "hybridpipe %s: rank %d (host %s): the communication thread has waited %.1f s for the other ranks of "
                "group '%s' (ranks [%s]) to %s; ",
                blocked_.aborting ? "ERROR" : "WARNING", me,
                me >= 0 && me < static_cast<int>(hosts_.size()) ? hosts_[me].c_str() : "?", waited,
                group.label.c_str(), ranks.empty() ? "all" : ranks.c_str(), blocked_.what);
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
  if (blocked_.aborting) abort_job(message + ": aborting the job");
  blocked_.warned = true;
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
}

void Engine::report_process_failure(const std::string& what) {
  std::vector<int> failed;
#if defined(OMPI_HAVE_MPI_EXT_FTMPI) && OMPI_HAVE_MPI_EXT_FTMPI
  if (health_ != MPI_COMM_NULL) {
    MPI_Group failed_group = MPI_GROUP_NULL, all = MPI_GROUP_NULL;
    if (MPIX_Comm_get_failed(health_, &failed_group) == MPI_SUCCESS && failed_group != MPI_GROUP_NULL) {
      int count = 0;
      MPI_Group_size(failed_group, &count);
      std::vector<int> ranks(static_cast<size_t>(count));
      for (int i = 0; i < count; ++i) ranks[static_cast<size_t>(i)] = i;
      failed.resize(static_cast<size_t>(count));
      MPI_Comm_group(health_, &all);
      MPI_Group_translate_ranks(failed_group, count, ranks.data(), all, failed.data());
      MPI_Group_free(&all);
      MPI_Group_free(&failed_group);
      std::sort(failed.begin(), failed.end());
    }
  }
#endif
  int me = -1;
  MPI_Comm_rank(groups_[0]->comm, &me);
  std::string message = "hybridpipe ERROR: rank " + std::to_string(me) + " (host " +
                        (me >= 0 && me < static_cast<int>(hosts_.size()) ? hosts_[me] : std::string("?")) + "): ";
  if (failed.empty()) {
    message += "a process of the job failed (MPI does not say which)";
  } else {
    message += std::string(failed.size() == 1 ? "rank " : "ranks ") + describe_ranks(failed, nullptr) +
               (failed.size() == 1 ? " is" : " are") + " gone (the process died: killed, crashed or out of memory)";
  }
  abort_job(message + "; MPI reported it in " + what + ": aborting the job");
}

void Engine::abort_job(const std::string& message) {
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
  MPI_Abort(groups_[0]->comm, 1);
  _exit(1);
}

}  // namespace hybridpipe
