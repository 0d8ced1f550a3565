// Shared-memory allreduce of one host's ranks; see shm_allreduce.h.
#include "shm_allreduce.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "reduce.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace hybridpipe {
namespace {

// memcpy with non-temporal (streaming) stores where the CPU has them: the destination's cache lines are
// written without being read first. An out-of-place allreduce writes outputs nobody touched since their last
// use; ordinary stores would read every line of them from memory before overwriting it (a third stream of
// memory traffic that the in-place form does not have, its lines having been read a moment before).
// The caller fences (streaming_fence) before it publishes the result.
void copy_streaming(unsigned char* destination, const unsigned char* source, size_t bytes) {
#if defined(__SSE2__)
  size_t head = (16 - (reinterpret_cast<uintptr_t>(destination) & 15)) & 15;
  head = std::min(head, bytes);
  std::memcpy(destination, source, head);
  destination += head;
  source += head;
  bytes -= head;
  for (; bytes >= 64; bytes -= 64, source += 64, destination += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(destination), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(destination + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(destination + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(destination + 48), d);
  }
#endif
  std::memcpy(destination, source, bytes);
}

void streaming_fence() {
#if defined(__SSE2__)
  _mm_sfence();  // streaming stores are weakly ordered: complete them before anyone is told the result is in
#endif
}

constexpr size_t kStreamingMinBytes = 1 << 20;  // smaller outputs are read soon: leave them in the cache

enum CounterKind : int { kPacked = 0, kReduced = 1, kUnpacked = 2, kKinds = 3 };
constexpr size_t kLine = 64;                      // one counter per cache line
constexpr size_t kPage = 4096;
constexpr size_t kSets = 4;                       // chunks in flight
constexpr size_t kMinChunk = kPage;
constexpr size_t kMaxSegment = 256ull << 20;      // the chunk shrinks on hosts with many ranks
constexpr size_t kBlockBytes = 16 * 1024;         // reduction block, L1-sized

size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// What rank 0 tells the others: whether it made the segment, its name and geometry.
struct Announcement {
  int ok = 0;
  uint64_t chunk_bytes = 0, sets = 0, header = 0, total = 0;
  char name[64] = {0};
  char error[192] = {0};
};

// A list of buffers seen as one byte stream, copied to or from contiguous memory at any offset.
class Stream {
 public:
  explicit Stream(const std::vector<Buffer>& buffers) : buffers_(buffers), starts_{0} {
    for (const Buffer& buffer : buffers) starts_.push_back(starts_.back() + buffer.bytes());
  }
  void read(size_t at, unsigned char* destination, size_t bytes) const {
    walk(at, bytes, [&](unsigned char* data, size_t take) {
      std::memcpy(destination, data, take);
      destination += take;
    });
  }
  void write(size_t at, const unsigned char* source, size_t bytes, bool streaming = false) const {
    walk(at, bytes, [&](unsigned char* data, size_t take) {
      if (streaming) {
        copy_streaming(data, source, take);
      } else {
        std::memcpy(data, source, take);
      }
      source += take;
    });
  }

 private:
  template <class Copy>
  void walk(size_t at, size_t bytes, Copy copy) const {
    // buffer i holds bytes [starts_[i], starts_[i + 1]) of the stream (empty buffers hold none)
    size_t i = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), at) - starts_.begin()) - 1;
    while (bytes > 0) {
      const size_t take = std::min(bytes, starts_[i + 1] - at);
      if (take > 0) copy(static_cast<unsigned char*>(buffers_[i].data) + (at - starts_[i]), take);
      at += take;
      bytes -= take;
      ++i;
    }
  }
  const std::vector<Buffer>& buffers_;
  std::vector<size_t> starts_;
};

// Piece `index` of `length` elements split into `parts`, cut at multiples of `align` elements so
// that no two ranks write the same cache line of the result.
void piece_of(size_t length, size_t parts, size_t index, size_t align, size_t* begin, size_t* count) {
  const size_t units = (length + align - 1) / align;
  const size_t base = units / parts, extra = units % parts;
  const size_t first = index * base + std::min(index, extra);
  const size_t last = first + base + (index < extra ? 1 : 0);
  *begin = std::min(first * align, length);
  *count = std::min(last * align, length) - *begin;
}

