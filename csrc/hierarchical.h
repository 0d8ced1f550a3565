// Hierarchical allreduce for a communicator whose ranks span several hosts, with more than one rank
// on some host.
//
// A flat ring over such a communicator sends 2 (n - 1) / n of the buffer out of a host through the one
// rank whose ring neighbour lives on the next host; the host's other ranks only talk inside it. Here:
//   1. inside each host the ranks reduce-scatter the buffer through the shared-memory segment
//      (shm_allreduce.h): each rank keeps the reduced values of its share;
//   2. the buffer is cut into P pieces, P = the largest number of ranks on one host. On a host with k
//      ranks, local rank l carries the pieces p with p * k / P == l (rounded down: a run of consecutive
//      pieces, its share): for each piece, the ranks that carry it (one per host) allreduce it over their
//      own communicator (ring or MPI library, with the caller's options: a wire dtype applies here, to
//      what crosses hosts, and nowhere else), so all of a host's ranks use the link at once and each host
//      sends about 2 (H - 1) / H of the buffer in all;
//   3. inside each host the ranks allgather their shares through the segment.
// The buffer goes through these steps in chunks (AllreduceOptions::hierarchical_chunk_bytes), as a software
// pipeline: while the calling thread (the communication thread) carries chunk c between hosts, a helper
// thread reduces chunk c + 1 inside the host and gathers chunk c - 1. The helper only touches the
// shared-memory segment and makes no MPI call (shared_memory_probes_mpi), so one thread per process still
// makes every MPI call. The first and last chunks are smaller (a ramp of halvings) so that little of the
// buffer is reduced before the first byte crosses the link or gathered after the last one arrives.
// Without a shared-memory segment (switched off, or not available) the three steps run one after the
// other over the whole buffer through MPI (the host's ring or library, then broadcasts).
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
  uint64_t pipelined_chunks() const { return pipelined_chunks_; }  // chunks that went through the pipeline

  // Reduces `input` into `output` (may alias) over the communicator; every rank calls it alike.
  void allreduce(const Buffer& input, const Buffer& output, ReduceOp op, const AllreduceOptions& options,
                 Workspace& workspace);
  // The chunks (element counts, in order) a buffer of `count` elements of `element_bytes` goes through for
  // a nominal chunk of `chunk_bytes` (0: one chunk; so is a buffer of fewer than 4 nominal chunks): a ramp of
  // halvings at each end, equal ones between.
  static std::vector<size_t> chunk_lengths(size_t count, size_t element_bytes, size_t chunk_bytes);

 private:
  int carrier(int piece) const { return static_cast<int>(static_cast<int64_t>(piece) * local_size_ / pieces_); }
  // Steps 1-3 in chunks through the shared-memory segment `shm` (nullptr: this rank is alone on its host).
  void pipelined(const Buffer& output, ReduceOp op, const AllreduceOptions& options, Workspace& workspace,
                 SharedMemoryAllreduce* shm);
  // Step 2 for this rank's pieces of elements [begin, begin + length) of `output`.
  void carry(const Buffer& output, size_t begin, size_t length, ReduceOp op, const AllreduceOptions& flat,
             Workspace& workspace);
  // Steps 1-3 one after the other over the whole buffer through MPI (no shared-memory segment).
  void in_steps(const Buffer& output, ReduceOp op, const AllreduceOptions& options, Workspace& workspace);

  MPI_Comm comm_;
  int size_ = 1;
  MPI_Comm local_ = MPI_COMM_NULL;  // the ranks of this host
  int local_rank_ = 0, local_size_ = 1;
  int hosts_ = 1, pieces_ = 1;
  std::vector<int> ranks_per_host_;
  std::vector<MPI_Comm> piece_comms_;  // [p]: the carriers of piece p, if this rank carries it
  int first_piece_ = 0, end_piece_ = 1;  // the pieces this rank carries: [first, end)
  uint64_t calls_ = 0, pipelined_chunks_ = 0;
};

// The hierarchy of `comm`, made on first use (collective: every rank of `comm` must reach it at the
// same point) and cached on the communicator as an MPI attribute, released with MPI_Comm_free.
Hierarchy* hierarchy_for(MPI_Comm comm);

}  // namespace hybridpipe
