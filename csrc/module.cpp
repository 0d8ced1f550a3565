// The only binding file of hybridpipe._C: argument conversion and GIL handling, no logic.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mutex>

#include "common.h"
#include "engine.h"
#include "hierarchical.h"
#include "fusion.h"
#include "p2p.h"
#include "ring_allreduce.h"
#include "shm_allreduce.h"
#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>  // MPIX_CUDA_AWARE_SUPPORT, MPIX_Query_cuda_support
#endif
#if defined(HYBRIDPIPE_WITH_CUDA)
#include "cuda/cuda_kernels.h"
#endif

namespace py = pybind11;
using namespace hybridpipe;

namespace {

// Scratch memory shared by all calls; one collective at a time per process uses it.
struct Core {
  std::mutex lock;
  Workspace workspace;
  std::vector<unsigned char> fusion_buffer;
};

Core& core() {
  static Core instance;
  return instance;
}

MPI_Comm to_comm(long long fortran_handle) { return MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_handle)); }

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// Buffer owners whose last reference went on a thread without the GIL (the communication thread, as it
// retires a finished transfer nobody holds any more, e.g. a dropped send). That thread must never wait for
// the GIL: a Python thread that computes holds it for up to the switch interval (5 ms) at a time, and all MPI
// progress (every hop of the pipeline, every collective) would wait with it. They are released by the next
// call into this module that holds the GIL (starting or waiting for a transfer), or release_dropped_owners().
std::mutex dropped_mutex;
std::vector<py::object*>& dropped_owners() {
  static auto* owners = new std::vector<py::object*>();  // never destroyed: threads may add at exit
  return *owners;
}

size_t release_dropped_owners() {  // with the GIL
  std::vector<py::object*> batch;
  {
    std::lock_guard<std::mutex> lock(dropped_mutex);
    batch.swap(dropped_owners());
  }
  for (py::object* owner : batch) delete owner;
  return batch.size();
}

// Holds a Python object for C++ (a transfer's buffer owner) until its last reference goes: at once on a
// thread holding the GIL, else handed to release_dropped_owners (leaked once Python is finalizing).
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

Buffer to_buffer(uintptr_t address, size_t count, int dtype) {
  return Buffer{reinterpret_cast<void*>(address), count, static_cast<DType>(dtype)};
}

// Whether the MPI library moves CUDA device memory itself: 1 yes, 0 no, -1 it cannot say (no query).
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

