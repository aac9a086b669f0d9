// A matmul whose contracted dimension is split over tp in one operand only.
// expect-error: mismatched contraction sharding
#include <concerto/concerto.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

#if CONCERTO_FAIL_CASE
constexpr auto x = input<"x">(spec(shard(dp), shard(tp))); // hidden split over tp...
#else
constexpr auto x = input<"x">(spec(shard(dp), replicate));
#endif
constexpr auto w = param<"w">(spec(replicate, shard(tp))); // ...but the weight's rows are whole
constexpr auto step = program(mse(matmul(x, w), data<"y">(spec(shard(dp), shard(tp)))), sgd{});
