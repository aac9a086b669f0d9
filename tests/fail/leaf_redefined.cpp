// Two leaves named "x" with different specs.
// expect-error: leaf redefined: two leaves share a name
#include <concerto/concerto.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;

constexpr auto x = input<"x">(spec(shard(dp), replicate));
#if CONCERTO_FAIL_CASE
constexpr auto x2 = input<"x">(spec(replicate, replicate));
#else
constexpr auto x2 = input<"x">(spec(shard(dp), replicate));
#endif
constexpr auto step = program(mse(matmul(x, param<"w">(spec(replicate, replicate))) + x2, data<"t">(spec(shard(dp), replicate))), sgd{});
