// Allreduce through one shared-memory segment, for a communicator whose ranks all share one host.
//
// The ring moves every byte 2 (n - 1) / n times through MPI's shared-memory transport, which copies
// it twice (into the transport's buffer and out again), and reduces it once more: about 11 passes
// over the buffer's memory per rank at n = 8. Here each rank copies its data into its slot of a
// segment mapped by every rank of the host; rank r sums piece r of all slots in one pass into a
// result area (its own piece read straight from its input, the sum written straight to its output
// too); every rank copies the rest of the result out. About 4 passes per rank, whatever n.
//
// The buffers stream through the segment in chunks: `sets` chunk-sized slot sets are in use at once,
// so a rank that has copied its result of chunk s out may already copy chunk s + 1 in while slower
// ranks still read chunk s. Ranks synchronise on per-rank sequence counters in the segment (no MPI
// call after set-up), and a call returns as soon as this rank's outputs are final: the next call's
// chunks queue behind it. A list of buffers is one stream, so fused buckets need no fusion buffer:
// a rank packs its tensors straight into its slot and unpacks straight from the result.
//
// float16 / bfloat16 travel as they are and are summed in float32, rounded once (like the ring).
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common.h"

namespace hybridpipe {

// Whether this thread's waits on the segment's counters also probe MPI now and then (see wait_until in
// shm_allreduce.cpp; true by default). A helper thread that must make no MPI call (hierarchical.cpp's, beside
// the communication thread, which drives MPI's progress meanwhile) sets it to false.
extern thread_local bool shared_memory_probes_mpi;

// Whether every rank of `comm` is on this host (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)); collective.
bool on_one_host(MPI_Comm comm);

class SharedMemoryAllreduce {
 public:
  // Collective over `comm`. On every rank: the segment, or nullptr (with `why` set) when the ranks
  // are not all on one host, or the segment (sets * (size + 1) * chunk_bytes, /dev/shm) could not be
  // created on some rank. Rank 0 chooses the geometry; the others follow it.
  static std::unique_ptr<SharedMemoryAllreduce> create(MPI_Comm comm, size_t chunk_bytes, std::string* why);
  ~SharedMemoryAllreduce();
  SharedMemoryAllreduce(const SharedMemoryAllreduce&) = delete;
  SharedMemoryAllreduce& operator=(const SharedMemoryAllreduce&) = delete;

  // Reduces inputs[i] into outputs[i] (all one dtype; input and output may alias). Every rank of the
  // communicator must pass the same counts and dtype and op, in the same order of calls.
  void allreduce(const std::vector<Buffer>& inputs, const std::vector<Buffer>& outputs, ReduceOp op,
                 const WaitPolicy& policy);

  // Reduce-scatter: as allreduce over the inputs seen as one stream, but only elements [begin, begin +
  // output.count) of the result are written, into `output` (the other ranks keep the other parts).
  void reduce_scatter(const std::vector<Buffer>& inputs, const Buffer& output, size_t begin, ReduceOp op,
                      const WaitPolicy& policy);
  // Allgather: this rank's `input` is elements [begin, begin + input.count) of `output`; every rank
  // ends with all of `output`. The parts go through the segment's result areas, chunk by chunk.
  void allgather(const Buffer& input, size_t begin, const Buffer& output, const WaitPolicy& policy);

  size_t chunk_bytes() const { return chunk_bytes_; }
  size_t sets() const { return sets_; }
  size_t mapped_bytes() const { return mapped_; }

 private:
  SharedMemoryAllreduce() = default;
  std::atomic<uint64_t>& counter(int rank, int kind);
  unsigned char* slot(size_t set, int rank);
  unsigned char* result(size_t set);
  void wait_all_reach(int kind, uint64_t value, const WaitPolicy& policy);
  // The reduction of the inputs (one stream of `total` elements) chunk by chunk; each finished run of
  // the result goes to emit(first element, data, elements).
  using Emit = std::function<void(size_t, const unsigned char*, size_t)>;
  void reduce_stream(const std::vector<Buffer>& inputs, size_t total, ReduceOp op, const WaitPolicy& policy,
                     const Emit& emit);

  MPI_Comm comm_ = MPI_COMM_NULL;  // the communicator it serves (the segment lives as its attribute)
  int rank_ = 0, size_ = 1;
  size_t chunk_bytes_ = 0, sets_ = 0, mapped_ = 0, header_ = 0;
  unsigned char* base_ = nullptr;
  uint64_t sequence_ = 0;  // chunks this rank has started; the same on every rank between calls
};

// The segment of `comm`, created on first use (a collective call: every rank of `comm` must reach it
// at the same point) and cached on the communicator as an MPI attribute, so it is released with
// MPI_Comm_free. nullptr when shared memory cannot serve `comm` (the reason is kept: see below).
SharedMemoryAllreduce* shared_memory_for(MPI_Comm comm, size_t chunk_bytes);
// The segment shared_memory_for(comm) made, without making one; *asked: whether it was ever asked.
SharedMemoryAllreduce* cached_shared_memory(MPI_Comm comm, bool* asked);
// Why shared_memory_for(comm) gave nullptr ("" if it was never asked or succeeded).
std::string shared_memory_unavailable_reason(MPI_Comm comm);

}  // namespace hybridpipe
