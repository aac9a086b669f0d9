// Automatic sharding on the examples' GPT, Llama, Llama with a mixture of experts, Evoformer
// pair stack, ViT and Wide-ResNet (every spec written auto_) at the benchmark workloads' sizes, on a dp x tp (dp x ep
// x tp; dap; dp alone) mesh of the cost preset's machines: how long the search and the
// planning of its best candidates take, what it chose, and its planned step next to the
// hand-written Megatron layout of the examples (given to the search as a seed, so it is planned
// under the same planner) and the other seeds. With --exhaustive (the MLP) every sharding is priced
// too, and the search's best list-schedule step is compared with the true optimum of that judge.
// With --compare-solvers the exact formulation of every ZeRO stage is solved by CBC and by Z3 (the
// time each takes, its objective, the gap it proved); with --iopddl FILE the formulation without
// ZeRO is written in the IOPDDL contest's format, and its optimum evaluated on the written instance.
// With --workload NAME a planner workload (ir::make_workload) sets the model, its sizes, its mesh
// and its hand-written layout (Megatron, DP with the workload's ZeRO, experts over ep, DAP).
//
//   bench_autoshard --model gpt --world 32 --tp 8 --layers 40 --hidden 5120 --heads 40 --seq 2048 --batch 16 --vocab 50304
//   bench_autoshard --model llama --world 64 --tp 8 --layers 80 --hidden 8192 --heads 64 --kv-heads 8 --ffn 28672 --seq 8192 --batch 8 --vocab 32000
//   bench_autoshard --model moe --world 64 --ep 8 --tp 1 --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --seq 4096 --batch 64 --vocab 32000 --experts 8
//   bench_autoshard --model evoformer --world 8 --layers 48 --seq 512 --hidden 128 --heads 4
//   bench_autoshard --model mlp --world 8 --tp 4 --batch 64 --hidden 4096 --exhaustive
//   bench_autoshard --model gpt --world 32 --tp 8 --layers 40 --hidden 5120 --heads 40 --seq 2048 --batch 16 --compare-solvers --iopddl gpt.json
//   bench_autoshard --workload gpt-zero3 --world 32
//   bench_autoshard --workload wresnet-dp --world 32 --micro-batch 32
#include "evoformer/model.hpp"
#include "gpt/model.hpp"
#include "llama/model.hpp"
#include "vit/model.hpp"
#include "wresnet/model.hpp"

#include <concerto/autoshard/search.hpp>
#include <concerto/ir/workloads.hpp>
#include <concerto/concerto.hpp>

#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>

using namespace concerto;

