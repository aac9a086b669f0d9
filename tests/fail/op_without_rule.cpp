// A DSL node of an op whose table entry has no sharding rule or backward recipe (the vocab-parallel
// cross-entropy's max, an op the compiler inserts) does not build: the table, not a switch
// elsewhere, says which ops a program may use.
// expect-error: its ir/ops.hpp entry lacks the DSL arity, the sharding rule or the backward recipe
#include <concerto/concerto.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;

constexpr auto logits = matmul(input<"x">(spec(shard(dp), replicate)), param<"w">(spec(replicate, replicate)));
#if CONCERTO_FAIL_CASE
constexpr auto y = detail::op_t<op_code::vocab_ce_max, decltype(logits)>{};
#else
constexpr auto y = detail::op_t<op_code::gelu, decltype(logits)>{};
#endif
constexpr auto step = program(mse(y, input<"t">(spec(shard(dp), replicate), no_grad)), sgd{});