// destination = op over sources[j] (count elements each); Average divides by the number of sources.
void reduce_sources(unsigned char* destination, const std::vector<const unsigned char*>& sources, size_t count,
                    DType dtype, ReduceOp op) {
  const size_t n = sources.size(), element = dtype_size(dtype);
  if (is_half(dtype)) {
    constexpr size_t block = kBlockBytes / sizeof(float) / 2;
    float sum[block], incoming[block];
    for (size_t at = 0; at < count; at += block) {
      const size_t length = std::min(block, count - at);
      half_to_float(sources[0] + at * element, sum, length, dtype);
      for (size_t j = 1; j < n; ++j) {
        half_to_float(sources[j] + at * element, incoming, length, dtype);
        reduce_into(sum, incoming, length, DType::Float32, op);
      }
      if (op == ReduceOp::Average) finalize_average(sum, length, DType::Float32, n);
      float_to_half(sum, destination + at * element, length, dtype);
    }
    return;
  }
  const size_t block = kBlockBytes / element;
  for (size_t at = 0; at < count; at += block) {
    const size_t length = std::min(block, count - at);
    unsigned char* out = destination + at * element;
    std::memcpy(out, sources[0] + at * element, length * element);
    for (size_t j = 1; j < n; ++j) reduce_into(out, sources[j] + at * element, length, dtype, op);
    if (op == ReduceOp::Average) finalize_average(out, length, dtype, n);
  }
}

constexpr int kProgressTag = 7099;     // never sent: probing it only drives MPI's progress engine
constexpr unsigned kProgressEvery = 64;  // tests between two such probes

// Tests `ready` until it holds, giving the core away between tests (ranks may outnumber cores):
// MPI's spin (policy.spin_us < 0) becomes test-and-yield forever; a polite policy yields for spin_us,
// then sleeps with the same backoff as its MPI waits. Every kProgressEvery tests it probes `comm`, so
// that a rank whose only busy thread is waiting here still moves its other MPI traffic along (a
// peer's rendezvous send to it, say) as it would inside an MPI wait.
template <class Ready>
void wait_until(Ready ready, MPI_Comm comm, const WaitPolicy& policy) {
  if (ready()) return;
  unsigned tests = 0;
  auto test = [&] {
    if (ready()) return true;
    if (shared_memory_probes_mpi && ++tests % kProgressEvery == 0) {
      int flag = 0;
      const int rc = MPI_Iprobe(MPI_ANY_SOURCE, kProgressTag, comm, &flag, MPI_STATUS_IGNORE);
      // a peer that died never moves its flag: a revoked or failed communicator ends the wait instead
      if (rc != MPI_SUCCESS && survive_process_failures() && is_process_failure(rc)) raise_mpi_error(rc, "MPI_Iprobe", comm);
    }
    sched_yield();
    return false;
  };
  if (policy.spin_us < 0) {
    while (!test()) {
    }
    return;
  }
  polite_wait(
      [&](int* flag) {
        *flag = test() ? 1 : 0;
        return MPI_SUCCESS;
      },
      policy);
}

}  // namespace

thread_local bool shared_memory_probes_mpi = true;

bool on_one_host(MPI_Comm comm) {
  int size = 1;
  HP_MPI(MPI_Comm_size, comm, comm, &size);
  MPI_Comm host = MPI_COMM_NULL;
  HP_MPI(MPI_Comm_split_type, comm, comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host);
  int host_size = 0;
  HP_MPI(MPI_Comm_size, host, host, &host_size);
  HP_MPI(MPI_Comm_free, host, &host);
  return host_size == size;  // the same answer on every rank: each host holds fewer than `size`
}

