// Point-to-point transfers as module.cpp binds them: starting them (holding the Python owner of their memory),
// waiting for them without the GIL, and the communication thread's counts.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"
#include "p2p.h"

namespace hybridpipe {
namespace bindings {

namespace py = pybind11;

void p2p_wait(P2PRequest& request, const WaitPolicy& policy);
bool p2p_wait_for(P2PRequest& request, double timeout_s, const WaitPolicy& policy);
std::string p2p_repr(P2PRequest& request);
P2PRequest* isend_py(uintptr_t address, size_t bytes, int dest, int tag, long long comm, py::object keep);
P2PRequest* isend_copy_py(py::bytes header, uintptr_t address, size_t bytes, int dest, int tag, long long comm);
py::tuple irecv_message_py(size_t capacity, int source, int tag, long long comm);
P2PRequest* irecv_py(uintptr_t address, size_t bytes, int source, int tag, long long comm, py::object keep);
size_t wait_any_py(const std::vector<P2PRequest*>& requests, const WaitPolicy& policy, double timeout_s);
bool transfers_driven();
py::object transfer_counts();

}  // namespace bindings
}  // namespace hybridpipe
