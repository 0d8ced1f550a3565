// The only binding file of hybridpipe._C: registrations only. What a binding does is a named function of
// direct_ops.cpp (the blocking collectives), transfer_ops.cpp (point-to-point), engine_py.cpp (the engine) and
// zero_ops.cpp (ZeRO's collectives on the engine), with py_glue.h's shared conversions.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common.h"
#include "direct_ops.h"
#include "engine.h"
#include "engine_py.h"
#include "p2p.h"
#include "py_glue.h"
#include "ring_allreduce.h"
#include "transfer_ops.h"
#include "zero_ops.h"
#if defined(HYBRIDPIPE_WITH_CUDA)
#include "cuda/cuda_kernels.h"  // cuda_device_count
#endif

namespace py = pybind11;
using namespace hybridpipe;
using namespace hybridpipe::bindings;

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
      .def(py::init(&make_wait_policy),
           py::arg("spin_us"), py::arg("max_sleep_us"))
      .def_readwrite("spin_us", &WaitPolicy::spin_us)
      .def_readwrite("max_sleep_us", &WaitPolicy::max_sleep_us);

  m.def("spinning_wait", &spinning, py::arg("policy"),
        "The policy without its sleeps, making the same MPI calls (a polite one tests until done).");

  py::class_<WireFormat>(m, "WireFormat",
                         "What float32 buffers travel as: dtype -1 (float32) or the code of float16 / bfloat16; "
                         "on_one_host: also between ranks of one host (the ring instead of shared memory).")
      .def(py::init<>())
      .def(py::init(&make_wire_format), py::arg("dtype"),
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
      &hierarchy_info,
      py::arg("comm"),
      "How hierarchical allreduces over `comm` are laid out: hosts, ranks per host (in order of each host's "
      "lowest rank), pieces, whether auto uses it, and how many allreduces used it. Collective the first time it is asked for `comm`.");

  m.def(
      "shared_memory_info",
      &shared_memory_info,
      py::arg("comm"), py::arg("options"), py::arg("create") = true,
      "Whether allreduces over `comm` go through a shared-memory segment, its geometry, or why not. With "
      "create (the default) a collective call the first time it is asked for a communicator: it makes the "
      "segment; without, it only reports what earlier calls made.");

  m.def(
      "allreduce",
      &allreduce_direct,
      py::arg("input"), py::arg("output"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("comm"),
      py::arg("options"), py::arg("header") = std::vector<long long>{},
      py::arg("algorithm") = AllreduceAlgorithm::Auto,
      "Allreduce `count` elements at address `input` into `output` over the communicator whose Fortran "
      "handle is `comm` (mpi4py: comm.py2f()). With a non-empty `header`, the ranks first check that they "
      "all passed the same header and return False (moving no data) when they did not.");

  m.def(
      "reducescatter",
      &reducescatter_direct,
      py::arg("input"), py::arg("output"), py::arg("counts"), py::arg("dtype"), py::arg("op"), py::arg("comm"),
      py::arg("options"), py::arg("input_is_scratch") = false, py::arg("algorithm") = AllreduceAlgorithm::Auto,
      "Reduce-scatter of sum(counts) elements at `input` over `comm`: this rank's counts[rank] elements of the "
      "result go to `output` (shared memory, ring or the MPI library, as allreduce chooses).");

  m.def(
      "allgather",
      &allgather_direct,
      py::arg("input"), py::arg("output"), py::arg("counts"), py::arg("dtype"), py::arg("comm"), py::arg("options"),
      py::arg("algorithm") = AllreduceAlgorithm::Auto,
      "Allgather over `comm`: this rank's counts[rank] elements at `input` land at their offset of `output` "
      "(sum(counts) elements) on every rank.");

  m.def(
      "headers_agree",
      &headers_agree_direct,
      py::arg("comm"), py::arg("fields"), py::arg("policy") = WaitPolicy{},
      "Whether every rank of `comm` passed the same integers.");

  m.def(
      "grouped_allreduce",
      &grouped_allreduce_direct,
      py::arg("inputs"), py::arg("outputs"), py::arg("counts"), py::arg("dtypes"), py::arg("op"),
      py::arg("comm"), py::arg("fusion_threshold_bytes"), py::arg("options"),
      "Fused allreduce of many buffers (addresses), packed into buckets of fusion_threshold_bytes.");

  py::class_<P2PRequest>(m, "P2PRequest", "An in-flight isend / irecv of raw bytes.")
      .def("test", &P2PRequest::test, "True once the transfer completed (does not block).")
      .def(
          "wait",
          &p2p_wait,
          py::arg("policy") = WaitPolicy{}, "Blocks (without the GIL) until the transfer completed.")
      .def(
          "wait_for",
          &p2p_wait_for,
          py::arg("timeout_s"), py::arg("policy") = WaitPolicy{},
          "Blocks (without the GIL) until the transfer completed or timeout_s seconds passed; whether it completed.")
      .def("cancel", &P2PRequest::cancel, py::call_guard<py::gil_scoped_release>(),
           "Cancels a receive that has not matched a message yet.")
      .def_property_readonly("done", &P2PRequest::done)
      .def_property_readonly("received_bytes", &P2PRequest::received_bytes)
      .def("__repr__", &p2p_repr);

  m.def(
      "isend",
      &isend_py,
      py::arg("address"), py::arg("bytes"), py::arg("dest"), py::arg("tag"), py::arg("comm"),
      py::arg("keep") = py::none(), py::return_value_policy::take_ownership,
      "Starts sending `bytes` bytes at `address` to rank `dest`; `keep` (the object owning the memory) is "
      "held until MPI is done with it, even if the request is dropped.");
  m.def(
      "isend_copy",
      &isend_copy_py,
      py::arg("header"), py::arg("address"), py::arg("bytes"), py::arg("dest"), py::arg("tag"), py::arg("comm"),
      py::return_value_policy::take_ownership,
      "Starts sending one message: `header` followed by `bytes` bytes at `address`, both copied first.");
  m.def(
      "irecv_message",
      &irecv_message_py,
      py::arg("capacity"), py::arg("source"), py::arg("tag"), py::arg("comm"),
      "Starts receiving a message of at most `capacity` bytes into a new bytearray; returns (request, bytearray).");
  m.def(
      "irecv",
      &irecv_py,
      py::arg("address"), py::arg("bytes"), py::arg("source"), py::arg("tag"), py::arg("comm"),
      py::arg("keep") = py::none(), py::return_value_policy::take_ownership,
      "Starts receiving at most `bytes` bytes into `address` from rank `source`; `keep` is held as for isend.");
  m.def(
      "wait_any",
      &wait_any_py,
      py::arg("requests"), py::arg("policy") = WaitPolicy{}, py::arg("timeout_s") = -1.0,
      "Blocks until one of the requests completed; returns its index, or len(requests) when timeout_s >= 0 "
      "seconds passed first.");
  m.def("release_dropped_owners", &release_dropped_owners,
        "Releases the buffer owners of finished transfers whose last reference went on the communication thread "
        "(which never takes the GIL); starting or waiting for a transfer does it too. Returns how many.");
  m.def("orphaned_transfers", &orphaned_transfers,
        "Transfers dropped while in flight whose buffers MPI may still use (they are kept until it is done).");
  m.def(
      "transfers_driven", &transfers_driven,
      "Whether the communication thread makes the MPI calls of point-to-point transfers (after hp.init).");
  m.def(
      "transfer_counts",
      &transfer_counts,
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
      .value("Departed", ErrorKind::Departed)
      .value("RanksLost", ErrorKind::RanksLost);

  py::class_<Engine>(m, "Engine", "The background negotiation + fusion + ring-allreduce thread.")
      .def(py::init<const EngineOptions&>(), py::arg("options"))
      .def(
          "add_group",
          &engine_add_group,
          py::arg("comm"), py::arg("label"))
      .def(
          "start",
          &engine_start,
          "Starts the communication thread (groups added before it are active from its first cycle).")
      .def(
          "submit",
          &engine_submit,
          py::arg("group"), py::arg("name"), py::arg("address"), py::arg("count"), py::arg("dtype"), py::arg("op"),
          py::arg("device") = 0, py::arg("output") = 0, py::arg("ready_event") = 0, py::arg("wire") = WireFormat{},
          "Queues an allreduce of the buffer at `address`; with `output`, the result is written there and the "
          "input only read (out of place). With `ready_event` (a CUDA event handle), the buffer is reduced only "
          "after that event has completed (polled by the engine thread, never waited on). `wire`: what a float32 "
          "buffer travels as (WireFormat; every rank must pass the same).")
      .def(
          "submit_call",
          &engine_submit_call,
          py::arg("group"), py::arg("name"), py::arg("kind"), py::arg("function"),
          "Queues function() to run on the engine thread at a point every rank of the group agrees on; "
          "keep a reference to function until the handle is waited for.")
      .def(
          "submit_reducescatter",
          &submit_reducescatter,
          py::arg("group"), py::arg("name"), py::arg("kind"), py::arg("input"), py::arg("output"), py::arg("counts"),
          py::arg("dtype"), py::arg("op"), py::arg("input_is_scratch") = false,
          "Queues a reduce-scatter of the sum(counts) elements at `input` over the group; rank r receives its "
          "counts[r] elements at `output`. `kind` must agree on every rank (a digest of the layout).")
      .def(
          "submit_allgather",
          &submit_allgather,
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
          &engine_wait,
          "Blocks until done; returns (error message or '', started, finished, ErrorKind, contributors): "
          "contributors is 0, or how many ranks contributed to an allreduce that ran while ranks had joined.",
          py::arg("handle"))
      .def(
          "shutdown",
          &engine_shutdown)
      .def("abandon", &engine_abandon,
           "Ends the engine without its peers after ranks were lost: revokes its communicators, joins its thread.")
      .def("lost_ranks", &Engine::lost_ranks,
           "World ranks reported lost while surviving failures (handles failed with ErrorKind.RanksLost).")
      .def("ranks_were_lost", &Engine::ranks_were_lost,
           "Whether the engine stopped because ranks were lost (lost_ranks() may not know which yet).")
      .def("leave_failed", &Engine::leave_failed,
           "This rank failed (an uncaught exception): take no new work; ranks waiting for it in a collective fail "
           "(ErrorKind.Departed) at once")
      .def(
          "set_device_allreduce",
          &engine_set_device_allreduce,
          py::arg("group"), py::arg("function"),
          "Buckets of CUDA tensors of `group` go to function(address, count, dtype, op, gpu) -> bool in device "
          "memory (a build with the CUDA kernels); False: staged through pinned host memory instead.")
      .def("stats", &Engine::stats, py::arg("group"))
      .def("take_events", &Engine::take_events, py::arg("group"));

  m.def("wire_bytes_sent", &wire_bytes_sent,
        "Bytes handed to MPI by the ring's sends and the library allreduce path since the process started.");
  m.def("set_survive_process_failures", &set_survive_process_failures, py::arg("on"),
        "While on, a failed process fails the engine's operations (ErrorKind.RanksLost) instead of aborting the job "
        "(needs ULFM: ulfm_compiled()).");
  m.def("survive_process_failures", &survive_process_failures);
  m.def("exit_if_alive_after", &exit_if_alive_after, py::arg("seconds"), py::arg("message"), py::arg("code"),
        "Ends the process with `code` (`message` on stderr) if it still runs `seconds` from now (a native thread): "
        "the survivors' bound on MPI_Finalize after ranks died (open-mpi/ompi#11404).");
  m.def("ulfm_compiled", &ulfm_compiled, "Whether the MPI this module was built with has ULFM (MPIX_Comm_revoke).");
  m.def("mpi_build_info", &mpi_build_info, "The MPI implementation and version this module was compiled with.");
  m.def("mpi_library_version", &mpi_library_version, "MPI_Get_library_version() of the libmpi loaded now.");
  m.def("dtype_size", &dtype_size_of);
  m.def("mpi_cuda_support", &mpi_cuda_support,
        "1 when the loaded MPI moves CUDA device memory itself, 0 when it does not, -1 when it cannot say.");
#if defined(HYBRIDPIPE_WITH_CUDA)
  m.def(
      "cuda_reduce_into",
      &cuda_reduce_into_direct,
      py::arg("accumulator"), py::arg("incoming"), py::arg("count"), py::arg("dtype"), py::arg("op"),
      py::arg("stream") = 0,
      "accumulator = op(accumulator, incoming) on the GPU, queued on `stream` (a cudaStream_t; 0: the default).");
  m.def("cuda_device_count", &cuda_device_count, "Visible CUDA devices (0 without a driver or GPU).");
#endif
  m.attr("cuda_compiled") = py::bool_(cuda_compiled());

  py::register_exception_translator(&translate_mpi_error);
}
