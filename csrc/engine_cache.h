// The engine's response cache (see engine.h): a name gets a bit the first time every rank of a group has it with
// the same count, dtype, op, device and wire format; from then on a negotiation is one bit-vector allreduce. One
// per group, the communication thread's own (Group::round).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine_announce.h"

namespace hybridpipe {

class ResponseCache {
 public:
  static constexpr size_t kNone = static_cast<size_t>(-1);
  // The bit of `entry`'s name when it is cached with the entry's metadata (and it is no refusal), else kNone.
  size_t cached_bit(const Entry& entry) const;
  // The bit of `name`, or kNone.
  size_t bit(const std::string& name) const;
  // `name` gets (or keeps) its bit, with the metadata every rank agreed on.
  void remember(const std::string& name, const Announced& meta);
  size_t size() const { return cache_.size(); }
  // The words of a negotiation's bit-vector: a flag word, then one bit per cached name.
  size_t words() const { return 1 + (cache_.size() + 63) / 64; }

 private:
  struct Cached {
    std::string name;
    size_t count;
    DType dtype;
    ReduceOp op;
    int device;
    WireFormat wire;
  };
  std::vector<Cached> cache_;
  std::unordered_map<std::string, size_t> bits_;  // name -> cache index
};

}  // namespace hybridpipe
