// A ZeRO stage that does not exist.
// expect-error: ZeRO has stages 1, 2 and 3
#include <concerto/concerto.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;

#if CONCERTO_FAIL_CASE
constexpr auto opt = zero<4>(adamw{}, dp);
#else
constexpr auto opt = zero<3>(adamw{}, dp);
#endif
static_assert(optimizer<decltype(opt)>);
