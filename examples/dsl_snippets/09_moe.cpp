// Tutorial step 9: a mixture-of-experts layer. Tokens over dp × ep, experts over ep; the
// dispatched tokens go to their experts' ranks and come back by two all-to-alls on ep.
#include <concerto/concerto.hpp>

#include <cstdio>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"ep"> ep;

constexpr moe_config cfg{.top_k = 2, .capacity_factor = 1.25, .aux_weight = 0.01};
constexpr auto h = input<"h">(spec(shard(dp, ep), replicate, replicate)); // [sequences, tokens, hidden]
constexpr auto gates = moe_route<cfg>(matmul(h, param<"router">(spec(replicate, replicate))));
constexpr auto x = moe_dispatch(h, gates).to(spec(shard(ep), shard(dp), replicate)); // [experts, slots, hidden]
constexpr auto y = matmul(gelu(matmul(x, param<"w1">(spec(shard(ep), replicate, replicate)))),
                          param<"w2">(spec(shard(ep), replicate, replicate)));
constexpr auto step = program(mse(moe_combine(y, gates), input<"target">(spec(shard(dp, ep), replicate, replicate))),
                              sgd{});

static_assert(step.count(collective::all_to_all, ep) == 4);    // dispatch and combine, forward and backward
static_assert(step.count(collective::all_reduce, dp) == 3);    // router, w1 and w2: summed over dp
static_assert(step.count(collective::all_reduce, ep) == 1);    // the router only: the experts are split over ep

int main() {
  const auto m = mesh::from_world(8, {{"dp", 2}, {"ep", 4}});
  const auto g = lower(step, {{"h", {8, 32, 64}}, {"router", {64, 8}}, {"w1", {8, 64, 256}}, {"w2", {8, 256, 64}},
                              {"target", {8, 32, 64}}},
                       m);
  std::printf("%s\n%zu tasks\n", step.dump().c_str(), g.tasks.size());
}
