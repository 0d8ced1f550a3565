// The background engine's Python methods (see engine_py.h).
#include "engine_py.h"

#include <stdexcept>

#include "py_glue.h"

namespace hybridpipe {
namespace bindings {

int engine_add_group(Engine& engine, long long comm, const std::string& label) {
  py::gil_scoped_release no_gil;
  return engine.add_group(to_comm(comm), label);
}

void engine_start(Engine& engine) {
  py::gil_scoped_release no_gil;
  engine.start();
}

uint64_t engine_submit(Engine& engine, int group, const std::string& name, uintptr_t address, size_t count, int dtype,
                       int op, int device, uintptr_t output, uintptr_t ready_event, const WireFormat& wire) {
  return engine.submit(group, name, to_buffer(address, count, dtype), static_cast<ReduceOp>(op), device,
                       output ? to_buffer(output, count, dtype) : Buffer{}, ready_event, wire);
}

uint64_t engine_submit_call(Engine& engine, int group, const std::string& name, int kind, py::function function) {
  // Borrowed: the caller keeps `function` alive until the handle is done (so no reference
  // count changes without the GIL); the engine thread takes the GIL to call it.
  PyObject* raw = function.ptr();
  return engine.submit_call(group, name, kind, [raw] {
    py::gil_scoped_acquire gil;
    try {
      py::handle function_handle(raw);
      function_handle();
    } catch (py::error_already_set& error) {
      error.discard_as_unraisable("hybridpipe engine call");
    }
  });
}

py::tuple engine_wait(Engine& engine, uint64_t handle) {
  double started = 0, finished = 0;
  std::string error;
  ErrorKind kind = ErrorKind::None;
  int contributors = 0;
  {
    py::gil_scoped_release no_gil;
    error = engine.wait(handle, &started, &finished, &kind, &contributors);
  }
  return py::make_tuple(error, started, finished, kind, contributors);
}

void engine_shutdown(Engine& engine) {
  py::gil_scoped_release no_gil;
  engine.shutdown();
}

void engine_abandon(Engine& engine) {
  py::gil_scoped_release no_gil;
  engine.abandon();
}

void engine_set_device_allreduce(Engine& engine, int group, py::function function) {
  // Borrowed: the caller keeps `function` alive as long as the engine (hybridpipe.comm.context does);
  // the engine thread takes the GIL to call it.
  PyObject* raw = function.ptr();
  engine.set_device_allreduce(group, [raw](void* data, size_t count, DType dtype, ReduceOp op, int gpu) {
    py::gil_scoped_acquire gil;
    try {
      return py::handle(raw)(reinterpret_cast<uintptr_t>(data), count, static_cast<int>(dtype), static_cast<int>(op), gpu)
          .cast<bool>();
    } catch (py::error_already_set& error) {  // rethrown as a plain error while the GIL is held
      throw std::runtime_error(std::string("the device allreduce failed: ") + error.what());
    }
  });
}

}  // namespace bindings
}  // namespace hybridpipe
