// Segmented ring allreduce and the small-message path; see ring_allreduce.h.
#include "ring_allreduce.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <mutex>

#include "hierarchical.h"
#include "reduce.h"
#include "shm_allreduce.h"

namespace hybridpipe {
namespace {

constexpr int kReduceScatterTag = 7001;
constexpr int kAllgatherTag = 7002;
enum WorkspaceSlot : size_t { kHalfCopy = 0, kReceiveSlots = 1, kWireCopy = 2, kIncoming = 3, kScatterCopy = 4,
                            kGatherCopy = 5 };

std::atomic<uint64_t> wire_bytes{0};  // bytes this process handed to MPI sends and MPI_Allreduce (see header)

void count_wire(size_t elements, size_t element_size) { wire_bytes += elements * element_size; }

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::Float32: return MPI_FLOAT;
    case DType::Float64: return MPI_DOUBLE;
    case DType::Int32: return MPI_INT32_T;
    case DType::Int64: return MPI_INT64_T;
    case DType::Float16:
    case DType::BFloat16: return MPI_UINT16_T;  // moved, never reduced, by MPI
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Average: return MPI_SUM;
    case ReduceOp::Min: return MPI_MIN;
    case ReduceOp::Max: return MPI_MAX;
  }
  return MPI_OP_NULL;
}

// Chunk i of `count` elements split into `parts`: the first count % parts chunks get one more.
struct Span {
  size_t begin;
  size_t length;
};

Span chunk_of(size_t count, size_t parts, size_t index) {
  const size_t base = count / parts, extra = count % parts;
  return {index * base + std::min(index, extra), base + (index < extra ? 1 : 0)};
}

size_t segments_in(size_t length, size_t segment) { return (length + segment - 1) / segment; }

Span segment_of(const Span& chunk, size_t segment, size_t index) {
  const size_t begin = chunk.begin + index * segment;
  return {begin, std::min(segment, chunk.begin + chunk.length - begin)};
}

void wait_sends(std::vector<MPI_Request>& requests, MPI_Comm comm, const WaitPolicy& policy) {
  if (requests.empty()) return;
  HP_MPI(wait_all, comm, static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE, policy);
  requests.clear();
}

void wait_one(MPI_Request& request, MPI_Comm comm, const WaitPolicy& policy) {
  HP_MPI(wait_all, comm, 1, &request, MPI_STATUSES_IGNORE, policy);
}

// Sends every segment of `chunk` of `data` to `peer` (requests appended to `sends`).
void send_chunk(unsigned char* data, const Span& chunk, size_t segment, size_t element_size,
                MPI_Datatype type, int peer, int tag, MPI_Comm comm, std::vector<MPI_Request>& sends) {
  for (size_t k = 0; k < segments_in(chunk.length, segment); ++k) {
    const Span part = segment_of(chunk, segment, k);
    sends.emplace_back();
    HP_MPI(MPI_Isend, comm, data + part.begin * element_size, static_cast<int>(part.length), type,
           peer, tag, comm, &sends.back());
    count_wire(part.length, element_size);
  }
}

