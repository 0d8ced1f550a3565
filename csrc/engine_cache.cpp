// The response cache (see engine_cache.h).
#include "engine_cache.h"

namespace hybridpipe {

size_t ResponseCache::cached_bit(const Entry& entry) const {
  auto bit = bits_.find(entry.name);
  if (!entry.refusal.empty() || bit == bits_.end()) return kNone;
  const Cached& cached = cache_[bit->second];
  const bool same = cached.count == entry.buffer.count && cached.dtype == entry.buffer.dtype && cached.op == entry.op &&
                    cached.device == entry.device && cached.wire == entry.wire;
  return same ? bit->second : kNone;
}

size_t ResponseCache::bit(const std::string& name) const {
  auto bit = bits_.find(name);
  return bit == bits_.end() ? kNone : bit->second;
}

void ResponseCache::remember(const std::string& name, const Announced& meta) {
  const Cached cached{name, meta.count, static_cast<DType>(meta.dtype), static_cast<ReduceOp>(meta.op), meta.device,
                      meta.wire};
  auto bit = bits_.find(name);
  if (bit == bits_.end()) {
    bits_[name] = cache_.size();
    cache_.push_back(cached);
  } else {
    cache_[bit->second] = cached;
  }
}

}  // namespace hybridpipe
