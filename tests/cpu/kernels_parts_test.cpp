// CPU kernels of the parts of one dim -- concat_dim (two parts, either one a table repeated over
// the leading dims), slice_dim and their gradients -- and of a table broadcast over the leading
// dims (scale_table), against index loops written here, the gradients also against central
// differences of the forward kernels.

#include "kernels_testing.hpp"

#include <concerto/runtime/cpu/kernels.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cstdint>
#include <tuple>
#include <vector>

namespace cpu = concerto::runtime::cpu;
namespace ir = concerto::ir;
using namespace kernels_testing;
using Catch::Matchers::ContainsSubstring;

namespace {
constexpr double fd_tol = 2e-3;
using i64 = std::int64_t;
// The index of [l, o, p, i] in a tensor [lead, outer, extent, inner] (lead 1 for a repeated part).
i64 at(i64 l, i64 o, i64 p, i64 i, i64 outer, i64 extent, i64 inner) { return ((l * outer + o) * extent + p) * inner + i; }
} // namespace

TEST_CASE("concat_dim joins two parts, a repeated table included; its gradients are each part's share of dy",
          "[cpu][kernels][parts]") {
  // lead, outer, extent, inner, the first part's length, which parts are repeated tables
  const auto [lead, outer, extent, inner, first, broadcast] =
      GENERATE(std::tuple<i64, i64, i64, i64, i64, i64>{1, 3, 5, 4, 2, 0},  // equal ranks along a middle dim
               std::tuple<i64, i64, i64, i64, i64, i64>{1, 1, 7, 1, 3, 0},  // along the last dim of a vector
               std::tuple<i64, i64, i64, i64, i64, i64>{4, 1, 9, 6, 1, 1},  // a class token before the patches
               std::tuple<i64, i64, i64, i64, i64, i64>{2, 3, 4, 2, 3, 2}); // a table after, with an outer dim
  CAPTURE(lead, outer, extent, inner, first, broadcast);
  const ir::dim_part g{lead, outer, extent, inner, 0, first, broadcast};
  std::mt19937 rng(static_cast<unsigned>(extent * 31 + first));
  auto a = random_floats(rng, static_cast<std::size_t>(g.part_values(first, 0)));
  auto b = random_floats(rng, static_cast<std::size_t>(g.part_values(extent - first, 1)));
  const auto dy = random_floats(rng, static_cast<std::size_t>(g.whole_values()));
  std::vector<float> out(dy.size());
  cpu::concat_dim(a, b, out, g);
  std::vector<double> want(out.size()), da(a.size()), db(b.size());
  for (i64 l = 0; l < lead; ++l)
    for (i64 o = 0; o < outer; ++o)
      for (i64 p = 0; p < extent; ++p)
        for (i64 i = 0; i < inner; ++i) {
          const bool in_a = p < first;
          const i64 len = in_a ? first : extent - first, pos = in_a ? p : p - first;
          const i64 src = at(g.repeated(in_a ? 0 : 1) ? 0 : l, o, pos, i, outer, len, inner);
          const auto w = static_cast<std::size_t>(at(l, o, p, i, outer, extent, inner));
          want[w] = in_a ? a[static_cast<std::size_t>(src)] : b[static_cast<std::size_t>(src)];
          (in_a ? da : db)[static_cast<std::size_t>(src)] += dy[w];
        }
  REQUIRE_CLOSE(out, want, 1e-7, 1e-9);
  std::vector<float> got_da(a.size()), got_db(b.size());
  cpu::concat_dim_grad(dy, got_da, ir::dim_part{lead, outer, extent, inner, 0, first, g.repeated(0) ? 1 : 0});
  cpu::concat_dim_grad(dy, got_db, ir::dim_part{lead, outer, extent, inner, first, extent - first, g.repeated(1) ? 1 : 0});
  REQUIRE_CLOSE(got_da, da, 1e-6, 1e-7);
  REQUIRE_CLOSE(got_db, db, 1e-6, 1e-7);
  std::vector<float> scratch(out.size());
  const auto loss = [&] {
    cpu::concat_dim(a, b, scratch, g);
    return project(dy, scratch);
  };
  REQUIRE_CLOSE(got_da, central_difference(a, loss), fd_tol, fd_tol);
  REQUIRE_CLOSE(got_db, central_difference(b, loss), fd_tol, fd_tol);
}