std::unique_ptr<SharedMemoryAllreduce> SharedMemoryAllreduce::create(MPI_Comm comm, size_t chunk_bytes,
                                                                     std::string* why) {
  int rank = 0, size = 1;
  HP_MPI(MPI_Comm_rank, comm, comm, &rank);
  HP_MPI(MPI_Comm_size, comm, comm, &size);
  if (!on_one_host(comm)) {
    *why = "its " + std::to_string(size) + " ranks are not all on one host";
    return nullptr;
  }

  Announcement plan;
  int fd = -1;
  if (rank == 0) {
    size_t chunk = round_up(std::max(chunk_bytes, kMinChunk), kPage);
    while (chunk > kMinChunk && kSets * (size + 1) * chunk > kMaxSegment) chunk = round_up(chunk / 2, kPage);
    plan.chunk_bytes = chunk;
    plan.sets = kSets;
    plan.header = round_up(static_cast<size_t>(size) * kKinds * kLine, kPage);
    plan.total = plan.header + kSets * (size + 1) * chunk;
    static std::atomic<int> serial{0};
    std::snprintf(plan.name, sizeof plan.name, "/hybridpipe-%d-%d", static_cast<int>(getpid()), serial++);
    fd = shm_open(plan.name, O_CREAT | O_EXCL | O_RDWR, 0600);
    int error = fd < 0 ? errno : 0;
    if (!error && ftruncate(fd, static_cast<off_t>(plan.total)) != 0) error = errno;
    // Reserve the pages now: a full /dev/shm must fail here, not as SIGBUS at the first copy.
    if (!error) {
      const int rc = posix_fallocate(fd, 0, static_cast<off_t>(plan.total));
      if (rc != 0 && rc != EOPNOTSUPP && rc != EINVAL) error = rc;
    }
    plan.ok = error == 0;
    if (!plan.ok) {
      std::snprintf(plan.error, sizeof plan.error, "rank 0 could not create %s of %zu bytes in /dev/shm: %s",
                    plan.name, static_cast<size_t>(plan.total), std::strerror(error));
      if (fd >= 0) {
        close(fd);
        shm_unlink(plan.name);
        fd = -1;
      }
    }
  }
  HP_MPI(MPI_Bcast, comm, &plan, static_cast<int>(sizeof plan), MPI_BYTE, 0, comm);
  if (!plan.ok) {
    *why = plan.error;
    return nullptr;
  }
  if (rank != 0) fd = shm_open(plan.name, O_RDWR, 0600);
  void* base = MAP_FAILED;
  if (fd >= 0) {
    base = mmap(nullptr, plan.total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
  }
  int mapped = base != MAP_FAILED ? 1 : 0, everywhere = 0;
  HP_MPI(MPI_Allreduce, comm, &mapped, &everywhere, 1, MPI_INT, MPI_MIN, comm);
  if (rank == 0) shm_unlink(plan.name);  // every rank has it open (or gave up): the name can go
  if (!everywhere) {
    if (base != MAP_FAILED) munmap(base, plan.total);
    *why = std::string("some rank could not map ") + plan.name;
    return nullptr;
  }
  std::unique_ptr<SharedMemoryAllreduce> segment(new SharedMemoryAllreduce());
  segment->comm_ = comm;
  segment->rank_ = rank;
  segment->size_ = size;
  segment->chunk_bytes_ = plan.chunk_bytes;
  segment->sets_ = plan.sets;
  segment->header_ = plan.header;
  segment->mapped_ = plan.total;
  segment->base_ = static_cast<unsigned char*>(base);
  return segment;
}

SharedMemoryAllreduce::~SharedMemoryAllreduce() {
  if (base_) munmap(base_, mapped_);
}

std::atomic<uint64_t>& SharedMemoryAllreduce::counter(int rank, int kind) {
  static_assert(sizeof(std::atomic<uint64_t>) == sizeof(uint64_t) && std::atomic<uint64_t>::is_always_lock_free,
                "process-shared counters need lock-free 64-bit atomics");
  return *reinterpret_cast<std::atomic<uint64_t>*>(base_ + (static_cast<size_t>(rank) * kKinds + kind) * kLine);
}

unsigned char* SharedMemoryAllreduce::slot(size_t set, int rank) {
  return base_ + header_ + (set * (size_ + 1) + static_cast<size_t>(rank)) * chunk_bytes_;
}

unsigned char* SharedMemoryAllreduce::result(size_t set) { return slot(set, size_); }

void SharedMemoryAllreduce::wait_all_reach(int kind, uint64_t value, const WaitPolicy& policy) {
  int next = 0;
  wait_until(
      [&] {
        while (next < size_ && counter(next, kind).load(std::memory_order_acquire) >= value) ++next;
        return next == size_;
      },
      comm_, policy);
}

void SharedMemoryAllreduce::allreduce(const std::vector<Buffer>& inputs, const std::vector<Buffer>& outputs,
                                      ReduceOp op, const WaitPolicy& policy) {
  if (inputs.size() != outputs.size() || inputs.empty()) {
    throw std::invalid_argument("shared-memory allreduce: " + std::to_string(inputs.size()) + " inputs but " +
                                std::to_string(outputs.size()) + " outputs");
  }
  const DType dtype = outputs[0].dtype;
  size_t total = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].dtype != dtype || outputs[i].dtype != dtype || inputs[i].count != outputs[i].count) {
      throw std::invalid_argument("shared-memory allreduce: buffer " + std::to_string(i) +
                                  " differs from the first in dtype or count");
    }
    total += outputs[i].count;
  }
  const Stream out(outputs);
  const size_t element = dtype_size(dtype);
  bool out_of_place = false;
  for (size_t i = 0; i < inputs.size(); ++i) out_of_place |= inputs[i].data != outputs[i].data;
  const bool streaming = out_of_place && total * element >= kStreamingMinBytes;
  reduce_stream(inputs, total, op, policy, [&](size_t at, const unsigned char* source, size_t length) {
    out.write(at * element, source, length * element, streaming);
  });
  if (streaming) streaming_fence();
}

