// Automatic sharding: auto_ in specs, the program compiled again with chosen specs
// (graph::respecify) equal to the program written with those specs, and the search
// (autoshard::choose) on the cases where the right layout depends on the shapes: pure data
// parallelism for a small hidden size and a large batch, split weights when data parallelism does
// not fit the memory cap, a vocabulary-parallel head for a large vocabulary and a small batch;
// never worse than a hand-written layout given as a seed; the same choice every time.
#include "../mpi/auto_lm_program.hpp"

#include <concerto/autoshard/auto_shard.hpp>
#include <concerto/autoshard/search.hpp>
#include <concerto/concerto.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <limits>
#include <utility>
#include <vector>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;

namespace {
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

// The MLP with every dimension decided (auto_lm::auto_mlp), and the same MLP written by hand three ways.
using auto_lm::auto_mlp; // every dimension decided
using auto_lm::eight;
using auto_lm::free2;
using auto_lm::mlp_shapes;

constexpr auto rows = spec(shard(dp), replicate);
constexpr auto hand_loss = mse(matmul(gelu(matmul(input<"x">(rows), param<"w1">(spec(replicate, shard(tp))))),
                                      param<"w2">(spec(shard(tp), replicate))),
                               input<"target">(rows));
constexpr auto megatron = program(hand_loss, adamw{}, on(dp, tp));
constexpr auto megatron_zero3 = program(hand_loss, zero<3>(adamw{}, dp), on(dp, tp));
constexpr auto all_rows = spec(shard(dp, tp), replicate);
constexpr auto dp_loss = mse(matmul(gelu(matmul(input<"x">(all_rows), param<"w1">(spec(replicate, replicate)))),
                                    param<"w2">(spec(replicate, replicate))),
                             input<"target">(all_rows));
constexpr auto pure_dp = program(dp_loss, zero<1>(adamw{}, dp), on(dp, tp));

graph::sharding_choice megatron_choice() {
  graph::sharding_choice c;
  c.leaves = {{"x", to_value(rows)},
              {"target", to_value(rows)},
              {"w1", to_value(spec(replicate, shard(tp)))},
              {"w2", to_value(spec(shard(tp), replicate))}};
  return c;
}

template <std::size_t N>
std::uint64_t lowered(const graph::program<N>& p, const shape_map& shapes, const mesh& m = eight) {
  return plan::hash(lower(p, shapes, m));
}

const graph::leaf_choice& chosen(const graph::sharding_choice& c, const std::string& leaf) {
  for (const auto& l : c.leaves)
    if (l.leaf == leaf) return l;
  FAIL("no choice for " << leaf);
  return c.leaves.front();
}
bool replicated(const spec_value& s) {
  for (int d = 0; d < s.rank; ++d)
    if (!s.dims[d][0].empty()) return false;
  return true;
}

using auto_lm::lm;
shape_map lm_shapes(std::int64_t batch, std::int64_t seq, std::int64_t vocab, std::int64_t hidden) {
  return auto_lm::shapes(batch, seq, vocab, hidden);
}
autoshard::options two_layers() {
  autoshard::options o;
  o.lower.depth = {{"layers", 2}};
  return o;
}
const cost::model h100 = cost::model::preset("h100x64");
} // namespace

TEST_CASE("auto_ marks the dimensions automatic sharding decides; as written they are replicated", "[autoshard]") {
  constexpr auto s = spec(auto_, shard(tp), auto_);
  STATIC_REQUIRE(to_value(s).free == 0b101);
  STATIC_REQUIRE(to_value(s).rank == 3);
  CHECK(to_string(to_value(s)) == "[auto,tp,auto]");
  STATIC_REQUIRE(auto_mlp.has_free_dims());
  STATIC_REQUIRE(!megatron.has_free_dims());
  STATIC_REQUIRE(auto_mlp.names[1] == graph::leaf_name("w1"));
  STATIC_REQUIRE(auto_mlp.free_dims[1] == 0b11);
  STATIC_REQUIRE(auto_mlp.spec_of("w1") == to_value(spec(replicate, replicate)));
  STATIC_REQUIRE(auto_mlp.count(collective::all_reduce) == 0); // nothing split, nothing to sum
}