namespace {

struct settings {
  std::string model = "gpt", preset = "h100x64", precision = "bf16";
  int world = 32, tp = 8, layers = 2, hidden = 1024, heads = 16, kv_heads = 0, ffn = 0, seq = 1024, batch = 16, vocab = 50304;
  int experts = 8, ep = 8, top_k = 2;
  double cap_gib = 0;
  bool exhaustive = false, compare_solvers = false;
  std::string iopddl;
  std::string workload; ///< a planner workload (ir::make_workload) whose model, sizes, mesh and layout these are
  int micro_batch = 1;  ///< the workload's sequences (images) per data-parallel rank
  std::size_t max_strategies = autoshard::formulation_limits{}.max_strategies;
  bool no_align = false;
  int zero_stage = 0;   ///< the workload's: data parallelism with ZeRO-2 or 3 over every rank (tp 1)
  bool sequence_parallel = false; ///< the workload's hand-written layout has Megatron's SP
};

// A planner workload's model at its size on `world` ranks of ranks_per_node 8, with the layout
// ir::make_workload writes by hand: tensor-parallel workloads on dp x tp (tp within a node; one
// micro-batch per data-parallel rank), the mixture of experts on dp x ep, data-parallel ones on
// one axis of every rank (ZeRO as the workload's), the Evoformer's pair stack on one dap group.
void from_workload(settings& s) {
  const auto& w = ir::detail::workloads::find_workload(s.workload);
  const auto& m = w.model;
  const int per_node = 8;
  if (w.wide_resnet) { // data parallel over every rank, micro_batch images each
    s.model = "wresnet", s.tp = 1, s.batch = s.world * s.micro_batch;
    return;
  }
  s.layers = static_cast<int>(m.layers), s.hidden = static_cast<int>(m.hidden), s.heads = static_cast<int>(m.heads);
  s.kv_heads = static_cast<int>(m.kv_heads), s.ffn = static_cast<int>(m.ffn), s.seq = static_cast<int>(m.seq);
  // A vocabulary padded as Megatron-LM pads it (to a multiple of 128 per tensor-parallel rank); the
  // ViT's classes as they are.
  const int pad = m.vit ? 1 : 128 * (w.tensor_parallel ? per_node : 1);
  s.vocab = static_cast<int>((m.vocab + pad - 1) / pad * pad), s.experts = static_cast<int>(m.experts), s.top_k = static_cast<int>(m.top_k);
  s.model = m.axial ? "evoformer" : m.experts > 0 ? "moe" : m.llama ? "llama" : m.vit ? "vit" : "gpt";
  s.tp = w.tensor_parallel ? per_node : 1;
  s.ep = per_node;
  s.batch = (w.tensor_parallel ? s.world / per_node : s.world) * s.micro_batch;
  s.sequence_parallel = m.llama && w.tensor_parallel;
  using ir::detail::workloads::grad_sync;
  s.zero_stage = w.sync == grad_sync::zero3 ? 3 : w.sync == grad_sync::zero2 ? 2 : 0;
  if (m.axial) s.world = per_node, s.batch = 1; // one protein
}

constexpr auto mlp_spec = spec(auto_, auto_);
constexpr auto mlp = program(mse(matmul(gelu(matmul(input<"x">(mlp_spec), param<"w1">(mlp_spec))), param<"w2">(mlp_spec)),
                                 input<"target">(mlp_spec)),
                             adamw{});

// The hand-written program's spec of every leaf the automatic one decides, and of every
// redistribution: the k-th `.to` written with auto_ is the hand-written program's k-th `.to` (the
// two programs are one model traced alike).
template <std::size_t A, std::size_t H>
graph::sharding_choice as_written(const graph::program<A>& automatic, const graph::program<H>& hand) {
  graph::sharding_choice c{.zero_stage = hand.zero_stage};
  if (hand.zero_axis >= 0) c.zero_axis = std::string(hand.axes.names[hand.zero_axis].view());
  for (int l = 0; l < automatic.name_count; ++l)
    if (automatic.free_dims[l] != 0) c.leaves.push_back({std::string(automatic.names[l].view()), hand.spec_of(automatic.names[l].view())});
  std::vector<int> written;
  for (int i = 0; i < hand.raw_size; ++i)
    if (hand.raw[i].op == op_code::to) written.push_back(i);
  std::size_t k = 0;
  for (int i = 0; i < automatic.raw_size; ++i) {
    if (automatic.raw[i].op != op_code::to || automatic.raw[i].free == 0) continue;
    if (k == written.size() || hand.raw[written[k]].use.rank != automatic.raw[i].use.rank)
      fail("bench_autoshard: the hand-written program's redistributions do not pair with the automatic one's");
    c.leaves.push_back({graph::redistribution_name(i), to_value(hand.raw[written[k++]].use, hand.axes)});
  }
  return c;
}

// Every sharding priced (autoshard::enumerate_all), next to the search's best on the same judge.
template <std::size_t N>
void exhaustive(const graph::program<N>& p, const mesh& m, const shape_map& shapes, const cost::model& model,
                const autoshard::options& o, double search_best_us) {
  const auto started = std::chrono::steady_clock::now();
  const auto all = autoshard::enumerate_all(p, m, shapes, model, o);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const double best = all.best.list_step_us;
  std::printf("exhaustive: %ld shardings priced in %.1f s; optimum of the list-schedule judge %.1f us, the search's best %.1f us "
              "(gap %.2f%%)\n",
              all.priced, s, best, search_best_us, 100.0 * (search_best_us - best) / best);
  std::printf("  the optimum: %s\n", autoshard::detail::key_of(all.best.choice).c_str());
}

// The exact formulation of each ZeRO stage solved by both solvers; the IOPDDL export of the first.
template <std::size_t N>
void formulations(const graph::program<N>& p, const mesh& m, const shape_map& shapes, const cost::model& model,
                  const autoshard::options& o, const settings& s) {
  for (const auto& zero : autoshard::detail::zero_choices(autoshard::detail::split_axes(m))) {
    const int stage = zero.zero_stage.value_or(0);
    const std::string& axis = zero.zero_axis;
    const auto f = autoshard::formulate(p, m, shapes, model,
                                        {.memory_cap_bytes = o.memory_cap_bytes, .lower = o.lower, .zero_stage = stage, .zero_axis = axis});
    std::printf("ZeRO-%d%s%-3s %zu nodes, %zu strategies:", stage, stage ? " over " : "", axis.c_str(), f.nodes.size(), f.strategy_count());
    for (const auto solver : {autoshard::mip_solver::cbc, autoshard::mip_solver::z3}) {
      const auto started = std::chrono::steady_clock::now();
      const auto r = autoshard::solve(f, {.time_limit_s = 60, .solver = solver});
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      const char* name = solver == autoshard::mip_solver::cbc ? "CBC" : "Z3";
      if (r.solutions.empty()) std::printf("  %s %.2f s: %s", name, secs, r.infeasible ? "infeasible" : "no solution");
      else
        std::printf("  %s %.2f s: %.1f us%s (bound %.1f)", name, secs, r.solutions[0].cost_us, r.solutions[0].proved ? " proved" : "",
                    r.solutions[0].lower_bound_us);
    }
    std::printf("\n");
    if (stage == 0 && !s.iopddl.empty()) {
      const auto instance = autoshard::to_iopddl(f, s.model);
      std::ofstream(s.iopddl) << instance.dump();
      const auto best = autoshard::solve(f).solutions.at(0);
      const auto value = autoshard::evaluate_iopddl(nlohmann::json::parse(std::ifstream(s.iopddl)), best.pick);
      std::printf("  written to %s; its optimum evaluates there to %lld ns (objective %.3f us)\n", s.iopddl.c_str(),
                  value ? static_cast<long long>(*value) : -1LL, best.cost_us);
    }
  }
}

template <std::size_t A, std::size_t H>
void run(const graph::program<A>& automatic, const graph::program<H>* hand, const shape_map& shapes, const settings& s) {
  // The experts' axis within a node when it fits there with tp, else across nodes.
  const auto ep_link = s.ep * s.tp <= 8 ? ir::link_class::intra_node : ir::link_class::inter_node;
  const auto m = s.model == "moe"         ? mesh::from_world(s.world, {{"dp", -1, ir::link_class::inter_node}, {"ep", s.ep, ep_link}, {"tp", s.tp}})
                 : s.model == "evoformer" ? mesh::from_world(s.world, {{"dap", -1}})
                 : s.tp > 1               ? mesh::from_world(s.world, {{"dp", -1, ir::link_class::inter_node}, {"tp", s.tp}})
                                          : mesh::from_world(s.world, {{"dp", -1, ir::link_class::inter_node}});
  autoshard::options o;
  o.lower = {.heads = s.heads, .precision = ir::parse_precision(s.precision, "--precision")};
  if (s.model == "wresnet") o.lower.depth = wresnet_model::wide_resnet_depths();
  else if (automatic.repeat_count > 0) o.lower.depth = {{std::string(automatic.repeats[0].name.view()), s.layers}};
  o.exact.limits.max_strategies = s.max_strategies;
  o.exact.limits.align_large_nodes = !s.no_align;
  if (s.cap_gib > 0) o.memory_cap_bytes = static_cast<std::int64_t>(s.cap_gib * (1LL << 30));
  const std::string written = s.model == "evoformer" ? "hand-written (DAP)"
                              : s.model == "moe"      ? "hand-written (experts over ep" + std::string(s.tp > 1 ? ", Megatron TP over tp)" : ")")
                              : s.sequence_parallel   ? "hand-written (Megatron TP over tp, SP, DP over dp)"
                                                      : "hand-written (Megatron TP over tp, DP over dp)";
  // A transformer on one axis (no tp to write Megatron's layout over): its hand-written layout is
  // data parallelism over that axis, with the workload's ZeRO: every weight whole, every batch split.
  const bool data_parallel_only = s.tp <= 1 && (s.model == "gpt" || s.model == "llama" || s.model == "vit" || s.model == "wresnet");
  if (data_parallel_only) {
    auto dp = autoshard::detail::layout_seed(automatic, autoshard::detail::free_leaves(automatic, shapes, o.lower),
                                             autoshard::detail::split_axes(m), {});
    if (s.zero_stage > 0) dp.zero_stage = s.zero_stage, dp.zero_axis = "dp";
    o.seeds.push_back({"hand-written (DP" + (s.zero_stage > 0 ? " + ZeRO-" + std::to_string(s.zero_stage) + ")" : std::string(")")), dp});
  } else if (hand) {
    o.seeds.push_back({written, as_written(automatic, *hand)});
  }
  const auto model = cost::model::preset(s.preset);
  const auto r = autoshard::choose(automatic, m, shapes, model, o);
  std::string axes;
  for (const auto& a : m.axes()) axes += (axes.empty() ? "" : " x ") + a.name + " " + std::to_string(a.size);
  const std::string size = s.model == "wresnet" ? "the Wide-ResNet of ir::conv_net_spec, " + std::to_string(s.batch) + " images"
                                                : std::to_string(s.layers) + " layers, hidden " + std::to_string(s.hidden) + ", seq " +
                                                      std::to_string(s.seq) + ", batch " + std::to_string(s.batch);
  std::printf("%s%s%s: %s on %d ranks (%s), %s, preset %s\n", s.model.c_str(), s.workload.empty() ? "" : ", workload ",
              s.workload.c_str(), size.c_str(), s.world, axes.c_str(), s.precision.c_str(), s.preset.c_str());
  std::printf("%s", r.explain().c_str());
  if (s.compare_solvers || !s.iopddl.empty()) formulations(automatic, m, shapes, model, o, s);
  if (s.exhaustive) {
    double best = std::numeric_limits<double>::infinity();
    for (const auto& c : r.planned) best = std::min(best, c.list_step_us);
    exhaustive(automatic, m, shapes, model, o, best);
  }
}

} // namespace

