// The binding files' shared helpers (see py_glue.h).
#include "py_glue.h"

namespace hybridpipe {
namespace bindings {

namespace {

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

std::mutex dropped_mutex;
std::vector<py::object*>& dropped_owners() {
  static auto* owners = new std::vector<py::object*>();  // never destroyed: threads may add at exit
  return *owners;
}

}  // namespace

Core& core() {
  static Core instance;
  return instance;
}

size_t release_dropped_owners() {
  std::vector<py::object*> batch;
  {
    std::lock_guard<std::mutex> lock(dropped_mutex);
    batch.swap(dropped_owners());
  }
  for (py::object* owner : batch) delete owner;
  return batch.size();
}

std::shared_ptr<void> keep_alive(const py::object& object) {
  if (object.is_none()) return nullptr;
  return std::shared_ptr<void>(new py::object(object), [](void* held) {
    auto* owned = static_cast<py::object*>(held);
    if (!Py_IsInitialized() || interpreter_finalizing()) return;
    if (PyGILState_Check()) {
      delete owned;
      return;
    }
    std::lock_guard<std::mutex> lock(dropped_mutex);
    dropped_owners().push_back(owned);
  });
}

bool headers_agree(MPI_Comm comm, const std::vector<long long>& fields, const WaitPolicy& policy) {
  std::vector<long long> extremes(2 * fields.size());
  for (size_t i = 0; i < fields.size(); ++i) {
    extremes[i] = fields[i];
    extremes[fields.size() + i] = -fields[i];
  }
  HP_MPI(allreduce_waiting, comm, MPI_IN_PLACE, extremes.data(), static_cast<int>(extremes.size()), MPI_LONG_LONG,
         MPI_MAX, comm, policy);
  for (size_t i = 0; i < fields.size(); ++i) {
    if (extremes[i] != -extremes[fields.size() + i]) return false;
  }
  return true;
}

void translate_mpi_error(std::exception_ptr pointer) {
  // hybridpipe.errors.MPIError, looked up once and kept for the life of the process.
  static PyObject* mpi_error_class = nullptr;
  try {
    if (pointer) std::rethrow_exception(pointer);
  } catch (const MPICallError& error) {
    if (!mpi_error_class) mpi_error_class = py::object(py::module_::import("hybridpipe.errors").attr("MPIError")).release().ptr();
    PyErr_SetString(mpi_error_class, error.what());
  }
}

}  // namespace bindings
}  // namespace hybridpipe
