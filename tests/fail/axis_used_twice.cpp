// One axis splitting two dimensions of a spec.
// expect-error: spec uses one mesh axis twice
#include <concerto/spec/spec.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

#if CONCERTO_FAIL_CASE
constexpr auto s = spec(shard(dp), shard(dp));
#else
constexpr auto s = spec(shard(dp), shard(tp));
#endif
static_assert(s.rank() == 2);
