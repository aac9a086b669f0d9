// A spec with five dimensions.
// expect-error: spec has more than 4 dimensions
#include <concerto/spec/spec.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;

#if CONCERTO_FAIL_CASE
constexpr auto s = spec(shard(dp), replicate, replicate, replicate, replicate);
#else
constexpr auto s = spec(shard(dp), replicate, replicate, replicate);
#endif
static_assert(s.rank() >= 4);
