// Tutorial step 10: axial attention with dynamic axial parallelism (DAP). A pair representation
// [N, N, c] split over dap on its rows; attention along the columns is attention along the rows
// of the transposed tensor, whose split moves to the rows by an all-to-all.
#include <concerto/concerto.hpp>

#include <cstdio>

using namespace concerto;
inline constexpr axis<"dap"> dap;

constexpr auto rows = spec(shard(dap), replicate, replicate);
constexpr auto w = param<"w">(spec(replicate, replicate));
constexpr auto z = input<"z">(rows); // its gradient is a result: both exchanges run backward too
constexpr auto zt = transpose(z).to(rows); // [j, i, c] split on j: an all-to-all over dap
constexpr auto column = transpose(matmul(attention(matmul(zt, w), zt, zt), w)).to(rows); // and back
constexpr auto step = program(mse(z + column, input<"target">(rows, no_grad)), adamw{});

static_assert(step.count(collective::all_to_all, dap) == 4); // there and back, forward and backward
static_assert(step.count(collective::all_reduce, dap) == 1); // w's gradient: w is replicated

int main() {
  const auto m = mesh::from_world(4, {{"dap", 4}});
  const auto g = lower(step, {{"z", {64, 64, 32}}, {"target", {64, 64, 32}}, {"w", {32, 32}}}, m, {.heads = 4});
  std::printf("%s\n%zu tasks\n", step.dump().c_str(), g.tasks.size());
}
