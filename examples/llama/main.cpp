// A small character-level Llama-family decoder trained on /usr/share/common-licenses/GPL-3 over
// MPI ranks: RMSNorm, rotary position embeddings, grouped-query attention, a SwiGLU feed-forward
// block, an untied LM head, AdamW (optionally ZeRO-1 or ZeRO-3 over dp), on a DP x TP mesh with
// optional sequence parallelism; or its mixture-of-experts form (--experts E: E SwiGLU experts
// behind a top-k router, split over --ep ranks, tokens over dp x ep), which also prints each
// layer's load balance:
//
//   examples/llama/run.sh                                 # 4 ranks: dp=2 x tp=2, concerto plan
//   examples/llama/run.sh --tp 2 --sp --zero 1 --policy sync,concerto --json results.json
//   examples/llama/run.sh --experts 4 --ep 4 --tp 1       # 4 ranks: ep=4, one expert each
//
// It prints the plan summary, a progress line every --log-every steps, and the median measured
// step time; it exits with status 1 if the loss did not fall. One plan trains with the trainer of
// examples/common/trainer.hpp: token shards (--data DIR, written by examples/shards), validation
// (--val-every), clipping (--clip), checkpoints that resume with the exact next batch (--save,
// --save-every, --resume), JSONL metrics (--metrics), safetensors (--export; reference.py
// computes the same validation loss in PyTorch). A comma-separated --policy compiles one step per policy
// on the same ranks and runs them in turn, step by step (the order rotating each round); each
// prints its median measured step, and --json FILE writes every result (median measured step
// time, predicted time, lower bound) as one JSON array. --auto leaves the specs and ZeRO stage
// (with --experts: where the experts live too) to automatic sharding (--explain,
// --memory-cap-mib; docs/auto-sharding.md). --help lists every option (flags.cpp). It is built
// in concerto's separately compiled mode (CMake: concerto::mpi_compiled; docs/training.md).
#include "../common/optimizer.hpp"
#include "../common/policy_runs.hpp"
#include "../common/trainer.hpp"
#include "model.hpp"
#include "runs.hpp"
#include "settings.hpp"

#include <concerto/concerto.hpp>
#include <concerto/core/file.hpp>
#include <concerto/train/step.hpp>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

using namespace concerto;

namespace {

using llama_example::settings;

// Llama's feed-forward width: 2/3 of 4·hidden, rounded up to a multiple of 8 (so that it splits).
int default_ffn(int hidden) { return (8 * hidden / 3 + 7) / 8 * 8; }

template <std::size_t N>
int train_on(const graph::program<N>& model, const settings& s) {
  const int ffn = s.ffn > 0 ? s.ffn : default_ffn(s.hidden);
  const bool moe = s.experts > 0;
  const int world = runtime::mpi::environment::world_size();
  const auto axes = moe ? std::vector<axis_request>{{"dp", -1}, {"ep", s.ep}, {"tp", s.tp}}
                        : std::vector<axis_request>{{"dp", -1}, {"tp", s.tp}};
  const auto m = mesh::from_world(world, axes);
  // The tokens' rows split over dp (and ep): each rank reads its own.
  // (Under --auto every rank reads the whole batch: the layout of the tokens is chosen later.)
  const auto token_axes = s.auto_shard ? std::vector<std::string>{}
                          : moe        ? std::vector<std::string>{"dp", "ep"}
                                       : std::vector<std::string>{"dp"};
  examples::batch_source source(s, examples::slice_of(m, runtime::mpi::environment::world_rank(), token_axes));
  const auto vocab = source.vocab();
  const shape_map shapes = moe ? llama_model::moe_shapes(s.batch, s.seq, vocab, s.hidden, s.heads, s.kv_heads, s.experts, ffn)
                               : llama_model::shapes(s.batch, s.seq, vocab, s.hidden, s.heads, s.kv_heads, ffn);
  const lower_options lower{.name = "llama", .heads = s.heads, .rope_theta = s.rope_theta,
                            .precision = ir::parse_precision(s.precision, "--precision"), .depth = {{"layers", s.layers}}};
  const auto policies = examples::plan_policies(s.policy);
  std::vector<train::basic_step<>> runs;
  runs.reserve(policies.size());
  for (const auto& policy : policies)
    runs.push_back(train::compile(model, m, shapes, examples::optimizer_of(s), examples::step_options_of(s, policy, lower)));
  if (runs.front().rank() == 0) {
    std::printf("llama: %d layers, hidden %d, %d heads (%d k/v heads), ffn %d, seq %d, batch %d, vocab %lld, %s\n", s.layers,
                s.hidden, s.heads, s.kv_heads, ffn, s.seq, s.batch, static_cast<long long>(vocab), source.describe().c_str());
    if (s.experts > 0)
      std::printf("experts: %d SwiGLU experts per layer, top-%d routing, capacity factor 1.25, balance loss weight 0.01\n",
                  s.experts, s.top_k);
    std::printf("mesh: dp=%d x %stp=%d%s%s on %d ranks, cost preset %s, precision %s\n", world / s.tp / s.ep,
                s.experts > 0 ? ("ep=" + std::to_string(s.ep) + " x ").c_str() : "", s.tp, s.sp ? " (sequence parallel)" : "",
                s.zero_stage > 0 ? (" ZeRO-" + std::to_string(s.zero_stage)).c_str() : "", world, s.cost_preset.c_str(), s.precision.c_str());
  }
  return llama_example::train_runs(runs, s, source, ffn, world, policies);
}

template <auto Residual>
void train_with_optimizer(const settings& s) {
  using namespace llama_model;
  switch (s.zero_stage) {
  // Each program is a constant made by the compiler ("static constexpr"): passed as a call's
  // result instead, g++ would emit code that builds it node by node at run time.
  case 0: {
    static constexpr auto model = make<Residual>();
    train_on(model, s);
    return;
  }
  case 1: {
    static constexpr auto model = make<Residual, zero<1>(adamw{}, dp)>();
    train_on(model, s);
    return;
  }
  case 3: {
    static constexpr auto model = make<Residual, zero<3>(adamw{}, dp)>();
    train_on(model, s);
    return;
  }
  default: fail("--zero " + std::to_string(s.zero_stage) + ": the example offers ZeRO stages 0, 1 and 3");
  }
}

} // namespace

int main(int argc, char** argv) {
  runtime::mpi::environment env(argc, argv);
  settings s;
  if (const auto status = llama_example::parse_command_line(argc, argv, s)) return *status;
  return runtime::mpi::run_or_abort([&] {
    if (s.auto_shard) {
      static constexpr auto switch_auto = llama_model::make_moe<llama_model::top1, adamw{}, llama_model::moe_decided>();
      static constexpr auto mixtral_auto = llama_model::make_moe<llama_model::top2, adamw{}, llama_model::moe_decided>();
      if (s.experts == 0) train_on(llama_model::llama_auto, s);
      else if (s.top_k == 1) train_on(switch_auto, s);
      else train_on(mixtral_auto, s);
      return;
    }
    if (s.experts > 0) {
      // As above: the programs are constants made by the compiler.
      static constexpr auto switch_moe = llama_model::make_moe<llama_model::top1>();
      static constexpr auto mixtral_moe = llama_model::make_moe<llama_model::top2>();
      if (s.top_k == 1) train_on(switch_moe, s);
      else train_on(mixtral_moe, s);
      return;
    }
    if (s.sp) train_with_optimizer<llama_model::sequence_parallel_residual>(s);
    else train_with_optimizer<llama_model::replicated_residual>(s);
  });
}
