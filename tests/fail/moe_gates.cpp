// Tokens dispatched by a tensor that is not a routing's gates.
// expect-error: moe_dispatch and moe_combine take the gates of a moe_route
#include <concerto/concerto.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"ep"> ep;

constexpr auto x = input<"x">(spec(shard(dp, ep), replicate, replicate));
constexpr auto logits = matmul(x, param<"router">(spec(replicate, replicate)));
#if CONCERTO_FAIL_CASE
constexpr auto gates = softmax(logits);
#else
constexpr auto gates = moe_route(logits);
#endif
constexpr auto sent = moe_dispatch(x, gates).to(spec(shard(ep), shard(dp), replicate));
constexpr auto y = matmul(sent, param<"w">(spec(shard(ep), replicate, replicate)));
constexpr auto step = program(mse(moe_combine(y, gates), input<"t">(spec(shard(dp, ep), replicate, replicate), no_grad)), sgd{});
