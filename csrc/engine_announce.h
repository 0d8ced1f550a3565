// What a slow round gathers (see engine_controller.h): every rank's pending names with their metadata, encoded
// for one MPI_Allgatherv and decoded into the same map on every rank, and what the engine's classes say about them.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "engine_queue.h"

namespace hybridpipe {

struct Announced {  // one pending name of one rank, as gathered in a slow round
  int rank;
  size_t count;
  int dtype;
  int op;
  bool stalled;
  double waited_s;
  std::string refusal;
  int device;
  bool join;
  bool call;
  WireFormat wire;
};

// Every rank's pending names (the snapshot), by name: the same map, in the same order, on every rank.
using Announcements = std::map<std::string, std::vector<Announced>>;

// A slow round's verdict on one of this rank's entries: it fails with `error` (or, error "", is done).
struct Failure {
  Entry entry;
  std::string error;
  ErrorKind kind;
};

// This rank's `snapshot` as the bytes it contributes; `stall_check_seconds` decides which are stalled.
std::string encode_announcements(const std::vector<Entry>& snapshot, std::chrono::steady_clock::time_point now,
                                 double stall_check_seconds);
// Rank r's bytes are `everyone[offsets[r], offsets[r] + lengths[r])`.
Announcements decode_announcements(const std::string& everyone, const std::vector<int>& lengths,
                                   const std::vector<int>& offsets);

// "rank 1 raised TypeError: ...; rank 3 raised ...": the ranks that refused the operation (submit_refusal).
std::string refusals_of(const std::vector<Announced>& ranks);
// Whether the ranks agree on what they submitted under one name.
bool same_metadata(const std::vector<Announced>& ranks);
// The error of a name the ranks disagree on, with every rank's values.
std::string disagreement(const std::string& name, const std::string& group, const std::vector<Announced>& ranks);

}  // namespace hybridpipe
