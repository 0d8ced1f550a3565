// What the binding files share (module.cpp registers, direct_ops / transfer_ops / engine_py / zero_ops.cpp do the
// work): conversions from Python's integers to MPI and buffer handles, the scratch memory of the direct
// collectives, the lifetime of Python buffer owners held by C++, and the translation of MPI errors.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

#include "common.h"
#include "ring_allreduce.h"

namespace hybridpipe {
namespace bindings {

namespace py = pybind11;

// Scratch memory shared by all direct calls; one collective at a time per process uses it.
struct Core {
  std::mutex lock;
  Workspace workspace;
  std::vector<unsigned char> fusion_buffer;
};
Core& core();

inline MPI_Comm to_comm(long long fortran_handle) { return MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_handle)); }

inline Buffer to_buffer(uintptr_t address, size_t count, int dtype) {
  return Buffer{reinterpret_cast<void*>(address), count, static_cast<DType>(dtype)};
}

// Buffer owners whose last reference went on a thread without the GIL (the communication thread, as it
// retires a finished transfer nobody holds any more, e.g. a dropped send). That thread must never wait for
// the GIL: a Python thread that computes holds it for up to the switch interval (5 ms) at a time, and all MPI
// progress (every hop of the pipeline, every collective) would wait with it. They are released by the next
// call into the module that holds the GIL (starting or waiting for a transfer), or release_dropped_owners().
size_t release_dropped_owners();  // with the GIL
// Holds a Python object for C++ (a transfer's buffer owner) until its last reference goes: at once on a
// thread holding the GIL, else handed to release_dropped_owners (leaked once Python is finalizing).
std::shared_ptr<void> keep_alive(const py::object& object);

// True when every rank of `comm` passed the same `fields` (one MPI_Allreduce of max(f), max(-f)).
bool headers_agree(MPI_Comm comm, const std::vector<long long>& fields, const WaitPolicy& policy = {});

// MPICallError -> hybridpipe.errors.MPIError (py::register_exception_translator).
void translate_mpi_error(std::exception_ptr pointer);

}  // namespace bindings
}  // namespace hybridpipe
