// A small character-level GPT trained on /usr/share/common-licenses/GPL-3 over MPI ranks, with
// a PP x DP x TP mesh (and sequence parallelism with --sp) chosen on the command line:
//
//   examples/gpt/run.sh                                  # 4 ranks: dp=2 x tp=2, concerto plan
//   examples/gpt/run.sh --tp 2 --sp --policy sync --steps 200
//   examples/gpt/run.sh --pp 2 --tp 1 --microbatches 4 --schedule zb_h1   # 2 stages x dp 2
//   examples/gpt/run.sh --pp 2 --tp 1 --layers 4 --microbatches 4 --virtual-stages 2 --schedule interleaved_1f1b,concerto
//
// With --pp N (or --microbatches M > 1) the layers are split into N pipeline stages (each
// holding --virtual-stages chunks of them, interleaved) and each step's batch into M
// micro-batches, run in the order of --schedule (gpipe, 1f1b, interleaved_1f1b, zb_h1, concerto;
// a comma-separated list runs each in turn, as --policy does; docs/pipeline.md says which takes
// chunks). --schedule and --virtual-stages without stages or micro-batches are refused.
// The model is written once in the DSL: a vocab-parallel embedding, a repeat of identical
// blocks (layernorm, causal attention, MLP; Megatron-LM's tensor parallelism), a final
// layernorm, a column-parallel LM head and the vocab-parallel cross-entropy; AdamW.
// It prints the plan summary, then the loss per step with a progress line, and the median
// measured step time; it exits with status 1 if the loss did not fall. A comma-separated
// --policy (e.g. sync,program_order,concerto) compiles one step per policy on the same ranks and
// runs them in turn, step by step (the order rotating each round), then prints each plan's
// median measured step. --cost-preset NAME picks the planner's cost model (cpu-netns: the
// emulated cluster's); --json FILE writes every plan's result (median measured step time,
// predicted time, lower bound, every step's time) as one JSON array. One plan trains with the
// trainer of examples/common/trainer.hpp: --data DIR (token shards), --clip, --val-every,
// --save/--resume, --metrics, --export (docs/training.md). --auto leaves every spec to automatic
// sharding for the mesh and shapes (--explain prints what it chose and why, --memory-cap-mib
// bounds the memory per rank; docs/auto-sharding.md). --help lists every option.
#include "../common/command_line.hpp"
#include "../common/optimizer.hpp"
#include "../common/policy_runs.hpp"
#include "../common/trainer.hpp"
#include "model.hpp"

#include <concerto/concerto.hpp>
#include <concerto/core/file.hpp>
#include <concerto/train/step.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using namespace concerto;
using gpt_model::gpt_sp;
using gpt_model::gpt_tp;

using settings = examples::text_model_settings;

template <std::size_t N>
int train_on(const graph::program<N>& model, const settings& s) {
  const int world = runtime::mpi::environment::world_size();
  // Pipelined, the runs compared are schedules; otherwise plan policies.
  const bool pipelined = s.pp > 1 || s.microbatches > 1;
  const auto policies = pipelined ? examples::split_policies(s.schedule, "--schedule") : examples::split_policies(s.policy);
  std::vector<axis_request> axes{{"dp", -1}, {"tp", s.tp}};
  if (pipelined) axes.insert(axes.begin(), axis_request{"pp", s.pp, ir::link_class::inter_node});
  const auto m = mesh::from_world(world, axes);
  // Characters as ids (the vocabulary padded so that it splits over tp), or token shards whose
  // rows each data-parallel rank reads for itself (under --auto every rank reads the whole batch:
  // the layout of the tokens is chosen later).
  examples::batch_source source(s, examples::slice_of(m, runtime::mpi::environment::world_rank(),
                                                      s.auto_shard ? std::vector<std::string>{} : std::vector<std::string>{"dp"}));
  const auto vocab = source.vocab();
  const shape_map shapes = gpt_model::shapes(s.batch, s.seq, vocab, s.hidden);
  const lower_options lower{.name = "gpt", .heads = s.heads, .precision = ir::parse_precision(s.precision, "--precision"),
                            .depth = {{"layers", s.layers}}};
  const auto make = [&](const std::string& name) {
    auto o = examples::step_options_of(
        s, pipelined ? examples::plan_policies(s.policy).front() : planner::parse_policy(name, "--policy"), lower);
    if (pipelined) o.pipeline = {.microbatches = s.microbatches, .schedule = name, .virtual_stages = s.virtual_stages};
    return train::compile(model, m, shapes, examples::optimizer_of(s), std::move(o));
  };
  std::vector<decltype(make(""))> runs;
  runs.reserve(policies.size());
  for (const auto& p : policies) runs.push_back(make(p));
  const bool root = runs.front().rank() == 0;
  if (root) {
    std::printf("gpt: %d layers, hidden %d, %d heads, seq %d, batch %d, vocab %lld, %s\n", s.layers, s.hidden, s.heads, s.seq,
                s.batch, static_cast<long long>(vocab), source.describe().c_str());
    std::printf("mesh: pp=%d x dp=%d x tp=%d%s on %d ranks, %d micro-batches per step, %d chunk%s per stage, cost preset %s, "
                "precision %s\n",
                s.pp, world / s.tp / s.pp, s.tp, s.sp ? " (sequence parallel)" : "", world, s.microbatches,
                s.virtual_stages, s.virtual_stages == 1 ? "" : "s", s.cost_preset.c_str(), s.precision.c_str());
  }
  examples::announce_plans(runs, root);
  const std::size_t k = runs.size();
  const auto stats = examples::train_all(runs, s, source, s.layers, s.hidden);
  nlohmann::json results = nlohmann::json::array();
  for (std::size_t p = 0; root && p < k; ++p) {
    const auto& sm = runs[p].summary();
    std::printf("loss %.4f -> %.4f (moving average); median step %.0f us (measured, %s plan)\n", stats[p].first, stats[p].last,
                concerto::median(stats[p].step_us), sm.policy.c_str());
    results.push_back(examples::result_of(runs[p],
                           {{"example", "gpt"}, {"world", world}, {"pp", s.pp}, {"microbatches", s.microbatches}, {"virtual_stages", s.virtual_stages}, {"tp", s.tp}, {"sp", s.sp}, {"layers", s.layers},
                            {"hidden", s.hidden}, {"heads", s.heads}, {"seq", s.seq}, {"batch", s.batch},
                            {"cost_preset", s.cost_preset}},
                           stats[p].step_us, stats[p].exposed_us));
  }
  examples::write_results(runs, s, results);
  if (root) std::fflush(stdout);
  // A resumed run's first loss is of a trained model: it need not fall further in a few steps.
  for (std::size_t p = 0; p < k && s.resume.empty(); ++p)
    if (!(stats[p].last < stats[p].first)) fail("the loss did not fall (" + policies[p] + " plan)");
  return 0;
}

int main(int argc, char** argv) {
  runtime::mpi::environment env(argc, argv);
  settings s;
  CLI::App app{"Trains a small character-level GPT on a text over MPI ranks (PP x DP x TP mesh)."};
  examples::add_text_model_options(app, s, "transformer blocks");
  examples::add_pipeline_options(app, s);
  if (const auto status = examples::parse_or_exit(app, argc, argv)) return *status;
  return runtime::mpi::run_or_abort([&] {
    if (s.auto_shard) train_on(gpt_model::gpt_auto, s);
    else if (s.sp) train_on(gpt_sp, s);
    else train_on(gpt_tp, s);
  });
}
