// Error checking for the CUDA sources: a failed CUDA runtime call throws std::runtime_error naming the call, the
// file and the line, and CUDA's own message (the "errors with file and line").
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace hybridpipe {

inline void cuda_check(cudaError_t status, const char* what, const char* file, int line) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("hybridpipe: ") + what + " failed (" + file + ":" + std::to_string(line) +
                             "): " + cudaGetErrorString(status));
  }
}

}  // namespace hybridpipe

#define HP_CUDA_CHECK(call) ::hybridpipe::cuda_check((call), #call, __FILE__, __LINE__)
