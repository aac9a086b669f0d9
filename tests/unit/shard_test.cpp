// train/detail/shard.hpp: each rank's block of a global tensor, where a ZeRO split pads a
// dimension that does not divide (graph/lower.hpp), and the copies between the two.
#include <concerto/train/detail/shard.hpp>

#include <catch2/catch_test_macros.hpp>

#include <cstddef>
#include <vector>

using namespace concerto::train::detail;
using dims = std::vector<std::int64_t>;

TEST_CASE("an uneven split gives the last ranks fewer rows, or none", "[train][shard]") {
  // 5 rows over 4 ranks in buffers of 2: rows [0,2), [2,4), [4,5) and none.
  const dims offsets{0, 2, 4, 6}, rows{2, 2, 1, 0};
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    const auto b = block_of({5, 3}, {{{4, r}}, {}}, {2, 3});
    CHECK(b.global == dims{5, 3});
    CHECK(b.local == dims{2, 3});
    CHECK(b.offset == dims{offsets[static_cast<std::size_t>(r)], 0});
    CHECK(b.held == dims{rows[static_cast<std::size_t>(r)], 3});
  }
  SECTION("behind an axis that divides (tp major, dp minor): each tp part split unevenly") {
    // 10 rows over tp 2 (5 each), then over dp 2 (3 and 2).
    const auto b = block_of({10, 3}, {{{2, 1}, {2, 1}}, {}}, {3, 3});
    CHECK(b.offset == dims{5 + 3, 0});
    CHECK(b.held == dims{2, 3});
  }
  SECTION("a split that divides is the plain block") {
    const auto b = block_of({8, 6}, {{{2, 1}}, {{3, 2}}}, {4, 2});
    CHECK(b.global == dims{8, 6});
    CHECK(b.offset == dims{4, 4});
    CHECK(b.held == dims{4, 2});
  }
  SECTION("a buffer that does not hold this rank's part of the program's shape is taken as it is") {
    // A pipelined step's whole batch of 4 rows, where the program's shape is a micro-batch's 2.
    const auto b = block_of({2, 8}, {{{2, 1}}, {}}, {2, 8});
    CHECK(b.global == dims{4, 8});
    CHECK(b.offset == dims{2, 0});
    CHECK(b.held == dims{2, 8});
    // A packed gradient: a flat buffer for a rank-3 value.
    CHECK(block_of({2, 3, 4}, {{}, {}, {}}, {48}).global == dims{48});
  }
}

TEST_CASE("copies between a tensor and a padded block touch the values only", "[train][shard]") {
  // A [3, 5] tensor whose inner dimension is split unevenly over 2 ranks: 3 and 2 columns, in
  // buffers of 3 columns.
  std::vector<float> global(15);
  for (std::size_t i = 0; i < global.size(); ++i) global[i] = static_cast<float>(i);
  const auto as_bytes = [](std::vector<float>& v) { return reinterpret_cast<std::byte*>(v.data()); };
  const auto last = block_of({3, 5}, {{}, {{2, 1}}}, {3, 3});
  std::vector<float> local(9, -1.0f);
  copy_block(last, sizeof(float), as_bytes(global), as_bytes(local), true);
  CHECK(local == std::vector<float>{3, 4, -1, 8, 9, -1, 13, 14, -1});
  std::vector<float> back(15, 0.0f);
  copy_block(last, sizeof(float), as_bytes(back), as_bytes(local), false);
  CHECK(back == std::vector<float>{0, 0, 0, 3, 4, 0, 0, 0, 8, 9, 0, 0, 0, 13, 14});
  SECTION("a rank that holds only padding copies nothing") {
    const auto none = block_of({5, 3}, {{{4, 3}}, {}}, {2, 3});
    std::vector<float> g(15, 7.0f), l(6, -1.0f);
    copy_block(none, sizeof(float), as_bytes(g), as_bytes(l), true);
    CHECK(l == std::vector<float>(6, -1.0f));
    copy_block(none, sizeof(float), as_bytes(g), as_bytes(l), false);
    CHECK(g == std::vector<float>(15, 7.0f));
  }
}
