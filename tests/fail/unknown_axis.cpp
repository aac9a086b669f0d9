// A parameter split over an axis the program's mesh does not declare: the message names the axis
// and the leaf.
// expect-error: param [^ ]*w[^ ]* uses axis [^ ]*ep
#include <concerto/concerto.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;
inline constexpr axis<"ep"> ep;

constexpr auto x = input<"x">(spec(shard(dp), replicate));
#if CONCERTO_FAIL_CASE
constexpr auto w = param<"w">(spec(replicate, shard(ep)));
#else
constexpr auto w = param<"w">(spec(replicate, shard(tp)));
#endif
constexpr auto step = program(mse(matmul(x, w), data<"t">(spec(shard(dp), replicate))), sgd{}, on(dp, tp));
