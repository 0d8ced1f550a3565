// The direct (blocking) collectives and the build's facts as module.cpp binds them: each converts its Python
// arguments, releases the GIL around MPI and returns what Python gets.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

#include "common.h"
#include "ring_allreduce.h"

namespace hybridpipe {
namespace bindings {

namespace py = pybind11;

WaitPolicy make_wait_policy(double spin_us, double max_sleep_us);
WireFormat make_wire_format(int dtype, bool on_one_host);
py::dict hierarchy_info(long long comm_handle);
py::dict shared_memory_info(long long comm_handle, const AllreduceOptions& options, bool create);
bool allreduce_direct(uintptr_t input, uintptr_t output, size_t count, int dtype, int op, long long comm,
                      const AllreduceOptions& options, const std::vector<long long>& header, AllreduceAlgorithm algorithm);
void reducescatter_direct(uintptr_t input, uintptr_t output, const std::vector<size_t>& counts, int dtype, int op,
                          long long comm, const AllreduceOptions& options, bool input_is_scratch,
                          AllreduceAlgorithm algorithm);
void allgather_direct(uintptr_t input, uintptr_t output, const std::vector<size_t>& counts, int dtype, long long comm,
                      const AllreduceOptions& options, AllreduceAlgorithm algorithm);
bool headers_agree_direct(long long comm, const std::vector<long long>& fields, const WaitPolicy& policy);
void grouped_allreduce_direct(const std::vector<uintptr_t>& inputs, const std::vector<uintptr_t>& outputs,
                              const std::vector<size_t>& counts, const std::vector<int>& dtypes, int op, long long comm,
                              size_t fusion_threshold_bytes, const AllreduceOptions& options);
// Whether the MPI library moves CUDA device memory itself: 1 yes, 0 no, -1 it cannot say (no query).
int mpi_cuda_support();
py::dict mpi_build_info();
std::string mpi_library_version();
size_t dtype_size_of(int dtype);
bool cuda_compiled();
#if defined(HYBRIDPIPE_WITH_CUDA)
void cuda_reduce_into_direct(uintptr_t accumulator, uintptr_t incoming, size_t count, int dtype, int op,
                             uintptr_t stream);
#endif

}  // namespace bindings
}  // namespace hybridpipe