TEST_CASE("slice_dim takes positions of one dim; its gradient puts dy there and zeros elsewhere", "[cpu][kernels][parts]") {
  const i64 outer = 3, extent = 6, inner = 5, offset = GENERATE(0, 2, 5), length = offset == 5 ? 1 : 3;
  CAPTURE(offset, length);
  const ir::dim_part g{1, outer, extent, inner, offset, length, 0};
  std::mt19937 rng(static_cast<unsigned>(offset + 3));
  auto x = random_floats(rng, static_cast<std::size_t>(g.whole_values()));
  const auto dy = random_floats(rng, static_cast<std::size_t>(g.part_values(length)));
  std::vector<float> part(dy.size()), dx(x.size());
  cpu::slice_dim(x, part, g);
  std::vector<double> want(part.size()), want_dx(x.size());
  for (i64 o = 0; o < outer; ++o)
    for (i64 p = 0; p < length; ++p)
      for (i64 i = 0; i < inner; ++i) {
        const auto from = static_cast<std::size_t>(at(0, o, offset + p, i, outer, extent, inner));
        const auto to = static_cast<std::size_t>(at(0, o, p, i, outer, length, inner));
        want[to] = x[from];
        want_dx[from] = dy[to];
      }
  REQUIRE_CLOSE(part, want, 1e-7, 1e-9);
  std::fill(dx.begin(), dx.end(), 7.0f); // every value is written: the zeros too
  cpu::slice_dim_grad(dy, dx, g);
  REQUIRE_CLOSE(dx, want_dx, 1e-7, 1e-9);
  std::vector<float> scratch(part.size());
  REQUIRE_CLOSE(dx, central_difference(x, [&] {
                  cpu::slice_dim(x, scratch, g);
                  return project(dy, scratch);
                }),
                fd_tol, fd_tol);
}

TEST_CASE("the parts' kernels refuse a part outside the dim and buffers of other sizes", "[cpu][kernels][parts]") {
  std::vector<float> x(12), part(6);
  const i64 past = GENERATE(4); // not a constant: g++ 12 would flag the copy the check stops (-Warray-bounds)
  REQUIRE_THROWS_WITH(cpu::slice_dim(x, part, ir::dim_part{1, 2, 6, 1, past, 3, 0}), ContainsSubstring("does not lie in an extent of 6"));
  std::vector<float> a(4), b(8), out(10);
  REQUIRE_THROWS_WITH(cpu::concat_dim(a, b, out, ir::dim_part{1, 2, 6, 1, 0, 2, 0}), ContainsSubstring("concat_dim: `out` holds 10"));
  REQUIRE_THROWS_WITH(cpu::concat_dim(a, b, out, ir::dim_part{1, 2, 2, 1, 0, 2, 0}), ContainsSubstring("leaves nothing"));
}

TEST_CASE("scale_table multiplies by a table of the last dims; its gradients are dy times the table and Σ x·dy",
          "[cpu][kernels][parts]") {
  const std::size_t rows = 7, cols = 5;
  std::mt19937 rng(17);
  auto x = random_floats(rng, rows * cols), table = random_floats(rng, cols);
  const auto dy = random_floats(rng, rows * cols);
  std::vector<float> y(rows * cols), dx(rows * cols), dtable(cols, 1.0f);
  cpu::scale_table(x, table, y, rows, cols);
  std::vector<double> want(y.size()), want_dtable(cols);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) {
      want[r * cols + c] = double(x[r * cols + c]) * table[c];
      want_dtable[c] += double(x[r * cols + c]) * dy[r * cols + c];
    }
  REQUIRE_CLOSE(y, want, 1e-6, 1e-7);
  cpu::scale_table(dy, table, dx, rows, cols);
  cpu::scale_table_grad(x, dy, dtable, rows, cols);
  REQUIRE_CLOSE(dtable, want_dtable, 1e-5, 1e-6);
  std::vector<float> scratch(y.size());
  const auto loss = [&] {
    cpu::scale_table(x, table, scratch, rows, cols);
    return project(dy, scratch);
  };
  REQUIRE_CLOSE(dx, central_difference(x, loss), fd_tol, fd_tol);
  REQUIRE_CLOSE(dtable, central_difference(table, loss), fd_tol, fd_tol);
  // Accumulating adds this batch's sums to what dtable held.
  cpu::scale_table_grad(x, dy, dtable, rows, cols, true);
  for (auto& v : want_dtable) v *= 2;
  REQUIRE_CLOSE(dtable, want_dtable, 1e-5, 1e-6);
}
