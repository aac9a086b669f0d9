// The dropout kernel: the fraction it drops, the scale of what it keeps, the same mask for the
// same (key, step, global index) and another one at another step or key, and a block of a split
// tensor masked as the whole tensor is there.

#include <concerto/runtime/cpu/kernels.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_floating_point.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cstdint>
#include <vector>

namespace cpu = concerto::runtime::cpu;
namespace ir = concerto::ir;
using concerto::runtime::dropout_layout;
using Catch::Matchers::ContainsSubstring;
using Catch::Matchers::WithinAbs;

namespace {
dropout_layout whole(std::int64_t rows, std::int64_t cols, double rate, std::uint64_t key) {
  dropout_layout l;
  l.rank = 2;
  l.local[0] = rows;
  l.local[1] = cols;
  l.global_stride[0] = cols;
  l.global_stride[1] = 1;
  l.key = key;
  l.threshold = static_cast<std::uint32_t>(rate * static_cast<double>(ir::fraction_den));
  l.scale = static_cast<float>(1.0 / (1.0 - rate));
  return l;
}
} // namespace

TEST_CASE("dropout drops its rate of the values and scales the rest; the same key and step draw the same mask",
          "[cpu][kernels][dropout]") {
  const std::int64_t rows = 200, cols = 500;
  const auto l = whole(rows, cols, 0.25, 42);
  const std::vector<float> x(static_cast<std::size_t>(rows * cols), 2.0f);
  std::vector<float> y(x.size()), again(x.size()), later(x.size()), other(x.size());
  cpu::dropout(x, y, l, 3);
  std::size_t dropped = 0;
  for (float v : y) {
    if (v == 0.0f) ++dropped;
    else REQUIRE_THAT(v, WithinAbs(2.0 / 0.75, 1e-6));
  }
  // 100000 draws: the dropped fraction within 4 standard deviations (0.0055) of the rate.
  CHECK_THAT(static_cast<double>(dropped) / static_cast<double>(y.size()), WithinAbs(0.25, 0.0055));
  cpu::dropout(x, again, l, 3);
  CHECK(again == y);
  cpu::dropout(x, later, l, 4);
  auto other_key = l;
  other_key.key = 43;
  cpu::dropout(x, other, other_key, 3);
  std::size_t same_step = 0, same_key = 0;
  for (std::size_t i = 0; i < y.size(); ++i) {
    same_step += (later[i] == 0.0f) == (y[i] == 0.0f);
    same_key += (other[i] == 0.0f) == (y[i] == 0.0f);
  }
  // Independent masks agree where both keep or both drop: 0.75² + 0.25² = 62.5 % of the values.
  CHECK_THAT(static_cast<double>(same_step) / static_cast<double>(y.size()), WithinAbs(0.625, 0.01));
  CHECK_THAT(static_cast<double>(same_key) / static_cast<double>(y.size()), WithinAbs(0.625, 0.01));
  // The rate 0 keeps every value as it is.
  cpu::dropout(x, other, whole(rows, cols, 0.0, 42), 3);
  CHECK(other == x);
}

TEST_CASE("each block of a split tensor draws the whole tensor's mask there", "[cpu][kernels][dropout]") {
  const std::int64_t rows = 6, cols = 8;
  const auto l = whole(rows, cols, 0.5, 7);
  std::vector<float> x(static_cast<std::size_t>(rows * cols));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 1.0f + static_cast<float>(i);
  std::vector<float> y(x.size());
  cpu::dropout(x, y, l, 1);
  // Rows split in 2 and columns in 4: block (r, c) holds rows [3r, 3r + 3) and columns [2c, 2c + 2).
  for (int r = 0; r < 2; ++r)
    for (int c = 0; c < 4; ++c) {
      auto b = l;
      b.local[0] = 3;
      b.local[1] = 2;
      b.offset[0] = 3 * r;
      b.offset[1] = 2 * c;
      std::vector<float> bx, by(6);
      for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 2; ++j) bx.push_back(x[static_cast<std::size_t>((3 * r + i) * cols + 2 * c + j)]);
      cpu::dropout(bx, by, b, 1);
      for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 2; ++j)
          CHECK(by[static_cast<std::size_t>(i * 2 + j)] == y[static_cast<std::size_t>((3 * r + i) * cols + 2 * c + j)]);
    }
  std::vector<float> short_y(5);
  REQUIRE_THROWS_WITH(cpu::dropout(x, short_y, l, 1), ContainsSubstring("dropout: `y` holds 5 elements"));
}
