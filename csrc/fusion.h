// Tensor fusion: many small buffers packed into one persistent buffer and reduced together.
#pragma once

#include <vector>

#include "ring_allreduce.h"

namespace hybridpipe {

// Consecutive buffers reduced together: indices into the caller's list, and their bytes.
struct Bucket {
  std::vector<size_t> items;
  size_t bytes = 0;
  bool alone = false;  // one buffer reduced in place, on its own (not packed)
};

// How fused allreduces cut a sequence of buffers into buckets; grouped_allreduce and the engine's
// buckets both use it, so they bucket alike. Buffers of one dtype, op and wire format are packed in order up to
// `threshold` bytes per bucket; a buffer that reduced_alone() says goes alone is a bucket of its own,
// and the open bucket stays open across it.
class BucketCutter {
 public:
  BucketCutter(size_t threshold, const AllreduceOptions& options, bool streamed)
      : threshold_(threshold), options_(options), streamed_(streamed) {}
  // Offers buffer `index`; returns the buckets that are complete now, in the order to reduce them.
  std::vector<Bucket> add(size_t index, size_t bytes, DType dtype, ReduceOp op, const WireFormat& wire = WireFormat{});
  // The open bucket, if any (at the end, or before something that must not be passed).
  std::vector<Bucket> flush();

 private:
  size_t threshold_;
  AllreduceOptions options_;
  bool streamed_;
  Bucket open_;
  DType dtype_ = DType::Float32;
  ReduceOp op_ = ReduceOp::Sum;
  WireFormat wire_;
};

// Reduces each inputs[i] into outputs[i] (same count and dtype; may alias). Buffers of one dtype
// are packed in order into the fusion buffer, up to `fusion_threshold_bytes` per bucket, and each
// bucket is one allreduce; a buffer at or above the threshold is reduced on its own, unpacked.
// All ranks must pass the same list (count and dtype of every entry, in order).
void grouped_allreduce(const std::vector<Buffer>& inputs, const std::vector<Buffer>& outputs, ReduceOp op,
                       MPI_Comm comm, size_t fusion_threshold_bytes, const AllreduceOptions& options,
                       Workspace& workspace, std::vector<unsigned char>& fusion_buffer);

}  // namespace hybridpipe
