// Non-blocking point-to-point transfers; see p2p.h.
#include "p2p.h"

#include <algorithm>
#include <climits>
#include <stdexcept>

#include "common.h"

namespace hybridpipe {

namespace {

std::string describe(const char* verb, size_t bytes, int peer, int tag) {
  return std::string(verb) + " of " + std::to_string(bytes) + " bytes " + (verb[0] == 's' ? "to" : "from") +
         " rank " + std::to_string(peer) + " (tag " + std::to_string(tag) + ")";
}

void check_tag(int tag, MPI_Comm comm) {
  void* upper = nullptr;
  int found = 0;
  HP_MPI(MPI_Comm_get_attr, comm, comm, MPI_TAG_UB, &upper, &found);
  const int tag_ub = found ? *static_cast<int*>(upper) : 32767;
  if (tag < 0 || tag > tag_ub) {
    throw std::invalid_argument("p2p tag " + std::to_string(tag) + " is outside 0.." + std::to_string(tag_ub) +
                                " (MPI_TAG_UB of this MPI)");
  }
}

}  // namespace

P2PRequest::~P2PRequest() {
  // A request dropped while in flight: a receive is cancelled (its buffer is about to be freed);
  // a send is released and completes on its own (the Python side keeps its buffer alive).
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (done_ || finalized) return;
  for (MPI_Request& part : parts_) {
    if (part == MPI_REQUEST_NULL) continue;
    if (is_receive_) {
      MPI_Cancel(&part);
      MPI_Wait(&part, MPI_STATUS_IGNORE);
    } else {
      MPI_Request_free(&part);
    }
  }
}

void P2PRequest::finish(const MPI_Status* statuses, size_t n) {
  received_bytes_ = 0;
  for (size_t i = 0; i < n; ++i) {
    int count = 0;
    if (statuses[i].MPI_SOURCE != MPI_PROC_NULL && statuses[i].MPI_SOURCE != MPI_ANY_SOURCE) {
      MPI_Get_count(&statuses[i], MPI_BYTE, &count);
    }
    if (count != MPI_UNDEFINED) received_bytes_ += static_cast<size_t>(count);
  }
  done_ = true;
}

bool P2PRequest::test() {
  if (done_) return true;
  int flag = 0;
  std::vector<MPI_Status> statuses(parts_.size());
  HP_MPI(MPI_Testall, comm_, static_cast<int>(parts_.size()), parts_.data(), &flag, statuses.data());
  if (flag) finish(statuses.data(), statuses.size());
  return done_;
}

void P2PRequest::wait(const WaitPolicy& policy) {
  if (done_) return;
  std::vector<MPI_Status> statuses(parts_.size());
  int rc = wait_all(static_cast<int>(parts_.size()), parts_.data(), statuses.data(), policy);
  if (rc != MPI_SUCCESS) {
    int code = rc;
    if (rc == MPI_ERR_IN_STATUS) {
      for (const MPI_Status& status : statuses) {
        if (status.MPI_ERROR != MPI_SUCCESS && status.MPI_ERROR != MPI_ERR_PENDING) code = status.MPI_ERROR;
      }
    }
    raise_mpi_error(code, ("MPI_Waitall (" + what_ + ")").c_str(), comm_);
  }
  finish(statuses.data(), statuses.size());
}

void P2PRequest::cancel() {
  if (done_) return;
  for (MPI_Request& part : parts_) {
    if (part != MPI_REQUEST_NULL) HP_MPI(MPI_Cancel, comm_, &part);
  }
  std::vector<MPI_Status> statuses(parts_.size());
  HP_MPI(MPI_Waitall, comm_, static_cast<int>(parts_.size()), parts_.data(), statuses.data());
  done_ = true;
}

namespace {

// Posts `bytes` at `data` as messages of at most kMaxPartBytes (a zero-byte message is still one),
// each with `post(cursor, part_bytes, &request)`; on failure frees the request and raises.
template <typename Post>
P2PRequest* post_parts(P2PRequest* request, char* data, size_t bytes, const char* call, Post post) {
  size_t left = bytes;
  char* cursor = data;
  do {
    const size_t part = std::min(left, P2PRequest::kMaxPartBytes);
    request->parts().push_back(MPI_REQUEST_NULL);
    const int rc = post(cursor, static_cast<int>(part), &request->parts().back());
    if (rc != MPI_SUCCESS) {
      MPI_Comm comm = request->comm();
      delete request;
      raise_mpi_error(rc, call, comm);
    }
    cursor += part;
    left -= part;
  } while (left > 0);
  return request;
}

}  // namespace

P2PRequest* isend(const void* data, size_t bytes, int dest, int tag, MPI_Comm comm) {
  check_tag(tag, comm);
  return post_parts(new P2PRequest(describe("send", bytes, dest, tag), comm),
                    static_cast<char*>(const_cast<void*>(data)), bytes, "MPI_Isend",
                    [&](char* cursor, int part, MPI_Request* out) {
                      return MPI_Isend(cursor, part, MPI_BYTE, dest, tag, comm, out);
                    });
}

P2PRequest* irecv(void* data, size_t bytes, int source, int tag, MPI_Comm comm) {
  check_tag(tag, comm);
  return post_parts(new P2PRequest(describe("receive", bytes, source, tag), comm, true), static_cast<char*>(data),
                    bytes, "MPI_Irecv", [&](char* cursor, int part, MPI_Request* out) {
                      return MPI_Irecv(cursor, part, MPI_BYTE, source, tag, comm, out);
                    });
}

size_t wait_any(const std::vector<P2PRequest*>& requests, const WaitPolicy& policy) {
  if (requests.empty()) throw std::invalid_argument("wait_any: no requests");
  std::vector<MPI_Request> handles;
  for (size_t i = 0; i < requests.size(); ++i) {
    if (requests[i]->done()) return i;
    if (requests[i]->parts().size() != 1) {
      throw std::invalid_argument("wait_any: " + requests[i]->what() + " has several parts (only messages up to 1 GiB)");
    }
    handles.push_back(requests[i]->parts()[0]);
  }
  int index = MPI_UNDEFINED;
  MPI_Status status;
  HP_MPI(wait_any, requests[0]->comm(), static_cast<int>(handles.size()), handles.data(), &index, &status, policy);
  if (index == MPI_UNDEFINED) throw std::logic_error("wait_any: every request was inactive");
  requests[index]->parts()[0] = handles[index];  // MPI_REQUEST_NULL now
  requests[index]->finish(&status, 1);
  return static_cast<size_t>(index);
}

}  // namespace hybridpipe
