// Tutorial step 3: the example. Column- then row-parallel weights over tp, batch over dp.
#include <concerto/concerto.hpp>

#include <cstdio>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

constexpr auto act = spec(shard(dp), replicate);         // [batch, hidden]
constexpr auto x = input<"x">(act);
constexpr auto w1 = param<"w1">(spec(replicate, shard(tp))); // column-parallel
constexpr auto w2 = param<"w2">(spec(shard(tp), replicate)); // row-parallel
constexpr auto loss = mse(matmul(gelu(matmul(x, w1)), w2), input<"target">(act));
constexpr auto step = program(loss, sgd{});

static_assert(step.count(collective::all_reduce, tp) == 2); // forward and backward
static_assert(step.count(collective::all_reduce, dp) == 2); // the weight gradients
static_assert(step.spec_of("w1.grad") == spec(replicate, shard(tp)));

int main() {
  const auto m = mesh::from_world(8, {{"dp", -1, ir::link_class::inter_node}, {"tp", 2}});
  const auto g = lower(step, {{"x", {32, 64}}, {"target", {32, 64}}, {"w1", {64, 256}}, {"w2", {256, 64}}}, m);
  std::printf("%s\n%s\n%zu tasks\n", step.dump().c_str(), step.dot().c_str(), g.tasks.size());
}