int main(int argc, char** argv) {
  settings s;
  CLI::App app{"Automatic sharding's search time and choice on the benchmark models"};
  app.add_option("--model", s.model, "gpt, llama, moe (Llama with a mixture of experts), evoformer (its pair stack: --seq residues, --hidden c_z), "
                                     "vit (--seq tokens, --vocab classes), wresnet (the wresnet-dp workload's Wide-ResNet: --batch images) or mlp")
      ->check(CLI::IsMember({"gpt", "llama", "moe", "evoformer", "vit", "wresnet", "mlp"}));
  app.add_option("--world", s.world, "ranks");
  app.add_option("--tp", s.tp, "size of the mesh's tp axis (intra-node); dp takes the rest (inter-node)");
  app.add_option("--layers", s.layers, "depth");
  app.add_option("--hidden", s.hidden, "width");
  app.add_option("--heads", s.heads, "attention heads");
  app.add_option("--kv-heads", s.kv_heads, "Llama: key/value heads (default: heads)");
  app.add_option("--ffn", s.ffn, "Llama: feed-forward width (default: 8/3 of hidden, rounded up to 8)");
  app.add_option("--seq", s.seq, "sequence length");
  app.add_option("--batch", s.batch, "global batch (sequences; the MLP's rows)");
  app.add_option("--vocab", s.vocab, "vocabulary");
  app.add_option("--experts", s.experts, "moe: experts per layer");
  app.add_option("--ep", s.ep, "moe: size of the mesh's ep axis (the hand-written layout splits the experts over it)");
  app.add_option("--top-k", s.top_k, "moe: experts per token, 1 or 2")->check(CLI::IsMember({1, 2}));
  app.add_option("--precision", s.precision, "fp32, bf16 or fp16");
  app.add_option("--preset", s.preset, "cost model preset");
  app.add_option("--cap-gib", s.cap_gib, "memory cap per rank in GiB (0: none)");
  app.add_flag("--exhaustive", s.exhaustive, "also price every sharding (the MLP: a few thousand)");
  app.add_flag("--compare-solvers", s.compare_solvers, "solve the exact formulation of each ZeRO stage with CBC and with Z3");
  app.add_option("--iopddl", s.iopddl, "write the exact formulation (no ZeRO) to this file in the IOPDDL contest's format");
  app.add_option("--workload", s.workload, "a planner workload (ir::make_workload's names): its model, sizes, mesh and hand-written "
                                           "layout on --world ranks (the other sizes are ignored)");
  app.add_option("--max-strategies", s.max_strategies, "the exact formulation's strategies per node (formulation_limits::max_strategies)");
  app.add_flag("--no-align", s.no_align, "refuse the exact formulation of a node over the limits instead of aligning its operands");
  app.add_option("--micro-batch", s.micro_batch, "with --workload: sequences (images) per data-parallel rank, as workload_options::micro_batch");
  CLI11_PARSE(app, argc, argv);
  try {
    if (!s.workload.empty()) from_workload(s);
    if (s.model == "gpt") run(gpt_model::gpt_auto, &gpt_model::gpt_tp, gpt_model::shapes(s.batch, s.seq, s.vocab, s.hidden), s);
    else if (s.model == "vit") {
      // --seq tokens: the class token and a square grid of patches (the example's 4-pixel patches:
      // the workload's 257 tokens are 64-pixel images here, where ViT-Huge/14 reads 224-pixel ones).
      const auto grid = static_cast<std::int64_t>(std::lround(std::sqrt(s.seq - 1.0)));
      if (grid * grid + 1 != s.seq) fail("bench_autoshard: --seq must be 1 + a square number of patches for the ViT");
      run(vit_model::vit_auto, &vit_model::vit_tp, vit_model::shapes(s.batch, grid * vit_model::patch, s.hidden, s.vocab), s);
    }
    else if (s.model == "llama" || s.model == "moe") {
      const int kv = s.kv_heads > 0 ? s.kv_heads : s.heads, ffn = s.ffn > 0 ? s.ffn : (8 * s.hidden / 3 + 7) / 8 * 8;
      const auto shapes = [&] { return llama_model::shapes(s.batch, s.seq, s.vocab, s.hidden, s.heads, kv, ffn); };
      if (s.model == "llama" && s.sequence_parallel) run(llama_model::llama_auto, &llama_model::llama_sp, shapes(), s);
      else if (s.model == "llama") run(llama_model::llama_auto, &llama_model::llama_tp, shapes(), s);
      else {
        using namespace llama_model;
        static constexpr auto hand1 = make_moe<top1>(), hand2 = make_moe<top2>();
        static constexpr auto auto1 = make_moe<top1, adamw{}, moe_decided>(), auto2 = make_moe<top2, adamw{}, moe_decided>();
        const auto moe = moe_shapes(s.batch, s.seq, s.vocab, s.hidden, s.heads, kv, s.experts, ffn);
        if (s.top_k == 1) run(auto1, &hand1, moe, s);
        else run(auto2, &hand2, moe, s);
      }
    } else if (s.model == "wresnet") {
      run(wresnet_model::wide_resnet_auto, static_cast<const graph::program<1>*>(nullptr), wresnet_model::wide_resnet_shapes(s.batch), s);
    } else if (s.model == "evoformer") {
      run(evoformer_model::pair_stack_auto, &evoformer_model::pair_stack, evoformer_model::shapes(s.seq, s.hidden), s);
    } else {
      const shape_map shapes{{"x", {s.batch, s.hidden}}, {"target", {s.batch, s.hidden}}, {"w1", {s.hidden, 4 * s.hidden}},
                             {"w2", {4 * s.hidden, s.hidden}}};
      run(mlp, static_cast<const graph::program<1>*>(nullptr), shapes, s);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
