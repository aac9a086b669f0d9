// The README's example, compiled so that the README cannot drift from the library.
#include <concerto/concerto.hpp>
#include <concerto/train/step.hpp>
using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

constexpr auto act = spec(shard(dp), replicate);                    // [batch, features]
constexpr auto mlp = program(mse(matmul(gelu(matmul(input<"x">(act),
                                                    param<"w1">(spec(replicate, shard(tp))))),  // column-parallel
                                        param<"w2">(spec(shard(tp), replicate))),               // row-parallel
                                 input<"target">(act)),
                             sgd{});
static_assert(mlp.count(collective::all_reduce, tp) == 2);          // forward and backward

int main(int argc, char** argv) {
  runtime::mpi::environment env(argc, argv);
  auto step = train::compile(mlp, mesh::from_world(env.world_size(), {{"dp", -1}, {"tp", 2}}),
                             {{"x", {64, 128}}, {"target", {64, 128}}, {"w1", {128, 512}}, {"w2", {512, 128}}},
                             {.sgd = {.lr = 0.5f}});
  // step(batch) plans on the first call (rank 0, or the plan cache), then runs the plan.
}
