// CPU kernels of the mixture of experts: the routing's choices, priorities and capacity on
// cases worked by hand, ties, dispatch and combine against direct loops, their gradients
// against central differences, and the balance loss's gradient against central differences
// of the Switch loss computed here in double. Routing is piecewise constant in the choices, so
// the differences are taken where no choice changes (checked).

#include "kernels_testing.hpp"

#include <concerto/runtime/cpu/kernels.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace cpu = concerto::runtime::cpu;
using namespace kernels_testing;
using Catch::Matchers::ContainsSubstring;

namespace {

std::vector<float> route(const std::vector<float>& logits, const cpu::moe_shape& s) {
  std::vector<float> gates(logits.size()), scratch(cpu::moe_route_workspace_floats(s));
  cpu::moe_route(logits, gates, s, scratch);
  return gates;
}

std::vector<double> softmax(const float* row, std::size_t n) {
  std::vector<double> p(n);
  double mx = row[0], sum = 0;
  for (std::size_t e = 1; e < n; ++e) mx = std::max(mx, static_cast<double>(row[e]));
  for (std::size_t e = 0; e < n; ++e) sum += p[e] = std::exp(row[e] - mx);
  for (auto& v : p) v /= sum;
  return p;
}

// The Switch balance loss of every group with the choices' counts held fixed (they are counts:
// not differentiated), in double: scale · E · Σ_g Σ_e count_ge/(S·k) · mean_t p_te.
double balance_loss(const std::vector<float>& logits, const cpu::moe_shape& s, const std::vector<double>& counts,
                    double scale) {
  double total = 0;
  for (std::size_t g = 0; g < s.groups; ++g)
    for (std::size_t t = g * s.group; t < (g + 1) * s.group; ++t) {
      const auto p = softmax(logits.data() + t * s.experts, s.experts);
      for (std::size_t e = 0; e < s.experts; ++e)
        total += counts[g * s.experts + e] / static_cast<double>(s.group * s.top_k) * p[e] / static_cast<double>(s.group);
    }
  return scale * static_cast<double>(s.experts) * total;
}

// Each group's top-k choices per expert (before capacity), in double: [groups, experts].
std::vector<double> choice_counts(const std::vector<float>& logits, const cpu::moe_shape& s) {
  std::vector<double> counts(s.groups * s.experts, 0.0);
  for (std::size_t t = 0; t < s.tokens(); ++t) {
    auto p = softmax(logits.data() + t * s.experts, s.experts);
    for (std::size_t j = 0; j < s.top_k; ++j) {
      const auto e = static_cast<std::size_t>(std::max_element(p.begin(), p.end()) - p.begin());
      counts[(t / s.group) * s.experts + e] += 1;
      p[e] = -1;
    }
  }
  return counts;
}

} // namespace

TEST_CASE("routing gives first choices their slots before second choices, in token order, up to capacity",
          "[cpu][kernels][moe]") {
  // One group of 3 tokens, 3 experts, top-2, capacity 2: every token prefers expert 0, then 1.
  const cpu::moe_shape s{.groups = 1, .group = 3, .experts = 3, .hidden = 1, .capacity = 2, .top_k = 2};
  const std::vector<float> logits{3, 2, 0, 3, 2, 0, 3, 2, 0};
  const auto gates = route(logits, s);
  const auto p = softmax(logits.data(), 3);
  // Expert 0 takes tokens 0 and 1 (first choices); token 2's first choice is over capacity.
  // Expert 1 takes tokens 0 and 1 (second choices), token 2's second choice is over capacity too.
  const std::vector<double> want{p[0], p[1], 0, p[0], p[1], 0, 0, 0, 0};
  for (std::size_t i = 0; i < want.size(); ++i) {
    CAPTURE(i);
    CHECK(std::abs(gates[i] - want[i]) <= 1e-6);
  }
  // With capacity 3 nothing is dropped; a first choice is served before another token's second one.
  const cpu::moe_shape roomy{.groups = 1, .group = 3, .experts = 3, .hidden = 1, .capacity = 3, .top_k = 2};
  const auto all = route(logits, roomy);
  CHECK(std::count_if(all.begin(), all.end(), [](float v) { return v != 0.0f; }) == 6);
  // Priority: token 2 prefers expert 1 first; with capacity 1, expert 1 goes to it, not to token 0's second choice.
  const cpu::moe_shape tight{.groups = 1, .group = 3, .experts = 3, .hidden = 1, .capacity = 1, .top_k = 2};
  const std::vector<float> mixed{3, 2, 0, 0, 0, 3, 2, 3, 0};
  const auto g = route(mixed, tight);
  CHECK(g[0 * 3 + 0] != 0.0f); // token 0's first choice, expert 0
  CHECK(g[0 * 3 + 1] == 0.0f); // token 0's second choice lost to token 2's first
  CHECK(g[2 * 3 + 1] != 0.0f);
  CHECK(g[1 * 3 + 2] != 0.0f); // token 1's first choice, expert 2
}

