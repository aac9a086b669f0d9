// Redistributions written with auto_ (`.to(spec(auto_, ...))`): as written they keep the layout
// their value arrives in (graph::kept_where_free, a pending sum made), so the program is the one
// without them;
// graph::respecify decides them by name (graph::redistribution_name) or, left decided_block, as their value
// arrives, listing them; the exact formulation gives them a strategy per layout and reads a
// choice back as respecify compiles it; the search seeds sequence parallelism from them and
// returns a choice that names each.
#include "../mpi/auto_lm_program.hpp"

#include <concerto/autoshard/search.hpp>
#include <concerto/concerto.hpp>

#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <array>
#include <string>
#include <vector>

using namespace concerto;

namespace {
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;
using auto_lm::eight; // dp 2 x tp 4
using auto_lm::free2;
using auto_lm::mlp_shapes;

constexpr auto batch = spec(auto_, replicate);
constexpr auto rows = spec(shard(dp), replicate);
constexpr auto col = spec(replicate, shard(tp));
constexpr auto row = spec(shard(tp), replicate);

// A residual MLP block, every spec decided, the branch's sum laid out by a decided redistribution.
constexpr auto x_open = input<"x">(batch);
constexpr auto branch_open = matmul(gelu(matmul(x_open, param<"w1">(free2))), param<"w2">(free2));
constexpr auto decided_block = program(mse(x_open + branch_open.to(spec(auto_, replicate)), input<"target">(batch)), adamw{}, on(dp, tp));

// The same block written by hand (Megatron's tensor parallelism): the branch's sum as it arrives,
// replicated over tp, or split over tp on the rows (sequence parallelism's reduce-scatter).
constexpr auto x_rows = input<"x">(rows);
constexpr auto branch = matmul(gelu(matmul(x_rows, param<"w1">(col))), param<"w2">(row));
constexpr auto as_arrives = program(mse(x_rows + branch, input<"target">(rows)), adamw{}, on(dp, tp));
constexpr auto open_on_hand = program(mse(x_rows + branch.to(spec(auto_, replicate)), input<"target">(rows)), adamw{}, on(dp, tp));
constexpr auto replicated = program(mse(x_rows + branch.to(rows), input<"target">(rows)), adamw{}, on(dp, tp));
constexpr auto sequence_split = program(mse(x_rows + branch.to(spec(shard(dp, tp), replicate)), input<"target">(rows)), adamw{}, on(dp, tp));

// The name of the program's one redistribution written with auto_.
template <std::size_t N>
std::string open_redistribution(const graph::program<N>& p) {
  for (int i = 0; i < p.raw_size; ++i)
    if (p.raw[i].op == op_code::to && p.raw[i].free != 0) return graph::redistribution_name(i);
  FAIL("no .to written with auto_");
  return {};
}

graph::sharding_choice megatron_leaves() {
  graph::sharding_choice c;
  c.leaves = {{"x", to_value(rows)}, {"target", to_value(rows)}, {"w1", to_value(col)}, {"w2", to_value(row)}};
  return c;
}

template <std::size_t N>
std::uint64_t lowered(const graph::program<N>& p, const shape_map& shapes) {
  return plan::hash(lower(p, shapes, eight));
}
const cost::model h100 = cost::model::preset("h100x64");
} // namespace

