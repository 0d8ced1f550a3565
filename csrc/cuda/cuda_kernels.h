// Host-callable entry points of the CUDA kernels (reduce.cu, fusion.cu), compiled when nvcc is present.
#pragma once

#include <cstdint>
#include <vector>

#include "../common.h"

namespace hybridpipe {

// accumulator = op(accumulator, incoming) on the GPU, on `stream` (a cudaStream_t; null: default).
void cuda_reduce_into(void* accumulator, const void* incoming, size_t count, DType dtype, ReduceOp op,
                      void* stream);
// Number of visible CUDA devices; 0 without a driver or GPU.
int cuda_device_count();

// One CUDA tensor of a fused bucket: its device memory and its place in the bucket's fusion buffer.
struct DevicePiece {
  void* data;
  size_t offset;
  size_t bytes;
};

// The engine's device-side fusion on one GPU (fusion.cu): a stream of its own, a device fusion buffer and the
// batched copy's descriptors, grown as buckets need. Not thread-safe: the engine thread alone uses it. Errors
// throw std::runtime_error naming the CUDA call, the file and the line.
class CudaFusion {
 public:
  explicit CudaFusion(int device);
  ~CudaFusion();
  CudaFusion(const CudaFusion&) = delete;
  CudaFusion& operator=(const CudaFusion&) = delete;
  // host[offset, offset + bytes) = each piece's device memory: one gather kernel into the device fusion buffer
  // and one copy of `total` bytes down (a single piece: one copy straight down). Returns when host holds them.
  void gather(const std::vector<DevicePiece>& pieces, unsigned char* host, size_t total);
  // The reverse: one copy of `total` bytes up and one scatter kernel (a single piece: one copy straight up).
  // Returns when every piece's device memory holds its bytes.
  void scatter(const std::vector<DevicePiece>& pieces, const unsigned char* host, size_t total);
  // The pieces into the device fusion buffer at their offsets (one gather kernel; a single piece: one
  // device-to-device copy); returns the buffer, once they are there. It stays valid until the next call.
  void* gather_device(const std::vector<DevicePiece>& pieces, size_t total);
  // The device fusion buffer's bytes back into the pieces (one scatter kernel; a single piece: one copy).
  void scatter_device(const std::vector<DevicePiece>& pieces, size_t total);
  // Kernel launches and copies issued so far (the batched copy's descriptor upload counted with its kernel).
  uint64_t launches() const { return launches_; }

 private:
  void reserve(size_t fusion_bytes, size_t ranges);
  void batched_copy(const std::vector<DevicePiece>& pieces, bool gather);
  int device_;
  void* stream_ = nullptr;
  void* fusion_ = nullptr;
  size_t fusion_bytes_ = 0;
  void* device_ranges_ = nullptr;
  void* host_ranges_ = nullptr;
  size_t ranges_ = 0;
  uint64_t launches_ = 0;
};

// The GPU whose memory `pointer` is (device or managed memory), or -1 for host memory.
int cuda_pointer_device(const void* pointer);
// Pinned host memory (cudaMallocHost), so that copies down and up run at full speed; freed by cuda_host_free.
void* cuda_host_alloc(size_t bytes);
void cuda_host_free(void* pointer);

}  // namespace hybridpipe
