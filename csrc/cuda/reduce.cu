// Device-side reduction kernels (float32/float64/int32/int64 and float16/bfloat16 via float32
// math), compiled when nvcc is present. The host code calls them through cuda_reduce_into()
// for buffers that live on the GPU; the CPU kernels in reduce.cpp have the same semantics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../common.h"
#include "cuda_check.h"
#include "cuda_kernels.h"

namespace hybridpipe {
namespace {

template <typename T>
__global__ void reduce_kernel(T* __restrict__ acc, const T* __restrict__ in, size_t n, int op) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const T a = acc[i], b = in[i];
    acc[i] = op <= 1 ? a + b : (op == 2 ? (b < a ? b : a) : (b > a ? b : a));
  }
}

// Half types: the arithmetic is done in float32 and rounded once per element.
template <typename H, typename ToFloat, typename FromFloat>
__global__ void reduce_half_kernel(H* __restrict__ acc, const H* __restrict__ in, size_t n, int op,
                                   ToFloat to_float, FromFloat from_float) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float a = to_float(acc[i]), b = to_float(in[i]);
    acc[i] = from_float(op <= 1 ? a + b : (op == 2 ? fminf(a, b) : fmaxf(a, b)));
  }
}

struct HalfToFloat { __device__ float operator()(__half v) const { return __half2float(v); } };
struct FloatToHalf { __device__ __half operator()(float v) const { return __float2half_rn(v); } };
struct Bf16ToFloat { __device__ float operator()(__nv_bfloat16 v) const { return __bfloat162float(v); } };
struct FloatToBf16 { __device__ __nv_bfloat16 operator()(float v) const { return __float2bfloat16_rn(v); } };

}  // namespace

void cuda_reduce_into(void* accumulator, const void* incoming, size_t count, DType dtype, ReduceOp op,
                      void* stream_handle) {
  if (count == 0) return;
  auto stream = static_cast<cudaStream_t>(stream_handle);
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<size_t>((count + threads - 1) / threads, 4096));
  const int code = static_cast<int>(op);
  switch (dtype) {
    case DType::Float32:
      reduce_kernel<<<blocks, threads, 0, stream>>>(static_cast<float*>(accumulator),
                                                    static_cast<const float*>(incoming), count, code);
      break;
    case DType::Float64:
      reduce_kernel<<<blocks, threads, 0, stream>>>(static_cast<double*>(accumulator),
                                                    static_cast<const double*>(incoming), count, code);
      break;
    case DType::Int32:
      reduce_kernel<<<blocks, threads, 0, stream>>>(static_cast<int32_t*>(accumulator),
                                                    static_cast<const int32_t*>(incoming), count, code);
      break;
    case DType::Int64:
      reduce_kernel<<<blocks, threads, 0, stream>>>(static_cast<int64_t*>(accumulator),
                                                    static_cast<const int64_t*>(incoming), count, code);
      break;
    case DType::Float16:
      reduce_half_kernel<<<blocks, threads, 0, stream>>>(static_cast<__half*>(accumulator),
                                                         static_cast<const __half*>(incoming), count, code,
                                                         HalfToFloat{}, FloatToHalf{});
      break;
    case DType::BFloat16:
      reduce_half_kernel<<<blocks, threads, 0, stream>>>(static_cast<__nv_bfloat16*>(accumulator),
                                                         static_cast<const __nv_bfloat16*>(incoming), count,
                                                         code, Bf16ToFloat{}, FloatToBf16{});
      break;
  }
  HP_CUDA_CHECK(cudaGetLastError());  // the kernel launch
}

int cuda_device_count() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) return 0;  // no driver or no GPU: not an error
  return devices;
}

}  // namespace hybridpipe
