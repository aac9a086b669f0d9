// Tutorial step 1: a two-layer MLP on one device. Nothing is sharded, so the program has no collectives.
#include <concerto/concerto.hpp>

#include <cstdio>

using namespace concerto;

constexpr auto whole = spec(replicate, replicate); // [batch, hidden], on every rank
constexpr auto x = input<"x">(whole);
constexpr auto w1 = param<"w1">(whole);
constexpr auto w2 = param<"w2">(whole);
constexpr auto loss = mse(matmul(gelu(matmul(x, w1)), w2), data<"y">(whole));
constexpr auto step = program(loss, sgd{});

static_assert(step.count(collective::all_reduce) == 0);
static_assert(step.count(op_code::matmul) == 6); // 2 forward, 4 backward (dx needs x's gradient too)

int main() {
  const auto m = mesh::from_world(1, {});
  const auto g = lower(step, {{"x", {32, 64}}, {"y", {32, 64}}, {"w1", {64, 256}}, {"w2", {256, 64}}}, m);
  std::printf("%s\n%zu tasks\n", step.dump().c_str(), g.tasks.size());
}
