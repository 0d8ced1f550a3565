// Tensor fusion: many small buffers packed into one persistent buffer and reduced together.
#pragma once

#include <vector>

#include "ring_allreduce.h"

namespace hybridpipe {

// Reduces each inputs[i] into outputs[i] (same count and dtype; may alias). Buffers of one dtype
// are packed in order into the fusion buffer, up to `fusion_threshold_bytes` per bucket, and each
// bucket is one allreduce; a buffer at or above the threshold is reduced on its own, unpacked.
// All ranks must pass the same list (count and dtype of every entry, in order).
void grouped_allreduce(const std::vector<Buffer>& inputs, const std::vector<Buffer>& outputs, ReduceOp op,
                       MPI_Comm comm, size_t fusion_threshold_bytes, const AllreduceOptions& options,
                       Workspace& workspace, std::vector<unsigned char>& fusion_buffer);

}  // namespace hybridpipe
