// A routing to no expert per token.
// expect-error: top_k must be at least 1
#include <concerto/concerto.hpp>

using namespace concerto;

constexpr auto logits = input<"logits">(spec(replicate, replicate, replicate));
#if CONCERTO_FAIL_CASE
constexpr auto gates = moe_route<moe_config{.top_k = 0}>(logits);
#else
constexpr auto gates = moe_route<moe_config{.top_k = 1}>(logits);
#endif
static_assert(decltype(gates)::size == 2);
