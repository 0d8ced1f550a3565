// Host-callable entry points of the CUDA kernels (defined in reduce.cu when nvcc is present).
#pragma once

#include "../common.h"

namespace hybridpipe {

// accumulator = op(accumulator, incoming) on the GPU, on `stream` (a cudaStream_t; null: default).
void cuda_reduce_into(void* accumulator, const void* incoming, size_t count, DType dtype, ReduceOp op,
                      void* stream);
// Number of visible CUDA devices; 0 without a driver or GPU.
int cuda_device_count();

}  // namespace hybridpipe
