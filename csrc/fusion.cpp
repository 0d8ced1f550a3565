// Pack / reduce / unpack loop of grouped_allreduce; see fusion.h.
#include "fusion.h"

#include <cstring>

#include "shm_allreduce.h"

namespace hybridpipe {

void grouped_allreduce(const std::vector<Buffer>& inputs, const std::vector<Buffer>& outputs, ReduceOp op,
                       MPI_Comm comm, size_t fusion_threshold_bytes, const AllreduceOptions& options,
                       Workspace& workspace, std::vector<unsigned char>& fusion_buffer) {
  if (inputs.size() != outputs.size()) {
    throw std::invalid_argument("grouped_allreduce: " + std::to_string(inputs.size()) + " inputs but " +
                                std::to_string(outputs.size()) + " outputs");
  }
  if (fusion_buffer.size() < fusion_threshold_bytes) fusion_buffer.resize(fusion_threshold_bytes);
  SharedMemoryAllreduce* shm = fused_shared_memory(comm, options);

  // Each dtype gets its own buckets, filled in list order.
  auto reduce = [&](const Bucket& bucket) {
    if (bucket.alone) {
      const size_t i = bucket.items[0];
      allreduce(inputs[i], outputs[i], op, comm, options, workspace);
      return;
    }
    const bool forced = options.wire.narrows(inputs[bucket.items[0]].dtype) && options.wire.on_one_host;
    if (shm && !forced && bucket.bytes > options.small_message_bytes) {  // straight into the segment and back
      std::vector<Buffer> ins, outs;
      for (size_t i : bucket.items) {
        ins.push_back(inputs[i]);
        outs.push_back(outputs[i]);
      }
      shm->allreduce(ins, outs, op, options.wait);
      return;
    }
    unsigned char* cursor = fusion_buffer.data();
    for (size_t i : bucket.items) {
      std::memcpy(cursor, inputs[i].data, inputs[i].bytes());
      cursor += inputs[i].bytes();
    }
    const DType dtype = inputs[bucket.items[0]].dtype;
    const Buffer fused{fusion_buffer.data(), bucket.bytes / dtype_size(dtype), dtype};
    allreduce(fused, fused, op, comm, options, workspace);
    cursor = fusion_buffer.data();
    for (size_t i : bucket.items) {
      std::memcpy(outputs[i].data, cursor, outputs[i].bytes());
      cursor += outputs[i].bytes();
    }
  };
  BucketCutter cutter(fusion_threshold_bytes, options, shm != nullptr);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Buffer& in = inputs[i];
    if (in.count != outputs[i].count || in.dtype != outputs[i].dtype) {
      throw std::invalid_argument("grouped_allreduce: input and output " + std::to_string(i) +
                                  " differ in count or dtype");
    }
    for (const Bucket& bucket : cutter.add(i, in.bytes(), in.dtype, op)) reduce(bucket);
  }
  for (const Bucket& bucket : cutter.flush()) reduce(bucket);
}

std::vector<Bucket> BucketCutter::add(size_t index, size_t bytes, DType dtype, ReduceOp op, const WireFormat& wire) {
  std::vector<Bucket> done;
  if (reduced_alone(bytes, threshold_, options_, streamed_)) {  // in place, alone; the bucket stays open
    done.push_back(Bucket{{index}, bytes, true});
    return done;
  }
  if (!open_.items.empty() && (dtype != dtype_ || op != op_ || wire != wire_ || open_.bytes + bytes > threshold_)) {
    done.push_back(std::move(open_));
    open_ = Bucket{};
  }
  dtype_ = dtype;
  op_ = op;
  wire_ = wire;
  open_.items.push_back(index);
  open_.bytes += bytes;
  return done;
}

std::vector<Bucket> BucketCutter::flush() {
  std::vector<Bucket> done;
  if (!open_.items.empty()) {
    done.push_back(std::move(open_));
    open_ = Bucket{};
  }
  return done;
}

}  // namespace hybridpipe
