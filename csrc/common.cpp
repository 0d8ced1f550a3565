// Dtype/op names and the MPI error formatter declared in common.h.
#include "common.h"

#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <sstream>
#include <thread>

#include <unistd.h>

namespace hybridpipe {

thread_local ProgressHook progress_hook;

bool cuda_event_done(uintptr_t event) {
  using Query = int (*)(void*);
  static const Query query = [] {
    void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    return driver ? reinterpret_cast<Query>(dlsym(driver, "cuEventQuery")) : nullptr;
  }();
  if (!query) {
    throw std::runtime_error("a CUDA ready event was passed, but the CUDA driver (libcuda.so.1, cuEventQuery) "
                             "cannot be loaded in this process");
  }
  constexpr int kSuccess = 0, kNotReady = 600;  // CUDA_SUCCESS, CUDA_ERROR_NOT_READY
  const int status = query(reinterpret_cast<void*>(event));
  if (status == kSuccess) return true;
  if (status == kNotReady) return false;
  throw std::runtime_error("cuEventQuery of a tensor's ready event failed with CUDA error " + std::to_string(status));
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::Float32: return 4;
    case DType::Float64: return 8;
    case DType::Float16: return 2;
    case DType::BFloat16: return 2;
    case DType::Int32: return 4;
    case DType::Int64: return 8;
  }
  throw std::invalid_argument("unknown dtype code " + std::to_string(static_cast<int>(dtype)));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
  }
  return "unknown";
}

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "Sum";
    case ReduceOp::Average: return "Average";
    case ReduceOp::Min: return "Min";
    case ReduceOp::Max: return "Max";
  }
  return "unknown";
}

bool is_half(DType dtype) { return dtype == DType::Float16 || dtype == DType::BFloat16; }

WaitPolicy spinning(const WaitPolicy& policy) {
  constexpr double kForeverUs = 1e12;  // a spin this long never reaches the sleeps
  return policy.spin_us < 0 ? policy : WaitPolicy{kForeverUs, policy.max_sleep_us};
}

int wait_all(int count, MPI_Request* requests, MPI_Status* statuses, const WaitPolicy& policy) {
  if (count == 0) return MPI_SUCCESS;
  if (policy.spin_us < 0) return MPI_Waitall(count, requests, statuses);
  return polite_wait([&](int* flag) { return MPI_Testall(count, requests, flag, statuses); }, policy);
}

int wait_any(int count, MPI_Request* requests, int* index, MPI_Status* status, const WaitPolicy& policy) {
  if (policy.spin_us < 0) return MPI_Waitany(count, requests, index, status);
  return polite_wait([&](int* flag) { return MPI_Testany(count, requests, index, flag, status); }, policy);
}

int allreduce_waiting(const void* send, void* receive, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm,
                      const WaitPolicy& policy) {
  if (policy.spin_us < 0) return MPI_Allreduce(send, receive, count, type, op, comm);
  MPI_Request request = MPI_REQUEST_NULL;
  const int rc = MPI_Iallreduce(send, receive, count, type, op, comm, &request);
  if (rc != MPI_SUCCESS) return rc;
  return wait_all(1, &request, MPI_STATUSES_IGNORE, policy);
}

void raise_mpi_error(int code, const char* call, MPI_Comm comm) {
  int rank = -1;
  // The communicator itself may be what is broken: fall back to the world rank.
  if (comm == MPI_COMM_NULL || MPI_Comm_rank(comm, &rank) != MPI_SUCCESS) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  }
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) length = 0;
  std::ostringstream message;
  message << "rank " << rank << ": " << call << " failed with error code " << code << " ("
          << std::string(text, static_cast<size_t>(length)) << ")";
  throw MPICallError(message.str(), code);
}

bool is_process_failure(int code) {
#if defined(MPIX_ERR_PROC_FAILED)
  if (code == 0) return false;
  int error_class = code;
  MPI_Error_class(code, &error_class);
  return error_class == MPIX_ERR_PROC_FAILED
#if defined(MPIX_ERR_PROC_FAILED_PENDING)
         || error_class == MPIX_ERR_PROC_FAILED_PENDING
#endif
#if defined(MPIX_ERR_REVOKED)
         || error_class == MPIX_ERR_REVOKED
#endif
      ;
#else
  (void)code;
  return false;
#endif
}

namespace {
std::atomic<bool> surviving{false};
}  // namespace

bool ulfm_compiled() {
#if defined(OMPI_HAVE_MPI_EXT_FTMPI) && OMPI_HAVE_MPI_EXT_FTMPI
  return true;
#else
  return false;
#endif
}

void set_survive_process_failures(bool on) {
  if (on && !ulfm_compiled()) {
    throw std::runtime_error("surviving a failed process needs an MPI with ULFM (Open MPI 5 started with --with-ft "
                             "ulfm); this module was built without it");
  }
  surviving.store(on, std::memory_order_release);
}

bool survive_process_failures() { return surviving.load(std::memory_order_acquire); }

void exit_if_alive_after(double seconds, const std::string& message, int code) {
  std::thread([seconds, message, code] {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    const std::string line = message + "\n";
    ssize_t written = ::write(STDERR_FILENO, line.data(), line.size());
    (void)written;
    ::_exit(code);
  }).detach();
}

void revoke(MPI_Comm comm) {
#if defined(OMPI_HAVE_MPI_EXT_FTMPI) && OMPI_HAVE_MPI_EXT_FTMPI
  if (comm != MPI_COMM_NULL) MPIX_Comm_revoke(comm);
#else
  (void)comm;
#endif
}

std::vector<int> failed_ranks(MPI_Comm comm) {
  std::vector<int> failed;
#if defined(OMPI_HAVE_MPI_EXT_FTMPI) && OMPI_HAVE_MPI_EXT_FTMPI
  if (comm == MPI_COMM_NULL) return failed;
  MPI_Group failed_group = MPI_GROUP_NULL, all = MPI_GROUP_NULL;
  if (MPIX_Comm_get_failed(comm, &failed_group) != MPI_SUCCESS || failed_group == MPI_GROUP_NULL) return failed;
  int count = 0;
  MPI_Group_size(failed_group, &count);
  std::vector<int> ranks(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) ranks[static_cast<size_t>(i)] = i;
  failed.resize(static_cast<size_t>(count));
  MPI_Comm_group(comm, &all);
  MPI_Group_translate_ranks(failed_group, count, ranks.data(), all, failed.data());
  MPI_Group_free(&all);
  MPI_Group_free(&failed_group);
  std::sort(failed.begin(), failed.end());
#else
  (void)comm;
#endif
  return failed;
}

}  // namespace hybridpipe