TEST_CASE("respecify compiles a program again with chosen leaf specs, as if they had been written", "[autoshard]") {
  const auto shapes = mlp_shapes(16, 8);
  SECTION("Megatron's layout") {
    const auto r = graph::respecify(auto_mlp, megatron_choice());
    REQUIRE(r.program);
    CHECK(r.program->size == megatron.size);
    CHECK(r.program->count(collective::all_reduce, tp) == megatron.count(collective::all_reduce, tp));
    CHECK(lowered(*r.program, shapes) == lowered(megatron, shapes));
    CHECK_FALSE(r.program->has_free_dims()); // decided: train::compile takes it as written
  }
  SECTION("with ZeRO-3 over dp chosen too") {
    auto c = megatron_choice();
    c.zero_stage = 3;
    c.zero_axis = "dp";
    const auto r = graph::respecify(auto_mlp, c);
    REQUIRE(r.program);
    CHECK(lowered(*r.program, shapes) == lowered(megatron_zero3, shapes));
    CHECK(lowered(*r.program, shapes) != lowered(megatron, shapes));
  }
  SECTION("a written ZeRO stage is undone and another chosen: pure DP with ZeRO-1") {
    const auto from_zero3 = graph::respecify(megatron_zero3, graph::sharding_choice{
                                                                 .leaves = {{"x", to_value(all_rows)},
                                                                            {"target", to_value(all_rows)},
                                                                            {"w1", to_value(spec(replicate, replicate))},
                                                                            {"w2", to_value(spec(replicate, replicate))}},
                                                                 .zero_stage = 1,
                                                                 .zero_axis = "dp"});
    REQUIRE(from_zero3.program);
    CHECK(lowered(*from_zero3.program, shapes) == lowered(pure_dp, shapes));
  }
  SECTION("a choice the compiler refuses comes back as its error, naming where") {
    graph::sharding_choice c;
    c.leaves = {{"x", to_value(spec(replicate, shard(tp)))}, {"w1", to_value(spec(replicate, replicate))}};
    const auto r = graph::respecify(auto_mlp, c); // x's contracted dim split, w1's not
    CHECK_FALSE(r.program);
    CHECK(r.err == errc::mismatched_contraction);
    CHECK(r.where == "matmul(x, w1)");
    // In the sentence the compile-time diagnostic prints (expr/messages.hpp), and where.
    CHECK(r.message() == std::string(CONCERTO_MESSAGE_MISMATCHED_CONTRACTION) + " (at matmul(x, w1))");
    for (int e = 1; e <= static_cast<int>(errc::unbuildable_op); ++e)
      CHECK(message_of(static_cast<errc>(e)).starts_with("concerto: "));
  }
  SECTION("a choice that does not fit the program is an error naming it") {
    CHECK_THROWS_WITH(graph::respecify(auto_mlp, {.leaves = {{"nope", to_value(rows)}}}), ContainsSubstring("no leaf or redistribution written with auto_ named 'nope'"));
    CHECK_THROWS_WITH(graph::respecify(auto_mlp, {.leaves = {{"w1", to_value(spec(replicate))}}}),
                      ContainsSubstring("must have rank 2"));
    CHECK_THROWS_WITH(graph::respecify(auto_mlp, {.zero_stage = 4}), ContainsSubstring("ZeRO stage 4 is not 0, 1, 2 or 3"));
    CHECK_THROWS_WITH(graph::respecify(auto_mlp, {.zero_stage = 2}), ContainsSubstring("needs a mesh axis"));
  }
}

TEST_CASE("a batch of ids redistributed for a chosen layout stays ids", "[autoshard][lower]") {
  // labels split over dp, the logits whole: the labels are gathered, as i64, before the loss.
  graph::sharding_choice c;
  c.leaves = {{"labels", to_value(rows)}};
  const auto r = graph::respecify(lm, c);
  REQUIRE(r.program);
  const auto g = lower(*r.program, lm_shapes(8, 4, 16, 8), eight, {.depth = {{"layers", 2}}});
  int gathers = 0;
  for (const auto& t : g.tasks)
    if (t.kind == ir::op_kind::all_gather && g.buffers[static_cast<std::size_t>(t.reads.front())].name == "labels") {
      ++gathers;
      CHECK(g.buffers[static_cast<std::size_t>(t.writes.front())].type == ir::dtype::i64);
      CHECK(t.bytes == 8 * 4 * 8); // the whole batch of 8 x 4 ids, 8 bytes each
    }
  CHECK(gathers == 1);
}

