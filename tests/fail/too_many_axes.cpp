// A program over five distinct mesh axes.
// expect-error: too many mesh axes
#include <concerto/concerto.hpp>

using namespace concerto;
inline constexpr axis<"a"> a;
inline constexpr axis<"b"> b;
inline constexpr axis<"c"> c;
inline constexpr axis<"d"> d;
inline constexpr axis<"e"> e;

constexpr auto x = input<"x">(spec(shard(a, b), shard(c, d)));
#if CONCERTO_FAIL_CASE
constexpr auto w = param<"w">(spec(shard(c, d), shard(e)));
#else
constexpr auto w = param<"w">(spec(shard(c, d), replicate));
#endif
constexpr auto step = program(mse(matmul(x, w), data<"t">(spec(shard(a, b), replicate))), sgd{});
