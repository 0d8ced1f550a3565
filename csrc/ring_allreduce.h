// Allreduce over MPI point-to-point: a segmented, pipelined ring for large buffers and the MPI
// library's own MPI_Allreduce for small ones.
//
// Ring = reduce-scatter + allgather. The buffer is cut into `size` chunks, each chunk into
// segments of `segment_bytes`. A received segment is reduced while the next ones are still on
// the wire (a window of receives in flight), and forwarded to the next rank as soon as it is
// reduced, so transfer and reduction overlap and each segment is reduced while it is in cache.
// float16/bfloat16 travel as 16-bit values in every step: the reduce-scatter accumulates in a float32
// copy and rounds each partial sum to the half type to send it, each rank rounds its finished chunk
// once, and the allgather moves half values (the MPI library path: a user-defined op on the 16-bit
// values, adding in float32). A sum over n ranks carries up to n - 1 roundings.
// float32 buffers with a wire dtype (WireFormat) stay float32: the ring rounds each segment to the wire's
// half type right before it sends it (while the previous ones are on the wire) and widens what it receives
// into float32 where it accumulates, with the rules above: each partial sum rounded once to be sent, each
// finished chunk rounded once (its owner keeps the rounded values too, so that every rank ends alike).
#pragma once

#include <mutex>
#include <vector>

#include "common.h"

namespace hybridpipe {

// What float32 buffers travel as between ranks: their own dtype (dtype < 0) or Float16 / BFloat16 (a DType
// code): the ring rounds segment by segment; at or below small_message_bytes the MPI library path rounds the
// whole buffer and sums the 16-bit values in float32 as it does for half buffers. Across a communicator whose ranks share one host it is ignored (shared memory, or a ring through memory,
// gains nothing from halving the bytes and pays the conversions) unless `on_one_host`: then every
// allreduce with it runs the ring with the wire dtype, shared memory skipped, on one host too.
struct WireFormat {
  int dtype = -1;
  bool on_one_host = false;
  bool narrows(DType buffer) const { return dtype >= 0 && buffer == DType::Float32; }
  bool operator==(const WireFormat& other) const { return dtype == other.dtype && on_one_host == other.on_one_host; }
  bool operator!=(const WireFormat& other) const { return !(*this == other); }
};

struct AllreduceOptions {
  size_t segment_bytes = 256 * 1024;          // ring segment; cache-sized
  size_t receive_window = 4;                  // ring receives in flight per step
  size_t small_message_bytes = 64 * 1024;     // at or below: MPI_Allreduce instead of the ring
  // Fused (grouped / engine) allreduces: a buffer of at least this size is reduced in place on its
  // own instead of being copied into and out of the fusion buffer (the copies cost more than the
  // extra ring start). 0: every buffer below the fusion threshold is packed.
  size_t unfused_bytes = 0;
  // Communicators whose ranks all share one host reduce buffers above small_message_bytes through a
  // shared-memory segment (shm_allreduce.h) instead of the ring; chunk: the segment's unit of streaming.
  bool shared_memory = true;
  size_t shared_memory_chunk_bytes = 128 * 1024;
  WaitPolicy wait;                            // how the ring waits for its segments (default: MPI's spin)
  // Communicators spanning hosts reduce buffers above small_message_bytes hierarchically
  // (hierarchical.h): -1 (auto) when some host has more than one of their ranks, 1 whenever they span
  // hosts, 0 never (the flat ring).
  int hierarchical = -1;
  // The hierarchical allreduce streams the buffer through its steps in chunks of about this size, so that
  // the steps inside a host overlap the transfer between hosts; 0: one chunk (the steps one after another).
  size_t hierarchical_chunk_bytes = 2 << 20;
  WireFormat wire;                            // the dtype float32 buffers travel in (see WireFormat)
};

class SharedMemoryAllreduce;

// Whether a fused (grouped / engine) allreduce reduces a buffer of `bytes` alone, in place, instead of
// packing it into the fusion buffer; the open bucket of smaller buffers stays open either way. Through
// shared memory (`streamed`) packing is free (a bucket's buffers are copied straight into the segment),
// so only buffers of at least the fusion threshold go alone.
inline bool reduced_alone(size_t bytes, size_t fusion_threshold_bytes, const AllreduceOptions& options,
                          bool streamed = false) {
  if (bytes >= fusion_threshold_bytes) return true;
  return !streamed && options.unfused_bytes > 0 && bytes >= options.unfused_bytes;
}

// The shared-memory segment that fused allreduces over `comm` stream through, or nullptr (shared
// memory switched off, one rank, or ranks on several hosts: ring / library). Collective the first
// time it is asked for `comm` (see shared_memory_for).
SharedMemoryAllreduce* fused_shared_memory(MPI_Comm comm, const AllreduceOptions& options);

enum class AllreduceAlgorithm : int { Auto = 0, Ring = 1, Library = 2, SharedMemory = 3, Hierarchical = 4 };

// Scratch memory reused across calls (receive slots, float32 copies of half buffers).
class Workspace {
 public:
  void* get(size_t slot, size_t bytes);

 private:
  std::vector<std::vector<unsigned char>> slots_;
};

// Reduces `input` over `comm` into `output` (same count and dtype; may alias for in place).
// Every rank must call with the same count, dtype and op (the Python layer checks this first).
// Auto: the MPI library at or below small_message_bytes; above it shared memory when every rank of
// `comm` is on one host (and options.shared_memory), else hierarchical when `comm` spans hosts with
// more than one rank on some host (options.hierarchical; the first such call is collective: it
// learns the layout), else the ring.
void allreduce(const Buffer& input, const Buffer& output, ReduceOp op, MPI_Comm comm,
               const AllreduceOptions& options, Workspace& workspace,
               AllreduceAlgorithm algorithm = AllreduceAlgorithm::Auto);

// Reduce-scatter: `input` (count elements on every rank) is reduced over `comm` and rank r receives
// elements [counts[0] + ... + counts[r - 1], + counts[r]) of the result in `output` (counts[r] elements; the
// counts must be the same on every rank and add up to input.count). The same algorithms as allreduce:
// above small_message_bytes a shared-memory segment when the ranks share a host, else the ring's
// reduce-scatter half (n - 1 chunk transfers, each reduced as it arrives); at or below it the MPI
// library (MPI_Reduce_scatter). float16 / bfloat16 are summed in float32 (as allreduce). With
// `input_is_scratch` the ring reduces inside `input` (its contents are then unspecified) instead of a
// copy. `output` may lie inside `input` (at this rank's offset).
void reducescatter(const Buffer& input, const Buffer& output, const std::vector<size_t>& counts, ReduceOp op,
                   MPI_Comm comm, const AllreduceOptions& options, Workspace& workspace, bool input_is_scratch = false,
                   AllreduceAlgorithm algorithm = AllreduceAlgorithm::Auto);

// Allgather: rank r's `input` (counts[r] elements) lands at offset counts[0] + ... + counts[r - 1] of
// `output` on every rank (output.count = the sum of the counts). Shared memory, the ring's allgather half
// or the MPI library (MPI_Allgatherv), chosen as for reducescatter. `input` may already be in place
// inside `output`.
void allgather(const Buffer& input, const Buffer& output, const std::vector<size_t>& counts, MPI_Comm comm,
               const AllreduceOptions& options, AllreduceAlgorithm algorithm = AllreduceAlgorithm::Auto);

// Bytes this process has handed to MPI for the ring's sends and the library path's MPI_Allreduce since it
// started (all communicators; shared memory and headers not counted): what the wire carries from here.
uint64_t wire_bytes_sent();

}  // namespace hybridpipe
