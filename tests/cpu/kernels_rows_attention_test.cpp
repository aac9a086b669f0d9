// CPU kernels that work row by row (layernorm, softmax) and causal attention, forward and
// backward, against double-precision references written here and against central differences
// of the float forward kernels.
//
// Tolerances: REQUIRE_CLOSE(got, want, rtol, atol) passes when |got - want| <= atol + rtol·|want|.
// Forward vs double reference: 1e-5 relative plus a small absolute term (float rounding of sums
// of ≤ a few hundred terms). Finite differences: h = 1e-2, rtol = atol = 2e-3 (truncation O(h²)
// and float rounding / 2h are ~1e-4 on these inputs); sampled differences on larger shapes
// use the same bound.

#include "kernels_testing.hpp"

#include <concerto/runtime/cpu/attention.hpp>
#include <concerto/runtime/cpu/normalization.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <tuple>

namespace cpu = concerto::runtime::cpu;
using namespace kernels_testing;
using Catch::Matchers::ContainsSubstring;

namespace {

constexpr double fd_tol = 2e-3;

struct ref_layernorm {
  std::vector<double> out, mean, rstd;
};

ref_layernorm layernorm_ref(const std::vector<float>& x, const std::vector<float>& gamma,
                            const std::vector<float>& beta, std::size_t rows, std::size_t cols, double eps) {
  ref_layernorm r{std::vector<double>(rows * cols), std::vector<double>(rows), std::vector<double>(rows)};
  for (std::size_t i = 0; i < rows; ++i) {
    double mu = 0.0, var = 0.0;
    for (std::size_t c = 0; c < cols; ++c) mu += x[i * cols + c];
    mu /= cols;
    for (std::size_t c = 0; c < cols; ++c) var += (x[i * cols + c] - mu) * (x[i * cols + c] - mu);
    var /= cols;
    const double rs = 1.0 / std::sqrt(var + eps);
    for (std::size_t c = 0; c < cols; ++c) r.out[i * cols + c] = (x[i * cols + c] - mu) * rs * gamma[c] + beta[c];
    r.mean[i] = mu;
    r.rstd[i] = rs;
  }
  return r;
}

std::vector<double> softmax_ref(const std::vector<float>& x, std::size_t rows, std::size_t cols) {
  std::vector<double> y(rows * cols);
  for (std::size_t r = 0; r < rows; ++r) {
    double m = -1e300, s = 0.0;
    for (std::size_t c = 0; c < cols; ++c) m = std::max(m, double(x[r * cols + c]));
    for (std::size_t c = 0; c < cols; ++c) s += y[r * cols + c] = std::exp(x[r * cols + c] - m);
    for (std::size_t c = 0; c < cols; ++c) y[r * cols + c] /= s;
  }
  return y;
}

struct ref_attention {
  std::vector<double> out, lse;
};

ref_attention attention_ref(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                            const cpu::attention_shape& s) {
  const std::size_t T = s.seq, D = s.head_dim, ld = s.heads * D;
  ref_attention r{std::vector<double>(s.q_floats()), std::vector<double>(s.lse_floats())};
  std::vector<double> p(T);
  for (std::size_t b = 0; b < s.batch; ++b)
    for (std::size_t h = 0; h < s.heads; ++h)
      for (std::size_t i = 0; i < T; ++i) {
        double m = -1e300;
        const std::size_t last = s.causal ? i : T - 1;
        for (std::size_t j = 0; j <= last; ++j) {
          double dot = 0.0;
          for (std::size_t d = 0; d < D; ++d) dot += double(q[(b * T + i) * ld + h * D + d]) * k[(b * T + j) * ld + h * D + d];
          p[j] = dot / std::sqrt(double(D));
          m = std::max(m, p[j]);
        }
        double sum = 0.0;
        for (std::size_t j = 0; j <= last; ++j) sum += p[j] = std::exp(p[j] - m);
        r.lse[(b * s.heads + h) * T + i] = m + std::log(sum);
        for (std::size_t d = 0; d < D; ++d) {
          double o = 0.0;
          for (std::size_t j = 0; j <= last; ++j) o += p[j] / sum * v[(b * T + j) * ld + h * D + d];
          r.out[(b * T + i) * ld + h * D + d] = o;
        }
      }
  return r;
}

} // namespace

