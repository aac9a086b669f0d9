// CPU kernels: matmul, elementwise, losses, embedding, optimizers, and the no-allocation contract.
// Forward kernels are checked against double-precision loops written here; backward kernels
// against those references AND against central differences of the float forward kernel.
//
// Tolerances: `REQUIRE_CLOSE(got, want, rtol, atol)` passes when every |got - want| <=
// atol + rtol·|want|. Forward vs double reference: rtol 1e-5 and a small atol (1e-6·√k for a
// matmul of inner size k: float rounding of a sum grows like its square root). Finite
// differences use h = 1e-2 on inputs in [-1, 1]: truncation O(h²) plus float rounding of the
// forward / 2h gives ~1e-4, so rtol 2e-3, atol 2e-3 (observed worst: under 0.1 of that).

#include "kernels_testing.hpp"

#include <concerto/runtime/cpu/kernels.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <numbers>
#include <new>
#include <tuple>

namespace cpu = concerto::runtime::cpu;
using namespace kernels_testing;
using Catch::Matchers::ContainsSubstring;

// ---- allocation counter for the "kernels allocate nothing" test -----------------------------
// Test-only global state: every C++ allocation in this executable passes through here.
namespace {
std::size_t allocations = 0;
}
void* operator new(std::size_t n) {
  ++allocations;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
// GCC pairs the inlined malloc/free against new/delete expressions and warns; they do match.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

namespace {

constexpr double fd_tol = 2e-3;

// ---- references in double --------------------------------------------------------------------
std::vector<double> ref_matmul(const std::vector<float>& a, const std::vector<float>& b, std::size_t m,
                               std::size_t n, std::size_t k, bool ta, bool tb, double alpha) {
  std::vector<double> c(m * n, 0.0);
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      double s = 0.0;
      for (std::size_t p = 0; p < k; ++p) {
        const double av = ta ? a[p * m + i] : a[i * k + p];
        const double bv = tb ? b[j * k + p] : b[p * n + j];
        s += av * bv;
      }
      c[i * n + j] = alpha * s;
    }
  return c;
}

double ref_gelu(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
}

} // namespace

TEST_CASE("matmul matches a double-precision product for every transpose combination", "[cpu][kernels][matmul]") {
  cpu::init_blas_threads(1);
  const auto [m, n, k] = GENERATE(std::tuple{1u, 1u, 1u}, std::tuple{3u, 5u, 7u}, std::tuple{17u, 31u, 13u},
                                  std::tuple{64u, 48u, 80u});
  const bool ta = GENERATE(false, true);
  const bool tb = GENERATE(false, true);
  CAPTURE(m, n, k, ta, tb);
  std::mt19937 rng(m * 1000 + n * 10 + k);
  const auto a = random_floats(rng, m * k);
  const auto b = random_floats(rng, k * n);
  const double tol = 1e-6 * std::sqrt(static_cast<double>(k)) + 1e-6;

  SECTION("overwriting C, with alpha") {
    std::vector<float> c(m * n, 123.0f);
    cpu::matmul(a, b, c, m, n, k, {.trans_a = ta, .trans_b = tb, .alpha = -0.5f});
    REQUIRE_CLOSE(c, ref_matmul(a, b, m, n, k, ta, tb, -0.5), 1e-5, tol);
  }
  SECTION("accumulating into C (beta = 1)") {
    auto c = random_floats(rng, m * n);
    auto want = ref_matmul(a, b, m, n, k, ta, tb, 1.0);
    for (std::size_t i = 0; i < c.size(); ++i) want[i] += c[i];
    cpu::matmul(a, b, c, m, n, k, {.trans_a = ta, .trans_b = tb, .accumulate = true});
    REQUIRE_CLOSE(c, want, 1e-5, tol);
  }
}

TEST_CASE("batched matmul multiplies each batch entry independently", "[cpu][kernels][matmul]") {
  std::mt19937 rng(7);
  const std::size_t batch = 3, m = 5, n = 4, k = 6;
  const bool ta = GENERATE(false, true);
  const bool tb = GENERATE(false, true);
  const auto a = random_floats(rng, batch * m * k);
  const auto b = random_floats(rng, batch * k * n);
  std::vector<float> c(batch * m * n);
  cpu::matmul_batched(a, b, c, batch, m, n, k, {.trans_a = ta, .trans_b = tb});
  for (std::size_t i = 0; i < batch; ++i) {
    const std::vector<float> ai(a.begin() + i * m * k, a.begin() + (i + 1) * m * k);
    const std::vector<float> bi(b.begin() + i * k * n, b.begin() + (i + 1) * k * n);
    CAPTURE(i);
    REQUIRE_CLOSE(std::span<const float>(c).subspan(i * m * n, m * n), ref_matmul(ai, bi, m, n, k, ta, tb, 1.0),
                  1e-5, 1e-5);
  }
}