// Reduce-scatter over `work` (accumulation dtype). Afterwards rank r holds the reduced chunk
// (r + 1) % size. Segment k of the chunk received at step s is forwarded at step s + 1 as soon
// as it is reduced, while the receives of later segments are already posted. `wire`: the dtype that
// travels — the accumulation dtype, or for float16/bfloat16 buffers the half type itself: partial sums
// are rounded to it to be sent (half the bytes of float32) and accumulated in float32 where received.
// `finished`: called with each segment of this rank's chunk once it is fully reduced (the last step).
// `source`: this rank's values when they are not in `work` yet (out of place: each segment is copied into
// `work` right before the first reduction into it, and this rank's own chunk is sent from `source`, so the
// copy and the first touch of `work`'s pages overlap the transfers instead of preceding them).
void reduce_scatter(unsigned char* work, size_t count, const std::vector<Span>& chunks, DType dtype, DType wire,
                    ReduceOp op, int rank, int size, MPI_Comm comm, const AllreduceOptions& options,
                    Workspace& workspace, const std::function<void(const Span&)>& finished = nullptr,
                    const unsigned char* source = nullptr) {
  if (!source) source = work;
  const size_t element = dtype_size(dtype);
  const bool narrow = wire != dtype;
  const size_t wire_element = dtype_size(wire);
  const size_t segment = std::max<size_t>(1, options.segment_bytes / element);
  const size_t window = std::max<size_t>(1, options.receive_window);
  const MPI_Datatype type = mpi_type(wire);
  const int next = (rank + 1) % size, previous = (rank - 1 + size) % size;
  auto* slots = static_cast<unsigned char*>(workspace.get(kReceiveSlots, window * segment * wire_element));
  // narrow: what is sent, rounded from `work` (every position is sent at most once, so one mirror of
  // the buffer keeps each send's bytes alive until the sends are waited for); received halves widened
  unsigned char* mirror = narrow ? static_cast<unsigned char*>(workspace.get(kWireCopy, count * wire_element)) : nullptr;
  float* incoming = narrow ? static_cast<float*>(workspace.get(kIncoming, segment * sizeof(float))) : nullptr;

  std::vector<MPI_Request> sends, receives(window, MPI_REQUEST_NULL);
  // Sends segment `part` of `from`: narrow, rounded into the mirror right before it goes, while the previous
  // ones are on the wire.
  auto send = [&](const Span& part, const unsigned char* from) {
    const unsigned char* out = from + part.begin * element;
    if (narrow) {
      float_to_half(reinterpret_cast<const float*>(out), mirror + part.begin * wire_element, part.length, wire);
      out = mirror + part.begin * wire_element;
    }
    sends.emplace_back();
    HP_MPI(MPI_Isend, comm, out, static_cast<int>(part.length), type, next, kReduceScatterTag, comm, &sends.back());
    count_wire(part.length, wire_element);
  };
  const Span own = chunks[static_cast<size_t>(rank)];
  for (size_t k = 0; k < segments_in(own.length, segment); ++k) send(segment_of(own, segment, k), source);
  for (int step = 0; step < size - 1; ++step) {
    const Span chunk = chunks[static_cast<size_t>((rank - step - 1 + 2 * size) % size)];
    const size_t parts = segments_in(chunk.length, segment);
    auto post = [&](size_t k) {
      const Span part = segment_of(chunk, segment, k);
      HP_MPI(MPI_Irecv, comm, slots + (k % window) * segment * wire_element, static_cast<int>(part.length),
             type, previous, kReduceScatterTag, comm, &receives[k % window]);
    };
    for (size_t k = 0; k < std::min(window, parts); ++k) post(k);
    for (size_t k = 0; k < parts; ++k) {
      const Span part = segment_of(chunk, segment, k);
      wait_one(receives[k % window], comm, options.wait);
      const unsigned char* received = slots + (k % window) * segment * wire_element;
      if (narrow) {
        half_to_float(received, incoming, part.length, wire);
        received = reinterpret_cast<const unsigned char*>(incoming);
      }
      if (source != work) std::memcpy(work + part.begin * element, source + part.begin * element, part.length * element);
      reduce_into(work + part.begin * element, received, part.length, dtype, op);
      if (step < size - 2) {
        send(part, work);
      } else if (finished) {
        finished(part);
      }
      if (k + window < parts) post(k + window);
    }
  }
  wait_sends(sends, comm, options.wait);
}

// Receives of every segment of `chunk` of `data` from `previous` (the allgather's).
void receive_chunk(unsigned char* data, const Span& chunk, size_t segment, size_t element, MPI_Datatype type,
                   int previous, MPI_Comm comm, std::vector<MPI_Request>& receives) {
  receives.assign(segments_in(chunk.length, segment), MPI_REQUEST_NULL);
  for (size_t k = 0; k < receives.size(); ++k) {
    const Span part = segment_of(chunk, segment, k);
    HP_MPI(MPI_Irecv, comm, data + part.begin * element, static_cast<int>(part.length), type, previous,
           kAllgatherTag, comm, &receives[k]);
  }
}

// The allgather's first moves when its caller made them already (the compressed ring, during its
// reduce-scatter): the receives of its first step posted, and the sends of this rank's own chunk.
struct GatherStart {
  std::vector<MPI_Request> receives, sends;
};