TEST_CASE("layernorm matches a double reference and saves mean and rstd", "[cpu][kernels][layernorm]") {
  const auto [rows, cols] = GENERATE(std::tuple{1u, 1u}, std::tuple{3u, 7u}, std::tuple{16u, 64u}, std::tuple{5u, 129u});
  CAPTURE(rows, cols);
  std::mt19937 rng(rows * 1000 + cols);
  const auto x = random_floats(rng, rows * cols, -2.0f, 3.0f);
  const auto gamma = random_floats(rng, cols, 0.5f, 1.5f);
  const auto beta = random_floats(rng, cols);
  std::vector<float> out(rows * cols), mean(rows), rstd(rows);
  cpu::layernorm(x, gamma, beta, out, mean, rstd, rows, cols, 1e-5f);
  const auto want = layernorm_ref(x, gamma, beta, rows, cols, 1e-5);
  REQUIRE_CLOSE(out, want.out, 1e-5, 1e-5);
  REQUIRE_CLOSE(mean, want.mean, 1e-5, 1e-6);
  REQUIRE_CLOSE(rstd, want.rstd, 1e-5, 1e-6);
}

TEST_CASE("layernorm with unit gamma and zero beta gives rows of mean 0 and variance 1", "[cpu][kernels][layernorm]") {
  std::mt19937 rng(3);
  const std::size_t rows = 6, cols = 50;
  const auto x = random_floats(rng, rows * cols, 5.0f, 9.0f); // offset mean, so centring matters
  std::vector<float> out(rows * cols), mean(rows), rstd(rows);
  cpu::layernorm(x, std::vector<float>(cols, 1.0f), std::vector<float>(cols, 0.0f), out, mean, rstd, rows, cols, 0.0f);
  for (std::size_t r = 0; r < rows; ++r) {
    double mu = 0.0, var = 0.0;
    for (std::size_t c = 0; c < cols; ++c) mu += out[r * cols + c];
    mu /= cols;
    for (std::size_t c = 0; c < cols; ++c) var += (out[r * cols + c] - mu) * (out[r * cols + c] - mu);
    CHECK(std::abs(mu) < 1e-5);
    CHECK(std::abs(var / cols - 1.0) < 1e-4);
  }
}

TEST_CASE("layernorm_grad is the gradient of layernorm", "[cpu][kernels][layernorm][grad]") {
  const auto [rows, cols] = GENERATE(std::tuple{4u, 6u}, std::tuple{3u, 17u});
  CAPTURE(rows, cols);
  std::mt19937 rng(rows * 100 + cols);
  auto x = random_floats(rng, rows * cols);
  auto gamma = random_floats(rng, cols, 0.5f, 1.5f);
  auto beta = random_floats(rng, cols);
  const auto w = random_floats(rng, rows * cols);
  std::vector<float> out(rows * cols), mean(rows), rstd(rows);
  auto loss = [&] {
    cpu::layernorm(x, gamma, beta, out, mean, rstd, rows, cols);
    return project(w, out);
  };
  loss();
  std::vector<float> dx(rows * cols), dgamma(cols, 7.0f), dbeta(cols, 7.0f);
  cpu::layernorm_grad(w, x, gamma, mean, rstd, dx, dgamma, dbeta, rows, cols);
  REQUIRE(max_abs(dx) > 0.1);
  std::vector<float> dx_alone(rows * cols);
  cpu::layernorm_grad(w, x, gamma, mean, rstd, dx_alone, {}, {}, rows, cols); // dx without the parameter sums
  CHECK(dx_alone == dx);

  SECTION("against finite differences in x, gamma and beta") {
    const auto fd_x = central_difference(x, loss);
    const auto fd_gamma = central_difference(gamma, loss);
    const auto fd_beta = central_difference(beta, loss);
    REQUIRE_CLOSE(dx, fd_x, fd_tol, fd_tol);
    REQUIRE_CLOSE(dgamma, fd_gamma, fd_tol, fd_tol);
    REQUIRE_CLOSE(dbeta, fd_beta, fd_tol, fd_tol);
  }
  SECTION("a gradient that is uniform along a row leaves dx at zero (normalisation removes shifts)") {
    std::vector<float> ones(rows * cols, 1.0f), g1(cols, 1.0f);
    cpu::layernorm_grad(ones, x, g1, mean, rstd, dx, dgamma, dbeta, rows, cols);
    REQUIRE(max_abs(dx) < 1e-5);
  }
  SECTION("accumulating adds the parameter gradients to what they held") {
    auto dg2 = dgamma, db2 = dbeta;
    cpu::layernorm_grad(w, x, gamma, mean, rstd, dx, dg2, db2, rows, cols, /*accumulate=*/true);
    std::vector<double> twice_g(cols), twice_b(cols);
    for (std::size_t c = 0; c < cols; ++c) {
      twice_g[c] = 2.0 * dgamma[c];
      twice_b[c] = 2.0 * dbeta[c];
    }
    REQUIRE_CLOSE(dg2, twice_g, 1e-6, 1e-6);
    REQUIRE_CLOSE(db2, twice_b, 1e-6, 1e-6);
  }
}

