// The Llama example after compiling (runs.hpp): training, the results, the export and the
// mixture of experts' load balance. Its own translation unit: none of it depends on the model's
// program, and the trainer's code would otherwise be compiled with every change to the model.
#include "runs.hpp"

#include "../common/policy_runs.hpp"
#include "../common/trainer.hpp"

#include <concerto/core/file.hpp>
#include <concerto/core/statistics.hpp>

#include <cstdio>
#include <string>
#include <vector>

using namespace concerto;

namespace llama_example {

namespace {
void print_load_balance(train::basic_step<>& step, const settings& s);
} // namespace

int train_runs(std::vector<train::basic_step<>>& runs, const settings& s, examples::batch_source& source, int ffn,
               int world, const std::vector<planner::policy>& policies) {
  const bool root = runs.front().rank() == 0;
  examples::announce_plans(runs, root);
  const std::size_t k = runs.size();
  const auto stats = examples::train_all(runs, s, source, s.layers, s.hidden);
  nlohmann::json results = nlohmann::json::array();
  for (std::size_t p = 0; root && p < k; ++p) {
    std::printf("loss %.4f -> %.4f (moving average); median step %.0f us (measured, %s plan)\n", stats[p].first, stats[p].last,
                concerto::median(stats[p].step_us), runs[p].summary().policy.c_str());
    results.push_back(examples::result_of(
        runs[p],
        {{"example", "llama"}, {"world", world}, {"tp", s.tp}, {"sp", s.sp}, {"zero", s.zero_stage}, {"layers", s.layers},
         {"hidden", s.hidden}, {"heads", s.heads}, {"kv_heads", s.kv_heads}, {"ffn", ffn}, {"seq", s.seq},
         {"batch", s.batch}, {"experts", s.experts}, {"ep", s.ep}, {"top_k", s.top_k}, {"cost_preset", s.cost_preset},
         {"loss_first", stats[p].first}, {"loss_last", stats[p].last}},
        stats[p].step_us, stats[p].exposed_us));
  }
  examples::write_results(runs, s, results);
  if (s.experts > 0) print_load_balance(runs.front(), s);
  if (root) std::fflush(stdout);
  // A resumed run's first loss is of a trained model: it need not fall further in a few steps.
  for (std::size_t p = 0; p < k && s.resume.empty(); ++p)
    if (!(stats[p].last < stats[p].first))
      fail("the loss did not fall (" + std::string(planner::to_string(policies[p])) + " plan)");
  return 0;
}

namespace {

// The last step's routing, layer by layer: each expert's share of the kept (token, expert) pairs,
// the share of choices dropped over capacity, and the balance loss (every rank gathers; rank 0
// prints).
void print_load_balance(train::basic_step<>& step, const settings& s) {
  for (const auto& layer : step.moe_balance_losses()) {
    const auto& name = layer.router;
    const auto g = step.gather(name);
    std::vector<double> kept(static_cast<std::size_t>(s.experts), 0.0);
    for (std::size_t i = 0; i < g.size(); ++i) kept[i % kept.size()] += g[i] != 0.0f;
    double total = 0;
    for (const auto k : kept) total += k;
    if (step.rank() != 0) continue;
    const double choices = static_cast<double>(g.size()) / static_cast<double>(s.experts) * s.top_k;
    std::printf("load balance %s: dropped %.1f%% of %d-way choices; expert shares", name.substr(0, name.find(".moe_route#")).c_str(),
                100.0 * (1.0 - total / choices), s.top_k);
    for (const auto k : kept) std::printf(" %.2f", k / total);
    std::printf("; balance %.3f (1: even), loss %.4f\n", layer.balance, layer.loss);
  }
}

} // namespace

} // namespace llama_example
