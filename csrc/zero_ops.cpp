// ZeRO's collectives on the engine (see zero_ops.h).
#include "zero_ops.h"

#include <stdexcept>

#include "py_glue.h"

namespace hybridpipe {
namespace bindings {

namespace {

// This rank's index into `counts` over `comm` (throws when the counts are shorter than the group).
size_t rank_in(MPI_Comm comm, const std::vector<size_t>& counts, const char* what) {
  int rank = 0;
  HP_MPI(MPI_Comm_rank, comm, comm, &rank);
  if (static_cast<size_t>(rank) >= counts.size()) {
    throw std::invalid_argument(std::string(what) + ": counts shorter than the group");
  }
  return static_cast<size_t>(rank);
}

size_t total_of(const std::vector<size_t>& counts) {
  size_t total = 0;
  for (size_t count : counts) total += count;
  return total;
}

}  // namespace

uint64_t submit_reducescatter(Engine& engine, int group, const std::string& name, int kind, uintptr_t input,
                              uintptr_t output, const std::vector<size_t>& counts, int dtype, int op,
                              bool input_is_scratch) {
  const Buffer in = to_buffer(input, total_of(counts), dtype);
  const std::vector<size_t> parts = counts;
  return engine.submit_collective(
      group, name, kind,
      [in, output, parts, dtype, op, input_is_scratch](MPI_Comm comm, Workspace& workspace,
                                                        const AllreduceOptions& options) {
        const size_t rank = rank_in(comm, parts, "submit_reducescatter");
        reducescatter(in, to_buffer(output, parts[rank], dtype), parts, static_cast<ReduceOp>(op), comm, options,
                      workspace, input_is_scratch);
      });
}

uint64_t submit_allgather(Engine& engine, int group, const std::string& name, int kind, uintptr_t input,
                          uintptr_t output, const std::vector<size_t>& counts, int dtype) {
  const Buffer out = to_buffer(output, total_of(counts), dtype);
  const std::vector<size_t> parts = counts;
  return engine.submit_collective(
      group, name, kind, [input, out, parts, dtype](MPI_Comm comm, Workspace&, const AllreduceOptions& options) {
        const size_t rank = rank_in(comm, parts, "submit_allgather");
        allgather(to_buffer(input, parts[rank], dtype), out, parts, comm, options);
      });
}

}  // namespace bindings
}  // namespace hybridpipe