TEST_CASE("layernorm_grad on a larger shape, sampled finite differences", "[cpu][kernels][layernorm][grad]") {
  std::mt19937 rng(5);
  const std::size_t rows = 16, cols = 96;
  auto x = random_floats(rng, rows * cols, -2.0f, 2.0f);
  const auto gamma = random_floats(rng, cols, 0.5f, 1.5f);
  const auto beta = random_floats(rng, cols);
  const auto w = random_floats(rng, rows * cols);
  std::vector<float> out(rows * cols), mean(rows), rstd(rows), dx(rows * cols), dg(cols), db(cols);
  auto loss = [&] {
    cpu::layernorm(x, gamma, beta, out, mean, rstd, rows, cols);
    return project(w, out);
  };
  loss();
  cpu::layernorm_grad(w, x, gamma, mean, rstd, dx, dg, db, rows, cols);
  std::vector<float> got;
  std::vector<double> want;
  for (int s = 0; s < 40; ++s) {
    const std::size_t i = rng() % x.size();
    got.push_back(dx[i]);
    want.push_back(central_difference_at(x, i, loss));
  }
  REQUIRE_CLOSE(got, want, fd_tol, fd_tol);
}

TEST_CASE("softmax is a stable row-wise softmax", "[cpu][kernels][softmax]") {
  const auto [rows, cols] = GENERATE(std::tuple{1u, 1u}, std::tuple{4u, 9u}, std::tuple{31u, 200u});
  CAPTURE(rows, cols);
  std::mt19937 rng(rows + cols);
  const auto x = random_floats(rng, rows * cols, -5.0f, 5.0f);
  std::vector<float> y(rows * cols);
  cpu::softmax(x, y, rows, cols);
  REQUIRE_CLOSE(y, softmax_ref(x, rows, cols), 1e-5, 1e-7);

  SECTION("rows sum to one") {
    for (std::size_t r = 0; r < rows; ++r) {
      double s = 0.0;
      for (std::size_t c = 0; c < cols; ++c) s += y[r * cols + c];
      CHECK(std::abs(s - 1.0) < 1e-5);
    }
  }
  SECTION("a shift by 1000 changes nothing (no overflow), in place") {
    auto shifted = x;
    for (auto& v : shifted) v += 1000.0f;
    cpu::softmax(shifted, shifted, rows, cols);
    // x + 1000 rounds to a multiple of 2^-14 in float, so the inputs themselves moved by ≤ 3e-5.
    REQUIRE_CLOSE(shifted, to_double(y), 1e-4, 1e-7);
  }
}

TEST_CASE("softmax_grad is the gradient of softmax", "[cpu][kernels][softmax][grad]") {
  std::mt19937 rng(19);
  const std::size_t rows = 3, cols = 7;
  auto x = random_floats(rng, rows * cols, -2.0f, 2.0f);
  const auto w = random_floats(rng, rows * cols);
  std::vector<float> y(rows * cols), dx(rows * cols);
  auto loss = [&] {
    cpu::softmax(x, y, rows, cols);
    return project(w, y);
  };
  loss();
  auto dy = w;
  cpu::softmax_grad(y, dy, dy, rows, cols); // in place over dy
  dx = dy;
  REQUIRE(max_abs(dx) > 0.01);
  REQUIRE_CLOSE(dx, central_difference(x, loss), fd_tol, 2e-4);
  for (std::size_t r = 0; r < rows; ++r) {
    double s = 0.0;
    for (std::size_t c = 0; c < cols; ++c) s += dx[r * cols + c];
    CHECK(std::abs(s) < 1e-6); // a softmax is invariant to shifting its row
  }
}

