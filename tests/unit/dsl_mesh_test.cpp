#include <concerto/mesh/mesh.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <random>
#include <set>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;

TEST_CASE("a mesh binds its free axis from the world size", "[dsl][mesh]") {
  SECTION("the free axis takes what the fixed ones leave") {
    const auto m = mesh::from_world(8, {{"dp", -1, ir::link_class::inter_node}, {"tp", 2}});
    CHECK(m.size("dp") == 4);
    CHECK(m.size("tp") == 2);
    CHECK(m.axes()[0].link == ir::link_class::inter_node);
    CHECK(m.rank_count() == 8);
  }
  SECTION("a world that does not divide is an error naming the free axis") {
    CHECK_THROWS_WITH(mesh::from_world(6, {{"dp", -1}, {"tp", 4}}), ContainsSubstring("'dp'"));
  }
  SECTION("fixed sizes must multiply to the world") {
    CHECK_THROWS_WITH(mesh::from_world(8, {{"dp", 2}, {"tp", 2}}), ContainsSubstring("world has 8"));
  }
  SECTION("two free axes are refused") {
    CHECK_THROWS_WITH(mesh::from_world(8, {{"dp", -1}, {"tp", -1}}), ContainsSubstring("both ask"));
  }
  SECTION("an unknown axis is named") { CHECK_THROWS_WITH(mesh::from_world(4, {{"dp", 4}}).size("tp"), ContainsSubstring("'tp'")); }
}

TEST_CASE("ranks and coordinates are row-major with the last axis fastest", "[dsl][mesh]") {
  const auto m = mesh::from_world(12, {{"pp", 3}, {"dp", 2}, {"tp", 2}});
  SECTION("hand-computed coordinates") {
    CHECK(m.coords(0) == std::vector<int>{0, 0, 0});
    CHECK(m.coords(5) == std::vector<int>{1, 0, 1});
    CHECK(m.coords(11) == std::vector<int>{2, 1, 1});
  }
  SECTION("hand-computed groups") {
    CHECK(m.group("tp", 5) == std::vector<int>{4, 5});
    CHECK(m.group("dp", 5) == std::vector<int>{5, 7});
    CHECK(m.group("pp", 5) == std::vector<int>{1, 5, 9});
  }
  SECTION("every rank round-trips and every axis partitions the world into groups of its size") {
    for (int r = 0; r < m.rank_count(); ++r) CHECK(m.rank_of(m.coords(r)) == r);
    for (const char* axis : {"pp", "dp", "tp"}) {
      const auto groups = m.groups(axis);
      std::set<int> seen;
      for (std::size_t g = 0; g < groups.size(); ++g) {
        CHECK(static_cast<int>(groups[g].size()) == m.size(axis));
        for (int r : groups[g]) {
          CHECK(seen.insert(r).second);
          CHECK(m.group_index(axis, r) == static_cast<int>(g));
          CHECK(m.group(axis, r) == groups[g]);
        }
      }
      CHECK(static_cast<int>(seen.size()) == m.rank_count());
    }
  }
}

TEST_CASE("random meshes keep the group properties", "[dsl][mesh][property]") {
  std::mt19937 rng(42);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<axis_request> req;
    const int axes = 1 + static_cast<int>(rng() % 3);
    int world = 1;
    for (int a = 0; a < axes; ++a) {
      const int size = 1 + static_cast<int>(rng() % 4);
      const char* names[] = {"a0", "a1", "a2"};
      req.push_back({names[a], size});
      world *= size;
    }
    const auto m = mesh::from_world(world, req);
    for (int r = 0; r < world; ++r) {
      REQUIRE(m.rank_of(m.coords(r)) == r);
      for (const auto& ax : req) {
        const auto g = m.group(ax.name, r);
        CHECK(std::find(g.begin(), g.end(), r) != g.end());
        CHECK(std::is_sorted(g.begin(), g.end()));
      }
    }
  }
}