TEST_CASE("a matmul with an empty inner dimension gives zeros or leaves C", "[cpu][kernels][matmul]") {
  std::vector<float> a, b;
  std::vector<float> c(6, 5.0f);
  cpu::matmul(a, b, c, 2, 3, 0, {.accumulate = true});
  CHECK(c == std::vector<float>(6, 5.0f));
  cpu::matmul(a, b, c, 2, 3, 0);
  CHECK(c == std::vector<float>(6, 0.0f));
}

TEST_CASE("matmul_grad is the gradient of matmul", "[cpu][kernels][matmul][grad]") {
  const bool ta = GENERATE(false, true);
  const bool tb = GENERATE(false, true);
  CAPTURE(ta, tb);
  std::mt19937 rng(11);
  const std::size_t m = 3, n = 4, k = 5;
  const cpu::matmul_options fwd{.trans_a = ta, .trans_b = tb, .alpha = 0.7f};
  auto a = random_floats(rng, m * k);
  auto b = random_floats(rng, k * n);
  const auto w = random_floats(rng, m * n);
  std::vector<float> c(m * n);
  auto loss = [&] {
    cpu::matmul(a, b, c, m, n, k, fwd);
    return project(w, c);
  };
  std::vector<float> da(m * k), db(k * n);
  cpu::matmul_grad(a, b, w, da, db, m, n, k, fwd);
  REQUIRE(max_abs(da) > 0.1);
  REQUIRE(max_abs(db) > 0.1);

  SECTION("against finite differences") {
    REQUIRE_CLOSE(da, central_difference(a, loss), fd_tol, fd_tol);
    REQUIRE_CLOSE(db, central_difference(b, loss), fd_tol, fd_tol);
  }
  SECTION("against the double product dC·Bᵀ, Aᵀ·dC written out") {
    // dA(i,p) = alpha Σ_j dC(i,j) B̄(p,j), stored as A is.
    std::vector<double> want_a(m * k), want_b(k * n);
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t p = 0; p < k; ++p)
        for (std::size_t j = 0; j < n; ++j) {
          const double bv = tb ? b[j * k + p] : b[p * n + j];
          const double av = ta ? a[p * m + i] : a[i * k + p];
          want_a[ta ? p * m + i : i * k + p] += 0.7 * w[i * n + j] * bv;
          want_b[tb ? j * k + p : p * n + j] += 0.7 * w[i * n + j] * av;
        }
    REQUIRE_CLOSE(da, want_a, 1e-5, 1e-6);
    REQUIRE_CLOSE(db, want_b, 1e-5, 1e-6);
  }
  SECTION("accumulating adds to what the gradients held, and an empty span is skipped") {
    auto da2 = random_floats(rng, m * k);
    auto want = to_double(da2);
    for (std::size_t i = 0; i < want.size(); ++i) want[i] += da[i];
    cpu::matmul_grad(a, b, w, da2, {}, m, n, k, fwd, /*accumulate=*/true);
    REQUIRE_CLOSE(da2, want, 1e-6, 1e-6);
  }
}

TEST_CASE("matmul_batched_grad is the gradient of matmul_batched", "[cpu][kernels][matmul][grad]") {
  const bool ta = GENERATE(false, true);
  const bool tb = GENERATE(false, true);
  std::mt19937 rng(13);
  const std::size_t batch = 2, m = 2, n = 3, k = 4;
  const cpu::matmul_options fwd{.trans_a = ta, .trans_b = tb};
  auto a = random_floats(rng, batch * m * k);
  auto b = random_floats(rng, batch * k * n);
  const auto w = random_floats(rng, batch * m * n);
  std::vector<float> c(batch * m * n);
  auto loss = [&] {
    cpu::matmul_batched(a, b, c, batch, m, n, k, fwd);
    return project(w, c);
  };
  std::vector<float> da(a.size()), db(b.size());
  cpu::matmul_batched_grad(a, b, w, da, db, batch, m, n, k, fwd);
  REQUIRE(max_abs(da) > 0.1);
  REQUIRE_CLOSE(da, central_difference(a, loss), fd_tol, fd_tol);
  REQUIRE_CLOSE(db, central_difference(b, loss), fd_tol, fd_tol);
}

