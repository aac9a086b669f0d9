// Specs and the redistribution table, checked at compile time.
#include <concerto/spec/redistribute.hpp>

namespace {
using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

// Specs are values of structural types: usable as template arguments.
template <spec_value S>
struct takes_spec {
  static constexpr int rank = S.rank;
};
static_assert(takes_spec<to_value(spec(shard(dp), replicate))>::rank == 2);

// Placements land on the right dimension; partial is not a dimension.
constexpr spec_value act = spec(shard(dp), replicate, partial(tp));
static_assert(act.rank == 2 && act.dims[0][0] == "dp" && act.dims[1][0].empty() && act.partial[0] == "tp");
constexpr spec_value two = spec(shard(dp, tp));
static_assert(two.rank == 1 && two.dims[0][0] == "dp" && two.dims[0][1] == "tp");
// Pending sums commute: partial order does not matter.
static_assert(to_value(spec(replicate, partial(tp), partial(dp))) == to_value(spec(replicate, partial(dp), partial(tp))));
static_assert(!(to_value(spec(shard(dp), replicate)) == to_value(spec(replicate, shard(dp)))));
static_assert(to_value(spec()).rank == 0);

// The indexed form round-trips.
constexpr bool round_trip(spec_value v) {
  axis_table t;
  pspec p;
  return to_pspec(v, t, p) && to_value(p, t) == v;
}
static_assert(round_trip(spec(shard(tp), replicate)));
static_assert(round_trip(spec(shard(dp), shard(tp))));

// The table, one row per case of the issue.
constexpr auto rows = spec(replicate, replicate);
constexpr auto sum = spec(replicate, replicate, partial(tp));
constexpr bool single(redist_plan p, redist_kind k, std::string_view axis, int to_dim = -1, int from_dim = -1) {
  return p.ok && p.size == 1 && p.steps[0].kind == k && p.steps[0].name == axis && p.steps[0].to_dim == to_dim &&
         p.steps[0].from_dim == from_dim;
}
static_assert(single(redistribute(sum, rows), redist_kind::all_reduce, "tp"));                      // partial -> replicate
static_assert(single(redistribute(sum, spec(replicate, shard(tp))), redist_kind::reduce_scatter, "tp", 1)); // partial -> shard
static_assert(single(redistribute(spec(shard(dp), replicate), rows), redist_kind::all_gather, "dp", -1, 0)); // shard -> replicate
static_assert(single(redistribute(spec(shard(tp), replicate), spec(replicate, shard(tp))), redist_kind::all_to_all, "tp", 1, 0));
static_assert(single(redistribute(rows, spec(replicate, shard(dp))), redist_kind::local_slice, "dp", 1)); // local
static_assert(single(redistribute(rows, sum), redist_kind::keep_one, "tp"));
static_assert(!is_collective(redist_kind::local_slice) && is_collective(redist_kind::reduce_scatter));
// Identity needs nothing; ranks must agree.
static_assert(redistribute(spec(shard(dp), replicate), spec(shard(dp), replicate)).size == 0);
static_assert(!redistribute(spec(shard(dp)), spec(shard(dp), replicate)).ok);
// Axes are independent: one step each, slices before gathers.
constexpr auto both = redistribute(spec(shard(dp), replicate, partial(tp)), spec(replicate, shard(tp)));
static_assert(both.size == 2 && both.steps[0].kind == redist_kind::reduce_scatter &&
              both.steps[1].kind == redist_kind::all_gather && both.steps[1].name == "dp");
constexpr auto shrink_first = redistribute(spec(shard(dp), replicate), spec(replicate, shard(tp)));
static_assert(shrink_first.size == 2 && shrink_first.steps[0].kind == redist_kind::local_slice &&
              shrink_first.steps[1].kind == redist_kind::all_gather);
// shard -> partial is a gather then keep-one.
static_assert(redistribute(spec(shard(tp)), spec(replicate, partial(tp))).count(redist_kind::all_gather) == 1);
} // namespace
