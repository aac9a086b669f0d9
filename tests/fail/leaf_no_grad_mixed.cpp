// One leaf name used with and without gradient: it would silently be whichever came first.
// expect-error: leaf redefined: two leaves share a name
#include <concerto/concerto.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;

constexpr auto act = spec(shard(dp), replicate);
constexpr auto w = param<"w">(spec(replicate, replicate));
constexpr auto x = input<"x">(act, no_grad);
#if CONCERTO_FAIL_CASE
constexpr auto x2 = input<"x">(act);
#else
constexpr auto x2 = input<"x">(act, no_grad);
#endif
constexpr auto step = program(mse(matmul(x, w) + matmul(x2, w), input<"t">(act, no_grad)), sgd{});
