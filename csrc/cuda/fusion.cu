// Device-side tensor fusion for the engine: the CUDA tensors of one bucket are gathered into a device fusion
// buffer by one kernel and copied down to pinned host memory in one copy, and after the host reduction copied
// up in one copy and scattered back by one kernel (Horovod's batched memcpy), instead of a copy each way per
// tensor. Compiled when nvcc is present; used by the engine thread only (engine.cpp).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda_check.h"
#include "cuda_kernels.h"

namespace hybridpipe {
namespace {

struct CopyRange {
  const unsigned char* src;
  unsigned char* dst;
  size_t bytes;
};

// Block row y copies ranges y, y + gridDim.y, ...; the x blocks of a row share the range. 16-byte moves where
// both ends and the length allow (a fusion offset need not be 16-byte aligned), else 4-byte, else bytes.
__global__ void batched_copy_kernel(const CopyRange* __restrict__ ranges, size_t n) {
  const size_t first = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t r = blockIdx.y; r < n; r += gridDim.y) {
    const CopyRange range = ranges[r];
    const uintptr_t alignment =
        reinterpret_cast<uintptr_t>(range.src) | reinterpret_cast<uintptr_t>(range.dst) | range.bytes;
    if ((alignment & 15) == 0) {
      const uint4* src = reinterpret_cast<const uint4*>(range.src);
      uint4* dst = reinterpret_cast<uint4*>(range.dst);
      for (size_t i = first; i < range.bytes / 16; i += stride) dst[i] = src[i];
    } else if ((alignment & 3) == 0) {
      const uint32_t* src = reinterpret_cast<const uint32_t*>(range.src);
      uint32_t* dst = reinterpret_cast<uint32_t*>(range.dst);
      for (size_t i = first; i < range.bytes / 4; i += stride) dst[i] = src[i];
    } else {
      for (size_t i = first; i < range.bytes; i += stride) range.dst[i] = range.src[i];
    }
  }
}

}  // namespace

CudaFusion::CudaFusion(int device) : device_(device) {
  HP_CUDA_CHECK(cudaSetDevice(device_));
  cudaStream_t stream = nullptr;
  HP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  stream_ = stream;
}