TEST_CASE("elementwise kernels match their definitions", "[cpu][kernels][elementwise]") {
  const std::size_t n = GENERATE(1u, 7u, 1000u, 1023u);
  CAPTURE(n);
  std::mt19937 rng(n);
  const auto a = random_floats(rng, n, -4.0f, 4.0f);
  const auto b = random_floats(rng, n, -4.0f, 4.0f);
  std::vector<float> out(n);
  std::vector<double> want(n);

  SECTION("add") {
    cpu::add(a, b, out);
    for (std::size_t i = 0; i < n; ++i) want[i] = double(a[i]) + b[i];
    REQUIRE_CLOSE(out, want, 1e-7, 0.0);
  }
  SECTION("add_inplace accumulates") {
    out = a;
    cpu::add_inplace(out, b);
    cpu::add_inplace(out, b);
    for (std::size_t i = 0; i < n; ++i) want[i] = double(a[i]) + 2.0 * b[i];
    REQUIRE_CLOSE(out, want, 1e-6, 1e-6);
  }
  SECTION("scale, in place") {
    out = a;
    cpu::scale(out, -1.5f, out);
    for (std::size_t i = 0; i < n; ++i) want[i] = -1.5 * a[i];
    REQUIRE_CLOSE(out, want, 1e-7, 0.0);
  }
  SECTION("gelu, tanh approximation") {
    cpu::gelu(a, out);
    for (std::size_t i = 0; i < n; ++i) want[i] = ref_gelu(a[i]);
    REQUIRE_CLOSE(out, want, 1e-5, 1e-6);
  }
  SECTION("relu") {
    cpu::relu(a, out);
    for (std::size_t i = 0; i < n; ++i) want[i] = a[i] > 0 ? a[i] : 0.0;
    REQUIRE_CLOSE(out, want, 0.0, 0.0 + 1e-300);
  }
  SECTION("relu_grad passes dout where x > 0 only") {
    cpu::relu_grad(a, b, out);
    for (std::size_t i = 0; i < n; ++i) want[i] = a[i] > 0 ? b[i] : 0.0;
    REQUIRE_CLOSE(out, want, 0.0, 1e-300);
  }
}

TEST_CASE("gelu values known by hand", "[cpu][kernels][elementwise]") {
  const std::vector<float> x{0.0f, 1.0f, -1.0f};
  std::vector<float> y(3), dy(3);
  cpu::gelu(x, y);
  CHECK(y[0] == 0.0f);
  // 0.5·(1 + tanh(0.7978845608·1.044715)) = 0.841192 (and gelu(-1) = -1 + gelu(1))
  CHECK(std::abs(y[1] - 0.8411920f) < 1e-6f);
  CHECK(std::abs(y[2] + 0.1588080f) < 1e-6f);
  cpu::gelu_grad(x, std::vector<float>(3, 1.0f), dy);
  CHECK(dy[0] == 0.5f);
}

TEST_CASE("gelu_grad and relu_grad are the gradients of gelu and relu", "[cpu][kernels][elementwise][grad]") {
  std::mt19937 rng(17);
  const std::size_t n = 41;
  auto x = random_floats(rng, n, -3.0f, 3.0f);
  // Keep relu's inputs off the kink, where a finite difference straddles it.
  for (auto& v : x)
    if (std::abs(v) < 0.05f) v = 0.5f;
  const auto w = random_floats(rng, n);
  std::vector<float> y(n), dx(n);

  SECTION("gelu") {
    auto loss = [&] {
      cpu::gelu(x, y);
      return project(w, y);
    };
    cpu::gelu_grad(x, w, dx);
    REQUIRE(max_abs(dx) > 0.1);
    REQUIRE_CLOSE(dx, central_difference(x, loss), fd_tol, fd_tol);
  }
  SECTION("relu") {
    auto loss = [&] {
      cpu::relu(x, y);
      return project(w, y);
    };
    cpu::relu_grad(x, w, dx);
    REQUIRE(max_abs(dx) > 0.1);
    REQUIRE_CLOSE(dx, central_difference(x, loss), fd_tol, fd_tol);
  }
}