// True when every rank of `comm` passed the same `fields` (one MPI_Allreduce of max(f), max(-f)).
bool headers_agree(MPI_Comm comm, const std::vector<long long>& fields, const WaitPolicy& policy = {}) {
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

std::string mpi_library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(text, &length);
  std::string version(text, static_cast<size_t>(length));
  while (!version.empty() && (version.back() == '\0' || version.back() == '\n')) version.pop_back();
  return version;  // some MPIs count the terminating NUL in `length`
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hybridpipe C++ core: fused segmented ring allreduce over MPI on buffer descriptors";

  py::enum_<AllreduceAlgorithm>(m, "AllreduceAlgorithm")
      .value("Auto", AllreduceAlgorithm::Auto)
      .value("Ring", AllreduceAlgorithm::Ring)
      .value("Library", AllreduceAlgorithm::Library)
      .value("SharedMemory", AllreduceAlgorithm::SharedMemory)
      .value("Hierarchical", AllreduceAlgorithm::Hierarchical);

  py::class_<WaitPolicy>(m, "WaitPolicy",
                         "How a thread waits for MPI requests: spin_us < 0 is MPI's own (spinning) wait; "
                         "otherwise test for spin_us microseconds, then sleep between tests (up to max_sleep_us).")
      .def(py::init<>())
      .def(py::init([](double spin_us, double max_sleep_us) { return WaitPolicy{spin_us, max_sleep_us}; }),
           py::arg("spin_us"), py::arg("max_sleep_us"))
      .def_readwrite("spin_us", &WaitPolicy::spin_us)
      .def_readwrite("max_sleep_us", &WaitPolicy::max_sleep_us);

  m.def("spinning_wait", &spinning, py::arg("policy"),
        "The policy without its sleeps, making the same MPI calls (a polite one tests until done).");

  py::class_<WireFormat>(m, "WireFormat",
                         "What float32 buffers travel as: dtype -1 (float32) or the code of float16 / bfloat16; "
                         "on_one_host: also between ranks of one host (the ring instead of shared memory).")
      .def(py::init<>())
      .def(py::init([](int dtype, bool on_one_host) { return WireFormat{dtype, on_one_host}; }), py::arg("dtype"),
           py::arg("on_one_host") = false)
      .def_readwrite("dtype", &WireFormat::dtype)
      .def_readwrite("on_one_host", &WireFormat::on_one_host);

  py::class_<AllreduceOptions>(m, "AllreduceOptions")
      .def(py::init<>())
      .def_readwrite("wait", &AllreduceOptions::wait)
      .def_readwrite("unfused_bytes", &AllreduceOptions::unfused_bytes)
      .def_readwrite("segment_bytes", &AllreduceOptions::segment_bytes)
      .def_readwrite("receive_window", &AllreduceOptions::receive_window)
      .def_readwrite("small_message_bytes", &AllreduceOptions::small_message_bytes)
      .def_readwrite("shared_memory", &AllreduceOptions::shared_memory)
      .def_readwrite("shared_memory_chunk_bytes", &AllreduceOptions::shared_memory_chunk_bytes)
      .def_readwrite("hierarchical", &AllreduceOptions::hierarchical)
      .def_readwrite("hierarchical_chunk_bytes", &AllreduceOptions::hierarchical_chunk_bytes)
      .def_readwrite("wire", &AllreduceOptions::wire);

  m.def(
      "hierarchy_info",
      [](long long comm_handle) {
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
      },
      py::arg("comm"),
      "How hierarchical allreduces over `comm` are laid out: hosts, ranks per host (in order of each host's "
      "lowest rank), pieces, whether auto uses it, and how many allreduces used it. Collective the first time it is asked for `comm`.");

  m.def(
      "shared_memory_info",
      [](long long comm_handle, const AllreduceOptions& options, bool create) {
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
      },
      py::arg("comm"), py::arg("options"), py::arg("create") = true,
      "Whether allreduces over `comm` go through a shared-memory segment, its geometry, or why not. With "
      "create (the default) a collective call the first time it is asked for a communicator: it makes the "
      "segment; without, it only reports what earlier calls made.");

  m.def(
      "allreduce",
      [](uintptr_t input, uintptr_t output, size_t count, int dtype, int op, long long comm,
         const AllreduceOptions& options, const std::vector<long long>& header, AllreduceAlgorithm algorithm) {
        py::gil_scoped_release no_gil;
        std::lock_guard<std::mutex> guard(core().lock);
        if (!header.empty() && !headers_agree(to_comm(comm), header, options.wait)) return false;
        allreduce(to_buffer(input, count, dtype), to_buffer(output, count, dtype), static_cast<ReduceOp>(op),
                  to_comm(comm), options, core().workspace, algorithm);
        return true;
      },
      py::arg("input"), py::arg("output"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("comm"),
      py::arg("options"), py::arg("header") = std::vector<long long>{},
      py::arg("algorithm") = AllreduceAlgorithm::Auto,
      "Allreduce `count` elements at address `input` into `output` over the communicator whose Fortran "
      "handle is `comm` (mpi4py: comm.py2f()). With a non-empty `header`, the ranks first check that they "
      "all passed the same header and return False (moving no data) when they did not.");

  m.def(
      "reducescatter",
      [](uintptr_t input, uintptr_t output, const std::vector<size_t>& counts, int dtype, int op, long long comm,
         const AllreduceOptions& options, bool input_is_scratch, AllreduceAlgorithm algorithm) {
        size_t total = 0;
        for (size_t count : counts) total += count;
        py::gil_scoped_release no_gil;
        std::lock_guard<std::mutex> guard(core().lock);
        int rank = 0;
        HP_MPI(MPI_Comm_rank, to_comm(comm), to_comm(comm), &rank);
        if (static_cast<size_t>(rank) >= counts.size()) throw std::invalid_argument("reducescatter: counts shorter than the communicator");
        reducescatter(to_buffer(input, total, dtype), to_buffer(output, counts[static_cast<size_t>(rank)], dtype), counts,
                      static_cast<ReduceOp>(op), to_comm(comm), options, core().workspace, input_is_scratch, algorithm);
      },
      py::arg("input"), py::arg("output"), py::arg("counts"), py::arg("dtype"), py::arg("op"), py::arg("comm"),
      py::arg("options"), py::arg("input_is_scratch") = false, py::arg("algorithm") = AllreduceAlgorithm::Auto,
      "Reduce-scatter of sum(counts) elements at `input` over `comm`: this rank's counts[rank] elements of the "
      "result go to `output` (shared memory, ring or the MPI library, as allreduce chooses).");

  m.def(
      "allgather",
      [](uintptr_t input, uintptr_t output, const std::vector<size_t>& counts, int dtype, long long comm,
         const AllreduceOptions& options, AllreduceAlgorithm algorithm) {
        size_t total = 0;
        for (size_t count : counts) total += count;
        py::gil_scoped_release no_gil;
        std::lock_guard<std::mutex> guard(core().lock);
        int rank = 0;
        HP_MPI(MPI_Comm_rank, to_comm(comm), to_comm(comm), &rank);
        if (static_cast<size_t>(rank) >= counts.size()) throw std::invalid_argument("allgather: counts shorter than the communicator");
        allgather(to_buffer(input, counts[static_cast<size_t>(rank)], dtype), to_buffer(output, total, dtype), counts,
                  to_comm(comm), options, algorithm);
      },
      py::arg("input"), py::arg("output"), py::arg("counts"), py::arg("dtype"), py::arg("comm"), py::arg("options"),
      py::arg("algorithm") = AllreduceAlgorithm::Auto,
      "Allgather over `comm`: this rank's counts[rank] elements at `input` land at their offset of `output` "
      "(sum(counts) elements) on every rank.");

  m.def(
      "headers_agree",
      [](long long comm, const std::vector<long long>& fields, const WaitPolicy& policy) {
        py::gil_scoped_release no_gil;
        return headers_agree(to_comm(comm), fields, policy);
      },
      py::arg("comm"), py::arg("fields"), py::arg("policy") = WaitPolicy{},
      "Whether every rank of `comm` passed the same integers.");

  m.def(
      "grouped_allreduce",
      [](const std::vector<uintptr_t>& inputs, const std::vector<uintptr_t>& outputs,
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
      },
      py::arg("inputs"), py::arg("outputs"), py::arg("counts"), py::arg("dtypes"), py::arg("op"),
      py::arg("comm"), py::arg("fusion_threshold_bytes"), py::arg("options"),
      "Fused allreduce of many buffers (addresses), packed into buckets of fusion_threshold_bytes.");

  py::class_<P2PRequest>(m, "P2PRequest", "An in-flight isend / irecv of raw bytes.")
      .def("test", &P2PRequest::test, "True once the transfer completed (does not block).")
      .def(
          "wait",
          [](P2PRequest& request, const WaitPolicy& policy) {
            {
              py::gil_scoped_release no_gil;
              request.wait(policy);
            }
            release_dropped_owners();
          },
          py::arg("policy") = WaitPolicy{}, "Blocks (without the GIL) until the transfer completed.")
      .def(
          "wait_for",
          [](P2PRequest& request, double timeout_s, const WaitPolicy& policy) {
            bool done = false;
            {
              py::gil_scoped_release no_gil;
              done = request.wait_for(timeout_s, policy);
            }
            release_dropped_owners();
            return done;
          },
          py::arg("timeout_s"), py::arg("policy") = WaitPolicy{},
          "Blocks (without the GIL) until the transfer completed or timeout_s seconds passed; whether it completed.")
      .def("cancel", &P2PRequest::cancel, py::call_guard<py::gil_scoped_release>(),
           "Cancels a receive that has not matched a message yet.")
      .def_property_readonly("done", &P2PRequest::done)
      .def_property_readonly("received_bytes", &P2PRequest::received_bytes)
      .def("__repr__", [](P2PRequest& request) {
        return "<P2PRequest " + request.what() + (request.done() ? " done>" : " in flight>");
      });

  m.def(
      "isend",
      [](uintptr_t address, size_t bytes, int dest, int tag, long long comm, py::object keep) {
        release_dropped_owners();
        return isend(reinterpret_cast<const void*>(address), bytes, dest, tag, to_comm(comm), keep_alive(keep));
      },
      py::arg("address"), py::arg("bytes"), py::arg("dest"), py::arg("tag"), py::arg("comm"),
      py::arg("keep") = py::none(), py::return_value_policy::take_ownership,
      "Starts sending `bytes` bytes at `address` to rank `dest`; `keep` (the object owning the memory) is "
      "held until MPI is done with it, even if the request is dropped.");
  m.def(
      "isend_copy",
      [](py::bytes header, uintptr_t address, size_t bytes, int dest, int tag, long long comm) {
        release_dropped_owners();
        char* head = nullptr;
        Py_ssize_t head_bytes = 0;
        PyBytes_AsStringAndSize(header.ptr(), &head, &head_bytes);
        return isend_copy(head, static_cast<size_t>(head_bytes), reinterpret_cast<const void*>(address), bytes, dest,
                          tag, to_comm(comm));
      },
      py::arg("header"), py::arg("address"), py::arg("bytes"), py::arg("dest"), py::arg("tag"), py::arg("comm"),
      py::return_value_policy::take_ownership,
      "Starts sending one message: `header` followed by `bytes` bytes at `address`, both copied first.");
  m.def(
      "irecv_message",
      [](size_t capacity, int source, int tag, long long comm) {
        release_dropped_owners();
        py::object buffer = py::reinterpret_steal<py::object>(
            PyByteArray_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(capacity)));
        if (!buffer) throw py::error_already_set();
        P2PRequest* request = irecv(PyByteArray_AS_STRING(buffer.ptr()), capacity, source, tag, to_comm(comm),
                                    keep_alive(buffer));
        return py::make_tuple(py::cast(request, py::return_value_policy::take_ownership), buffer);
      },
      py::arg("capacity"), py::arg("source"), py::arg("tag"), py::arg("comm"),
      "Starts receiving a message of at most `capacity` bytes into a new bytearray; returns (request, bytearray).");
  m.def(
      "irecv",
      [](uintptr_t address, size_t bytes, int source, int tag, long long comm, py::object keep) {
        release_dropped_owners();
        return irecv(reinterpret_cast<void*>(address), bytes, source, tag, to_comm(comm), keep_alive(keep));
      },
      py::arg("address"), py::arg("bytes"), py::arg("source"), py::arg("tag"), py::arg("comm"),
      py::arg("keep") = py::none(), py::return_value_policy::take_ownership,
      "Starts receiving at most `bytes` bytes into `address` from rank `source`; `keep` is held as for isend.");
  m.def(
      "wait_any",
      [](const std::vector<P2PRequest*>& requests, const WaitPolicy& policy, double timeout_s) {
        size_t index = 0;
        {
          py::gil_scoped_release no_gil;
          index = wait_any(requests, policy, timeout_s);
        }
        release_dropped_owners();
        return index;
      },
      py::arg("requests"), py::arg("policy") = WaitPolicy{}, py::arg("timeout_s") = -1.0,
      "Blocks until one of the requests completed; returns its index, or len(requests) when timeout_s >= 0 "
      "seconds passed first.");
  m.def("release_dropped_owners", &release_dropped_owners,
        "Releases the buffer owners of finished transfers whose last reference went on the communication thread "
        "(which never takes the GIL); starting or waiting for a transfer does it too. Returns how many.");
  m.def("orphaned_transfers", &orphaned_transfers,
        "Transfers dropped while in flight whose buffers MPI may still use (they are kept until it is done).");
  m.def(
      "transfers_driven", [] { return installed_transfer_queue() != nullptr; },
      "Whether the communication thread makes the MPI calls of point-to-point transfers (after hp.init).");
  m.def(
      "transfer_counts",
      []() -> py::object {
        auto queue = installed_transfer_queue();
        if (!queue) return py::none();
        const TransferQueue::Counts counts = queue->counts();
        py::dict out;
        out["posted_here"] = counts.posted_here;
        out["posted_by_driver"] = counts.posted_by_driver;
        out["completed_here"] = counts.completed_here;
        out["completed_by_driver"] = counts.completed_by_driver;
        return out;
      },
      "After hp.init: how many transfers the requesting threads posted and completed themselves (under the "
      "communication lock) and how many the communication thread did; None without hp.init.");

  py::class_<EngineOptions>(m, "EngineOptions")
      .def(py::init<>())
      .def_readwrite("cycle_time_ms", &EngineOptions::cycle_time_ms)
      .def_readwrite("idle_cycle_time_ms", &EngineOptions::idle_cycle_time_ms)
      .def_readwrite("stall_check_seconds", &EngineOptions::stall_check_seconds)
      .def_readwrite("stall_shutdown_seconds", &EngineOptions::stall_shutdown_seconds)
      .def_readwrite("timeout_seconds", &EngineOptions::timeout_seconds)
      .def_readwrite("fusion_threshold_bytes", &EngineOptions::fusion_threshold_bytes)
      .def_readwrite("allreduce", &EngineOptions::allreduce)
      .def_readwrite("record_events", &EngineOptions::record_events)
      .def_readwrite("thread_nice", &EngineOptions::thread_nice)
      .def_readwrite("waiters_help", &EngineOptions::waiters_help);

  py::class_<EngineEvent>(m, "EngineEvent")
      .def_readonly("phase", &EngineEvent::phase)
      .def_readonly("start", &EngineEvent::start)
      .def_readonly("end", &EngineEvent::end)
      .def_readonly("bytes", &EngineEvent::bytes)
      .def_readonly("tensors", &EngineEvent::tensors);

  py::class_<EngineStats>(m, "EngineStats")
      .def_readonly("cycles", &EngineStats::cycles)
      .def_readonly("slow_rounds", &EngineStats::slow_rounds)
      .def_readonly("tensors", &EngineStats::tensors)
      .def_readonly("buckets", &EngineStats::buckets)
      .def_readonly("shared_memory", &EngineStats::shared_memory)
      .def_readonly("helped", &EngineStats::helped)
      .def_readonly("bytes", &EngineStats::bytes)
      .def_readonly("stall_warnings", &EngineStats::stall_warnings)
      .def_readonly("cuda_buckets", &EngineStats::cuda_buckets)
      .def_readonly("cuda_launches", &EngineStats::cuda_launches)
      .def_readonly("cuda_aware_buckets", &EngineStats::cuda_aware_buckets);

  py::enum_<ErrorKind>(m, "ErrorKind", "Why an engine handle failed.")
      .value("None_", ErrorKind::None)
      .value("Mismatch", ErrorKind::Mismatch)
      .value("Stalled", ErrorKind::Stalled)
      .value("Stopped", ErrorKind::Stopped)
      .value("Failed", ErrorKind::Failed)
      .value("Refused", ErrorKind::Refused)
      .value("Joined", ErrorKind::Joined)
      .value("Departed", ErrorKind::Departed);

  py::class_<Engine>(m, "Engine", "The background negotiation + fusion + ring-allreduce thread.")
      .def(py::init<const EngineOptions&>(), py::arg("options"))
      .def(
          "add_group",
          [](Engine& engine, long long comm, const std::string& label) {
            py::gil_scoped_release no_gil;
            return engine.add_group(to_comm(comm), label);
          },
          py::arg("comm"), py::arg("label"))
      .def(
          "start",
          [](Engine& engine) {
            py::gil_scoped_release no_gil;
            engine.start();
          },
          "Starts the communication thread (groups added before it are active from its first cycle).")
      .def(
          "submit",
          [](Engine& engine, int group, const std::string& name, uintptr_t address, size_t count, int dtype, int op,
             int device, uintptr_t output, uintptr_t ready_event, const WireFormat& wire) {
            return engine.submit(group, name, to_buffer(address, count, dtype), static_cast<ReduceOp>(op), device,
                                 output ? to_buffer(output, count, dtype) : Buffer{}, ready_event, wire);
          },
          py::arg("group"), py::arg("name"), py::arg("address"), py::arg("count"), py::arg("dtype"), py::arg("op"),
          py::arg("device") = 0, py::arg("output") = 0, py::arg("ready_event") = 0, py::arg("wire") = WireFormat{},
          "Queues an allreduce of the buffer at `address`; with `output`, the result is written there and the "
          "input only read (out of place). With `ready_event` (a CUDA event handle), the buffer is reduced only "
          "after that event has completed (polled by the engine thread, never waited on). `wire`: what a float32 "
          "buffer travels as (WireFormat; every rank must pass the same).")
      .def(
          "submit_call",
          [](Engine& engine, int group, const std::string& name, int kind, py::function function) {
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
          },
          py::arg("group"), py::arg("name"), py::arg("kind"), py::arg("function"),
          "Queues function() to run on the engine thread at a point every rank of the group agrees on; "
          "keep a reference to function until the handle is waited for.")
      .def(
          "submit_reducescatter",
          [](Engine& engine, int group, const std::string& name, int kind, uintptr_t input, uintptr_t output,
             const std::vector<size_t>& counts, int dtype, int op, bool input_is_scratch) {
            size_t total = 0;
            for (size_t count : counts) total += count;
            const Buffer in = to_buffer(input, total, dtype);
            const std::vector<size_t> parts = counts;
            return engine.submit_collective(
                group, name, kind,
                [in, output, parts, dtype, op, input_is_scratch](MPI_Comm comm, Workspace& workspace,
                                                                  const AllreduceOptions& options) {
                  int rank = 0;
                  HP_MPI(MPI_Comm_rank, comm, comm, &rank);
                  if (static_cast<size_t>(rank) >= parts.size()) {
                    throw std::invalid_argument("submit_reducescatter: counts shorter than the group");
                  }
                  reducescatter(in, to_buffer(output, parts[static_cast<size_t>(rank)], dtype), parts,
                                static_cast<ReduceOp>(op), comm, options, workspace, input_is_scratch);
                });
          },
          py::arg("group"), py::arg("name"), py::arg("kind"), py::arg("input"), py::arg("output"), py::arg("counts"),
          py::arg("dtype"), py::arg("op"), py::arg("input_is_scratch") = false,
          "Queues a reduce-scatter of the sum(counts) elements at `input` over the group; rank r receives its "
          "counts[r] elements at `output`. `kind` must agree on every rank (a digest of the layout).")
      .def(
          "submit_allgather",
          [](Engine& engine, int group, const std::string& name, int kind, uintptr_t input, uintptr_t output,
             const std::vector<size_t>& counts, int dtype) {
            size_t total = 0;
            for (size_t count : counts) total += count;
            const Buffer out = to_buffer(output, total, dtype);
            const std::vector<size_t> parts = counts;
            return engine.submit_collective(
                group, name, kind,
                [input, out, parts, dtype](MPI_Comm comm, Workspace&, const AllreduceOptions& options) {
                  int rank = 0;
                  HP_MPI(MPI_Comm_rank, comm, comm, &rank);
                  if (static_cast<size_t>(rank) >= parts.size()) {
                    throw std::invalid_argument("submit_allgather: counts shorter than the group");
                  }
                  allgather(to_buffer(input, parts[static_cast<size_t>(rank)], dtype), out, parts, comm, options);
                });
          },
          py::arg("group"), py::arg("name"), py::arg("kind"), py::arg("input"), py::arg("output"), py::arg("counts"),
          py::arg("dtype"),
          "Queues an allgather over the group: rank r's counts[r] elements at `input` land at their offset of "
          "`output` (sum(counts) elements) on every rank.")
      .def("submit_tuning", &Engine::submit_tuning, py::arg("group"), py::arg("name"),
           py::arg("fusion_threshold_bytes"), py::arg("cycle_time_ms"),
           "Queues a change of the fusion threshold and cycle time (autotuning), agreed like submit_call.")
      .def("tuning", &Engine::tuning, "(fusion_threshold_bytes, cycle_time_ms) in effect.")
      .def("submit_refusal", &Engine::submit_refusal, py::arg("group"), py::arg("name"), py::arg("refusal"),
           py::arg("detached"),
           "Stands in for an operation whose arguments failed this rank's checks: the other ranks' operations "
           "under `name` fail (ErrorKind.Refused) naming this rank and `refusal`. Returns a handle (0 if detached).")
      .def("submit_join", &Engine::submit_join, py::arg("group"),
           "Horovod's join on this group (see engine.h); the handle is done once every rank joined.")
      .def("last_joined", &Engine::last_joined, py::arg("group"))
      .def("hosts", &Engine::hosts, "Every rank's host name (MPI_Get_processor_name), in world rank order.")
      .def("drive_transfers", &Engine::drive_transfers,
           "From now on the engine's thread makes every point-to-point transfer's MPI calls (before start()).")
      .def("poll", &Engine::poll, py::arg("handle"))
      .def(
          "wait",
          [](Engine& engine, uint64_t handle) {
            double started = 0, finished = 0;
            std::string error;
            ErrorKind kind = ErrorKind::None;
            int contributors = 0;
            {
              py::gil_scoped_release no_gil;
              error = engine.wait(handle, &started, &finished, &kind, &contributors);
            }
            return py::make_tuple(error, started, finished, kind, contributors);
          },
          "Blocks until done; returns (error message or '', started, finished, ErrorKind, contributors): "
          "contributors is 0, or how many ranks contributed to an allreduce that ran while ranks had joined.",
          py::arg("handle"))
      .def(
          "shutdown",
          [](Engine& engine) {
            py::gil_scoped_release no_gil;
            engine.shutdown();
          })
      .def("leave_failed", &Engine::leave_failed,
           "This rank failed (an uncaught exception): take no new work; ranks waiting for it in a collective fail "
           "(ErrorKind.Departed) at once")
      .def(
          "set_device_allreduce",
          [](Engine& engine, int group, py::function function) {
            // Borrowed: the caller keeps `function` alive as long as the engine (hybridpipe.comm.context does);
            // the engine thread takes the GIL to call it.
            PyObject* raw = function.ptr();
            engine.set_device_allreduce(group, [raw](void* data, size_t count, DType dtype, ReduceOp op, int gpu) {
              py::gil_scoped_acquire gil;
              try {
                return py::handle(raw)(reinterpret_cast<uintptr_t>(data), count, static_cast<int>(dtype),
                                       static_cast<int>(op), gpu)
                    .cast<bool>();
              } catch (py::error_already_set& error) {  // rethrown as a plain error while the GIL is held
                throw std::runtime_error(std::string("the device allreduce failed: ") + error.what());
              }
            });
          },
          py::arg("group"), py::arg("function"),
          "Buckets of CUDA tensors of `group` go to function(address, count, dtype, op, gpu) -> bool in device "
          "memory (a build with the CUDA kernels); False: staged through pinned host memory instead.")
      .def("stats", &Engine::stats, py::arg("group"))
      .def("take_events", &Engine::take_events, py::arg("group"));

  m.def("wire_bytes_sent", &wire_bytes_sent,
        "Bytes handed to MPI by the ring's sends and the library allreduce path since the process started.");
  m.def("mpi_build_info", &mpi_build_info, "The MPI implementation and version this module was compiled with.");
  m.def("mpi_library_version", &mpi_library_version, "MPI_Get_library_version() of the libmpi loaded now.");
  m.def("dtype_size", [](int dtype) { return dtype_size(static_cast<DType>(dtype)); });
  m.def("mpi_cuda_support", &mpi_cuda_support,
        "1 when the loaded MPI moves CUDA device memory itself, 0 when it does not, -1 when it cannot say.");
#if defined(HYBRIDPIPE_WITH_CUDA)
  m.def(
      "cuda_reduce_into",
      [](uintptr_t accumulator, uintptr_t incoming, size_t count, int dtype, int op, uintptr_t stream) {
        py::gil_scoped_release release;
        cuda_reduce_into(reinterpret_cast<void*>(accumulator), reinterpret_cast<const void*>(incoming), count,
                         static_cast<DType>(dtype), static_cast<ReduceOp>(op), reinterpret_cast<void*>(stream));
      },
      py::arg("accumulator"), py::arg("incoming"), py::arg("count"), py::arg("dtype"), py::arg("op"),
      py::arg("stream") = 0,
      "accumulator = op(accumulator, incoming) on the GPU, queued on `stream` (a cudaStream_t; 0: the default).");
  m.def("cuda_device_count", &cuda_device_count, "Visible CUDA devices (0 without a driver or GPU).");
#endif
  m.attr("cuda_compiled") = py::bool_(
#if defined(HYBRIDPIPE_WITH_CUDA)
      true
#else
      false
#endif
  );

  py::register_exception_translator([](std::exception_ptr pointer) {
    // hybridpipe.errors.MPIError, looked up once and kept for the life of the process.
    static PyObject* mpi_error_class = nullptr;
    try {
      if (pointer) std::rethrow_exception(pointer);
    } catch (const MPICallError& error) {
      if (!mpi_error_class) mpi_error_class = py::object(py::module_::import("hybridpipe.errors").attr("MPIError")).release().ptr();
      PyErr_SetString(mpi_error_class, error.what());
    }
  });
}
