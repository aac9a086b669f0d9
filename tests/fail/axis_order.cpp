// Tokens split over (ep, dp) with ep first: the all-to-all on ep cannot take the major axis out.
// expect-error: would need the axes splitting one dimension in another order
#include <concerto/concerto.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"ep"> ep;

#if CONCERTO_FAIL_CASE
constexpr auto x = input<"x">(spec(shard(ep, dp), replicate, replicate));
#else
constexpr auto x = input<"x">(spec(shard(dp, ep), replicate, replicate));
#endif
constexpr auto gates = moe_route(matmul(x, param<"router">(spec(replicate, replicate))));
constexpr auto sent = moe_dispatch(x, gates).to(spec(shard(ep), shard(dp), replicate));
constexpr auto y = matmul(sent, param<"w">(spec(shard(ep), replicate, replicate)));
constexpr auto step = program(mse(moe_combine(y, gates), input<"t">(spec(replicate, replicate, replicate), no_grad)), sgd{});