TEST_CASE("a .to written with auto_ keeps, on those dims, the layout its value arrives in", "[autoshard]") {
  // The program is the one without the redistribution: the row-parallel product's pending sum
  // is made (at the .to instead of at the residual add).
  STATIC_REQUIRE(open_on_hand.size == as_arrives.size);
  STATIC_REQUIRE(open_on_hand.count(collective::all_reduce, tp) == as_arrives.count(collective::all_reduce, tp));
  STATIC_REQUIRE(open_on_hand.count(collective::reduce_scatter, tp) == 0);
  STATIC_REQUIRE(decided_block.has_free_dims());

  // The rule itself, on axes dp = 0, tp = 1: a free dim keeps what arrives less the axes the
  // written dims use; a pending sum is made.
  constexpr auto kept = [] {
    pspec split; // rows over dp, tp
    split.rank = 2;
    split.dims[0][0] = 0;
    split.dims[0][1] = 1;
    pspec summing; // rows over dp, a sum pending over tp
    summing.rank = 2;
    summing.dims[0][0] = 0;
    summing.partial = 0b10;
    pspec written; // the width written over tp
    written.rank = 2;
    written.dims[1][0] = 1;
    return std::array{graph::kept_where_free(written, 0b01, split), graph::kept_where_free(written, 0b01, summing),
                      graph::kept_where_free(written, 0b11, summing)};
  }();
  STATIC_REQUIRE(kept[0].dims[0][0] == 0);
  STATIC_REQUIRE(kept[0].dims[0][1] == -1); // tp is the width's now
  STATIC_REQUIRE(kept[0].dims[1][0] == 1);
  STATIC_REQUIRE(kept[1].partial == 0);      // the sum over tp is made onto the width
  STATIC_REQUIRE(kept[1].dims[1][0] == 1);
  STATIC_REQUIRE(kept[2].dims[0][0] == 0);   // every dim free: as it arrives, the sum made
  STATIC_REQUIRE(kept[2].dims[1][0] == -1);
  STATIC_REQUIRE(kept[2].partial == 0);
}

TEST_CASE("respecify decides a .to written with auto_ by name, or as its value arrives", "[autoshard]") {
  const auto shapes = mlp_shapes(64, 256);
  const auto name = open_redistribution(decided_block);
  CHECK(name.starts_with("to#"));
  SECTION("named: the program written with that layout") {
    auto c = megatron_leaves();
    c.leaves.push_back({name, to_value(rows)});
    const auto r = graph::respecify(decided_block, c);
    REQUIRE(r.program);
    CHECK(r.kept.empty());
    CHECK_FALSE(r.program->has_free_dims());
    CHECK(lowered(*r.program, shapes) == lowered(replicated, shapes));
    c.leaves.back().spec = to_value(spec(shard(dp, tp), replicate));
    const auto sp = graph::respecify(decided_block, c);
    REQUIRE(sp.program);
    CHECK(sp.program->count(collective::reduce_scatter, tp) >= 1);
    CHECK(lowered(*sp.program, shapes) == lowered(sequence_split, shapes));
  }
  SECTION("left decided_block: decided as it arrives, listed, nothing left to decide") {
    const auto r = graph::respecify(decided_block, megatron_leaves());
    REQUIRE(r.program);
    REQUIRE(r.kept.size() == 1);
    CHECK(r.kept.front().leaf == name);
    CHECK(r.kept.front().spec == to_value(rows)); // the pending sum made, the rows as they came
    CHECK(r.program->count(collective::all_reduce, tp) == replicated.count(collective::all_reduce, tp));
    CHECK_FALSE(r.program->has_free_dims());
    CHECK(lowered(*r.program, shapes) == lowered(replicated, shapes));
  }
  SECTION("a name the program lacks, a spec of another rank") {
    auto c = megatron_leaves();
    c.leaves.push_back({"to#999", to_value(rows)});
    CHECK_THROWS_AS(graph::respecify(decided_block, c), error);
    c.leaves.back() = {name, to_value(spec(replicate))};
    CHECK_THROWS_AS(graph::respecify(decided_block, c), error);
  }
}