TEST_CASE("routing breaks ties toward the lower expert and keeps every gate of a routed pair above zero",
          "[cpu][kernels][moe]") {
  const cpu::moe_shape s{.groups = 2, .group = 2, .experts = 4, .hidden = 1, .capacity = 2, .top_k = 2};
  // Group 0: equal logits (ties); group 1: one expert far ahead, so the others' probabilities underflow.
  const std::vector<float> logits{1, 1, 1, 1, 1, 1, 1, 1, 0, 200, 0, 0, 0, 200, 0, 0};
  const auto gates = route(logits, s);
  for (std::size_t t = 0; t < 2; ++t) {
    CHECK(gates[t * 4 + 0] == 0.25f);
    CHECK(gates[t * 4 + 1] == 0.25f);
    CHECK(gates[t * 4 + 2] == 0.0f);
    CHECK(gates[t * 4 + 3] == 0.0f);
  }
  for (std::size_t t = 2; t < 4; ++t) {
    CHECK(gates[t * 4 + 1] == 1.0f);
    CHECK(gates[t * 4 + 0] > 0.0f); // second choice by tie-break: a probability of 0 kept as FLT_MIN
    CHECK(gates[t * 4 + 2] == 0.0f);
  }
}

TEST_CASE("dispatch places tokens in slots, combine sums them weighted, and both gradients are exact",
          "[cpu][kernels][moe]") {
  const cpu::moe_shape s{.groups = 2, .group = 6, .experts = 3, .hidden = 5, .capacity = 3, .top_k = 2};
  std::mt19937 rng(7);
  const auto logits = random_floats(rng, s.tokens() * s.experts, -2, 2);
  const auto gates = route(logits, s);
  auto x = random_floats(rng, s.tokens() * s.hidden);
  std::vector<std::int32_t> slot(s.tokens() * s.experts);
  std::vector<float> sent(s.experts * s.slots() * s.hidden);
  cpu::moe_dispatch(x, gates, sent, s, slot);
  // Direct: token t's kth routed expert e holds it at row e·slots + g·capacity + (tokens of g before t routed to e).
  std::vector<float> want(sent.size(), 0.0f);
  for (std::size_t g = 0; g < s.groups; ++g)
    for (std::size_t e = 0; e < s.experts; ++e) {
      std::size_t c = 0;
      for (std::size_t t = g * s.group; t < (g + 1) * s.group; ++t)
        if (gates[t * s.experts + e] != 0.0f) {
          for (std::size_t h = 0; h < s.hidden; ++h) want[((e * s.slots()) + g * s.capacity + c) * s.hidden + h] = x[t * s.hidden + h];
          ++c;
        }
      CHECK(c <= s.capacity);
    }
  CHECK(sent == want);

  // combine(y) = Σ gate·y[slot]; with y = sent, each token gets its row times its kept gates' sum.
  std::vector<float> out(s.tokens() * s.hidden);
  cpu::moe_combine(sent, gates, out, s, slot);
  for (std::size_t t = 0; t < s.tokens(); ++t) {
    double kept = 0;
    for (std::size_t e = 0; e < s.experts; ++e) kept += gates[t * s.experts + e];
    for (std::size_t h = 0; h < s.hidden; ++h) CHECK(std::abs(out[t * s.hidden + h] - kept * x[t * s.hidden + h]) <= 1e-6);
  }

  // Gradients: dispatch is linear in x, combine in y and in the gates (at fixed slots).
  const auto w_sent = random_floats(rng, sent.size()), w_out = random_floats(rng, out.size());
  std::vector<float> dx(x.size());
  cpu::moe_dispatch_grad(w_sent, gates, dx, s, slot);
  const auto fd_x = central_difference(x, [&] {
    cpu::moe_dispatch(x, gates, sent, s, slot);
    return project(w_sent, sent);
  });
  REQUIRE_CLOSE(dx, fd_x, 2e-3, 2e-3);
  auto y = random_floats(rng, sent.size());
  auto g = gates;
  std::vector<float> dy(y.size()), dgates(g.size());
  cpu::moe_combine_grad(w_out, y, g, dy, dgates, s, slot);
  const auto fd_y = central_difference(y, [&] {
    cpu::moe_combine(y, g, out, s, slot);
    return project(w_out, out);
  });
  REQUIRE_CLOSE(dy, fd_y, 2e-3, 2e-3);
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (g[i] == 0.0f) {
      CHECK(dgates[i] == 0.0f); // not routed: no slot, no gradient
      continue;
    }
    const double fd = central_difference_at(g, i, [&] {
      cpu::moe_combine(y, g, out, s, slot);
      return project(w_out, out);
    }, 1e-3f);
    CAPTURE(i);
    CHECK(std::abs(dgates[i] - fd) <= 2e-3 + 2e-3 * std::abs(fd));
  }
}