TEST_CASE("automatic sharding picks pure data parallelism for a small hidden size and a large batch", "[autoshard]") {
  const auto r = autoshard::choose(auto_mlp, eight, mlp_shapes(4096, 256), h100);
  REQUIRE(r.program);
  const auto& x = chosen(r.chosen.choice, "x").spec;
  CAPTURE(r.explain());
  // Data parallelism (over tp alone, in fact: the cost model's inter-node sum costs more than
  // dp's share of the work saves), the weights whole on every rank.
  CHECK(!x.dims[0][0].empty());
  CHECK(x.dims[1][0].empty());
  CHECK(r.chosen.choice.zero_stage.value_or(0) != 3);
  CHECK(replicated(chosen(r.chosen.choice, "w1").spec));
  CHECK(replicated(chosen(r.chosen.choice, "w2").spec));
  CHECK(r.evaluated > 20);
  // The chosen program is the one the choice compiles to, and its step is the best planned.
  CHECK(lowered(*r.program, mlp_shapes(4096, 256)) == r.chosen.graph_hash);
  for (const auto& c : r.planned) CHECK(r.chosen.planned_step_us <= c.planned_step_us);
  CHECK_THAT(r.explain(), ContainsSubstring("all_reduce"));
}

TEST_CASE("automatic sharding splits the weights when pure data parallelism does not fit", "[autoshard]") {
  const auto shapes = mlp_shapes(64, 4096);
  auto o = autoshard::options{};
  const auto unbounded = autoshard::choose(auto_mlp, eight, shapes, h100, o);
  std::int64_t dp_peak = 0;
  for (const auto& c : unbounded.seeds)
    if (c.origin.starts_with("pure DP") && !c.choice.zero_stage.value_or(0)) dp_peak = c.peak_bytes;
  REQUIRE(dp_peak > 0);
  o.memory_cap_bytes = dp_peak / 2;
  const auto r = autoshard::choose(auto_mlp, eight, shapes, h100, o);
  CAPTURE(r.explain());
  CHECK(r.chosen.peak_bytes <= *o.memory_cap_bytes);
  CHECK((!replicated(chosen(r.chosen.choice, "w1").spec) || r.chosen.choice.zero_stage.value_or(0) == 3));
  for (const auto& c : r.planned) CHECK(c.peak_bytes <= *o.memory_cap_bytes);
  o.memory_cap_bytes = 1 << 20;
  CHECK_THROWS_WITH(autoshard::choose(auto_mlp, eight, shapes, h100, o), ContainsSubstring("no sharding fits the memory cap of 1 MiB"));
}

TEST_CASE("automatic sharding splits the head over its vocabulary for a large vocabulary and a small batch", "[autoshard]") {
  const auto r = autoshard::choose(lm, eight, lm_shapes(2, 256, 131072, 256), h100, two_layers());
  CAPTURE(r.explain());
  const auto& head = chosen(r.chosen.choice, "head").spec;
  CHECK(!head.dims[1][0].empty()); // the vocabulary
  CHECK(head.dims[0][0].empty());
}

TEST_CASE("automatic sharding is never worse than a hand-written layout it is given, and chooses alike every time",
          "[autoshard]") {
  auto o = two_layers();
  graph::sharding_choice hand;
  const auto col = to_value(spec(replicate, shard(tp))), row = to_value(spec(shard(tp), replicate));
  hand.leaves = {{"ids", to_value(rows)}, {"labels", to_value(rows)}, {"wte", row}, {"fc1", col}, {"fc2", row}, {"head", col}};
  o.seeds.push_back({"hand-written", hand});
  const auto shapes = lm_shapes(16, 128, 8192, 512);
  const auto r = autoshard::choose(lm, eight, shapes, h100, o);
  CAPTURE(r.explain());
  const auto it = std::find_if(r.planned.begin(), r.planned.end(), [](const auto& c) { return c.origin == "hand-written"; });
  REQUIRE(it != r.planned.end());
  CHECK(r.chosen.planned_step_us <= it->planned_step_us);
  const auto again = autoshard::choose(lm, eight, shapes, h100, o);
  CHECK(autoshard::detail::key_of(again.chosen.choice) == autoshard::detail::key_of(r.chosen.choice));
  CHECK(again.chosen.planned_step_us == r.chosen.planned_step_us);
}