TEST_CASE("bias_add adds a row vector and bias_add_grad sums columns", "[cpu][kernels][elementwise][grad]") {
  const auto [rows, cols] = GENERATE(std::tuple{1u, 1u}, std::tuple{5u, 3u}, std::tuple{33u, 65u});
  CAPTURE(rows, cols);
  std::mt19937 rng(rows * 100 + cols);
  const auto x = random_floats(rng, rows * cols);
  auto bias = random_floats(rng, cols);
  const auto w = random_floats(rng, rows * cols);

  std::vector<float> y = x;
  cpu::bias_add(y, bias, y, rows, cols); // in place
  std::vector<double> want(rows * cols);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) want[r * cols + c] = double(x[r * cols + c]) + bias[c];
  REQUIRE_CLOSE(y, want, 1e-7, 0.0);

  std::vector<float> db(cols, 9.0f);
  cpu::bias_add_grad(w, db, rows, cols);
  std::vector<double> sums(cols, 0.0);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) sums[c] += w[r * cols + c];
  REQUIRE_CLOSE(db, sums, 1e-5, 1e-5);

  std::vector<float> out(rows * cols);
  auto loss = [&] {
    cpu::bias_add(x, bias, out, rows, cols);
    return project(w, out);
  };
  REQUIRE_CLOSE(db, central_difference(bias, loss), fd_tol, fd_tol);

  cpu::bias_add_grad(w, db, rows, cols, /*accumulate=*/true);
  for (auto& s : sums) s *= 2.0;
  REQUIRE_CLOSE(db, sums, 1e-5, 1e-5);
}

TEST_CASE("cross-entropy matches its definition and its gradient", "[cpu][kernels][loss]") {
  SECTION("uniform logits cost log(classes) whatever the target") {
    const std::vector<float> logits(3 * 10, 0.25f);
    const std::vector<std::int32_t> t{0, 9, 4};
    std::vector<float> lse(3);
    CHECK(std::abs(cpu::cross_entropy(logits, t, lse, 3, 10) - std::log(10.0f)) < 1e-6f);
  }
  SECTION("against a double reference on odd shapes, large logits included") {
    const auto [rows, classes] = GENERATE(std::tuple{1u, 2u}, std::tuple{7u, 13u}, std::tuple{64u, 257u});
    CAPTURE(rows, classes);
    std::mt19937 rng(rows + classes);
    const auto logits = random_floats(rng, rows * classes, 90.0f, 110.0f); // exp would overflow unshifted
    std::vector<std::int32_t> t(rows);
    for (auto& v : t) v = static_cast<std::int32_t>(rng() % classes);
    std::vector<float> lse(rows);
    const float loss = cpu::cross_entropy(logits, t, lse, rows, classes);
    double want = 0.0;
    std::vector<double> want_lse(rows);
    for (std::size_t r = 0; r < rows; ++r) {
      double m = -1e300, s = 0.0;
      for (std::size_t c = 0; c < classes; ++c) m = std::max(m, double(logits[r * classes + c]));
      for (std::size_t c = 0; c < classes; ++c) s += std::exp(logits[r * classes + c] - m);
      want_lse[r] = m + std::log(s);
      want += (want_lse[r] - logits[r * classes + t[r]]) / rows;
    }
    CHECK(std::abs(loss - want) < 1e-5 * (1.0 + want));
    REQUIRE_CLOSE(lse, want_lse, 1e-6, 1e-6);

    std::vector<float> dl(rows * classes);
    cpu::cross_entropy_grad(logits, t, lse, dl, rows, classes);
    for (std::size_t r = 0; r < rows; ++r) {
      double s = 0.0;
      for (std::size_t c = 0; c < classes; ++c) s += dl[r * classes + c];
      // softmax sums to one, the one-hot too; lse ≈ 100 in float is good to ~4e-6 relative
      CHECK(std::abs(s) < 2e-5);
    }
  }
  SECTION("cross_entropy_grad against finite differences, with an upstream gradient") {
    std::mt19937 rng(23);
    const std::size_t rows = 4, classes = 5;
    auto logits = random_floats(rng, rows * classes, -2.0f, 2.0f);
    const std::vector<std::int32_t> t{1, 4, 0, 1};
    std::vector<float> lse(rows), dl(rows * classes);
    auto loss = [&] { return 0.5 * cpu::cross_entropy(logits, t, lse, rows, classes); };
    loss();
    cpu::cross_entropy_grad(logits, t, lse, dl, rows, classes, 0.5f);
    REQUIRE(max_abs(dl) > 0.05);
    REQUIRE_CLOSE(dl, central_difference(logits, loss), fd_tol, 2e-4);
  }
  SECTION("a target outside the classes is refused, naming the row") {
    const std::vector<float> logits(2 * 3, 0.0f);
    std::vector<float> lse(2);
    REQUIRE_THROWS_WITH(cpu::cross_entropy(logits, std::vector<std::int32_t>{0, 3}, lse, 2, 3),
                        ContainsSubstring("target of row 1 is 3"));
  }
}