// Allgather of the reduced chunks in `data` (the dtype that travels), in segments of `segment` elements:
// rank r starts with chunk (r + 1) % size, receives straight into place and forwards each segment once it
// arrives. `wide`: a float32 buffer whose chunks travel in the half type `dtype` (`data` their mirror):
// each received segment is widened into it. `start`: the first moves, made by the caller.
void allgather_chunks(unsigned char* data, const std::vector<Span>& chunks, DType dtype, size_t segment, int rank,
                      int size, MPI_Comm comm, const AllreduceOptions& options, float* wide = nullptr,
                      GatherStart* start = nullptr) {
  const size_t element = dtype_size(dtype);
  const MPI_Datatype type = mpi_type(dtype);
  const int next = (rank + 1) % size, previous = (rank - 1 + size) % size;
  auto chunk_at = [&](int step) { return chunks[static_cast<size_t>((rank - step + size) % size)]; };

  GatherStart here;
  std::vector<MPI_Request>& sends = start ? start->sends : here.sends;
  std::vector<MPI_Request>& receives = start ? start->receives : here.receives;
  if (!start) {
    receive_chunk(data, chunk_at(0), segment, element, type, previous, comm, receives);
    send_chunk(data, chunks[static_cast<size_t>((rank + 1) % size)], segment, element, type, next, kAllgatherTag,
               comm, sends);
  }
  for (int step = 0; step < size - 1; ++step) {
    const Span chunk = chunk_at(step);
    const size_t parts = segments_in(chunk.length, segment);
    if (step > 0) receive_chunk(data, chunk, segment, element, type, previous, comm, receives);
    for (size_t k = 0; k < parts; ++k) {
      wait_one(receives[k], comm, options.wait);
      const Span part = segment_of(chunk, segment, k);
      if (step < size - 2) {
        sends.emplace_back();
        HP_MPI(MPI_Isend, comm, data + part.begin * element, static_cast<int>(part.length), type, next,
               kAllgatherTag, comm, &sends.back());
        count_wire(part.length, element);
      }
      if (wide) half_to_float(data + part.begin * element, wide + part.begin, part.length, dtype);
    }
  }
  wait_sends(sends, comm, options.wait);
}

// float16 / bfloat16 in the MPI library: MPI has no such types, so a user-defined op on a private copy of
// MPI_UINT16_T per half type adds (or takes the min / max of) pairs in float32 and rounds the result to
// the half type: 16-bit values travel, each combining step rounds once.
struct HalfOps {
  MPI_Datatype float16 = MPI_DATATYPE_NULL, bfloat16 = MPI_DATATYPE_NULL;
  MPI_Op sum = MPI_OP_NULL, min = MPI_OP_NULL, max = MPI_OP_NULL;
};

template <int Kind>  // 0 sum, 1 min, 2 max
void combine_halves(void* in, void* inout, int* length, MPI_Datatype* type);

const HalfOps& half_ops() {
  static HalfOps ops;
  static std::once_flag once;
  std::call_once(once, [] {
    MPI_Type_dup(MPI_UINT16_T, &ops.float16);
    MPI_Type_commit(&ops.float16);
    MPI_Type_dup(MPI_UINT16_T, &ops.bfloat16);
    MPI_Type_commit(&ops.bfloat16);
    MPI_Op_create(&combine_halves<0>, 1, &ops.sum);
    MPI_Op_create(&combine_halves<1>, 1, &ops.min);
    MPI_Op_create(&combine_halves<2>, 1, &ops.max);
  });
  return ops;
}

template <int Kind>
void combine_halves(void* in, void* inout, int* length, MPI_Datatype* type) {
  const DType dtype = *type == half_ops().bfloat16 ? DType::BFloat16 : DType::Float16;
  constexpr int kBlock = 256;
  float a[kBlock], b[kBlock];
  auto* source = static_cast<unsigned char*>(in);
  auto* target = static_cast<unsigned char*>(inout);
  for (int at = 0; at < *length; at += kBlock) {
    const int n = std::min(kBlock, *length - at);
    half_to_float(source + static_cast<size_t>(at) * 2, a, static_cast<size_t>(n), dtype);
    half_to_float(target + static_cast<size_t>(at) * 2, b, static_cast<size_t>(n), dtype);
    for (int i = 0; i < n; ++i) b[i] = Kind == 0 ? a[i] + b[i] : Kind == 1 ? std::min(a[i], b[i]) : std::max(a[i], b[i]);
    float_to_half(b, target + static_cast<size_t>(at) * 2, static_cast<size_t>(n), dtype);
  }
}

