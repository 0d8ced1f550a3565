// Slow-round announcements (see engine_announce.h): their encoding and what they say.
#include "engine_announce.h"

#include <algorithm>
#include <cstring>

namespace hybridpipe {

namespace {

void put(std::string& out, const void* data, size_t bytes) { out.append(static_cast<const char*>(data), bytes); }

template <typename T>
T take(const char*& cursor) {
  T value;
  std::memcpy(&value, cursor, sizeof(T));
  cursor += sizeof(T);
  return value;
}

std::string describe(const Announced& a) {
  static const char* const devices[] = {"", " device=cuda", " device=accelerator"};
  return "count=" + std::to_string(a.count) + " dtype=" + dtype_name(static_cast<DType>(a.dtype)) +
         " op=" + op_name(static_cast<ReduceOp>(a.op)) + devices[a.device >= 0 && a.device <= 2 ? a.device : 2] +
         (a.wire.dtype < 0 ? "" : std::string(" wire=") + dtype_name(static_cast<DType>(a.wire.dtype))) +
         (a.wire.on_one_host ? " (on one host too)" : "");
}

}  // namespace

std::string encode_announcements(const std::vector<Entry>& snapshot, std::chrono::steady_clock::time_point now,
                                 double stall_check_seconds) {
  std::string mine;
  for (const Entry& entry : snapshot) {
    const uint32_t length = static_cast<uint32_t>(entry.name.size());
    const uint64_t count = entry.buffer.count;
    const int32_t dtype = static_cast<int32_t>(entry.buffer.dtype), op = static_cast<int32_t>(entry.op);
    const double waited = std::chrono::duration<double>(now - entry.submitted).count();
    const uint8_t stalled = !entry.warned && waited > stall_check_seconds;
    put(mine, &length, sizeof length);
    put(mine, entry.name.data(), length);
    put(mine, &count, sizeof count);
    put(mine, &dtype, sizeof dtype);
    put(mine, &op, sizeof op);
    put(mine, &stalled, sizeof stalled);
    put(mine, &waited, sizeof waited);
    const uint32_t refusal_length = static_cast<uint32_t>(entry.refusal.size());
    put(mine, &refusal_length, sizeof refusal_length);
    put(mine, entry.refusal.data(), refusal_length);
    const int32_t device = entry.device;
    put(mine, &device, sizeof device);
    const uint8_t join = entry.join, call = entry.job != nullptr;
    put(mine, &join, sizeof join);
    put(mine, &call, sizeof call);
    const int32_t wire_dtype = entry.wire.dtype;
    const uint8_t wire_on_one_host = entry.wire.on_one_host;
    put(mine, &wire_dtype, sizeof wire_dtype);
    put(mine, &wire_on_one_host, sizeof wire_on_one_host);
  }
  return mine;
}

Announcements decode_announcements(const std::string& everyone, const std::vector<int>& lengths,
                                   const std::vector<int>& offsets) {
  Announcements by_name;  // sorted: the same order on every rank
  for (size_t r = 0; r < lengths.size(); ++r) {
    const char* cursor = everyone.data() + offsets[r];
    const char* end = cursor + lengths[r];
    while (cursor < end) {
      const uint32_t length = take<uint32_t>(cursor);
      std::string name(cursor, length);
      cursor += length;
      Announced a{};
      a.rank = static_cast<int>(r);
      a.count = static_cast<size_t>(take<uint64_t>(cursor));
      a.dtype = take<int32_t>(cursor);
      a.op = take<int32_t>(cursor);
      a.stalled = take<uint8_t>(cursor) != 0;
      a.waited_s = take<double>(cursor);
      const uint32_t refusal_length = take<uint32_t>(cursor);
      a.refusal.assign(cursor, refusal_length);
      cursor += refusal_length;
      a.device = take<int32_t>(cursor);
      a.join = take<uint8_t>(cursor) != 0;
      a.call = take<uint8_t>(cursor) != 0;
      a.wire.dtype = take<int32_t>(cursor);
      a.wire.on_one_host = take<uint8_t>(cursor) != 0;
      by_name[name].push_back(std::move(a));
    }
  }
  return by_name;
}

std::string refusals_of(const std::vector<Announced>& ranks) {
  std::string refusals;
  for (const Announced& a : ranks) {
    if (!a.refusal.empty()) refusals += (refusals.empty() ? "" : "; ") + ("rank " + std::to_string(a.rank) + " raised " + a.refusal);
  }
  return refusals;
}

bool same_metadata(const std::vector<Announced>& ranks) {
  return std::all_of(ranks.begin(), ranks.end(), [&](const Announced& a) {
    return a.count == ranks[0].count && a.dtype == ranks[0].dtype && a.op == ranks[0].op && a.device == ranks[0].device &&
           a.wire == ranks[0].wire;
  });
}

std::string disagreement(const std::string& name, const std::string& group, const std::vector<Announced>& ranks) {
  std::string listing;
  for (const Announced& a : ranks) listing += (listing.empty() ? "" : "; ") + ("rank " + std::to_string(a.rank) + ": " + describe(a));
  return "allreduce_async '" + name + "' on group '" + group + "': ranks disagree (" + listing +
         "); every rank must submit the same count, dtype, op, device and compression under one name";
}

}  // namespace hybridpipe
