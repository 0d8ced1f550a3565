// The direct collectives and the build's facts (see direct_ops.h).
#include "direct_ops.h"

#include <pybind11/stl.h>

#include <mutex>
#include <stdexcept>
#include <string>

#include "fusion.h"
#include "hierarchical.h"
#include "py_glue.h"
#include "shm_allreduce.h"
#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>  // MPIX_CUDA_AWARE_SUPPORT, MPIX_Query_cuda_support
#endif
#if defined(HYBRIDPIPE_WITH_CUDA)
#include "cuda/cuda_kernels.h"
#endif

namespace hybridpipe {
namespace bindings {

WaitPolicy make_wait_policy(double spin_us, double max_sleep_us) { return WaitPolicy{spin_us, max_sleep_us}; }

WireFormat make_wire_format(int dtype, bool on_one_host) { return WireFormat{dtype, on_one_host}; }

py::dict hierarchy_info(long long comm_handle) {
  Hierarchy* hierarchy = nullptr;
  {
    py::gil_scoped_release no_gil;
    hierarchy = hierarchy_for(to_comm(comm_handle));
  }
  py::dict info;
  info["hosts"] = hierarchy->hosts();
  info["ranks_per_host"] = hierarchy->ranks_per_host();
  info["pieces"] = hierarchy->pieces();
  info["useful"] = hierarchy->useful();
  info["calls"] = hierarchy->calls();
  info["pipelined_chunks"] = hierarchy->pipelined_chunks();
  return info;
}

py::dict shared_memory_info(long long comm_handle, const AllreduceOptions& options, bool create) {
  const MPI_Comm comm = to_comm(comm_handle);
  int size = 1;
  HP_MPI(MPI_Comm_size, comm, comm, &size);
  SharedMemoryAllreduce* shm = nullptr;
  std::string reason;
  if (size == 1) {
    reason = "one rank: nothing to share";
  } else if (!options.shared_memory) {
    reason = "switched off (shared_memory=False)";
  } else {
    bool asked = true;
    {
      py::gil_scoped_release no_gil;
      shm = create ? shared_memory_for(comm, options.shared_memory_chunk_bytes) : cached_shared_memory(comm, &asked);
    }
    reason = !asked ? "not created" : shm ? "" : shared_memory_unavailable_reason(comm);
  }
  py::dict info;
  info["available"] = shm != nullptr;
  info["reason"] = reason;
  info["chunk_bytes"] = shm ? shm->chunk_bytes() : 0;
  info["sets"] = shm ? shm->sets() : 0;
  info["mapped_bytes"] = shm ? shm->mapped_bytes() : 0;
  return info;
}

bool allreduce_direct(uintptr_t input, uintptr_t output, size_t count, int dtype, int op, long long comm,
                      const AllreduceOptions& options, const std::vector<long long>& header,
                      AllreduceAlgorithm algorithm) {
  py::gil_scoped_release no_gil;
  std::lock_guard<std::mutex> guard(core().lock);
  if (!header.empty() && !headers_agree(to_comm(comm), header, options.wait)) return false;
  allreduce(to_buffer(input, count, dtype), to_buffer(output, count, dtype), static_cast<ReduceOp>(op), to_comm(comm),
            options, core().workspace, algorithm);
  return true;
}

namespace {

// This rank's entry of a reduce-scatter's or an allgather's per-rank counts (checked to cover the communicator).
size_t own_count(const std::vector<size_t>& counts, long long comm, const char* what) {
  int rank = 0;
  HP_MPI(MPI_Comm_rank, to_comm(comm), to_comm(comm), &rank);
  if (static_cast<size_t>(rank) >= counts.size())
    throw std::invalid_argument(std::string(what) + ": counts shorter than the communicator");
  return counts[static_cast<size_t>(rank)];
}

}  // namespace

void reducescatter_direct(uintptr_t input, uintptr_t output, const std::vector<size_t>& counts, int dtype, int op,
                          long long comm, const AllreduceOptions& options, bool input_is_scratch,
                          AllreduceAlgorithm algorithm) {
  size_t total = 0;
  for (size_t count : counts) total += count;
  py::gil_scoped_release no_gil;
  std::lock_guard<std::mutex> guard(core().lock);
  reducescatter(to_buffer(input, total, dtype), to_buffer(output, own_count(counts, comm, "reducescatter"), dtype),
                counts, static_cast<ReduceOp>(op), to_comm(comm), options, core().workspace, input_is_scratch,
                algorithm);
}

void allgather_direct(uintptr_t input, uintptr_t output, const std::vector<size_t>& counts, int dtype, long long comm,
                      const AllreduceOptions& options, AllreduceAlgorithm algorithm) {
  size_t total = 0;
  for (size_t count : counts) total += count;
  py::gil_scoped_release no_gil;
  std::lock_guard<std::mutex> guard(core().lock);
  allgather(to_buffer(input, own_count(counts, comm, "allgather"), dtype), to_buffer(output, total, dtype), counts,
            to_comm(comm), options, algorithm);
}

bool headers_agree_direct(long long comm, const std::vector<long long>& fields, const WaitPolicy& policy) {
  py::gil_scoped_release no_gil;
  return headers_agree(to_comm(comm), fields, policy);
}

void grouped_allreduce_direct(const std::vector<uintptr_t>& inputs, const std::vector<uintptr_t>& outputs,
                              const std::vector<size_t>& counts, const std::vector<int>& dtypes, int op, long long comm,
                              size_t fusion_threshold_bytes, const AllreduceOptions& options) {
  if (inputs.size() != counts.size() || outputs.size() != counts.size() || dtypes.size() != counts.size()) {
    throw std::invalid_argument("grouped_allreduce: inputs, outputs, counts and dtypes differ in length");
  }
  std::vector<Buffer> in, out;
  for (size_t i = 0; i < counts.size(); ++i) {
    in.push_back(to_buffer(inputs[i], counts[i], dtypes[i]));
    out.push_back(to_buffer(outputs[i], counts[i], dtypes[i]));
  }
  py::gil_scoped_release no_gil;
  std::lock_guard<std::mutex> guard(core().lock);
  grouped_allreduce(in, out, static_cast<ReduceOp>(op), to_comm(comm), fusion_threshold_bytes, options,
                    core().workspace, core().fusion_buffer);
}

int mpi_cuda_support() {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support();
#elif defined(MPIX_CUDA_AWARE_SUPPORT)
  return 0;  // Open MPI built without CUDA
#else
  return -1;
#endif
}

py::dict mpi_build_info() {
  py::dict info;
#if defined(OPEN_MPI)
  info["implementation"] = "Open MPI";
  info["version"] = std::to_string(OMPI_MAJOR_VERSION) + "." + std::to_string(OMPI_MINOR_VERSION) + "." +
                    std::to_string(OMPI_RELEASE_VERSION);
#elif defined(I_MPI_VERSION)
  info["implementation"] = "Intel MPI";
  info["version"] = I_MPI_VERSION;
#elif defined(MVAPICH2_VERSION)
  info["implementation"] = "MVAPICH";
  info["version"] = MVAPICH2_VERSION;
#elif defined(MPICH_VERSION)
  info["implementation"] = "MPICH";
  info["version"] = MPICH_VERSION;
#else
  info["implementation"] = "unknown";
  info["version"] = "";
#endif
  info["mpi_standard"] = std::to_string(MPI_VERSION) + "." + std::to_string(MPI_SUBVERSION);
  return info;
}

std::string mpi_library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(text, &length);
  std::string version(text, static_cast<size_t>(length));
  while (!version.empty() && (version.back() == '\0' || version.back() == '\n')) version.pop_back();
  return version;  // some MPIs count the terminating NUL in `length`
}

size_t dtype_size_of(int dtype) { return dtype_size(static_cast<DType>(dtype)); }

bool cuda_compiled() {
#if defined(HYBRIDPIPE_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

#if defined(HYBRIDPIPE_WITH_CUDA)
void cuda_reduce_into_direct(uintptr_t accumulator, uintptr_t incoming, size_t count, int dtype, int op,
                             uintptr_t stream) {
  py::gil_scoped_release release;
  cuda_reduce_into(reinterpret_cast<void*>(accumulator), reinterpret_cast<const void*>(incoming), count,
                   static_cast<DType>(dtype), static_cast<ReduceOp>(op), reinterpret_cast<void*>(stream));
}
#endif

}  // namespace bindings
}  // namespace hybridpipe
