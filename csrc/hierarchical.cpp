// Hierarchical allreduce; see hierarchical.h.
#include "hierarchical.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "reduce.h"
#include "shm_allreduce.h"

namespace hybridpipe {
namespace {

// Piece p of `count` elements cut into `parts`: the first count % parts pieces get one more.
void piece_span(size_t count, size_t parts, size_t index, size_t* begin, size_t* length) {
  const size_t base = count / parts, extra = count % parts;
  *begin = index * base + std::min(index, extra);
  *length = base + (index < extra ? 1 : 0);
}

Buffer slice(const Buffer& buffer, size_t begin, size_t length) {
  Buffer part = buffer;
  part.data = static_cast<unsigned char*>(buffer.data) + begin * dtype_size(buffer.dtype);
  part.count = length;
  return part;
}

// Divides `count` elements of `data` by `divisor` (Average's last step), half types through float32.
void divide(void* data, size_t count, DType dtype, size_t divisor, Workspace& workspace, size_t slot) {
  if (count == 0) return;
  if (!is_half(dtype)) {
    finalize_average(data, count, dtype, divisor);
    return;
  }
  auto* work = static_cast<float*>(workspace.get(slot, count * sizeof(float)));
  half_to_float(data, work, count, dtype);
  finalize_average(work, count, DType::Float32, divisor);
  float_to_half(work, data, count, dtype);
}

int delete_cached(MPI_Comm, int, void* value, void*) {
  delete static_cast<Hierarchy*>(value);
  return MPI_SUCCESS;
}

int cache_key() {
  static const int key = [] {
    int created = MPI_KEYVAL_INVALID;
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, delete_cached, &created, nullptr);
    return created;
  }();
  return key;
}

// What the two threads of the pipeline tell each other: chunks reduced inside the host (the helper's step
// 1), chunks carried between hosts (the calling thread's step 2), and the first failure of either.
class Handoff {
 public:
  void reduced(size_t chunks) { set(&reduced_, chunks); }
  void carried(size_t chunks) { set(&carried_, chunks); }
  // Wait until that many chunks are reduced / carried; false when the other thread failed.
  bool wait_reduced(size_t chunks) { return wait(&reduced_, chunks); }
  bool wait_carried(size_t chunks) { return wait(&carried_, chunks); }
  void fail(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) error_ = error;
    changed_.notify_all();
  }
  std::exception_ptr error() {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

 private:
  void set(size_t* counter, size_t value) {
    std::lock_guard<std::mutex> lock(mutex_);
    *counter = value;
    changed_.notify_all();
  }
  bool wait(const size_t* counter, size_t value) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return *counter >= value || error_; });
    return !error_;
  }
  std::mutex mutex_;
  std::condition_variable changed_;
  size_t reduced_ = 0, carried_ = 0;
  std::exception_ptr error_;
};

constexpr size_t kDivideSlot = 7;  // a workspace slot the ring and library paths do not use
constexpr size_t kMaxBroadcastBytes = size_t(1) << 30;
// Smaller buffers (the engine's fused buckets) go through the steps in one chunk: their pipeline's extra
// transfers and hand-offs cost more than it hides where the cores are the bottleneck (docs/benchmarks.md).
constexpr size_t kMinChunks = 4;
constexpr size_t kRampSteps = 4;  // the first and last chunks: 1/16, 1/8, 1/4, 1/2 of the nominal one

// The bytes an element of `buffer` puts on the link between hosts: a nominal chunk is that many bytes there, so
// a float32 buffer with a 16-bit wire format goes in chunks of twice the elements, each as long on the link as
// a plain chunk (with plain chunks, half-length transfers would pay the per-chunk costs twice as often).
size_t wire_element_bytes(const Buffer& buffer, const AllreduceOptions& options) {
  return options.wire.narrows(buffer.dtype) ? dtype_size(static_cast<DType>(options.wire.dtype))
                                            : dtype_size(buffer.dtype);
}

}  // namespace

