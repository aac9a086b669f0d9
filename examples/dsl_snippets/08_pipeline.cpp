// The GPT of 07_gpt.cpp over pipeline stages: the same program, a mesh with a `pp` axis, the
// stack's layers split over it and each step's batch into micro-batches.
#define CONCERTO_SNIPPET_NO_MAIN
#include "07_gpt.cpp"

#include <concerto/pipeline/policies.hpp>
#include <concerto/pipeline/stages.hpp>

// Per micro-batch, a middle stage of 4 receives the stack's value and sends it on, and the
// gradient comes back the same way; the first stage only sends values and receives gradients.
static_assert(gpt.pipeline_messages("layers", 1, 4).sends == 2 && gpt.pipeline_messages("layers", 1, 4).recvs == 2);
static_assert(gpt.pipeline_messages("layers", 0, 4).sends == 1 && gpt.pipeline_messages("layers", 0, 4).recvs == 1);

int main() {
  // A batch of 8 sequences in 4 micro-batches (one sequence per data-parallel rank each): the
  // program is lowered for one micro-batch.
  const shape_map micro{{"ids", {2, 32}},    {"labels", {2, 32}}, {"wte", {512, 64}},  {"ln1.g", {64}},
                        {"ln1.b", {64}},     {"wq", {64, 64}},    {"wk", {64, 64}},    {"wv", {64, 64}},
                        {"wo", {64, 64}},    {"ln2.g", {64}},     {"ln2.b", {64}},     {"fc1", {64, 256}},
                        {"fc2", {256, 64}},  {"lnf.g", {64}},     {"lnf.b", {64}},     {"head", {64, 512}}};
  const auto m = mesh::from_world(8, {{"pp", 2}, {"dp", 2}, {"tp", 2}});
  const auto g = lower(gpt, micro, m, {.name = "gpt", .heads = 4, .depth = {{"layers", 4}}});
  const auto split = pipeline::split(g, {.microbatches = 4});
  const auto problem = pipeline::problem_of(split, g, cost::model::preset("h100x64"));
  for (const char* policy : {"gpipe", "1f1b", "zb_h1"}) {
    const auto schedule = pipeline::baseline(policy, problem);
    const auto stage0 = pipeline::stage_graph(g, split, 0, schedule);
    std::printf("%-6s predicted %.0f us, stage 0 runs %zu tasks\n", policy, pipeline::simulate(problem, schedule).step_us,
                stage0.tasks.size());
  }
}
