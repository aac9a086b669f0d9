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
// predicted time, lower bound, every step's time) as one JSON array. --help lists every option.
#include "../common/command_line.hpp"
#include "../common/corpus.hpp"
#include "../common/optimizer.hpp"
#include "../common/policy_runs.hpp"
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
  // Characters as ids; the vocabulary is padded so that it splits over tp.
  const auto corpus = examples::read_corpus(s.text, s.seq);
  const auto& text = corpus.text;
  const auto& id_of = corpus.id_of;
  const auto vocab = corpus.vocab;

  const shape_map shapes = gpt_model::shapes(s.batch, s.seq, vocab, s.hidden);
  const int world = runtime::mpi::environment::world_size();
  // Pipelined, the runs compared are schedules; otherwise plan policies.
  const bool pipelined = s.pp > 1 || s.microbatches > 1;
  const auto policies = pipelined ? examples::split_policies(s.schedule, "--schedule") : examples::split_policies(s.policy);
  const auto make = [&](const std::string& name) {
    train::step_options o{.policy = pipelined ? examples::plan_policies(s.policy).front() : planner::parse_policy(name, "--policy"),
                          .lower = {.name = "gpt", .heads = s.heads, .depth = {{"layers", s.layers}}},
                          .cost_preset = s.cost_preset};
    std::vector<axis_request> axes{{"dp", -1}, {"tp", s.tp}};
    if (pipelined) {
      axes.insert(axes.begin(), axis_request{"pp", s.pp, ir::link_class::inter_node});
      o.pipeline = {.microbatches = s.microbatches, .schedule = name, .virtual_stages = s.virtual_stages};
    }
    return train::compile(model, mesh::from_world(world, axes), shapes, examples::optimizer_of(s), std::move(o));
  };
  std::vector<decltype(make(""))> runs;
  runs.reserve(policies.size());
  for (const auto& p : policies) runs.push_back(make(p));
  const bool root = runs.front().rank() == 0;
  if (root) {
    std::printf("gpt: %d layers, hidden %d, %d heads, seq %d, batch %d, vocab %lld, %zu chars of %s\n", s.layers, s.hidden,
                s.heads, s.seq, s.batch, static_cast<long long>(vocab), text.size(), s.text.c_str());
    std::printf("mesh: pp=%d x dp=%d x tp=%d%s on %d ranks, %d micro-batches per step, %d chunk%s per stage, cost preset %s\n",
                s.pp, world / s.tp / s.pp, s.tp, s.sp ? " (sequence parallel)" : "", world, s.microbatches,
                s.virtual_stages, s.virtual_stages == 1 ? "" : "s", s.cost_preset.c_str());
  }
  examples::announce_plans(runs, root);
  // Every rank draws the same global batch (a fixed seed), and keeps its shard; every policy of
  // a round gets the same batch.
  std::uint64_t state = 12345;
  const auto next = [&] {
    state = train::detail::mix(state);
    return state;
  };
  const std::size_t k = runs.size();
  std::vector<double> first(k), last(k);
  std::vector<std::vector<double>> times(k), exposed(k);
  for (int i = 0; i < s.steps; ++i) {
    train::tensor ids{{s.batch, s.seq}}, labels{{s.batch, s.seq}};
    for (int b = 0; b < s.batch; ++b) {
      const auto at = next() % (text.size() - static_cast<std::size_t>(s.seq) - 1);
      for (int t = 0; t < s.seq; ++t) {
        ids.i64.push_back(id_of[static_cast<unsigned char>(text[at + static_cast<std::size_t>(t)])]);
        labels.i64.push_back(id_of[static_cast<unsigned char>(text[at + static_cast<std::size_t>(t) + 1])]);
      }
    }
    for (std::size_t j = 0; j < k; ++j) {
      const std::size_t p = (j + static_cast<std::size_t>(i)) % k; // rotate who goes first
      const auto r = runs[p]({{"ids", ids}, {"labels", labels}});
      if (i == 0) first[p] = r.loss;
      last[p] = 0.9 * (i == 0 ? r.loss : last[p]) + 0.1 * r.loss;
      if (i > 0) { // the first step also warms caches
        times[p].push_back(r.step_us);
        exposed[p].push_back(r.exposed_comm_us);
      }
      if (root && k == 1) {
        const int width = 30, done = (i + 1) * width / s.steps;
        std::printf("step %4lld/%d  loss %.4f  (avg %.4f)  lr %.2e  %7.0f us  [%s%s]\n", static_cast<long long>(r.step),
                    s.steps, r.loss, last[p], static_cast<double>(r.lr), r.step_us,
                    std::string(static_cast<std::size_t>(done), '#').c_str(),
                    std::string(static_cast<std::size_t>(width - done), '.').c_str());
        std::fflush(stdout);
      }
    }
  }
  nlohmann::json results = nlohmann::json::array();
  for (std::size_t p = 0; root && p < k; ++p) {
    const auto& sm = runs[p].summary();
    std::printf("loss %.4f -> %.4f (moving average); median step %.0f us (measured, %s plan)\n", first[p], last[p],
                concerto::median(times[p]), sm.policy.c_str());
    results.push_back(examples::result_of(runs[p],
                           {{"example", "gpt"}, {"world", world}, {"pp", s.pp}, {"microbatches", s.microbatches}, {"virtual_stages", s.virtual_stages}, {"tp", s.tp}, {"sp", s.sp}, {"layers", s.layers},
                            {"hidden", s.hidden}, {"heads", s.heads}, {"seq", s.seq}, {"batch", s.batch},
                            {"cost_preset", s.cost_preset}},
                           times[p], exposed[p]));
  }
  if (root && !s.json.empty()) write_file_atomically(s.json, results.dump(2) + "\n");
  if (!s.export_path.empty()) { // the first policy's model (each trains the same one, up to rounding)
    runs.front().export_safetensors(s.export_path, s.export_dtype == "bf16" ? train::safetensors::dtype::bf16
                                                                            : train::safetensors::dtype::f32);
    if (root) std::printf("parameters written to %s (safetensors, %s)\n", s.export_path.c_str(), s.export_dtype.c_str());
  }
  if (root) std::fflush(stdout);
  for (std::size_t p = 0; p < k; ++p)
    if (!(last[p] < first[p])) fail("the loss did not fall (" + policies[p] + " plan)");
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
    if (s.sp) train_on(gpt_sp, s);
    else train_on(gpt_tp, s);
  });
}
