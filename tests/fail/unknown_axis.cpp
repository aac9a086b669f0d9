// A spec names an axis that the declared mesh lacks.
// expect-error: unknown axis: a spec or zero
#include <concerto/concerto.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

constexpr auto x = input<"x">(spec(shard(dp), replicate));
constexpr auto loss = mse(matmul(x, param<"w">(spec(replicate, shard(tp)))), data<"t">(spec(shard(dp), shard(tp))));
#if CONCERTO_FAIL_CASE
constexpr auto step = program(loss, sgd{}, on(dp));
#else
constexpr auto step = program(loss, sgd{}, on(dp, tp));
#endif
