// A routing whose capacity factor is not positive.
// expect-error: the capacity factor must be positive
#include <concerto/concerto.hpp>

using namespace concerto;

constexpr auto logits = input<"logits">(spec(replicate, replicate, replicate));
#if CONCERTO_FAIL_CASE
constexpr auto gates = moe_route<moe_config{.top_k = 2, .capacity_factor = 0}>(logits);
#else
constexpr auto gates = moe_route<moe_config{.top_k = 2, .capacity_factor = 1}>(logits);
#endif
static_assert(decltype(gates)::size == 2);
