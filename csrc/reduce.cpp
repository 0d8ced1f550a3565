// Reduction kernels: plain loops over __restrict__ pointers that the compiler vectorises at -O3.
#include "reduce.h"

#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

namespace hybridpipe {
namespace {

template <typename T>
void reduce_typed(T* __restrict__ acc, const T* __restrict__ in, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Average:
      for (size_t i = 0; i < n; ++i) acc[i] += in[i];
      return;
    case ReduceOp::Min:
      for (size_t i = 0; i < n; ++i) acc[i] = in[i] < acc[i] ? in[i] : acc[i];
      return;
    case ReduceOp::Max:
      for (size_t i = 0; i < n; ++i) acc[i] = in[i] > acc[i] ? in[i] : acc[i];
      return;
  }
}

template <typename T>
void divide_typed(T* __restrict__ buffer, size_t n, size_t divisor) {
  const T d = static_cast<T>(divisor);
  for (size_t i = 0; i < n; ++i) buffer[i] = buffer[i] / d;  // integer '/' truncates toward zero
}

inline uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline float bits_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

}  // namespace

void reduce_into(void* accumulator, const void* incoming, size_t count, DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::Float32:
      return reduce_typed(static_cast<float*>(accumulator), static_cast<const float*>(incoming), count, op);
    case DType::Float64:
      return reduce_typed(static_cast<double*>(accumulator), static_cast<const double*>(incoming), count, op);
    case DType::Int32:
      return reduce_typed(static_cast<int32_t*>(accumulator), static_cast<const int32_t*>(incoming), count, op);
    case DType::Int64:
      return reduce_typed(static_cast<int64_t*>(accumulator), static_cast<const int64_t*>(incoming), count, op);
    case DType::Float16:
    case DType::BFloat16:
      break;
  }
  throw std::invalid_argument(std::string("reduce_into: ") + dtype_name(dtype) +
                              " is reduced in float32; convert it first");
}

void finalize_average(void* buffer, size_t count, DType dtype, size_t divisor) {
  switch (dtype) {
    case DType::Float32: return divide_typed(static_cast<float*>(buffer), count, divisor);
    case DType::Float64: return divide_typed(static_cast<double*>(buffer), count, divisor);
    case DType::Int32: return divide_typed(static_cast<int32_t*>(buffer), count, divisor);
    case DType::Int64: return divide_typed(static_cast<int64_t*>(buffer), count, divisor);
    case DType::Float16:
    case DType::BFloat16:
      break;
  }
  throw std::invalid_argument(std::string("finalize_average: ") + dtype_name(dtype) +
                              " is averaged in float32; convert it first");
}

DType accumulation_dtype(DType dtype) { return is_half(dtype) ? DType::Float32 : dtype; }

uint16_t float_to_float16_bits(float value) {
  uint32_t x = float_bits(value);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return static_cast<uint16_t>(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (x >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65536: overflow
  if (x < 0x38800000u) {
    // Below the smallest normal half (2^-14): adding 0.5 moves the value into a float whose
    // low mantissa bits are round-to-nearest-even(|value| * 2^24), done by the FPU itself.
    const uint32_t shifted = float_bits(bits_float(x) + 0.5f) - 0x3f000000u;
    return static_cast<uint16_t>(sign | shifted);
  }
  const uint32_t mantissa_odd = (x >> 13) & 1u;
  x += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mantissa_odd;  // rebias + round to even
  return static_cast<uint16_t>(sign | (x >> 13));  // a carry into exponent 31 yields inf
}

float float16_bits_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1fu) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // 2^-24
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

uint16_t float_to_bfloat16_bits(float value) {
  const uint32_t x = float_bits(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);  // quiet NaN
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

float bfloat16_bits_to_float(uint16_t bits) { return bits_float(static_cast<uint32_t>(bits) << 16); }

namespace {

// float16 <-> float32 with the x86 F16C instructions, 8 values at a time (the same round-to-nearest-even as
// the scalar functions; a NaN keeps its payload's top bits): ~10x the scalar speed, which the compressed
// ring's conversions need to hide behind the wire. Chosen at run time, so the build needs no -march.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HYBRIDPIPE_F16C 1
__attribute__((target("avx,f16c"))) size_t float16_to_float_f16c(const uint16_t* in, float* out, size_t count) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  }
  return i;
}

__attribute__((target("avx,f16c"))) size_t float_to_float16_f16c(const float* in, uint16_t* out, size_t count) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  }
  return i;
}

bool has_f16c() {
  static const bool supported = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return supported;
}
#endif

}  // namespace

void half_to_float(const void* source, float* destination, size_t count, DType half_dtype) {
  const uint16_t* __restrict__ in = static_cast<const uint16_t*>(source);
  float* __restrict__ out = destination;
  if (half_dtype == DType::BFloat16) {
    for (size_t i = 0; i < count; ++i) out[i] = bfloat16_bits_to_float(in[i]);
    return;
  }
  size_t i = 0;
#if defined(HYBRIDPIPE_F16C)
  if (has_f16c()) i = float16_to_float_f16c(in, out, count);
#endif
  for (; i < count; ++i) out[i] = float16_bits_to_float(in[i]);
}

void float_to_half(const float* source, void* destination, size_t count, DType half_dtype) {
  const float* __restrict__ in = source;
  uint16_t* __restrict__ out = static_cast<uint16_t*>(destination);
  if (half_dtype == DType::BFloat16) {
    for (size_t i = 0; i < count; ++i) out[i] = float_to_bfloat16_bits(in[i]);
    return;
  }
  size_t i = 0;
#if defined(HYBRIDPIPE_F16C)
  if (has_f16c()) i = float_to_float16_f16c(in, out, count);
#endif
  for (; i < count; ++i) out[i] = float_to_float16_bits(in[i]);
}

}  // namespace hybridpipe
