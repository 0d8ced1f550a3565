// What the engine's source files (engine*.cpp: the engine and its collaborating classes) share and nothing else
// needs: the negotiation's flag bits, the probe tags, the join's name, the clock.
#pragma once

#include <chrono>
#include <cstdint>

namespace hybridpipe {
namespace engine_detail {

using Clock = std::chrono::steady_clock;

inline double seconds_now() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

constexpr uint64_t kAllCached = 1ull << 0;   // AND: no rank has an uncached ready name
constexpr uint64_t kNotStalled = 1ull << 1;  // AND: no rank has a name waiting past stall_check_seconds
constexpr uint64_t kWantStop = 1ull << 2;    // AND: every rank asked to stop and has nothing pending
constexpr uint64_t kIdle = 1ull << 3;        // AND: nobody has anything pending
constexpr uint64_t kNotExpired = 1ull << 4;  // AND: nothing waited past stall_shutdown_seconds
constexpr uint64_t kNoRegistration = 1ull << 5;  // AND (group 0 only): no rank has a group waiting to join
constexpr uint64_t kNobodyLeft = 1ull << 6;  // AND: no rank has asked to stop with nothing pending (hp.shutdown)

constexpr int kProbeTag = 1;   // on health_: "is your communication thread alive?" (round, 0)
constexpr int kAnswerTag = 2;  // on health_: "yes" (round, seconds my thread has been blocked)
constexpr double kProbeGraceSeconds = 1.0;  // a live thread answers within milliseconds

constexpr const char* kJoinName = "hybridpipe.join";

}  // namespace engine_detail
}  // namespace hybridpipe
