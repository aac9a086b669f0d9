// program(...) given a tensor instead of a loss.
// expect-error: program\(\.\.\.\) needs a scalar loss
#include <concerto/concerto.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;

constexpr auto y = matmul(input<"x">(spec(shard(dp), replicate)), param<"w">(spec(replicate, replicate)));
#if CONCERTO_FAIL_CASE
constexpr auto step = program(y, sgd{});
#else
constexpr auto step = program(mse(y, data<"t">(spec(shard(dp), replicate))), sgd{});
#endif
