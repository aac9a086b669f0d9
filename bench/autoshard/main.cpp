// Automatic sharding on the examples' GPT, Llama, Llama with a mixture of experts and Evoformer
// pair stack (every spec written auto_) at the benchmark workloads' sizes, on a dp x tp (dp x ep
// x tp; dap) mesh of the cost preset's machines: how long the search and the
// planning of its best candidates take, what it chose, and its planned step next to the
// hand-written Megatron layout of the examples (given to the search as a seed, so it is planned
// under the same planner) and the other seeds. With --exhaustive (the MLP) every sharding is priced
// too, and the search's best list-schedule step is compared with the true optimum of that judge.
// With --compare-solvers the exact formulation of every ZeRO stage is solved by CBC and by Z3 (the
// time each takes, its objective, the gap it proved); with --iopddl FILE the formulation without
// ZeRO is written in the IOPDDL contest's format, and its optimum evaluated on the written instance.
//
//   bench_autoshard --model gpt --world 32 --tp 8 --layers 40 --hidden 5120 --heads 40 --seq 2048 --batch 16 --vocab 50304
//   bench_autoshard --model llama --world 64 --tp 8 --layers 80 --hidden 8192 --heads 64 --kv-heads 8 --ffn 28672 --seq 8192 --batch 8 --vocab 32000
//   bench_autoshard --model moe --world 64 --ep 8 --tp 1 --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --seq 4096 --batch 64 --vocab 32000 --experts 8
//   bench_autoshard --model evoformer --world 8 --layers 48 --seq 512 --hidden 128 --heads 4
//   bench_autoshard --model mlp --world 8 --tp 4 --batch 64 --hidden 4096 --exhaustive
//   bench_autoshard --model gpt --world 32 --tp 8 --layers 40 --hidden 5120 --heads 40 --seq 2048 --batch 16 --compare-solvers --iopddl gpt.json
#include "evoformer/model.hpp"
#include "gpt/model.hpp"
#include "llama/model.hpp"

#include <concerto/autoshard/search.hpp>
#include <concerto/concerto.hpp>

#include <CLI/CLI.hpp>

#include <chrono>
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
};

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
                                          : mesh::from_world(s.world, {{"dp", -1, ir::link_class::inter_node}, {"tp", s.tp}});
  autoshard::options o;
  o.lower = {.heads = s.heads, .precision = ir::parse_precision(s.precision, "--precision")};
  if (automatic.repeat_count > 0) o.lower.depth = {{std::string(automatic.repeats[0].name.view()), s.layers}};
  if (s.cap_gib > 0) o.memory_cap_bytes = static_cast<std::int64_t>(s.cap_gib * (1LL << 30));
  const std::string written = s.model == "evoformer" ? "hand-written (DAP)"
                              : s.model == "moe"      ? "hand-written (experts over ep, Megatron TP over tp)"
                                                      : "hand-written (Megatron TP over tp, DP over dp)";
  if (hand) o.seeds.push_back({written, as_written(automatic, *hand)});
  const auto model = cost::model::preset(s.preset);
  const auto r = autoshard::choose(automatic, m, shapes, model, o);
  std::string axes;
  for (const auto& a : m.axes()) axes += (axes.empty() ? "" : " x ") + a.name + " " + std::to_string(a.size);
  std::printf("%s: %d layers, hidden %d, seq %d, batch %d on %d ranks (%s), %s, preset %s\n", s.model.c_str(), s.layers, s.hidden, s.seq,
              s.batch, s.world, axes.c_str(), s.precision.c_str(), s.preset.c_str());
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
  app.add_option("--model", s.model, "gpt, llama, moe (Llama with a mixture of experts), evoformer (its pair stack: --seq residues, --hidden c_z) or mlp")
      ->check(CLI::IsMember({"gpt", "llama", "moe", "evoformer", "mlp"}));
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
  CLI11_PARSE(app, argc, argv);
  try {
    if (s.model == "gpt") run(gpt_model::gpt_auto, &gpt_model::gpt_tp, gpt_model::shapes(s.batch, s.seq, s.vocab, s.hidden), s);
    else if (s.model == "llama" || s.model == "moe") {
      const int kv = s.kv_heads > 0 ? s.kv_heads : s.heads, ffn = s.ffn > 0 ? s.ffn : (8 * s.hidden / 3 + 7) / 8 * 8;
      if (s.model == "llama")
        run(llama_model::llama_auto, &llama_model::llama_tp, llama_model::shapes(s.batch, s.seq, s.vocab, s.hidden, s.heads, kv, ffn), s);
      else {
        using namespace llama_model;
        static constexpr auto hand1 = make_moe<top1>(), hand2 = make_moe<top2>();
        static constexpr auto auto1 = make_moe<top1, adamw{}, moe_decided>(), auto2 = make_moe<top2, adamw{}, moe_decided>();
        const auto shapes = moe_shapes(s.batch, s.seq, s.vocab, s.hidden, s.heads, kv, s.experts, ffn);
        if (s.top_k == 1) run(auto1, &hand1, shapes, s);
        else run(auto2, &hand2, shapes, s);
      }
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