Hierarchy::Hierarchy(MPI_Comm comm) : comm_(comm) {
  int rank = 0;
  HP_MPI(MPI_Comm_rank, comm, comm, &rank);
  HP_MPI(MPI_Comm_size, comm, comm, &size_);
  HP_MPI(MPI_Comm_split_type, comm, comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local_);
  MPI_Comm_set_errhandler(local_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(local_, &local_rank_);
  MPI_Comm_size(local_, &local_size_);
  // every rank's (local size, local rank): hosts are counted by their local rank 0
  int mine[2] = {local_size_, local_rank_};
  std::vector<int> all(2 * static_cast<size_t>(size_));
  HP_MPI(MPI_Allgather, comm, mine, 2, MPI_INT, all.data(), 2, MPI_INT, comm);
  hosts_ = 0;
  pieces_ = 1;
  for (int r = 0; r < size_; ++r) {
    pieces_ = std::max(pieces_, all[2 * r]);
    if (all[2 * r + 1] == 0) {
      ++hosts_;
      ranks_per_host_.push_back(all[2 * r]);
    }
  }
  piece_comms_.assign(static_cast<size_t>(pieces_), MPI_COMM_NULL);
  if (hosts_ < 2) return;  // all on one host: never used (one rank per host: one piece, over all the ranks)
  first_piece_ = pieces_;
  end_piece_ = 0;
  for (int p = 0; p < pieces_; ++p) {  // the carriers of piece p: local rank p * k / P on each host
    if (carrier(p) == local_rank_) {
      first_piece_ = std::min(first_piece_, p);
      end_piece_ = p + 1;
    }
    const int color = carrier(p) == local_rank_ ? p : MPI_UNDEFINED;
    HP_MPI(MPI_Comm_split, comm, comm, color, rank, &piece_comms_[static_cast<size_t>(p)]);
    if (piece_comms_[static_cast<size_t>(p)] != MPI_COMM_NULL) {
      MPI_Comm_set_errhandler(piece_comms_[static_cast<size_t>(p)], MPI_ERRORS_RETURN);
    }
  }
}

Hierarchy::~Hierarchy() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  for (MPI_Comm& piece : piece_comms_) {
    if (piece != MPI_COMM_NULL) MPI_Comm_free(&piece);
  }
  if (local_ != MPI_COMM_NULL) MPI_Comm_free(&local_);
}

std::vector<size_t> Hierarchy::chunk_lengths(size_t count, size_t element_bytes, size_t chunk_bytes) {
  const size_t nominal = std::max<size_t>(1, chunk_bytes / std::max<size_t>(1, element_bytes));
  if (chunk_bytes == 0 || count < kMinChunks * nominal) return {count};
  std::vector<size_t> ramp;  // the first chunks, smallest first; the last ones mirror them
  size_t ramped = 0;
  for (size_t step = kRampSteps; step > 0; --step) {
    const size_t length = nominal >> step;
    if (length == 0 || 2 * (ramped + length) > count / 2) continue;  // the ramps take at most half the buffer
    ramp.push_back(length);
    ramped += length;
  }
  const size_t middle = count - 2 * ramped;
  const size_t parts = (middle + nominal - 1) / nominal;
  std::vector<size_t> lengths(ramp);
  for (size_t i = 0; i < parts; ++i) lengths.push_back(middle / parts + (i < middle % parts ? 1 : 0));
  lengths.insert(lengths.end(), ramp.rbegin(), ramp.rend());
  return lengths;
}

void Hierarchy::allreduce(const Buffer& input, const Buffer& output, ReduceOp op, const AllreduceOptions& options,
                          Workspace& workspace) {
  if (input.count != output.count || input.dtype != output.dtype) {
    throw std::invalid_argument("hierarchical allreduce: input and output differ in count or dtype");
  }
  ++calls_;
  if (output.count == 0) return;
  if (input.data != output.data) std::memcpy(output.data, input.data, output.bytes());
  // the same answer on every rank of a host: the segment exists on all of them or on none
  SharedMemoryAllreduce* shm = nullptr;
  if (local_size_ > 1 && options.shared_memory) shm = shared_memory_for(local_, options.shared_memory_chunk_bytes);
  if (local_size_ > 1 && shm == nullptr) {
    in_steps(output, op, options, workspace);
  } else {
    pipelined(output, op, options, workspace, shm);
  }
}

void Hierarchy::carry(const Buffer& output, size_t begin, size_t length, ReduceOp op, const AllreduceOptions& flat,
                      Workspace& workspace) {
  const ReduceOp step_op = op == ReduceOp::Average ? ReduceOp::Sum : op;
  for (int p = first_piece_; p < end_piece_; ++p) {  // in piece order on every rank
    size_t at = 0, span = 0;
    piece_span(length, static_cast<size_t>(pieces_), static_cast<size_t>(p), &at, &span);
    if (span == 0) continue;
    const Buffer piece = slice(output, begin + at, span);
    hybridpipe::allreduce(piece, piece, step_op, piece_comms_[static_cast<size_t>(p)], flat, workspace);
    if (op == ReduceOp::Average) divide(piece.data, span, output.dtype, static_cast<size_t>(size_), workspace, kDivideSlot);
  }
}

