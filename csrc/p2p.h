// Non-blocking point-to-point transfers of raw byte buffers: the pipeline's activations and
// gradients. A buffer address may be host memory or, with a CUDA-aware MPI, device memory; the
// core only sees (address, bytes).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <string>
#include <vector>

#include "common.h"

namespace hybridpipe {

// One logical send or receive. Messages above kMaxPartBytes travel as several MPI messages of the
// same tag (MPI keeps their order), because MPI counts are int.
class P2PRequest {
 public:
  static constexpr size_t kMaxPartBytes = size_t(1) << 30;

  P2PRequest(std::string what, MPI_Comm comm, bool is_receive = false)
      : what_(std::move(what)), comm_(comm), is_receive_(is_receive) {}
  P2PRequest(const P2PRequest&) = delete;
  P2PRequest& operator=(const P2PRequest&) = delete;
  ~P2PRequest();

  std::vector<MPI_Request>& parts() { return parts_; }
  bool test();                    // true once every part completed
  void wait(const WaitPolicy& policy = {});  // blocks until every part completed
  void cancel();                  // cancels a receive that has not matched (no-op once done)
  bool done() const { return done_; }
  size_t received_bytes() const { return received_bytes_; }  // a receive, once done
  const std::string& what() const { return what_; }
  MPI_Comm comm() const { return comm_; }
  void finish(const MPI_Status* statuses, size_t n);  // record the outcome of completed parts

 private:
  std::string what_;
  MPI_Comm comm_;
  bool is_receive_;
  std::vector<MPI_Request> parts_;
  bool done_ = false;
  size_t received_bytes_ = 0;
};

// Starts sending `bytes` bytes at `data` to rank `dest` of `comm` with `tag`.
P2PRequest* isend(const void* data, size_t bytes, int dest, int tag, MPI_Comm comm);
// Starts receiving at most `bytes` bytes into `data` from rank `source` of `comm` with `tag`.
// A message larger than 1 GiB must be received with the exact size it was sent with.
P2PRequest* irecv(void* data, size_t bytes, int source, int tag, MPI_Comm comm);
// Blocks until one of `requests` (single-part, not yet done) completes; returns its index.
size_t wait_any(const std::vector<P2PRequest*>& requests, const WaitPolicy& policy = {});

}  // namespace hybridpipe