// MPI_Allreduce: one library call, best for small buffers (half types travel as 16-bit, see HalfOps; so does a
// float32 buffer with a wire dtype: rounded to it whole, summed by HalfOps, widened back).
void library_allreduce(const Buffer& input, const Buffer& output, ReduceOp op, MPI_Comm comm, int size,
                       const AllreduceOptions& options, Workspace& workspace) {
  if (options.wire.narrows(output.dtype)) {
    const DType wire = static_cast<DType>(options.wire.dtype);
    auto* halves = static_cast<unsigned char*>(workspace.get(kWireCopy, output.count * dtype_size(wire)));
    float_to_half(static_cast<const float*>(input.data), halves, output.count, wire);
    AllreduceOptions as_half = options;
    as_half.wire = WireFormat{};
    const Buffer narrow{halves, output.count, wire};
    library_allreduce(narrow, narrow, op == ReduceOp::Average ? ReduceOp::Sum : op, comm, size, as_half, workspace);
    half_to_float(halves, static_cast<float*>(output.data), output.count, wire);
    if (op == ReduceOp::Average) finalize_average(output.data, output.count, DType::Float32, static_cast<size_t>(size));
    return;
  }
  if (is_half(output.dtype)) {
    const HalfOps& ops = half_ops();
    if (input.data != output.data) std::memcpy(output.data, input.data, output.bytes());
    const MPI_Op half_op = op == ReduceOp::Min ? ops.min : op == ReduceOp::Max ? ops.max : ops.sum;
    HP_MPI(allreduce_waiting, comm, MPI_IN_PLACE, output.data, static_cast<int>(output.count),
           output.dtype == DType::BFloat16 ? ops.bfloat16 : ops.float16, half_op, comm, options.wait);
    count_wire(output.count, 2);
    if (op == ReduceOp::Average) {
      auto* work = static_cast<float*>(workspace.get(kHalfCopy, output.count * sizeof(float)));
      half_to_float(output.data, work, output.count, output.dtype);
      finalize_average(work, output.count, DType::Float32, static_cast<size_t>(size));
      float_to_half(work, output.data, output.count, output.dtype);
    }
    return;
  }
  const void* send = input.data == output.data ? MPI_IN_PLACE : input.data;
  HP_MPI(allreduce_waiting, comm, send, output.data, static_cast<int>(output.count), mpi_type(output.dtype),
         mpi_op(op), comm, options.wait);
  count_wire(output.count, dtype_size(output.dtype));
  if (op == ReduceOp::Average) finalize_average(output.data, output.count, output.dtype, static_cast<size_t>(size));
}

// The ring over a float32 buffer whose segments travel in the half type `wire`. The allgather starts inside
// the reduce-scatter: its first receives are posted before it (into a mirror of the buffer in `wire` apart
// from the reduce-scatter's), and each segment of this rank's chunk is rounded and sent as soon as it is
// reduced, so the link does not wait between the phases. Its owner keeps the rounded value too.
void narrow_ring_allreduce(const float* source, float* work, size_t count, const std::vector<Span>& chunks, DType wire,
                           ReduceOp op, MPI_Comm comm, int rank, int size, const AllreduceOptions& options,
                           Workspace& workspace) {
  const size_t segment = std::max<size_t>(1, options.segment_bytes / sizeof(float));  // the reduce-scatter's
  const size_t wire_element = dtype_size(wire);
  auto* gathered = static_cast<unsigned char*>(workspace.get(kGatherCopy, count * wire_element));
  GatherStart start;
  receive_chunk(gathered, chunks[static_cast<size_t>(rank)], segment, wire_element, mpi_type(wire),
                (rank - 1 + size) % size, comm, start.receives);
  auto finished = [&](const Span& part) {
    float* values = work + part.begin;
    unsigned char* rounded = gathered + part.begin * wire_element;
    if (op == ReduceOp::Average) finalize_average(values, part.length, DType::Float32, static_cast<size_t>(size));
    float_to_half(values, rounded, part.length, wire);
    send_chunk(gathered, part, segment, wire_element, mpi_type(wire), (rank + 1) % size, kAllgatherTag, comm,
               start.sends);
    half_to_float(rounded, values, part.length, wire);
  };
  reduce_scatter(reinterpret_cast<unsigned char*>(work), count, chunks, DType::Float32, wire, op, rank, size, comm,
                 options, workspace, finished, reinterpret_cast<const unsigned char*>(source));
  allgather_chunks(gathered, chunks, wire, segment, rank, size, comm, options, work, &start);
}

