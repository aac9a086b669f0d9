// A repeated block that returns another spec than it takes (its output is the next layer's input).
// expect-error: a repeated block returns another spec than it takes
#include <concerto/concerto.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

constexpr auto act = spec(shard(dp), replicate);
#if CONCERTO_FAIL_CASE
constexpr auto block = [](auto h) { return gelu(matmul(h, param<"w">(spec(replicate, shard(tp))))); }; // ends split over tp
#else
constexpr auto block = [](auto h) { return gelu(matmul(h, param<"w">(spec(replicate, shard(tp))))).to(act); };
#endif
constexpr auto step = program(mse(repeat<"layers">(block, input<"x">(act)), data<"y">(act)), sgd{});