void SharedMemoryAllreduce::reduce_scatter(const std::vector<Buffer>& inputs, const Buffer& output, size_t begin,
                                           ReduceOp op, const WaitPolicy& policy) {
  if (inputs.empty()) throw std::invalid_argument("shared-memory reduce-scatter: no inputs");
  const DType dtype = output.dtype;
  size_t total = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].dtype != dtype) {
      throw std::invalid_argument("shared-memory reduce-scatter: input " + std::to_string(i) +
                                  " differs from the output in dtype");
    }
    total += inputs[i].count;
  }
  if (begin + output.count > total) {
    throw std::invalid_argument("shared-memory reduce-scatter: the kept part ends past the inputs");
  }
  const size_t element = dtype_size(dtype), end = begin + output.count;
  auto* kept = static_cast<unsigned char*>(output.data);
  reduce_stream(inputs, total, op, policy, [&](size_t at, const unsigned char* source, size_t length) {
    const size_t from = std::max(at, begin), to = std::min(at + length, end);
    if (from < to) std::memcpy(kept + (from - begin) * element, source + (from - at) * element, (to - from) * element);
  });
}

void SharedMemoryAllreduce::allgather(const Buffer& input, size_t begin, const Buffer& output,
                                      const WaitPolicy& policy) {
  if (input.dtype != output.dtype || begin + input.count > output.count) {
    throw std::invalid_argument("shared-memory allgather: this rank's part does not fit the output");
  }
  const size_t element = dtype_size(output.dtype), total = output.count, end = begin + input.count;
  const size_t chunk = chunk_bytes_ / element;
  if (total == 0) return;
  auto* out = static_cast<unsigned char*>(output.data);
  auto* mine = static_cast<const unsigned char*>(input.data);
  // Chunk c: elements [c * chunk, ...) of the output, through the result area of set `sequence % sets_`:
  // each rank writes its part of the chunk there, then every rank copies the others' parts out.
  auto span_of = [&](size_t index, size_t* at, size_t* length, uint64_t* sequence) {
    *at = index * chunk;
    *length = std::min(chunk, total - *at);
    *sequence = sequence_ + 1 + index;
  };
  auto put = [&](size_t index) {
    size_t at, length;
    uint64_t sequence;
    span_of(index, &at, &length, &sequence);
    if (sequence > sets_) wait_all_reach(kUnpacked, sequence - sets_, policy);  // the set is free
    const size_t from = std::max(at, begin), to = std::min(at + length, end);
    if (from < to) {
      std::memcpy(result(sequence % sets_) + (from - at) * element, mine + (from - begin) * element,
                  (to - from) * element);
    }
    counter(rank_, kReduced).store(sequence, std::memory_order_release);
  };
  auto take = [&](size_t index) {
    size_t at, length;
    uint64_t sequence;
    span_of(index, &at, &length, &sequence);
    wait_all_reach(kReduced, sequence, policy);
    const unsigned char* area = result(sequence % sets_);
    const size_t from = std::min(std::max(at, begin), at + length), to = std::max(from, std::min(at + length, end));
    if (from > at) std::memcpy(out + at * element, area, (from - at) * element);  // before my part
    if (at + length > to) std::memcpy(out + to * element, area + (to - at) * element, (at + length - to) * element);
    counter(rank_, kUnpacked).store(sequence, std::memory_order_release);
  };
  if (input.data != out + begin * element && input.count) std::memmove(out + begin * element, mine, input.bytes());
  const size_t chunks = (total + chunk - 1) / chunk;
  for (size_t index = 0; index < chunks; ++index) {
    put(index);
    if (index > 0) take(index - 1);
  }
  take(chunks - 1);
  sequence_ += chunks;
}

