// Reference: the redistribution table as constexpr queries.
#include <concerto/spec/redistribute.hpp>

#include <cstdio>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

constexpr auto pending = spec(shard(dp), replicate, partial(tp));
constexpr auto plan = redistribute(pending, spec(shard(dp), shard(tp)));
static_assert(plan.size == 1 && plan.steps[0].kind == redist_kind::reduce_scatter && plan.steps[0].to_dim == 1);
static_assert(redistribute(pending, spec(shard(dp), replicate)).steps[0].kind == redist_kind::all_reduce);
static_assert(redistribute(spec(shard(dp), replicate), spec(replicate, replicate)).steps[0].kind == redist_kind::all_gather);
static_assert(redistribute(spec(shard(tp), replicate), spec(replicate, shard(tp))).steps[0].kind == redist_kind::all_to_all);
static_assert(redistribute(spec(replicate, replicate), spec(shard(dp), replicate)).steps[0].kind == redist_kind::local_slice);

int main() {
  std::printf("%s -> %s: %s over %s\n", to_string(to_value(pending)).c_str(),
              to_string(to_value(spec(shard(dp), shard(tp)))).c_str(), std::string(to_string(plan.steps[0].kind)).c_str(),
              std::string(plan.steps[0].name.view()).c_str());
}
