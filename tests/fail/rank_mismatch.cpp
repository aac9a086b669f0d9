// A bias table declared with a higher rank than the tensor it is added to (a table of x's last dims
// has at most x's rank).
// expect-error: spec rank does not match the tensor rank
#include <concerto/concerto.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;

constexpr auto x = input<"x">(spec(shard(dp), replicate));
#if CONCERTO_FAIL_CASE
constexpr auto b = param<"b">(spec(replicate, replicate, replicate));
#else
constexpr auto b = param<"b">(spec(replicate));
#endif
constexpr auto step = program(mse(bias(x, b), data<"t">(spec(shard(dp), replicate))), sgd{});
