// The background engine as module.cpp binds it (hybridpipe._C.Engine): its methods that convert arguments, hold
// Python callables for the engine thread or release the GIL. The ZeRO collectives queued on it are in zero_ops.h.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "engine.h"

namespace hybridpipe {
namespace bindings {

namespace py = pybind11;

int engine_add_group(Engine& engine, long long comm, const std::string& label);
void engine_start(Engine& engine);
uint64_t engine_submit(Engine& engine, int group, const std::string& name, uintptr_t address, size_t count, int dtype,
                       int op, int device, uintptr_t output, uintptr_t ready_event, const WireFormat& wire);
uint64_t engine_submit_call(Engine& engine, int group, const std::string& name, int kind, py::function function);
py::tuple engine_wait(Engine& engine, uint64_t handle);
void engine_shutdown(Engine& engine);
void engine_abandon(Engine& engine);
void engine_set_device_allreduce(Engine& engine, int group, py::function function);

}  // namespace bindings
}  // namespace hybridpipe