void ring_allreduce(const Buffer& input, const Buffer& output, ReduceOp op, MPI_Comm comm, int rank, int size,
                    const AllreduceOptions& options, Workspace& workspace) {
  const size_t count = output.count;
  const DType work_dtype = accumulation_dtype(output.dtype);
  const size_t work_element = dtype_size(work_dtype);
  // out of place, the reduce-scatter copies the input into the output segment by segment as it goes
  unsigned char* work = static_cast<unsigned char*>(output.data);
  const auto* source = static_cast<const unsigned char*>(input.data);
  if (is_half(output.dtype)) {
    work = static_cast<unsigned char*>(workspace.get(kHalfCopy, count * sizeof(float)));
    half_to_float(input.data, reinterpret_cast<float*>(work), count, output.dtype);
    source = work;
  }
  std::vector<Span> chunks;
  for (int i = 0; i < size; ++i) chunks.push_back(chunk_of(count, static_cast<size_t>(size), static_cast<size_t>(i)));
  if (options.wire.narrows(output.dtype)) {  // float32 here, the wire's half type between ranks
    narrow_ring_allreduce(reinterpret_cast<const float*>(source), reinterpret_cast<float*>(work), count, chunks,
                          static_cast<DType>(options.wire.dtype), op, comm, rank, size, options, workspace);
    return;
  }
  reduce_scatter(work, count, chunks, work_dtype, output.dtype, op, rank, size, comm, options, workspace, nullptr,
                 source);

  const Span mine = chunks[static_cast<size_t>((rank + 1) % size)];
  unsigned char* my_work = work + mine.begin * work_element;
  if (op == ReduceOp::Average) finalize_average(my_work, mine.length, work_dtype, static_cast<size_t>(size));
  if (is_half(output.dtype)) {
    float_to_half(reinterpret_cast<float*>(my_work),
                  static_cast<unsigned char*>(output.data) + mine.begin * dtype_size(output.dtype), mine.length,
                  output.dtype);
  }
  allgather_chunks(static_cast<unsigned char*>(output.data), chunks, output.dtype,
                   std::max<size_t>(1, options.segment_bytes / dtype_size(output.dtype)), rank, size, comm, options);
}

}  // namespace

uint64_t wire_bytes_sent() { return wire_bytes.load(); }

void* Workspace::get(size_t slot, size_t bytes) {
  if (slots_.size() <= slot) slots_.resize(slot + 1);
  if (slots_[slot].size() < bytes) slots_[slot].resize(bytes);
  return slots_[slot].data();
}

SharedMemoryAllreduce* fused_shared_memory(MPI_Comm comm, const AllreduceOptions& options) {
  int size = 1;
  HP_MPI(MPI_Comm_size, comm, comm, &size);
  if (!options.shared_memory || size == 1) return nullptr;
  return shared_memory_for(comm, options.shared_memory_chunk_bytes);
}

