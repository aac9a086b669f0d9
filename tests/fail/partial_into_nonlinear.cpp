// A pending sum pinned with .to(partial) and fed to gelu.
// expect-error: partial fed to a nonlinear op
#include <concerto/concerto.hpp>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

constexpr auto x = input<"x">(spec(shard(dp), replicate));
constexpr auto h = matmul(gelu(matmul(x, param<"w1">(spec(replicate, shard(tp))))), param<"w2">(spec(shard(tp), replicate)));
#if CONCERTO_FAIL_CASE
constexpr auto y = gelu(h.to(spec(shard(dp), replicate, partial(tp))));
#else
constexpr auto y = gelu(h.to(spec(shard(dp), replicate)));
#endif
constexpr auto step = program(mse(y, data<"t">(spec(shard(dp), replicate))), sgd{});
