// ZeRO over an axis that the declared mesh lacks.
// expect-error: unknown axis: a spec or zero
#include <concerto/concerto.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"fsdp"> fsdp;

constexpr auto x = input<"x">(spec(shard(dp), replicate));
constexpr auto loss = mse(matmul(x, param<"w">(spec(replicate, replicate))), data<"t">(spec(shard(dp), replicate)));
#if CONCERTO_FAIL_CASE
constexpr auto step = program(loss, zero<3>(adamw{}, fsdp), on(dp));
#else
constexpr auto step = program(loss, zero<3>(adamw{}, dp), on(dp));
#endif