void Hierarchy::pipelined(const Buffer& output, ReduceOp op, const AllreduceOptions& options, Workspace& workspace,
                          SharedMemoryAllreduce* shm) {
  AllreduceOptions flat = options;  // the pieces run the flat algorithms, never this one again
  flat.hierarchical = 0;
  const ReduceOp step_op = op == ReduceOp::Average ? ReduceOp::Sum : op;
  const std::vector<size_t> lengths = chunk_lengths(output.count, wire_element_bytes(output, options),
                                                         options.hierarchical_chunk_bytes);
  std::vector<size_t> starts(1, 0);
  for (size_t length : lengths) starts.push_back(starts.back() + length);
  const size_t chunks = lengths.size();
  pipelined_chunks_ += chunks;
  // this rank's share of chunk c: its pieces, consecutive
  auto share = [&](size_t c, size_t* begin) {
    size_t first = 0, span = 0, last = 0, last_span = 0;
    piece_span(lengths[c], static_cast<size_t>(pieces_), static_cast<size_t>(first_piece_), &first, &span);
    piece_span(lengths[c], static_cast<size_t>(pieces_), static_cast<size_t>(end_piece_ - 1), &last, &last_span);
    *begin = first;
    return slice(output, starts[c] + first, last + last_span - first);
  };
  auto reduce_in_host = [&](size_t c) {
    size_t begin = 0;
    const Buffer kept = share(c, &begin);
    shm->reduce_scatter({slice(output, starts[c], lengths[c])}, kept, begin, step_op, options.wait);
  };
  auto gather_in_host = [&](size_t c) {
    size_t begin = 0;
    const Buffer kept = share(c, &begin);
    shm->allgather(kept, begin, slice(output, starts[c], lengths[c]), options.wait);
  };
  if (shm == nullptr || chunks == 1) {  // alone on this host, or one chunk: this thread does every step
    for (size_t c = 0; c < chunks; ++c) {
      if (shm) reduce_in_host(c);
      carry(output, starts[c], lengths[c], op, flat, workspace);
      if (shm) gather_in_host(c);
    }
    return;
  }
  // The helper: reduce c + 1, then gather c once it has crossed; the same order on every rank of the host.
  Handoff handoff;
  std::thread helper([&] {
    shared_memory_probes_mpi = false;
    try {
      reduce_in_host(0);
      handoff.reduced(1);
      for (size_t c = 0; c < chunks; ++c) {
        if (c + 1 < chunks) {
          reduce_in_host(c + 1);
          handoff.reduced(c + 2);
        }
        if (!handoff.wait_carried(c + 1)) return;
        gather_in_host(c);
      }
    } catch (...) {
      handoff.fail(std::current_exception());
    }
  });
  try {
    for (size_t c = 0; c < chunks && handoff.wait_reduced(c + 1); ++c) {
      carry(output, starts[c], lengths[c], op, flat, workspace);
      handoff.carried(c + 1);
    }
  } catch (...) {
    handoff.fail(std::current_exception());
  }
  helper.join();
  if (std::exception_ptr error = handoff.error()) std::rethrow_exception(error);
}

void Hierarchy::in_steps(const Buffer& output, ReduceOp op, const AllreduceOptions& options, Workspace& workspace) {
  const ReduceOp step_op = op == ReduceOp::Average ? ReduceOp::Sum : op;
  AllreduceOptions flat = options;  // the parts run the flat algorithms, never this one again
  flat.hierarchical = 0;
  // 1. inside the host
  hybridpipe::allreduce(output, output, step_op, local_, flat, workspace);
  // 2. between hosts, chunk by chunk as pipelined() cuts them (another host may have a segment and pipeline)
  const std::vector<size_t> lengths = chunk_lengths(output.count, wire_element_bytes(output, options),
                                                         options.hierarchical_chunk_bytes);
  size_t start = 0;
  for (size_t length : lengths) {
    carry(output, start, length, op, flat, workspace);
    start += length;
  }
  // 3. inside the host, every piece of every chunk from the rank that carried it
  std::vector<MPI_Request> requests;
  start = 0;
  for (size_t length : lengths) {
    for (int p = 0; p < pieces_; ++p) {
      size_t begin = 0, span = 0;
      piece_span(length, static_cast<size_t>(pieces_), static_cast<size_t>(p), &begin, &span);
      auto* data = static_cast<unsigned char*>(output.data) + (start + begin) * dtype_size(output.dtype);
      for (size_t bytes = span * dtype_size(output.dtype); bytes > 0;) {  // MPI counts are int
        const size_t part = std::min(bytes, kMaxBroadcastBytes);
        requests.emplace_back(MPI_REQUEST_NULL);
        HP_MPI(MPI_Ibcast, local_, data, static_cast<int>(part), MPI_BYTE, carrier(p), local_, &requests.back());
        data += part;
        bytes -= part;
      }
    }
    start += length;
  }
  HP_MPI(wait_all, local_, static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE, options.wait);
}

Hierarchy* hierarchy_for(MPI_Comm comm) {
  void* value = nullptr;
  int found = 0;
  HP_MPI(MPI_Comm_get_attr, comm, comm, cache_key(), &value, &found);
  if (found) return static_cast<Hierarchy*>(value);
  auto made = std::make_unique<Hierarchy>(comm);
  HP_MPI(MPI_Comm_set_attr, comm, comm, cache_key(), made.get());
  return made.release();
}

}  // namespace hybridpipe