void SharedMemoryAllreduce::reduce_stream(const std::vector<Buffer>& inputs, size_t total, ReduceOp op,
                                          const WaitPolicy& policy, const Emit& emit) {
  if (total == 0) return;
  const DType dtype = inputs[0].dtype;
  const size_t element = dtype_size(dtype);
  const size_t chunk = chunk_bytes_ / element;
  const size_t align = std::max<size_t>(1, kLine / element);
  const size_t block = kBlockBytes / element;
  const Stream in(inputs);
  std::vector<const unsigned char*> sources(static_cast<size_t>(size_));
  std::vector<unsigned char> mine(block * element);

  // Chunk c of this call: elements [c * chunk, c * chunk + length) in slot set `sequence % sets_`.
  // Rank r reduces piece r of each chunk; its own data of that piece never goes through its slot (it
  // is read from its input) and its result goes to its output as it is made, so the copies in and out
  // skip that piece: at n = 2 that halves them.
  struct Chunk {
    size_t begin = 0, length = 0, piece = 0, count = 0, set = 0;
    uint64_t sequence = 0;
  };
  auto chunk_at = [&](size_t index) {
    Chunk c;
    c.begin = index * chunk;
    c.length = std::min(chunk, total - c.begin);
    c.sequence = sequence_ + 1 + index;
    c.set = c.sequence % sets_;
    piece_of(c.length, static_cast<size_t>(size_), static_cast<size_t>(rank_), align, &c.piece, &c.count);
    return c;
  };
  // Copies the chunk except this rank's piece: stream -> slot (pack) or result -> stream (unpack).
  auto around_piece = [&](const Chunk& c, auto copy) {
    copy(c.begin, 0, c.piece);
    copy(c.begin + c.piece + c.count, c.piece + c.count, c.length - c.piece - c.count);
  };
  auto pack = [&](const Chunk& c) {
    if (c.sequence > sets_) wait_all_reach(kUnpacked, c.sequence - sets_, policy);  // the set is free
    unsigned char* slot_base = slot(c.set, rank_);
    around_piece(c, [&](size_t at, size_t offset, size_t length) {
      if (length) in.read(at * element, slot_base + offset * element, length * element);
    });
    counter(rank_, kPacked).store(c.sequence, std::memory_order_release);
  };
  auto reduce = [&](const Chunk& c) {
    wait_all_reach(kPacked, c.sequence, policy);
    for (size_t at = 0; at < c.count; at += block) {
      const size_t length = std::min(block, c.count - at);
      const size_t offset = c.piece + at;  // in the chunk
      in.read((c.begin + offset) * element, mine.data(), length * element);
      for (int j = 0; j < size_; ++j) sources[static_cast<size_t>(j)] = slot(c.set, j) + offset * element;
      sources[static_cast<size_t>(rank_)] = mine.data();
      unsigned char* reduced = result(c.set) + offset * element;
      reduce_sources(reduced, sources, length, dtype, op);
      emit(c.begin + offset, reduced, length);
    }
    counter(rank_, kReduced).store(c.sequence, std::memory_order_release);
  };
  auto unpack = [&](const Chunk& c) {
    wait_all_reach(kReduced, c.sequence, policy);
    const unsigned char* result_base = result(c.set);
    around_piece(c, [&](size_t at, size_t offset, size_t length) {
      if (length) emit(at, result_base + offset * element, length);
    });
    counter(rank_, kUnpacked).store(c.sequence, std::memory_order_release);
  };

  // Software pipeline: chunk c + 1 is packed before chunk c is unpacked, so a rank has work while
  // the others finish reducing chunk c.
  const size_t chunks = (total + chunk - 1) / chunk;
  Chunk previous;
  for (size_t index = 0; index < chunks; ++index) {
    const Chunk current = chunk_at(index);
    pack(current);
    if (index > 0) unpack(previous);
    reduce(current);
    previous = current;
  }
  unpack(previous);
  sequence_ += chunks;
}
namespace {

struct Cached {
  std::unique_ptr<SharedMemoryAllreduce> segment;
  std::string why;
};

int delete_cached(MPI_Comm, int, void* value, void*) {
  delete static_cast<Cached*>(value);
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

Cached* find_cached(MPI_Comm comm) {
  void* value = nullptr;
  int found = 0;
  HP_MPI(MPI_Comm_get_attr, comm, comm, cache_key(), &value, &found);
  return found ? static_cast<Cached*>(value) : nullptr;
}

}  // namespace

SharedMemoryAllreduce* shared_memory_for(MPI_Comm comm, size_t chunk_bytes) {
  if (Cached* cached = find_cached(comm)) return cached->segment.get();
  auto cached = std::make_unique<Cached>();
  cached->segment = SharedMemoryAllreduce::create(comm, chunk_bytes, &cached->why);
  HP_MPI(MPI_Comm_set_attr, comm, comm, cache_key(), cached.get());
  return cached.release()->segment.get();
}

SharedMemoryAllreduce* cached_shared_memory(MPI_Comm comm, bool* asked) {
  Cached* cached = find_cached(comm);
  *asked = cached != nullptr;
  return cached ? cached->segment.get() : nullptr;
}

std::string shared_memory_unavailable_reason(MPI_Comm comm) {
  Cached* cached = find_cached(comm);
  return cached ? cached->why : std::string();
}

}  // namespace hybridpipe