TEST_CASE("mse and mse_grad", "[cpu][kernels][loss]") {
  SECTION("hand-computed") {
    const std::vector<float> p{1.0f, 2.0f, 4.0f}, t{1.0f, 0.0f, 1.0f};
    CHECK(cpu::mse(p, t) == (0.0f + 4.0f + 9.0f) / 3.0f);
    std::vector<float> d(3);
    cpu::mse_grad(p, t, d);
    CHECK(d == std::vector<float>{0.0f, 4.0f / 3.0f, 2.0f});
  }
  SECTION("against finite differences") {
    std::mt19937 rng(29);
    auto p = random_floats(rng, 37);
    const auto t = random_floats(rng, 37);
    std::vector<float> d(37);
    cpu::mse_grad(p, t, d, 3.0f);
    REQUIRE(max_abs(d) > 0.01);
    REQUIRE_CLOSE(d, central_difference(p, [&] { return 3.0 * cpu::mse(p, t); }), fd_tol, 1e-4);
  }
}

TEST_CASE("embedding looks rows up and its gradient scatter-adds them", "[cpu][kernels][embedding]") {
  std::mt19937 rng(31);
  const std::size_t vocab = 11, dim = 5;
  auto table = random_floats(rng, vocab * dim);
  const std::vector<std::int32_t> ids{3, 0, 10, 3, 7, 3}; // 3 repeats: its gradient rows add up
  const auto w = random_floats(rng, ids.size() * dim);
  std::vector<float> out(ids.size() * dim);

  SECTION("forward copies the rows") {
    cpu::embedding(ids, table, out, dim);
    for (std::size_t i = 0; i < ids.size(); ++i)
      for (std::size_t c = 0; c < dim; ++c) REQUIRE(out[i * dim + c] == table[ids[i] * dim + c]);
  }
  SECTION("backward against finite differences and by hand") {
    std::vector<float> dtable(vocab * dim, 42.0f);
    cpu::embedding_grad(ids, w, dtable, dim);
    auto loss = [&] {
      cpu::embedding(ids, table, out, dim);
      return project(w, out);
    };
    REQUIRE_CLOSE(dtable, central_difference(table, loss), fd_tol, fd_tol);
    for (std::size_t c = 0; c < dim; ++c) {
      CHECK(std::abs(dtable[3 * dim + c] - (w[0 * dim + c] + w[3 * dim + c] + w[5 * dim + c])) < 1e-6f);
      CHECK(dtable[1 * dim + c] == 0.0f);
    }
  }
  SECTION("two vocabulary shards add up to the whole lookup and gradient") {
    const std::size_t split = 4;
    std::vector<float> lo(out.size()), hi(out.size());
    const auto policy = cpu::id_outside_table::zero_row;
    const std::span<const float> t(table);
    cpu::embedding(ids, t.first(split * dim), lo, dim, 0, policy);
    cpu::embedding(ids, t.subspan(split * dim), hi, dim, split, policy);
    cpu::embedding(ids, table, out, dim);
    for (std::size_t i = 0; i < out.size(); ++i) REQUIRE(lo[i] + hi[i] == out[i]);

    std::vector<float> whole(vocab * dim), shards(vocab * dim);
    cpu::embedding_grad(ids, w, whole, dim);
    cpu::embedding_grad(ids, w, std::span(shards).first(split * dim), dim, false, 0, policy);
    cpu::embedding_grad(ids, w, std::span(shards).subspan(split * dim), dim, false, split, policy);
    CHECK(shards == whole);
  }
  SECTION("an id outside an unsharded table is refused, naming it") {
    const std::vector<std::int32_t> bad{1, 11};
    std::vector<float> o(2 * dim);
    REQUIRE_THROWS_WITH(cpu::embedding(bad, table, o, dim), ContainsSubstring("id 11 at position 1"));
    REQUIRE_THROWS_WITH(cpu::embedding_grad(bad, o, table, dim), ContainsSubstring("id 11 at position 1"));
  }
}