void allreduce(const Buffer& input, const Buffer& output, ReduceOp op, MPI_Comm comm,
               const AllreduceOptions& options, Workspace& workspace, AllreduceAlgorithm algorithm) {
  if (input.count != output.count || input.dtype != output.dtype) {
    throw std::invalid_argument("allreduce: input and output differ in count or dtype");
  }
  int rank = 0, size = 1;
  HP_MPI(MPI_Comm_rank, comm, comm, &rank);
  HP_MPI(MPI_Comm_size, comm, comm, &size);
  if (output.count == 0) return;
  if (size == 1) {
    if (input.data != output.data) std::memcpy(output.data, input.data, output.bytes());
    return;
  }
  if (options.wire.dtype >= 0 && !is_half(static_cast<DType>(options.wire.dtype))) {
    throw std::invalid_argument("allreduce: the wire dtype must be float16 or bfloat16 (code " +
                                std::to_string(options.wire.dtype) + ")");
  }
  const bool large = output.bytes() > options.small_message_bytes && output.count >= static_cast<size_t>(size);
  const bool forced = options.wire.narrows(output.dtype) && options.wire.on_one_host;  // the ring, even on one host
  if (algorithm == AllreduceAlgorithm::SharedMemory ||
      (algorithm == AllreduceAlgorithm::Auto && large && options.shared_memory && !forced)) {
    if (SharedMemoryAllreduce* shm = shared_memory_for(comm, options.shared_memory_chunk_bytes)) {
      shm->allreduce({input}, {output}, op, options.wait);
      return;
    }
    if (algorithm == AllreduceAlgorithm::SharedMemory) {
      throw std::invalid_argument("allreduce: shared memory cannot serve this communicator: " +
                                  shared_memory_unavailable_reason(comm) + " (use the ring: algorithm Ring or Auto)");
    }
  }
  if (algorithm == AllreduceAlgorithm::Hierarchical ||
      (algorithm == AllreduceAlgorithm::Auto && large && options.hierarchical != 0)) {
    Hierarchy* hierarchy = hierarchy_for(comm);
    const bool applies = algorithm == AllreduceAlgorithm::Hierarchical || options.hierarchical == 1
                             ? hierarchy->spans_hosts()
                             : hierarchy->useful();
    if (applies) {
      hierarchy->allreduce(input, output, op, options, workspace);
      return;
    }
    if (algorithm == AllreduceAlgorithm::Hierarchical) {
      throw std::invalid_argument("allreduce: hierarchical needs a communicator spanning hosts; all " +
                                  std::to_string(size) + " ranks of this one are on one host (use Auto)");
    }
  }
  bool use_ring = algorithm == AllreduceAlgorithm::Ring;
  if (algorithm == AllreduceAlgorithm::Auto) use_ring = large;
  auto run = [&](const AllreduceOptions& chosen) {
    if (use_ring) {
      ring_allreduce(input, output, op, comm, rank, size, chosen, workspace);
    } else {
      library_allreduce(input, output, op, comm, size, chosen, workspace);
    }
  };
  if (options.wire.narrows(output.dtype) && !forced && !hierarchy_for(comm)->spans_hosts()) {
    AllreduceOptions one_host = options;  // ranks of one host: the wire dtype would only cost conversions
    one_host.wire = WireFormat{};
    run(one_host);
  } else {
    run(options);
  }
}

namespace {

// counts[i] elements for rank i, laid out one after the other.
std::vector<Span> layout_of(const std::vector<size_t>& counts) {
  std::vector<Span> spans;
  size_t at = 0;
  for (size_t count : counts) {
    spans.push_back({at, count});
    at += count;
  }
  return spans;
}

// The ring leaves rank r with chunk (r + 1) % size of what it is given (and starts its allgather there):
// given this rotation, rank r ends with (and starts from) spans[r].
std::vector<Span> rotated_for_ring(const std::vector<Span>& spans) {
  const size_t n = spans.size();
  std::vector<Span> rotated(n);
  for (size_t i = 0; i < n; ++i) rotated[i] = spans[(i + n - 1) % n];
  return rotated;
}

void check_layout(const char* function, const Buffer& full, const Buffer& part, const std::vector<size_t>& counts,
                  int rank, int size) {
  if (static_cast<int>(counts.size()) != size) {
    throw std::invalid_argument(std::string(function) + ": " + std::to_string(counts.size()) +
                                " counts for a communicator of " + std::to_string(size) + " ranks");
  }
  size_t total = 0;
  for (size_t count : counts) total += count;
  if (total != full.count) {
    throw std::invalid_argument(std::string(function) + ": the counts add up to " + std::to_string(total) +
                                " elements but the full buffer has " + std::to_string(full.count));
  }
  if (part.count != counts[static_cast<size_t>(rank)] || part.dtype != full.dtype) {
    throw std::invalid_argument(std::string(function) + ": this rank's part has " + std::to_string(part.count) +
                                " elements (or another dtype) but its count is " +
                                std::to_string(counts[static_cast<size_t>(rank)]));
  }
}

std::vector<int> int_counts(const char* function, const std::vector<size_t>& counts) {
  std::vector<int> ints;
  for (size_t count : counts) {
    if (count > static_cast<size_t>(std::numeric_limits<int>::max())) {
      throw std::invalid_argument(std::string(function) + ": a part of " + std::to_string(count) +
                                  " elements is too large for the MPI library path");
    }
    ints.push_back(static_cast<int>(count));
  }
  return ints;
}

}  // namespace