TEST_CASE("automatic sharding finds the optimum exhaustive enumeration finds on the MLP", "[autoshard]") {
  // The batch dimension and both weights decided, the ZeRO stage kept: a few thousand
  // shardings, each priced on the search's judge. The optima include 2-D tensor parallelism
  // (x [R,tp] with w1 [tp,dp]) and data replicated over the slow axis, which no seed is.
  constexpr auto batch = spec(auto_, replicate);
  constexpr auto mlp = program(mse(matmul(gelu(matmul(input<"x">(batch), param<"w1">(free2))), param<"w2">(free2)),
                                   input<"target">(batch)),
                               adamw{});
  autoshard::options o;
  o.decide_zero = false;
  for (const auto& [rows, hidden] : std::vector<std::pair<std::int64_t, std::int64_t>>{{64, 4096}, {2048, 2048}, {4096, 256}}) {
    const auto shapes = mlp_shapes(rows, hidden);
    const auto all = autoshard::enumerate_all(mlp, eight, shapes, h100, o);
    const auto r = autoshard::choose(mlp, eight, shapes, h100, o);
    double best = std::numeric_limits<double>::infinity();
    for (const auto& c : r.planned) best = std::min(best, c.list_step_us);
    CAPTURE(rows, hidden, all.priced, autoshard::detail::key_of(all.best.choice), r.explain());
    CHECK(all.priced > 1000);
    CHECK(best <= all.best.list_step_us * 1.001);
    CHECK(r.evaluated < all.priced / 4);
  }
}

TEST_CASE("automatic sharding says what is missing", "[autoshard]") {
  CHECK_THROWS_WITH(autoshard::choose(megatron, eight, mlp_shapes(16, 8), h100),
                    ContainsSubstring("no leaf written auto_ and no seed was given"));
  CHECK_THROWS_WITH(autoshard::choose(auto_mlp, eight, {{"x", {16, 8}}}, h100), ContainsSubstring("no sharding of the program is valid"));
}

TEST_CASE("auto_shard leaves every placement of a hand-written program to automatic sharding, the program as written a seed",
          "[autoshard]") {
  const auto shapes = mlp_shapes(64, 512);
  const auto check = [&](const auto& hand, const char* what) {
    CAPTURE(what);
    const auto whole = autoshard::auto_shard(hand);
    REQUIRE(whole.program->has_free_dims());
    CHECK(whole.program->zero_stage == 0);
    for (int l = 0; l < whole.program->name_count; ++l) CHECK(whole.program->free_dims[l] != 0); // every leaf decided
    // The choice that comes back is the program as written, ZeRO stage included: the same lowered graph.
    const auto written = graph::respecify(*whole.program, whole.as_written);
    REQUIRE(written.program);
    CHECK(lowered(*written.program, shapes) == lowered(hand, shapes));
    autoshard::options o;
    o.seeds.push_back({"as written", whole.as_written});
    const auto r = autoshard::choose(*whole.program, eight, shapes, h100, o);
    CAPTURE(r.explain());
    REQUIRE(r.program);
    CHECK_FALSE(r.program->has_free_dims());
    const auto is_written = [](const auto& c) { return c.origin == "as written"; };
    if (const auto it = std::find_if(r.planned.begin(), r.planned.end(), is_written); it != r.planned.end())
      CHECK(r.chosen.planned_step_us <= it->planned_step_us);
    else {
      const auto seed = std::find_if(r.seeds.begin(), r.seeds.end(), is_written);
      REQUIRE(seed != r.seeds.end());
      CHECK(r.chosen.list_step_us <= seed->list_step_us);
    }
  };
  check(megatron, "Megatron");
  check(megatron_zero3, "Megatron + ZeRO-3");
  check(pure_dp, "DP + ZeRO-1");
}