TEST_CASE("the exact formulation decides a .to written with auto_ with the leaves", "[autoshard]") {
  const auto shapes = mlp_shapes(64, 256);
  const auto name = open_redistribution(decided_block);
  const auto f = autoshard::formulate(decided_block, eight, shapes, h100, {});
  REQUIRE(std::any_of(f.leaves.begin(), f.leaves.end(), [&](const auto& l) { return l.second == name; }));
  const auto solved = autoshard::solve(f, {.solutions = 3});
  REQUIRE_FALSE(solved.solutions.empty());
  for (const auto& s : solved.solutions) {
    const auto c = f.choice(s.pick);
    CHECK(std::any_of(c.leaves.begin(), c.leaves.end(), [&](const auto& l) { return l.leaf == name; }));
    const auto r = graph::respecify(decided_block, c);
    REQUIRE(r.program);
    CHECK(r.kept.empty());
    const auto back = f.pick_of(c);
    REQUIRE(back);
    CHECK(f.cost_us(*back) == f.cost_us(s.pick));
  }
  // A choice that leaves it decided_block reads back as respecify decides it: as its value arrives.
  const auto open_pick = f.pick_of(megatron_leaves());
  REQUIRE(open_pick);
  auto whole = megatron_leaves();
  whole.leaves.push_back({name, to_value(rows)});
  const auto whole_pick = f.pick_of(whole);
  REQUIRE(whole_pick);
  CHECK(*open_pick == *whole_pick);
}

TEST_CASE("the search seeds sequence parallelism and names every decided .to", "[autoshard]") {
  const auto shapes = mlp_shapes(256, 1024);
  autoshard::options o;
  o.exact.solutions = 1;
  auto hand = megatron_leaves();
  hand.leaves.push_back({open_redistribution(decided_block), to_value(spec(shard(dp, tp), replicate))});
  o.seeds.push_back({"hand-written, SP", hand});
  const auto r = autoshard::choose(decided_block, eight, shapes, h100, o);
  CHECK(std::any_of(r.seeds.begin(), r.seeds.end(), [](const auto& s) { return s.origin.ends_with(", SP"); }));
  const auto& c = r.chosen.choice.leaves;
  CHECK(std::any_of(c.begin(), c.end(), [&](const auto& l) { return l.leaf == open_redistribution(decided_block); }));
  const auto again = graph::respecify(decided_block, r.chosen.choice);
  REQUIRE(again.program);
  CHECK(again.kept.empty());
  const auto seed = std::find_if(r.planned.begin(), r.planned.end(), [](const auto& p) { return p.origin == "hand-written, SP"; });
  if (seed != r.planned.end()) CHECK(r.chosen.planned_step_us <= seed->planned_step_us);
  CHECK(std::find(r.free_leaves.begin(), r.free_leaves.end(), open_redistribution(decided_block)) != r.free_leaves.end());
}

TEST_CASE("a choice compiles with the mesh's axis order, whatever axis ZeRO names first", "[autoshard]") {
  // No on(...): the program knows no axes until a choice names them. ZeRO over tp interned
  // first would make tp the major axis of every dim split over both, and the compiler would
  // refuse layouts the formulation (which lays splits out in the mesh's order) found consistent.
  constexpr auto unordered = program(mse(x_open + branch_open.to(spec(auto_, replicate)), input<"target">(batch)), adamw{});
  graph::sharding_choice rows_over_both{.zero_stage = 1, .zero_axis = "tp"};
  const auto both = to_value(spec(shard(dp, tp), replicate));
  rows_over_both.leaves = {{"x", both}, {"target", both}, {"w1", to_value(spec(replicate, replicate))},
                           {"w2", to_value(spec(replicate, replicate))}, {open_redistribution(unordered), both}};
  CHECK(graph::respecify(unordered, rows_over_both).err == errc::axis_order); // tp became the major axis
  rows_over_both.axes = {"dp", "tp"};
  CHECK(graph::respecify(unordered, rows_over_both).message() == "");

  const auto shapes = mlp_shapes(256, 256);
  for (const auto& zero : autoshard::detail::zero_choices(autoshard::detail::split_axes(eight))) {
    const auto f = autoshard::formulate(unordered, eight, shapes, h100,
                                        {.zero_stage = zero.zero_stage.value_or(0), .zero_axis = zero.zero_axis});
    const auto solved = autoshard::solve(f, {.solutions = 4});
    for (const auto& s : solved.solutions) {
      const auto c = f.choice(s.pick);
      CHECK(c.axes == std::vector<std::string>{"dp", "tp"});
      const auto r = graph::respecify(unordered, c);
      CHECK(r.message() == "");
    }
  }
}