namespace {
struct ref_adamw {
  std::vector<double> p, m, v;
  void step(const std::vector<float>& g, const cpu::adamw_config& c, int t) {
    for (std::size_t i = 0; i < p.size(); ++i) {
      p[i] *= 1.0 - double(c.lr) * c.weight_decay;
      m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * g[i];
      v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * double(g[i]) * g[i];
      const double mh = m[i] / (1.0 - std::pow(double(c.beta1), t));
      const double vh = v[i] / (1.0 - std::pow(double(c.beta2), t));
      p[i] -= c.lr * mh / (std::sqrt(vh) + c.eps);
    }
  }
};
} // namespace

TEST_CASE("optimizer updates follow the PyTorch definitions", "[cpu][kernels][optimizer]") {
  std::mt19937 rng(37);
  const std::size_t n = 101;
  const auto p0 = random_floats(rng, n);

  SECTION("sgd with momentum and weight decay over three steps") {
    const cpu::sgd_config cfg{.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.01f};
    auto p = p0;
    std::vector<float> buf(n, 0.0f);
    std::vector<double> rp = to_double(p0), rb(n, 0.0);
    for (int t = 0; t < 3; ++t) {
      const auto g = random_floats(rng, n);
      cpu::sgd_update(p, g, buf, cfg);
      for (std::size_t i = 0; i < n; ++i) {
        rb[i] = 0.9 * rb[i] + (g[i] + 0.01 * rp[i]);
        rp[i] -= 0.1 * rb[i];
      }
    }
    REQUIRE_CLOSE(p, rp, 1e-5, 1e-6);
    REQUIRE_CLOSE(buf, rb, 1e-5, 1e-6);
  }
  SECTION("plain sgd needs no buffer: p -= lr·g") {
    auto p = p0;
    const auto g = random_floats(rng, n);
    cpu::sgd_update(p, g, {}, {.lr = 0.5f});
    std::vector<double> want(n);
    for (std::size_t i = 0; i < n; ++i) want[i] = double(p0[i]) - 0.5 * g[i];
    REQUIRE_CLOSE(p, want, 1e-6, 1e-7);
  }
  SECTION("adamw's first step moves each weight by lr against the gradient's sign") {
    const cpu::adamw_config cfg{.lr = 0.01f, .weight_decay = 0.1f};
    auto p = p0;
    std::vector<float> m(n, 0.0f), v(n, 0.0f);
    const auto g = random_floats(rng, n);
    cpu::adamw_update(p, g, m, v, cfg, 1);
    std::vector<double> want(n);
    for (std::size_t i = 0; i < n; ++i)
      want[i] = p0[i] * (1.0 - 0.01 * 0.1) - 0.01 * g[i] / (std::abs(double(g[i])) + 1e-8);
    REQUIRE_CLOSE(p, want, 1e-5, 1e-6);
  }
  SECTION("adamw over five steps against a double reference") {
    const cpu::adamw_config cfg{.lr = 0.003f, .beta1 = 0.8f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.05f};
    auto p = p0;
    std::vector<float> m(n, 0.0f), v(n, 0.0f);
    ref_adamw r{to_double(p0), std::vector<double>(n), std::vector<double>(n)};
    for (int t = 1; t <= 5; ++t) {
      const auto g = random_floats(rng, n);
      cpu::adamw_update(p, g, m, v, cfg, t);
      r.step(g, cfg, t);
    }
    REQUIRE_CLOSE(p, r.p, 1e-5, 1e-6);
    REQUIRE_CLOSE(m, r.m, 1e-5, 1e-6);
    REQUIRE_CLOSE(v, r.v, 1e-5, 1e-7);
  }
  SECTION("updating two shards separately equals updating the whole range") {
    const auto g = random_floats(rng, n);
    auto whole = p0, shards = p0;
    std::vector<float> m1(n, 0.0f), v1(n, 0.0f), m2(n, 0.0f), v2(n, 0.0f);
    cpu::adamw_update(whole, g, m1, v1, {}, 3);
    const std::size_t cut = 40;
    const std::span<const float> gs(g);
    cpu::adamw_update(std::span(shards).first(cut), gs.first(cut), std::span(m2).first(cut),
                      std::span(v2).first(cut), {}, 3);
    cpu::adamw_update(std::span(shards).subspan(cut), gs.subspan(cut), std::span(m2).subspan(cut),
                      std::span(v2).subspan(cut), {}, 3);
    CHECK(shards == whole);
    CHECK(shards != p0);
  }
  SECTION("adamw refuses step 0, sgd a missing momentum buffer") {
    std::vector<float> p(n), g(n), m(n), v(n);
    REQUIRE_THROWS_WITH(cpu::adamw_update(p, g, m, v, {}, 0), ContainsSubstring("step counts from 1"));
    REQUIRE_THROWS_WITH(cpu::sgd_update(p, g, {}, {.momentum = 0.9f}), ContainsSubstring("momentum_buf"));
  }
}

