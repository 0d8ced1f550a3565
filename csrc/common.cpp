// Dtype/op names and the MPI error formatter declared in common.h.
#include "common.h"

#include <sstream>

namespace hybridpipe {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::Float32: return 4;
    case DType::Float64: return 8;
    case DType::Float16: return 2;
    case DType::BFloat16: return 2;
    case DType::Int32: return 4;
    case DType::Int64: return 8;
  }
  throw std::invalid_argument("unknown dtype code " + std::to_string(static_cast<int>(dtype)));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
  }
  return "unknown";
}

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "Sum";
    case ReduceOp::Average: return "Average";
    case ReduceOp::Min: return "Min";
    case ReduceOp::Max: return "Max";
  }
  return "unknown";
}

bool is_half(DType dtype) { return dtype == DType::Float16 || dtype == DType::BFloat16; }

void raise_mpi_error(int code, const char* call, MPI_Comm comm) {
  int rank = -1;
  // The communicator itself may be what is broken: fall back to the world rank.
  if (comm == MPI_COMM_NULL || MPI_Comm_rank(comm, &rank) != MPI_SUCCESS) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  }
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) length = 0;
  std::ostringstream message;
  message << "rank " << rank << ": " << call << " failed with error code " << code << " ("
          << std::string(text, static_cast<size_t>(length)) << ")";
  throw MPICallError(message.str());
}

}  // namespace hybridpipe