void reducescatter(const Buffer& input, const Buffer& output, const std::vector<size_t>& counts, ReduceOp op,
                   MPI_Comm comm, const AllreduceOptions& options, Workspace& workspace, bool input_is_scratch,
                   AllreduceAlgorithm algorithm) {
  int rank = 0, size = 1;
  HP_MPI(MPI_Comm_rank, comm, comm, &rank);
  HP_MPI(MPI_Comm_size, comm, comm, &size);
  check_layout("reducescatter", input, output, counts, rank, size);
  const std::vector<Span> spans = layout_of(counts);
  const Span mine = spans[static_cast<size_t>(rank)];
  const size_t element = dtype_size(input.dtype);
  auto* in = static_cast<unsigned char*>(input.data);
  if (size == 1) {
    if (output.count && in != output.data) std::memcpy(output.data, in, output.bytes());
    return;
  }
  if (input.count == 0) return;
  const bool large = input.bytes() > options.small_message_bytes;
  if (algorithm == AllreduceAlgorithm::SharedMemory ||
      (algorithm == AllreduceAlgorithm::Auto && large && options.shared_memory)) {
    if (SharedMemoryAllreduce* shm = shared_memory_for(comm, options.shared_memory_chunk_bytes)) {
      shm->reduce_scatter({input}, output, mine.begin, op, options.wait);
      return;
    }
    if (algorithm == AllreduceAlgorithm::SharedMemory) {
      throw std::invalid_argument("reducescatter: shared memory cannot serve this communicator: " +
                                  shared_memory_unavailable_reason(comm) + " (use the ring: algorithm Ring or Auto)");
    }
  }
  const bool use_ring = algorithm == AllreduceAlgorithm::Ring ||
                        ((algorithm == AllreduceAlgorithm::Auto || algorithm == AllreduceAlgorithm::Hierarchical) && large);
  if (use_ring) {
    const DType work_dtype = accumulation_dtype(input.dtype);
    const size_t work_element = dtype_size(work_dtype);
    unsigned char* work;
    if (is_half(input.dtype)) {
      work = static_cast<unsigned char*>(workspace.get(kHalfCopy, input.count * sizeof(float)));
      half_to_float(in, reinterpret_cast<float*>(work), input.count, input.dtype);
    } else if (input_is_scratch) {
      work = in;
    } else {
      work = static_cast<unsigned char*>(workspace.get(kScatterCopy, input.bytes()));
      std::memcpy(work, in, input.bytes());
    }
    reduce_scatter(work, input.count, rotated_for_ring(spans), work_dtype, input.dtype, op, rank, size, comm,
                   options, workspace);
    unsigned char* my_work = work + mine.begin * work_element;
    if (op == ReduceOp::Average) finalize_average(my_work, mine.length, work_dtype, static_cast<size_t>(size));
    if (is_half(input.dtype)) {
      float_to_half(reinterpret_cast<float*>(my_work), output.data, mine.length, input.dtype);
    } else if (my_work != output.data && mine.length) {
      std::memmove(output.data, my_work, mine.length * element);
    }
    return;
  }
  // the MPI library: MPI_Ireduce_scatter (half types through the user-defined op on 16-bit values)
  const std::vector<int> ints = int_counts("reducescatter", counts);
  const void* send = in;
  MPI_Datatype type = mpi_type(input.dtype);
  MPI_Op mop = mpi_op(op);
  if (is_half(input.dtype)) {
    const HalfOps& ops = half_ops();
    type = input.dtype == DType::BFloat16 ? ops.bfloat16 : ops.float16;
    mop = op == ReduceOp::Min ? ops.min : op == ReduceOp::Max ? ops.max : ops.sum;
  }
  unsigned char* receive = static_cast<unsigned char*>(output.data);
  if (receive == in + mine.begin * element && mine.length) {  // the output inside the input: MPI forbids aliasing
    receive = static_cast<unsigned char*>(workspace.get(kScatterCopy, output.bytes()));
  }
  MPI_Request request = MPI_REQUEST_NULL;
  HP_MPI(MPI_Ireduce_scatter, comm, send, receive, ints.data(), type, mop, comm, &request);
  HP_MPI(wait_all, comm, 1, &request, MPI_STATUSES_IGNORE, options.wait);
  count_wire(input.count, element);
  if (receive != output.data) std::memcpy(output.data, receive, output.bytes());
  if (op == ReduceOp::Average && output.count) {
    if (is_half(output.dtype)) {
      auto* work = static_cast<float*>(workspace.get(kHalfCopy, output.count * sizeof(float)));
      half_to_float(output.data, work, output.count, output.dtype);
      finalize_average(work, output.count, DType::Float32, static_cast<size_t>(size));
      float_to_half(work, output.data, output.count, output.dtype);
    } else {
      finalize_average(output.data, output.count, output.dtype, static_cast<size_t>(size));
    }
  }
}

