// AlphaFold 2's Evoformer pair stack (its triangle-free core: row and column gated
// self-attention and the transition, examples/evoformer/model.hpp) trained to regress a smooth
// synthetic target from fixed pair features, with dynamic axial parallelism: the pair
// representation [N_res, N_res, c_z] split over every rank on one residue dimension, switched
// between rows and columns by all-to-alls.
//
//   examples/evoformer/run.sh                                    # 4 ranks: dap = 4, concerto plan
//   examples/evoformer/run.sh --residues 64 --channels 32 --policy sync,program_order,concerto
//
// It prints the plan summary, the loss per step and the median measured step time; it exits with
// status 1 if the loss did not fall. A comma-separated --policy runs one step per policy on the
// same ranks in turn; --json FILE writes each one's result (bench/cluster/run reads them).
#include "../common/command_line.hpp"
#include "../common/policy_runs.hpp"
#include "model.hpp"

#include <concerto/core/file.hpp>
#include <concerto/train/step.hpp>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

using namespace concerto;

namespace {

struct settings {
  int residues = 32, channels = 32, heads = 4, blocks = 2, steps = 60;
  float lr = 3e-3f;
  std::string policy = "concerto", cost_preset = "cpu", json;
};

// Fixed pair features and the target: smooth functions of the two residues and the channel.
train::batch pair_data(const settings& s) {
  const std::int64_t n = s.residues, c = s.channels;
  train::tensor z{{n, n, c}}, target{{n, n, c}};
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < n; ++j)
      for (std::int64_t k = 0; k < c; ++k) {
        const double x = static_cast<double>(i), y = static_cast<double>(j), ch = static_cast<double>(k);
        z.f32.push_back(static_cast<float>(std::sin(0.3 * x + 0.2 * ch) + std::cos(0.4 * y - 0.1 * ch)));
        target.f32.push_back(static_cast<float>(std::tanh(0.1 * (x - y) + 0.05 * ch)));
      }
  return {{"z", z}, {"target", target}};
}

int train_pair_stack(const settings& s) {
  const int world = runtime::mpi::environment::world_size();
  const auto policies = examples::plan_policies(s.policy);
  std::vector<train::basic_step<>> runs;
  for (const auto& policy : policies)
    runs.push_back(train::compile(evoformer_model::pair_stack, mesh::from_world(world, {{"dap", world}}),
                                  evoformer_model::shapes(s.residues, s.channels), {.adamw = {.lr = s.lr}},
                                  {.policy = policy,
                                   .lower = {.name = "evoformer", .heads = s.heads, .depth = {{"blocks", s.blocks}}},
                                   .cost_preset = s.cost_preset}));
  const bool root = runs.front().rank() == 0;
  if (root)
    std::printf("evoformer pair stack: %d blocks, %d residues, c_z %d, %d heads; dap = %d ranks, cost preset %s\n", s.blocks,
                s.residues, s.channels, s.heads, world, s.cost_preset.c_str());
  examples::announce_plans(runs, root);
  const auto batch = pair_data(s);
  const std::size_t k = runs.size();
  std::vector<double> first(k), last(k);
  std::vector<std::vector<double>> times(k), exposed(k);
  for (int i = 0; i < s.steps; ++i)
    for (std::size_t j = 0; j < k; ++j) {
      const std::size_t p = (j + static_cast<std::size_t>(i)) % k; // rotate who goes first
      const auto r = runs[p](batch);
      if (i == 0) first[p] = r.loss;
      last[p] = r.loss;
      if (i > 0) {
        times[p].push_back(r.step_us);
        exposed[p].push_back(r.exposed_comm_us);
      }
      if (root && k == 1 && (i % 10 == 0 || i + 1 == s.steps))
        std::printf("step %4lld/%d  loss %.5f  %7.0f us\n", static_cast<long long>(r.step), s.steps, r.loss, r.step_us);
    }
  nlohmann::json results = nlohmann::json::array();
  for (std::size_t p = 0; root && p < k; ++p) {
    std::printf("loss %.5f -> %.5f; median step %.0f us (measured, %s plan)\n", first[p], last[p], concerto::median(times[p]),
                runs[p].summary().policy.c_str());
    results.push_back(examples::result_of(runs[p],
                                             {{"example", "evoformer"}, {"world", world}, {"dap", world}, {"tp", 1},
                                              {"blocks", s.blocks}, {"residues", s.residues}, {"channels", s.channels},
                                              {"heads", s.heads}, {"cost_preset", s.cost_preset}, {"loss_first", first[p]},
                                              {"loss_last", last[p]}},
                                             times[p], exposed[p]));
  }
  if (root && !s.json.empty()) write_file_atomically(s.json, results.dump(2) + "\n");
  if (root) std::fflush(stdout);
  for (std::size_t p = 0; p < k; ++p)
    if (!(last[p] < first[p])) fail("the loss did not fall (" + std::string(planner::to_string(policies[p])) + " plan)");
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  runtime::mpi::environment env(argc, argv);
  settings s;
  CLI::App app{"Trains AlphaFold 2's Evoformer pair stack (triangle-free core) with dynamic axial parallelism over MPI ranks."};
  app.add_option("--residues", s.residues, "residues N: the pair representation is [N, N, c_z]")->check(examples::positive)
      ->capture_default_str();
  app.add_option("--channels", s.channels, "pair channels c_z")->check(examples::positive)->capture_default_str();
  app.add_option("--heads", s.heads, "attention heads (over c_z / heads lanes)")->check(examples::positive)->capture_default_str();
  app.add_option("--blocks", s.blocks, "Evoformer blocks")->check(examples::positive)->capture_default_str();
  app.add_option("--steps", s.steps, "training steps")->check(examples::positive)->capture_default_str();
  app.add_option("--lr", s.lr, "AdamW learning rate")->check(examples::positive)->capture_default_str();
  app.add_option("--policy", s.policy, "plan policy, or a comma-separated list: sync, program_order, xla_lhs, concerto")
      ->capture_default_str();
  app.add_option("--cost-preset", s.cost_preset, "the planner's cost model (cpu-netns: the emulated cluster's)")
      ->capture_default_str();
  app.add_option("--json", s.json, "write the result of every policy to this file (a JSON array)");
  if (const auto status = examples::parse_or_exit(app, argc, argv)) return *status;
  return runtime::mpi::run_or_abort([&] { return train_pair_stack(s); });
}
