// Point-to-point transfers for Python (see transfer_ops.h).
#include "transfer_ops.h"

#include <pybind11/stl.h>

#include "py_glue.h"

namespace hybridpipe {
namespace bindings {

void p2p_wait(P2PRequest& request, const WaitPolicy& policy) {
  {
    py::gil_scoped_release no_gil;
    request.wait(policy);
  }
  release_dropped_owners();
}

bool p2p_wait_for(P2PRequest& request, double timeout_s, const WaitPolicy& policy) {
  bool done = false;
  {
    py::gil_scoped_release no_gil;
    done = request.wait_for(timeout_s, policy);
  }
  release_dropped_owners();
  return done;
}

std::string p2p_repr(P2PRequest& request) {
  return "<P2PRequest " + request.what() + (request.done() ? " done>" : " in flight>");
}

P2PRequest* isend_py(uintptr_t address, size_t bytes, int dest, int tag, long long comm, py::object keep) {
  release_dropped_owners();
  return isend(reinterpret_cast<const void*>(address), bytes, dest, tag, to_comm(comm), keep_alive(keep));
}

P2PRequest* isend_copy_py(py::bytes header, uintptr_t address, size_t bytes, int dest, int tag, long long comm) {
  release_dropped_owners();
  char* head = nullptr;
  Py_ssize_t head_bytes = 0;
  PyBytes_AsStringAndSize(header.ptr(), &head, &head_bytes);
  return isend_copy(head, static_cast<size_t>(head_bytes), reinterpret_cast<const void*>(address), bytes, dest, tag,
                    to_comm(comm));
}

py::tuple irecv_message_py(size_t capacity, int source, int tag, long long comm) {
  release_dropped_owners();
  py::object buffer =
      py::reinterpret_steal<py::object>(PyByteArray_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(capacity)));
  if (!buffer) throw py::error_already_set();
  P2PRequest* request =
      irecv(PyByteArray_AS_STRING(buffer.ptr()), capacity, source, tag, to_comm(comm), keep_alive(buffer));
  return py::make_tuple(py::cast(request, py::return_value_policy::take_ownership), buffer);
}

P2PRequest* irecv_py(uintptr_t address, size_t bytes, int source, int tag, long long comm, py::object keep) {
  release_dropped_owners();
  return irecv(reinterpret_cast<void*>(address), bytes, source, tag, to_comm(comm), keep_alive(keep));
}

size_t wait_any_py(const std::vector<P2PRequest*>& requests, const WaitPolicy& policy, double timeout_s) {
  size_t index = 0;
  {
    py::gil_scoped_release no_gil;
    index = wait_any(requests, policy, timeout_s);
  }
  release_dropped_owners();
  return index;
}

bool transfers_driven() { return installed_transfer_queue() != nullptr; }

py::object transfer_counts() {
  auto queue = installed_transfer_queue();
  if (!queue) return py::none();
  const TransferQueue::Counts counts = queue->counts();
  py::dict out;
  out["posted_here"] = counts.posted_here;
  out["posted_by_driver"] = counts.posted_by_driver;
  out["completed_here"] = counts.completed_here;
  out["completed_by_driver"] = counts.completed_by_driver;
  return out;
}

}  // namespace bindings
}  // namespace hybridpipe
