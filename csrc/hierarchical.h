// Hierarchical allreduce for a communicator whose ranks span several hosts, with more than one rank
// on some host.
//
// A flat ring over such a communicator sends 2 (n - 1) / n of the buffer out of a host through the one
// rank whose ring neighbour lives on the next host; the host's other ranks only talk inside it. Here:
//   1. inside each host the ranks reduce the buffer (the shared-memory segment, shm_allreduce.h);
//   2. the buffer is cut into P pieces, P = the largest number of ranks on one host. On a host with k
//      ranks, local rank l carries the pieces p with p mod k == l: for each piece, the ranks that carry
//      it (one per host) allreduce it over their own communicator (ring or MPI library), so all of a
//      host's ranks use the link at once and each host sends about 2 (H - 1) / H of the buffer in all;
//   3. inside each host every piece is broadcast from the rank that carried it.
// Sum, Min and Max are reduced as they go; Average sums and divides once by the communicator's size at
// the end (integers as the flat ring does). float16 / bfloat16 are rounded after the host step and
// again after the hosts' step (the flat ring rounds once).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "ring_allreduce.h"

namespace hybridpipe {

class Hierarchy {
 public:
  // Collective over `comm`: learns the hosts' layout and makes the host and piece communicators.
  explicit Hierarchy(MPI_Comm comm);
  ~Hierarchy();
  Hierarchy(const Hierarchy&) = delete;
  Hierarchy& operator=(const Hierarchy&) = delete;

  int hosts() const { return hosts_; }
  int pieces() const { return pieces_; }                  // the most ranks on one host
  bool spans_hosts() const { return hosts_ > 1; }
  // Whether it beats the flat ring: several hosts, more than one rank on some host.
  bool useful() const { return hosts_ > 1 && pieces_ > 1; }
  std::vector<int> ranks_per_host() const { return ranks_per_host_; }  // in order of each host's lowest rank
  uint64_t calls() const { return calls_; }  // allreduces it ran

  // Reduces `input` into `output` (may alias) over the communicator; every rank calls it alike.
  void allreduce(const Buffer& input, const Buffer& output, ReduceOp op, const AllreduceOptions& options,
                 Workspace& workspace);

 private:
  MPI_Comm comm_;
  int size_ = 1;
  MPI_Comm local_ = MPI_COMM_NULL;  // the ranks of this host
  int local_rank_ = 0, local_size_ = 1;
  int hosts_ = 1, pieces_ = 1;
  std::vector<int> ranks_per_host_;
  std::vector<MPI_Comm> piece_comms_;  // [p]: the carriers of piece p, if this rank carries it
  uint64_t calls_ = 0;
};

// The hierarchy of `comm`, made on first use (collective: every rank of `comm` must reach it at the
// same point) and cached on the communicator as an MPI attribute, released with MPI_Comm_free.
Hierarchy* hierarchy_for(MPI_Comm comm);

}  // namespace hybridpipe