TEST_CASE("the routing's gradient is the softmax's through the kept gates plus the balance loss's",
          "[cpu][kernels][moe]") {
  const cpu::moe_shape s{.groups = 2, .group = 5, .experts = 4, .hidden = 1, .capacity = 2, .top_k = 2};
  std::mt19937 rng(11);
  auto logits = random_floats(rng, s.tokens() * s.experts, -2, 2);
  const auto gates = route(logits, s);
  const auto w = random_floats(rng, gates.size());
  std::vector<float> scratch(cpu::moe_route_grad_workspace_floats(s));
  const auto counts = choice_counts(logits, s); // for the balance loss written here
  for (const float aux : {0.0f, 0.3f}) {
    CAPTURE(aux);
    std::vector<float> dlogits(logits.size());
    cpu::moe_route_grad(logits, gates, w, dlogits, s, aux, scratch);
    for (std::size_t i = 0; i < logits.size(); ++i) {
      const double fd = central_difference_at(logits, i, [&] {
        const auto moved = route(logits, s);
        for (std::size_t k = 0; k < moved.size(); ++k) REQUIRE((moved[k] != 0.0f) == (gates[k] != 0.0f)); // no choice changed
        return project(w, moved) + balance_loss(logits, s, counts, aux);
      }, 1e-3f);
      CAPTURE(i);
      CHECK(std::abs(dlogits[i] - fd) <= 2e-3 + 2e-3 * std::abs(fd));
    }
  }
}

TEST_CASE("the balance loss's value is the loss whose gradient the routing adds", "[cpu][kernels][moe]") {
  SECTION("on cases worked by hand") {
    const cpu::moe_shape s{.groups = 1, .group = 2, .experts = 2, .hidden = 1, .capacity = 2, .top_k = 1};
    // Both tokens choose expert 0: f = (1, 0), P_0 = (e²/(e²+1) + e/(e+1)) / 2.
    const double p0 = (std::exp(2.0) / (std::exp(2.0) + 1) + std::exp(1.0) / (std::exp(1.0) + 1)) / 2;
    CHECK(std::abs(cpu::moe_balance_sum(std::vector<float>{2, 0, 1, 0}, s) - 2 * p0) < 1e-6);
    // One token each, mirrored: f = P = (1/2, 1/2), the balanced value 1.
    CHECK(std::abs(cpu::moe_balance_sum(std::vector<float>{1, 0, 0, 1}, s) - 1.0) < 1e-6);
  }
  SECTION("summed over groups, as the gradient's loss of moe_route_grad") {
    const cpu::moe_shape s{.groups = 3, .group = 6, .experts = 4, .hidden = 1, .capacity = 3, .top_k = 2};
    std::mt19937 rng(5);
    const auto logits = random_floats(rng, s.tokens() * s.experts, -2, 2);
    // balance_loss is what the routing's gradient was checked against above (weight 1).
    CHECK(std::abs(cpu::moe_balance_sum(logits, s) - balance_loss(logits, s, choice_counts(logits, s), 1.0)) < 1e-5);
  }
}

TEST_CASE("the MoE kernels refuse top_k beyond the experts and gates over capacity", "[cpu][kernels][moe]") {
  const cpu::moe_shape s{.groups = 1, .group = 2, .experts = 2, .hidden = 1, .capacity = 1, .top_k = 3};
  std::vector<float> logits(4, 0.0f), gates(4), scratch(cpu::moe_route_workspace_floats(s));
  CHECK_THROWS_WITH(cpu::moe_route(logits, gates, s, scratch), ContainsSubstring("top_k 3 must be between 1 and the 2 experts"));
  const cpu::moe_shape one{.groups = 1, .group = 2, .experts = 2, .hidden = 1, .capacity = 1, .top_k = 1};
  const std::vector<float> both_to_0{0.5f, 0.0f, 0.5f, 0.0f}, x{1, 2};
  std::vector<float> sent(2);
  std::vector<std::int32_t> slot(4);
  CHECK_THROWS_WITH(cpu::moe_dispatch(x, both_to_0, sent, one, slot),
                    ContainsSubstring("expert 0 has more than its capacity of 1 tokens in group 0"));
}
