// Element-wise reduction kernels and float16/bfloat16 <-> float32 conversion (CPU).
//
// float16/bfloat16 are never reduced in their own precision: the ring converts them to float32,
// reduces in float32 and rounds once at the end (see ring_allreduce.h), so a sum over n ranks
// carries one rounding instead of n - 1.
#pragma once

#include "common.h"

namespace hybridpipe {

// accumulator[i] = op(accumulator[i], incoming[i]) for i < count. Average reduces like Sum;
// the division happens once, in finalize_average. dtype must not be a half type.
void reduce_into(void* accumulator, const void* incoming, size_t count, DType dtype, ReduceOp op);

// buffer[i] /= divisor (integer types: truncation toward zero, like C and torch's "trunc").
void finalize_average(void* buffer, size_t count, DType dtype, size_t divisor);

// The dtype the ring accumulates in: float32 for half types, the dtype itself otherwise.
DType accumulation_dtype(DType dtype);

void half_to_float(const void* source, float* destination, size_t count, DType half_dtype);
void float_to_half(const float* source, void* destination, size_t count, DType half_dtype);

uint16_t float_to_float16_bits(float value);  // round to nearest even; overflow -> inf
float float16_bits_to_float(uint16_t bits);
uint16_t float_to_bfloat16_bits(float value);  // round to nearest even; NaN stays NaN
float bfloat16_bits_to_float(uint16_t bits);

}  // namespace hybridpipe
