// The sharded optimizer's (ZeRO's) collectives queued on the engine (Engine::submit_collective): a fused
// reduce-scatter of gradients and an allgather of parameters, in the same sequence as the gradients' allreduces.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine.h"

namespace hybridpipe {
namespace bindings {

// Rank r receives its counts[r] elements of the reduced sum(counts) elements at `input` at `output`.
uint64_t submit_reducescatter(Engine& engine, int group, const std::string& name, int kind, uintptr_t input,
                              uintptr_t output, const std::vector<size_t>& counts, int dtype, int op,
                              bool input_is_scratch);
// Rank r's counts[r] elements at `input` land at their offset of `output` (sum(counts) elements) on every rank.
uint64_t submit_allgather(Engine& engine, int group, const std::string& name, int kind, uintptr_t input,
                          uintptr_t output, const std::vector<size_t>& counts, int dtype);

}  // namespace bindings
}  // namespace hybridpipe