TEST_CASE("a size mismatch is refused, naming the kernel and the argument", "[cpu][kernels][errors]") {
  std::vector<float> a(6), b(9), c(5);
  REQUIRE_THROWS_WITH(cpu::matmul(a, b, c, 2, 3, 3), ContainsSubstring("matmul: `c` holds 5"));
  REQUIRE_THROWS_WITH(cpu::add(a, a, c), ContainsSubstring("add: `out`"));
  REQUIRE_THROWS_WITH(cpu::init_blas_threads(0), ContainsSubstring("at least 1"));
}

TEST_CASE("the kernels allocate nothing once their buffers exist", "[cpu][kernels][alloc]") {
  std::mt19937 rng(41);
  const std::size_t rows = 8, cols = 12, n = rows * cols;
  const cpu::attention_shape s{.batch = 2, .seq = 4, .heads = 3, .head_dim = 2};
  auto x = random_floats(rng, n), y = random_floats(rng, n), z(x), g = random_floats(rng, n);
  std::vector<float> vec(cols, 1.0f), vec2(cols), stats(rows), stats2(rows);
  std::vector<std::int32_t> t(rows, 1);
  auto q = random_floats(rng, s.q_floats()), k = q, v = q, o = q, dq = q, dk = q, dv = q;
  std::vector<float> lse(s.lse_floats()), ws(cpu::causal_attention_grad_workspace_floats(s));
  std::vector<float> m(n), vv(n), dw(n);
  cpu::init_blas_threads(1);

  const std::size_t before = allocations;
  cpu::matmul(x, y, std::span(z).first(rows * rows), rows, rows, cols, {.trans_b = true});
  cpu::matmul_grad(x, y, std::span(g).first(rows * rows), z, dw, rows, rows, cols, {.trans_b = true}, true);
  cpu::add(x, y, z);
  cpu::add_inplace(z, x);
  cpu::scale(z, 2.0f, z);
  cpu::bias_add(x, vec, z, rows, cols);
  cpu::bias_add_grad(g, vec2, rows, cols);
  cpu::gelu(x, z);
  cpu::gelu_grad(x, g, z);
  cpu::relu(x, z);
  cpu::relu_grad(x, g, z);
  cpu::layernorm(x, vec, vec2, z, stats, stats2, rows, cols);
  cpu::layernorm_grad(g, x, vec, stats, stats2, y, vec2, vec2, rows, cols);
  cpu::softmax(x, z, rows, cols);
  cpu::softmax_grad(z, g, y, rows, cols);
  cpu::causal_attention(q, k, v, o, lse, ws, s);
  cpu::causal_attention_grad(q, k, v, o, lse, dq, dk, dv, ws, s);
  cpu::cross_entropy(x, t, stats, rows, cols);
  cpu::cross_entropy_grad(x, t, stats, z, rows, cols);
  cpu::mse(x, y);
  cpu::mse_grad(x, y, z);
  cpu::embedding(t, x, std::span(z).first(rows * cols), cols);
  cpu::embedding_grad(t, std::span(z).first(rows * cols), y, cols);
  cpu::sgd_update(x, g, m, {.momentum = 0.9f});
  cpu::adamw_update(x, g, m, vv, {}, 1);
  const std::size_t after = allocations;
  auto probe = std::make_unique<std::vector<float>>(rows); // the counter does see allocations
  const std::size_t after_probe = allocations;
  CHECK(after == before);
  CHECK(after_probe == after + 2);
  CHECK(probe->size() == rows);
}
