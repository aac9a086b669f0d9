// A repeated block that reads a parameter also used outside it (block parameters are per layer).
// expect-error: a repeated block reads a leaf that is not its own
#include <concerto/concerto.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;

constexpr auto act = spec(shard(dp), replicate);
constexpr auto block = [](auto h) { return h + matmul(h, param<"w">(spec(replicate, replicate))); };
#if CONCERTO_FAIL_CASE
constexpr auto head = param<"w">(spec(replicate, replicate)); // the block's "w" again
#else
constexpr auto head = param<"head">(spec(replicate, replicate));
#endif
constexpr auto step = program(mse(matmul(repeat<"layers">(block, input<"x">(act)), head), data<"y">(act)), sgd{});
