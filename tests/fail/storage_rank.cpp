// A parameter whose storage spec has another rank than its compute spec.
// expect-error: the storage spec has another rank than the compute spec
#include <concerto/concerto.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;

#if CONCERTO_FAIL_CASE
constexpr auto w = param<"w">(spec(replicate, replicate), stored(spec(shard(dp))));
#else
constexpr auto w = param<"w">(spec(replicate, replicate), stored(spec(shard(dp), replicate)));
#endif
static_assert(w.size == 1);
