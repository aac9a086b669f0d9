// Tutorial step 2: data parallelism is one changed spec: the batch is split over dp.
#include <concerto/concerto.hpp>

#include <cstdio>

using namespace concerto;
inline constexpr axis<"dp"> dp;

constexpr auto batch = spec(shard(dp), replicate);
constexpr auto whole = spec(replicate, replicate);
constexpr auto loss = mse(matmul(gelu(matmul(input<"x">(batch), param<"w1">(whole))), param<"w2">(whole)),
                          data<"y">(batch));
constexpr auto step = program(loss, sgd{});

// Each weight gradient is a sum over the batch, which is split: one all-reduce per weight.
static_assert(step.count(collective::all_reduce, dp) == 2);
static_assert(step.spec_of("w1.grad") == whole);

int main() {
  const auto m = mesh::from_world(4, {{"dp", -1}});
  const auto g = lower(step, {{"x", {32, 64}}, {"y", {32, 64}}, {"w1", {64, 256}}, {"w2", {256, 64}}}, m);
  std::printf("%s\n%zu tasks\n", step.dump().c_str(), g.tasks.size());
}
