// A repeat inside a repeated block.
// expect-error: repeat inside a repeated block
#include <concerto/concerto.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;

constexpr auto act = spec(shard(dp), replicate);
constexpr auto inner = [](auto h) { return h + matmul(h, param<"w">(spec(replicate, replicate))); };
#if CONCERTO_FAIL_CASE
constexpr auto outer = [](auto h) { return repeat<"inner">(inner, h); };
#else
constexpr auto outer = [](auto h) { return inner(h); };
#endif
constexpr auto step = program(mse(repeat<"outer">(outer, input<"x">(act)), data<"y">(act)), sgd{});
