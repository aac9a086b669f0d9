// One dimension split over three axes.
// expect-error: shard\(\.\.\.\) takes one or two mesh axes
#include <concerto/spec/spec.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;
inline constexpr axis<"sp"> sp;

#if CONCERTO_FAIL_CASE
constexpr auto s = spec(shard(dp, tp, sp));
#else
constexpr auto s = spec(shard(dp, tp));
#endif
static_assert(s.rank() == 1);
