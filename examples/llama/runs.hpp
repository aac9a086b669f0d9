#pragma once
// The Llama example after compiling its steps (runs.cpp): the part that does not depend on the
// model's program, in a translation unit of its own.
#include "settings.hpp"

#include <concerto/planner/policy.hpp>
#include <concerto/train/step.hpp>

#include <vector>

namespace examples {
class batch_source;
}

namespace llama_example {

/// Trains the compiled steps: one with the trainer (examples/common/trainer.hpp), several in turn
/// on the same batches; prints and writes the results, exports (--export), prints the mixture of
/// experts' load balance; fails when the loss did not fall. Collective.
int train_runs(std::vector<concerto::train::basic_step<>>& runs, const settings& s, examples::batch_source& source, int ffn,
               int world, const std::vector<concerto::planner::policy>& policies);

} // namespace llama_example
