// Tutorial step 5: ZeRO is a choice of optimizer (or of parameter storage specs).
#include <concerto/concerto.hpp>

#include <cstdio>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

constexpr auto act = spec(shard(dp), replicate);
constexpr auto loss = mse(matmul(gelu(matmul(input<"x">(act), param<"w1">(spec(replicate, shard(tp))))),
                                 param<"w2">(spec(shard(tp), replicate))),
                          input<"target">(act));

constexpr auto z1 = program(loss, zero<1>(adamw{}, dp)); // state sharded
constexpr auto z2 = program(loss, zero<2>(adamw{}, dp)); // and gradients
constexpr auto z3 = program(loss, zero<3>(adamw{}, dp)); // and parameters

static_assert(z1.count(collective::all_reduce, dp) == 2 && z1.count(collective::all_gather, dp) == 2);
static_assert(z2.count(collective::reduce_scatter, dp) == 2 && z2.count(collective::all_gather, dp) == 2);
static_assert(z3.count(collective::reduce_scatter, dp) == 2 && z3.count(collective::all_gather, dp) == 4);

// ZeRO-3 by hand: a parameter stored sharded over dp and gathered for use.
constexpr auto w1_fsdp = param<"w1">(spec(replicate, shard(tp)), stored(spec(shard(dp), shard(tp))));

static_assert(z3.spec_of("w1") == spec(shard(dp), shard(tp)));

int main() {
  (void)w1_fsdp;
  std::printf("%s\n", z3.dump().c_str());
}