TEST_CASE("causal attention matches a double reference", "[cpu][kernels][attention]") {
  const auto [batch, seq, heads, head_dim] =
      GENERATE(std::tuple{1u, 1u, 1u, 1u}, std::tuple{2u, 5u, 3u, 4u}, std::tuple{1u, 33u, 2u, 8u},
               std::tuple{3u, 17u, 4u, 7u});
  const cpu::attention_shape s{.batch = batch, .seq = seq, .heads = heads, .head_dim = head_dim};
  CAPTURE(batch, seq, heads, head_dim);
  std::mt19937 rng(batch * 1000 + seq * 10 + head_dim);
  const auto q = random_floats(rng, s.q_floats(), -2.0f, 2.0f);
  const auto k = random_floats(rng, s.q_floats(), -2.0f, 2.0f);
  auto v = random_floats(rng, s.q_floats());
  std::vector<float> out(s.q_floats()), lse(s.lse_floats()), ws(cpu::causal_attention_workspace_floats(s), NAN);
  cpu::causal_attention(q, k, v, out, lse, ws, s);
  const auto want = attention_ref(q, k, v, s);
  REQUIRE_CLOSE(out, want.out, 1e-5, 1e-5);
  REQUIRE_CLOSE(lse, want.lse, 1e-5, 1e-5);

  SECTION("the first position sees only itself: its output is its own value row") {
    for (std::size_t b = 0; b < batch; ++b)
      for (std::size_t c = 0; c < heads * head_dim; ++c)
        REQUIRE(out[b * seq * heads * head_dim + c] == v[b * seq * heads * head_dim + c]);
  }
  SECTION("changing the last position's value moves only the last position's output") {
    const std::size_t row = heads * head_dim;
    for (std::size_t b = 0; b < batch; ++b)
      for (std::size_t c = 0; c < row; ++c) v[(b * seq + seq - 1) * row + c] += 10.0f;
    std::vector<float> out2(out.size());
    cpu::causal_attention(q, k, v, out2, lse, ws, s);
    double earlier = 0.0, last = INFINITY;
    for (std::size_t b = 0; b < batch; ++b)
      for (std::size_t i = 0; i < seq; ++i)
        for (std::size_t c = 0; c < row; ++c) {
          const std::size_t at = (b * seq + i) * row + c;
          const double moved = std::abs(double(out2[at]) - out[at]);
          if (i + 1 < seq) earlier = std::max(earlier, moved);
          else last = std::min(last, moved); // 10 × its own (positive) attention weight
        }
    CHECK(earlier < 1e-6);
    CHECK(last > 1e-3);
  }
}

TEST_CASE("causal_attention_grad is the gradient of causal_attention", "[cpu][kernels][attention][grad]") {
  const cpu::attention_shape s{.batch = 2, .seq = 4, .heads = 2, .head_dim = 3};
  std::mt19937 rng(43);
  auto q = random_floats(rng, s.q_floats());
  auto k = random_floats(rng, s.q_floats());
  auto v = random_floats(rng, s.q_floats());
  const auto w = random_floats(rng, s.q_floats());
  std::vector<float> out(s.q_floats()), lse(s.lse_floats()), ws(cpu::causal_attention_workspace_floats(s));
  auto loss = [&] {
    cpu::causal_attention(q, k, v, out, lse, ws, s);
    return project(w, out);
  };
  loss();
  std::vector<float> dq(s.q_floats()), dk(s.q_floats()), dv(s.q_floats());
  std::vector<float> gws(cpu::causal_attention_grad_workspace_floats(s), NAN); // must not be read
  cpu::causal_attention_grad(q, k, v, w, lse, dq, dk, dv, gws, s);
  REQUIRE(max_abs(dq) > 0.01);
  REQUIRE(max_abs(dk) > 0.01);
  REQUIRE(max_abs(dv) > 0.1);
  REQUIRE_CLOSE(dq, central_difference(q, loss), fd_tol, fd_tol);
  REQUIRE_CLOSE(dk, central_difference(k, loss), fd_tol, fd_tol);
  REQUIRE_CLOSE(dv, central_difference(v, loss), fd_tol, fd_tol);
}