void allgather(const Buffer& input, const Buffer& output, const std::vector<size_t>& counts, MPI_Comm comm,
               const AllreduceOptions& options, AllreduceAlgorithm algorithm) {
  int rank = 0, size = 1;
  HP_MPI(MPI_Comm_rank, comm, comm, &rank);
  HP_MPI(MPI_Comm_size, comm, comm, &size);
  check_layout("allgather", output, input, counts, rank, size);
  const std::vector<Span> spans = layout_of(counts);
  const Span mine = spans[static_cast<size_t>(rank)];
  const size_t element = dtype_size(output.dtype);
  auto* out = static_cast<unsigned char*>(output.data);
  if (output.count == 0) return;
  if (size == 1) {
    if (input.data != out) std::memcpy(out, input.data, input.bytes());
    return;
  }
  const bool large = output.bytes() > options.small_message_bytes;
  if (algorithm == AllreduceAlgorithm::SharedMemory ||
      (algorithm == AllreduceAlgorithm::Auto && large && options.shared_memory)) {
    if (SharedMemoryAllreduce* shm = shared_memory_for(comm, options.shared_memory_chunk_bytes)) {
      shm->allgather(input, mine.begin, output, options.wait);
      return;
    }
    if (algorithm == AllreduceAlgorithm::SharedMemory) {
      throw std::invalid_argument("allgather: shared memory cannot serve this communicator: " +
                                  shared_memory_unavailable_reason(comm) + " (use the ring: algorithm Ring or Auto)");
    }
  }
  if (mine.length && input.data != out + mine.begin * element) {
    std::memmove(out + mine.begin * element, input.data, input.bytes());
  }
  const bool use_ring = algorithm == AllreduceAlgorithm::Ring ||
                        ((algorithm == AllreduceAlgorithm::Auto || algorithm == AllreduceAlgorithm::Hierarchical) && large);
  if (use_ring) {
    allgather_chunks(out, rotated_for_ring(spans), output.dtype, std::max<size_t>(1, options.segment_bytes / element),
                     rank, size, comm, options);
    return;
  }
  const std::vector<int> ints = int_counts("allgather", counts);
  std::vector<int> displacements;
  for (const Span& span : spans) displacements.push_back(static_cast<int>(span.begin));
  MPI_Request request = MPI_REQUEST_NULL;
  HP_MPI(MPI_Iallgatherv, comm, MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out, ints.data(), displacements.data(),
         mpi_type(output.dtype), comm, &request);
  HP_MPI(wait_all, comm, 1, &request, MPI_STATUSES_IGNORE, options.wait);
  count_wire(input.count * static_cast<size_t>(size - 1), element);
}

}  // namespace hybridpipe
