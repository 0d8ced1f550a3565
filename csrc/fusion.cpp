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

  // Each dtype gets its own buckets, filled in list order; `pending` holds one dtype's bucket.
  std::vector<size_t> pending;
  DType pending_dtype = DType::Float32;
  size_t pending_bytes = 0;
  auto flush = [&]() {
    if (pending.empty()) return;
    if (shm && pending_bytes > options.small_message_bytes) {  // straight into the segment and back
      std::vector<Buffer> ins, outs;
      for (size_t i : pending) {
        ins.push_back(inputs[i]);
        outs.push_back(outputs[i]);
      }
      shm->allreduce(ins, outs, op, options.wait);
      pending.clear();
      pending_bytes = 0;
      return;
    }
    unsigned char* cursor = fusion_buffer.data();
    for (size_t i : pending) {
      std::memcpy(cursor, inputs[i].data, inputs[i].bytes());
      cursor += inputs[i].bytes();
    }
    const Buffer fused{fusion_buffer.data(), pending_bytes / dtype_size(pending_dtype), pending_dtype};
    allreduce(fused, fused, op, comm, options, workspace);
    cursor = fusion_buffer.data();
    for (size_t i : pending) {
      std::memcpy(outputs[i].data, cursor, outputs[i].bytes());
      cursor += outputs[i].bytes();
    }
    pending.clear();
    pending_bytes = 0;
  };

  for (size_t i = 0; i < inputs.size(); ++i) {
    const Buffer& in = inputs[i];
    if (in.count != outputs[i].count || in.dtype != outputs[i].dtype) {
      throw std::invalid_argument("grouped_allreduce: input and output " + std::to_string(i) +
                                  " differ in count or dtype");
    }
    if (reduced_alone(in.bytes(), fusion_threshold_bytes, options, shm != nullptr)) {
      allreduce(in, outputs[i], op, comm, options, workspace);
      continue;
    }
    if (!pending.empty() && (in.dtype != pending_dtype || pending_bytes + in.bytes() > fusion_threshold_bytes)) {
      flush();
    }
    pending_dtype = in.dtype;
    pending.push_back(i);
    pending_bytes += in.bytes();
  }
  flush();
}

}  // namespace hybridpipe