CudaFusion::~CudaFusion() {
  cudaSetDevice(device_);
  if (stream_) cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  cudaFree(fusion_);
  cudaFree(device_ranges_);
  cudaFreeHost(host_ranges_);
  if (stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

void CudaFusion::reserve(size_t fusion_bytes, size_t ranges) {
  if (fusion_bytes > fusion_bytes_) {
    HP_CUDA_CHECK(cudaFree(fusion_));
    fusion_ = nullptr;
    fusion_bytes_ = 0;
    HP_CUDA_CHECK(cudaMalloc(&fusion_, fusion_bytes));
    fusion_bytes_ = fusion_bytes;
  }
  if (ranges > ranges_) {
    HP_CUDA_CHECK(cudaFree(device_ranges_));
    HP_CUDA_CHECK(cudaFreeHost(host_ranges_));
    device_ranges_ = host_ranges_ = nullptr;
    ranges_ = 0;
    HP_CUDA_CHECK(cudaMalloc(&device_ranges_, ranges * sizeof(CopyRange)));
    HP_CUDA_CHECK(cudaMallocHost(&host_ranges_, ranges * sizeof(CopyRange)));
    ranges_ = ranges;
  }
}

void CudaFusion::batched_copy(const std::vector<DevicePiece>& pieces, bool gather) {
  auto stream = static_cast<cudaStream_t>(stream_);
  auto* ranges = static_cast<CopyRange*>(host_ranges_);
  size_t longest = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    unsigned char* slot = static_cast<unsigned char*>(fusion_) + pieces[i].offset;
    unsigned char* tensor = static_cast<unsigned char*>(pieces[i].data);
    ranges[i] = gather ? CopyRange{tensor, slot, pieces[i].bytes} : CopyRange{slot, tensor, pieces[i].bytes};
    longest = std::max(longest, pieces[i].bytes);
  }
  // the descriptors go up on the stream, ahead of the kernel that reads them; the pinned array is rewritten
  // only after the stream has been synchronized (gather and scatter both end with it)
  HP_CUDA_CHECK(cudaMemcpyAsync(device_ranges_, host_ranges_, pieces.size() * sizeof(CopyRange),
                                cudaMemcpyHostToDevice, stream));
  const int threads = 256;
  const unsigned rows = static_cast<unsigned>(std::min<size_t>(pieces.size(), 65535));
  const unsigned columns = static_cast<unsigned>(std::clamp<size_t>(longest / (16 * threads * 4), 1, 64));
  batched_copy_kernel<<<dim3(columns, rows), threads, 0, stream>>>(static_cast<const CopyRange*>(device_ranges_),
                                                                   pieces.size());
  HP_CUDA_CHECK(cudaGetLastError());
  launches_ += 1;
}

void CudaFusion::gather(const std::vector<DevicePiece>& pieces, unsigned char* host, size_t total) {
  if (pieces.empty()) return;
  HP_CUDA_CHECK(cudaSetDevice(device_));
  auto stream = static_cast<cudaStream_t>(stream_);
  if (pieces.size() == 1) {
    HP_CUDA_CHECK(cudaMemcpyAsync(host + pieces[0].offset, pieces[0].data, pieces[0].bytes, cudaMemcpyDeviceToHost,
                                  stream));
    launches_ += 1;
  } else {
    reserve(total, pieces.size());
    batched_copy(pieces, true);
    HP_CUDA_CHECK(cudaMemcpyAsync(host, fusion_, total, cudaMemcpyDeviceToHost, stream));
    launches_ += 1;
  }
  HP_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void CudaFusion::scatter(const std::vector<DevicePiece>& pieces, const unsigned char* host, size_t total) {
  if (pieces.empty()) return;
  HP_CUDA_CHECK(cudaSetDevice(device_));
  auto stream = static_cast<cudaStream_t>(stream_);
  if (pieces.size() == 1) {
    HP_CUDA_CHECK(cudaMemcpyAsync(pieces[0].data, host + pieces[0].offset, pieces[0].bytes, cudaMemcpyHostToDevice,
                                  stream));
    launches_ += 1;
  } else {
    reserve(total, pieces.size());
    HP_CUDA_CHECK(cudaMemcpyAsync(fusion_, host, total, cudaMemcpyHostToDevice, stream));
    launches_ += 1;
    batched_copy(pieces, false);
  }
  HP_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void* CudaFusion::gather_device(const std::vector<DevicePiece>& pieces, size_t total) {
  HP_CUDA_CHECK(cudaSetDevice(device_));
  reserve(total, pieces.size());
  auto stream = static_cast<cudaStream_t>(stream_);
  if (pieces.size() == 1) {
    HP_CUDA_CHECK(cudaMemcpyAsync(static_cast<unsigned char*>(fusion_) + pieces[0].offset, pieces[0].data,
                                  pieces[0].bytes, cudaMemcpyDeviceToDevice, stream));
    launches_ += 1;
  } else if (!pieces.empty()) {
    batched_copy(pieces, true);
  }
  HP_CUDA_CHECK(cudaStreamSynchronize(stream));
  return fusion_;
}

void CudaFusion::scatter_device(const std::vector<DevicePiece>& pieces, size_t total) {
  HP_CUDA_CHECK(cudaSetDevice(device_));
  reserve(total, pieces.size());
  auto stream = static_cast<cudaStream_t>(stream_);
  if (pieces.size() == 1) {
    HP_CUDA_CHECK(cudaMemcpyAsync(pieces[0].data, static_cast<unsigned char*>(fusion_) + pieces[0].offset,
                                  pieces[0].bytes, cudaMemcpyDeviceToDevice, stream));
    launches_ += 1;
  } else if (!pieces.empty()) {
    batched_copy(pieces, false);
  }
  HP_CUDA_CHECK(cudaStreamSynchronize(stream));
}

int cuda_pointer_device(const void* pointer) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) {
    cudaGetLastError();  // clear the (non-sticky) error it leaves
    return -1;
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged ? attributes.device
                                                                                             : -1;
}

void* cuda_host_alloc(size_t bytes) {
  void* pointer = nullptr;
  HP_CUDA_CHECK(cudaMallocHost(&pointer, std::max<size_t>(bytes, 1)));
  return pointer;
}

void cuda_host_free(void* pointer) { cudaFreeHost(pointer); }

}  // namespace hybridpipe
