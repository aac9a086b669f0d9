// The DSL's MLP (docs/tutorial.md step 3) trained with data x tensor parallelism over MPI:
// the first weight split by columns and the second by rows over `tp`, the batch over `dp`.
//
//   examples/mlp/run.sh                 # 4 ranks as dp=2 x tp=2
//   NP=4 examples/mlp/run.sh --tp 4 --steps 100 --policy sync
//   NP=2 examples/mlp/run.sh --tp 1 --batch 64 --hidden 1024 --policy sync,program_order,concerto
//
// It learns a fixed random teacher network and exits with status 1 if the loss did not fall.
// A comma-separated --policy compiles one step per policy on the same ranks and runs them in
// turn, step by step (the order rotating each round), so that every plan sees the same machine
// state; --json FILE writes each policy's result (median measured step time, the predicted one
// and the plan's lower bound, every step's time) as one JSON array, which bench/cluster/run reads.
// --help lists every option.
#include "../common/command_line.hpp"
#include "../common/policy_runs.hpp"

#include <concerto/concerto.hpp>
#include <concerto/core/file.hpp>
#include <concerto/train/step.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

constexpr auto act = spec(shard(dp), replicate); // [batch, features]
// The features and the target are inputs without gradient: nothing needs x.grad, so the step
// runs neither its matmul nor (under tp) its all-reduce.
constexpr auto mlp = program(mse(matmul(gelu(matmul(input<"x">(act, no_grad), param<"w1">(spec(replicate, shard(tp))))),
                                        param<"w2">(spec(shard(tp), replicate))),
                                 input<"target">(act, no_grad)),
                             sgd{});

int main(int argc, char** argv) {
  runtime::mpi::environment env(argc, argv);
  int tp_size = 2, steps = 60;
  std::int64_t B = 64, F = 128, ffn = 4;
  std::string policy = "concerto", cost_preset = "cpu", json;
  CLI::App app{"Trains the DSL's MLP on a random teacher network over MPI ranks (DP x TP mesh)."};
  app.add_option("--tp", tp_size, "tensor-parallel ranks (the rest is data parallel)")->check(examples::positive)->capture_default_str();
  app.add_option("--steps", steps, "training steps")->check(examples::positive)->capture_default_str();
  app.add_option("--policy", policy, "plan policy, or a comma-separated list: sync, program_order, xla_lhs, concerto")
      ->capture_default_str();
  app.add_option("--batch", B, "global batch (rows per step)")->check(examples::positive)->capture_default_str();
  app.add_option("--hidden", F, "features in and out")->check(examples::positive)->capture_default_str();
  app.add_option("--ffn", ffn, "hidden width as a multiple of --hidden")->check(examples::positive)->capture_default_str();
  app.add_option("--cost-preset", cost_preset, "the planner's cost model (cpu-netns: the emulated cluster's)")
      ->capture_default_str();
  app.add_option("--json", json, "write the result of every policy to this file (a JSON array)");
  if (const auto status = examples::parse_or_exit(app, argc, argv)) return *status;
  return runtime::mpi::run_or_abort([&] {
    const int world = runtime::mpi::environment::world_size();
    const std::int64_t H = ffn * F;
    const shape_map shapes{{"x", {B, F}}, {"target", {B, F}}, {"w1", {F, H}}, {"w2", {H, F}}};
    train::optimizer_settings opt;
    // The mean over B·F values makes each gradient small (~1/F): 2.0 suits the default 128 features.
    opt.sgd.lr = 2.0f * static_cast<float>(F) / 128.0f;
    const auto policies = examples::plan_policies(policy);
    const auto make = [&](planner::policy p) {
      train::step_options options;
      options.policy = p;
      options.cost_preset = cost_preset;
      return train::compile(mlp, mesh::from_world(world, {{"dp", -1}, {"tp", tp_size}}), shapes, opt, options);
    };
    std::vector<decltype(make(planner::policy::concerto))> runs;
    runs.reserve(policies.size());
    for (const auto& p : policies) runs.push_back(make(p));
    const bool root = runs.front().rank() == 0;
    if (root) {
      std::printf("mlp: batch %lld, %lld -> %lld -> %lld, dp=%d x tp=%d, cost preset %s\n", static_cast<long long>(B),
                  static_cast<long long>(F), static_cast<long long>(H), static_cast<long long>(F), world / tp_size, tp_size,
                  cost_preset.c_str());
    }
    examples::announce_plans(runs, root);

    // A teacher: target = tanh(x·T) for a fixed random T; x drawn fresh each step, the same
    // batch for every policy of a round.
    std::vector<float> teacher(static_cast<std::size_t>(F * F));
    for (std::size_t i = 0; i < teacher.size(); ++i) teacher[i] = train::detail::uniform(7, "teacher", i) / std::sqrt(static_cast<float>(F) / 3);
    const std::size_t k = runs.size();
    std::vector<double> first(k), last(k);
    std::vector<std::vector<double>> times(k), exposed(k);
    for (int s = 0; s < steps; ++s) {
      train::tensor x{{B, F}}, t{{B, F}};
      const auto salt = static_cast<std::uint64_t>(s) * static_cast<std::uint64_t>(B * F);
      for (std::int64_t i = 0; i < B * F; ++i) x.f32.push_back(train::detail::uniform(11, "x", salt + static_cast<std::uint64_t>(i)));
      t.f32.assign(static_cast<std::size_t>(B * F), 0.0f);
      for (std::int64_t r = 0; r < B; ++r)
        for (std::int64_t kk = 0; kk < F; ++kk) {
          const float xv = x.f32[static_cast<std::size_t>(r * F + kk)];
          for (std::int64_t c = 0; c < F; ++c) t.f32[static_cast<std::size_t>(r * F + c)] += xv * teacher[static_cast<std::size_t>(kk * F + c)];
        }
      for (auto& v : t.f32) v = std::tanh(v);
      for (std::size_t j = 0; j < k; ++j) {
        const std::size_t p = (j + static_cast<std::size_t>(s)) % k; // rotate who goes first
        const auto r = runs[p]({{"x", x}, {"target", t}});
        if (s == 0) first[p] = r.loss;
        last[p] = r.loss;
        if (s > 0) { // the first step also warms caches and connections
          times[p].push_back(r.step_us);
          exposed[p].push_back(r.exposed_comm_us);
        }
        if (root && k == 1 && (s % 10 == 0 || s + 1 == steps))
          std::printf("step %4lld  loss %.5f  %.0f us (exposed comm %.0f us)\n", static_cast<long long>(r.step), r.loss,
                      r.step_us, r.exposed_comm_us);
      }
    }
    nlohmann::json results = nlohmann::json::array();
    for (std::size_t p = 0; p < k; ++p) {
      if (!root) continue;
      const auto& sm = runs[p].summary();
      std::printf("loss %.5f -> %.5f; median step %.0f us (measured, %s plan)\n", first[p], last[p], concerto::median(times[p]),
                  sm.policy.c_str());
      results.push_back(examples::result_of(runs[p],
                                            {{"example", "mlp"}, {"world", world}, {"tp", tp_size}, {"batch", B}, {"hidden", F},
                                             {"ffn", ffn}, {"cost_preset", cost_preset}},
                                            times[p], exposed[p]));
    }
    if (root && !json.empty()) write_file_atomically(json, results.dump(2) + "\n");
    if (root) std::fflush(stdout);
    for (std::size_t p = 0; p < k; ++p)
      if (!(last[p] < first[p])) fail("the loss did not fall (" + std::string(planner::to_string(policies[p])) + " plan)");
  });
}
