// The DSL's MLP (docs/tutorial.md step 3) trained with data x tensor parallelism over MPI:
// the first weight split by columns and the second by rows over `tp`, the batch over `dp`.
//
//   examples/mlp/run.sh                 # 4 ranks as dp=2 x tp=2
//   NP=4 examples/mlp/run.sh --tp 4 --steps 100 --policy sync
//
// It learns a fixed random teacher network and exits with status 1 if the loss did not fall.
#include <concerto/concerto.hpp>
#include <concerto/train/step.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

constexpr auto act = spec(shard(dp), replicate); // [batch, features]
constexpr auto mlp = program(mse(matmul(gelu(matmul(input<"x">(act), param<"w1">(spec(replicate, shard(tp))))),
                                        param<"w2">(spec(shard(tp), replicate))),
                                 input<"target">(act)),
                             sgd{});

int main(int argc, char** argv) {
  runtime::mpi::environment env(argc, argv);
  return runtime::mpi::run_or_abort([&] {
    int tp_size = 2, steps = 60;
    std::string policy = "concerto";
    for (int i = 1; i + 1 < argc; i += 2) {
      const std::string a = argv[i];
      if (a == "--tp") tp_size = std::atoi(argv[i + 1]);
      else if (a == "--steps") steps = std::atoi(argv[i + 1]);
      else if (a == "--policy") policy = argv[i + 1];
      else fail("unknown option '" + a + "' (known: --tp N, --steps N, --policy NAME)");
    }
    const int world = runtime::mpi::environment::world_size();
    constexpr std::int64_t B = 64, F = 128, H = 512;
    const shape_map shapes{{"x", {B, F}}, {"target", {B, F}}, {"w1", {F, H}}, {"w2", {H, F}}};
    train::step_options options;
    options.policy = policy;
    train::optimizer_settings opt;
    opt.sgd.lr = 2.0f; // the mean over 8192 values makes each gradient small
    auto step = train::compile(mlp, mesh::from_world(world, {{"dp", -1}, {"tp", tp_size}}), shapes, opt, options);
    const bool root = step.rank() == 0;
    if (root) std::printf("%s\n", step.summary().text().c_str());

    // A teacher: target = tanh(x·T) for a fixed random T; x drawn fresh each step.
    std::vector<float> teacher(static_cast<std::size_t>(F * F));
    for (std::size_t i = 0; i < teacher.size(); ++i) teacher[i] = train::detail::uniform(7, "teacher", i) / std::sqrt(static_cast<float>(F) / 3);
    double first = 0, last = 0;
    for (int s = 0; s < steps; ++s) {
      train::tensor x{{B, F}}, t{{B, F}};
      const auto salt = static_cast<std::uint64_t>(s) * static_cast<std::uint64_t>(B * F);
      for (std::int64_t i = 0; i < B * F; ++i) x.f32.push_back(train::detail::uniform(11, "x", salt + static_cast<std::uint64_t>(i)));
      t.f32.assign(static_cast<std::size_t>(B * F), 0.0f);
      for (std::int64_t r = 0; r < B; ++r)
        for (std::int64_t c = 0; c < F; ++c) {
          float v = 0;
          for (std::int64_t k = 0; k < F; ++k) v += x.f32[static_cast<std::size_t>(r * F + k)] * teacher[static_cast<std::size_t>(k * F + c)];
          t.f32[static_cast<std::size_t>(r * F + c)] = std::tanh(v);
        }
      const auto r = step({{"x", x}, {"target", t}});
      if (s == 0) first = r.loss;
      last = r.loss;
      if (root && (s % 10 == 0 || s + 1 == steps))
        std::printf("step %4lld  loss %.5f  %.0f us (exposed comm %.0f us)\n", static_cast<long long>(r.step), r.loss,
                    r.step_us, r.exposed_comm_us);
    }
    if (root) std::printf("loss %.5f -> %.5f\n", first, last);
    if (!(last < first)) fail("the loss did not fall");
  });
}