TEST_CASE("causal_attention_grad on a larger odd shape, sampled finite differences", "[cpu][kernels][attention][grad]") {
  const cpu::attention_shape s{.batch = 2, .seq = 19, .heads = 3, .head_dim = 5};
  std::mt19937 rng(47);
  std::vector<float> q = random_floats(rng, s.q_floats()), k = random_floats(rng, s.q_floats()),
                     v = random_floats(rng, s.q_floats());
  const auto w = random_floats(rng, s.q_floats());
  std::vector<float> out(s.q_floats()), lse(s.lse_floats()), ws(cpu::causal_attention_workspace_floats(s));
  auto loss = [&] {
    cpu::causal_attention(q, k, v, out, lse, ws, s);
    return project(w, out);
  };
  loss();
  std::vector<float> dq(s.q_floats()), dk(s.q_floats()), dv(s.q_floats());
  std::vector<float> gws(cpu::causal_attention_grad_workspace_floats(s));
  cpu::causal_attention_grad(q, k, v, w, lse, dq, dk, dv, gws, s);
  for (auto* pair : {&q, &k, &v}) {
    const std::vector<float>& grad = pair == &q ? dq : pair == &k ? dk : dv;
    std::vector<float> got;
    std::vector<double> want;
    for (int i = 0; i < 30; ++i) {
      const std::size_t at = rng() % pair->size();
      got.push_back(grad[at]);
      want.push_back(central_difference_at(*pair, at, loss));
    }
    INFO((pair == &q ? "dq" : pair == &k ? "dk" : "dv"));
    REQUIRE(max_abs(got) > 0.01);
    REQUIRE_CLOSE(got, want, fd_tol, fd_tol);
  }
}

TEST_CASE("attention without the mask sees every position, and its gradient is the finite difference",
          "[cpu][kernels][attention][grad]") {
  const cpu::attention_shape s{.batch = 2, .seq = 5, .heads = 2, .head_dim = 3, .causal = false};
  std::mt19937 rng(47);
  auto q = random_floats(rng, s.q_floats(), -2.0f, 2.0f);
  auto k = random_floats(rng, s.q_floats(), -2.0f, 2.0f);
  auto v = random_floats(rng, s.q_floats());
  std::vector<float> out(s.q_floats()), lse(s.lse_floats()), ws(cpu::causal_attention_workspace_floats(s));
  cpu::causal_attention(q, k, v, out, lse, ws, s);
  const auto want = attention_ref(q, k, v, s);
  REQUIRE_CLOSE(out, want.out, 1e-5, 1e-5);
  REQUIRE_CLOSE(lse, want.lse, 1e-5, 1e-5);
  // The first position now sees the last one too: its output is not its own value row.
  double moved = 0;
  for (std::size_t c = 0; c < s.heads * s.head_dim; ++c) moved = std::max(moved, std::abs(double(out[c]) - v[c]));
  CHECK(moved > 1e-3);
  const auto w = random_floats(rng, s.q_floats());
  auto loss = [&] {
    cpu::causal_attention(q, k, v, out, lse, ws, s);
    return project(w, out);
  };
  loss();
  std::vector<float> dq(s.q_floats()), dk(s.q_floats()), dv(s.q_floats()), gws(cpu::causal_attention_grad_workspace_floats(s));
  cpu::causal_attention_grad(q, k, v, w, lse, dq, dk, dv, gws, s);
  REQUIRE_CLOSE(dq, central_difference(q, loss), fd_tol, fd_tol);
  REQUIRE_CLOSE(dk, central_difference(k, loss), fd_tol, fd_tol);
  REQUIRE_CLOSE(dv, central_difference(v, loss), fd_tol, fd_tol);
}

TEST_CASE("attention refuses a workspace that is too small, naming the sizing function", "[cpu][kernels][attention][errors]") {
  const cpu::attention_shape s{.batch = 1, .seq = 4, .heads = 1, .head_dim = 2};
  std::vector<float> q(s.q_floats()), out(s.q_floats()), lse(s.lse_floats()), ws(15), ws_ok(16);
  REQUIRE_THROWS_WITH(cpu::causal_attention(q, q, q, out, lse, ws, s),
                      ContainsSubstring("causal_attention_workspace_floats() = 16"));
  REQUIRE_THROWS_WITH(cpu::causal_attention(q, q, std::vector<float>(7), out, lse, ws_ok, s),
                      ContainsSubstring("`v` holds 7"));
}
