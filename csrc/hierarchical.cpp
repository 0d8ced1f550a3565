// Hierarchical allreduce; see hierarchical.h.
#include "hierarchical.h"

#include <algorithm>
#include <cstring>

#include "reduce.h"

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

constexpr size_t kDivideSlot = 7;  // a workspace slot the ring and library paths do not use
constexpr size_t kMaxBroadcastBytes = size_t(1) << 30;

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
  if (hosts_ < 2 || pieces_ < 2) return;  // not useful: no piece communicators
  for (int p = 0; p < pieces_; ++p) {  // the carriers of piece p: local rank p mod k on each host
    const int color = local_rank_ == p % local_size_ ? p : MPI_UNDEFINED;
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

void Hierarchy::allreduce(const Buffer& input, const Buffer& output, ReduceOp op, const AllreduceOptions& options,
                          Workspace& workspace) {
  if (input.count != output.count || input.dtype != output.dtype) {
    throw std::invalid_argument("hierarchical allreduce: input and output differ in count or dtype");
  }
  const size_t count = output.count;
  ++calls_;
  if (count == 0) return;
  if (input.data != output.data) std::memcpy(output.data, input.data, output.bytes());
  const ReduceOp step_op = op == ReduceOp::Average ? ReduceOp::Sum : op;
  // the parts run the flat algorithms (ring, library, shared memory), never this one again
  AllreduceOptions flat = options;
  flat.hierarchical = 0;
  // 1. inside the host
  if (local_size_ > 1) hybridpipe::allreduce(output, output, step_op, local_, flat, workspace);
  // 2. between hosts, each piece over the ranks that carry it (in piece order on every rank)
  const size_t parts = static_cast<size_t>(pieces_);
  for (size_t p = 0; p < parts; ++p) {
    if (piece_comms_[p] == MPI_COMM_NULL) continue;
    size_t begin = 0, length = 0;
    piece_span(count, parts, p, &begin, &length);
    if (length == 0) continue;
    const Buffer piece = slice(output, begin, length);
    hybridpipe::allreduce(piece, piece, step_op, piece_comms_[p], flat, workspace);
    if (op == ReduceOp::Average) divide(piece.data, length, output.dtype, static_cast<size_t>(size_), workspace, kDivideSlot);
  }
  // 3. inside the host, every piece from the rank that carried it
  if (local_size_ == 1) return;
  std::vector<MPI_Request> requests;
  for (size_t p = 0; p < parts; ++p) {
    size_t begin = 0, length = 0;
    piece_span(count, parts, p, &begin, &length);
    if (length == 0) continue;
    const int root = static_cast<int>(p % static_cast<size_t>(local_size_));
    auto* data = static_cast<unsigned char*>(output.data) + begin * dtype_size(output.dtype);
    size_t bytes = length * dtype_size(output.dtype);
    for (; bytes > 0;) {  // MPI counts are int
      const size_t part = std::min(bytes, kMaxBroadcastBytes);
      requests.emplace_back(MPI_REQUEST_NULL);
      HP_MPI(MPI_Ibcast, local_, data, static_cast<int>(part), MPI_BYTE, root, local_, &requests.back());
      data += part;
      bytes -= part;
    }
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
