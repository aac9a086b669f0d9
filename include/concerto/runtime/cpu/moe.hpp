#pragma once
/// @file
/// @brief Mixture-of-experts kernels on the CPU: top-k routing with a capacity, dispatch of
/// tokens to their experts' slots, the gate-weighted combine, the load-balancing loss, and the
/// gradients of each.
///
/// Tokens come in groups (a sequence: `group` tokens); routing, capacity and the balance loss
/// are per group, so that a mesh that splits the groups over ranks routes every token as one
/// rank would. The gates are dense `[tokens, experts]`: the softmax probability of a (token,
/// expert) pair that is routed and kept, 0 otherwise (a kept gate is at least FLT_MIN, so a
/// zero always means "not routed"). A pair's slot is the token's rank among the group's tokens
/// routed to that expert, so each kernel derives it from the gates: the expert buffers are
/// `[experts, groups·capacity, hidden]`, expert e's slot c of group g at row e·groups·capacity +
/// g·capacity + c, and empty slots hold zero.
///
/// Which pairs are kept: each token's top_k experts by probability (ties to the lower expert
/// index), then every group's first choices take slots in token order, then the second choices,
/// and so on (GShard's priority), up to `capacity` slots per expert; the rest are dropped.
/// The balance loss is Switch/GShard's: weight · experts · Σ_e f_e·P_e per group, f_e the share
/// of the group's top-k choices naming e (before capacity), P_e its mean probability, averaged
/// over the `global_groups` of the step; moe_route_grad adds its gradient to the logits'.
///
/// @code
/// cpu::moe_shape s{.groups = 2, .group = 16, .experts = 4, .hidden = 64, .capacity = 8, .top_k = 2};
/// cpu::moe_route(logits, gates, s, cpu::moe_route_scratch(s, ws));
/// cpu::moe_dispatch(x, gates, expert_in, s, slots);
/// @endcode

#include <concerto/runtime/cpu/detail/check.hpp>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace concerto::runtime::cpu {

/// @brief Extents of an MoE kernel call.
struct moe_shape {
  std::size_t groups = 0;   ///< groups on this rank
  std::size_t group = 0;    ///< tokens per group
  std::size_t experts = 0;
  std::size_t hidden = 0;   ///< values per token (dispatch, combine)
  std::size_t capacity = 0; ///< slots per expert and group
  std::size_t top_k = 1;
  /// The slot rows' layout: 1 is expert-major ([experts, slots, hidden]); k > 1 is chunk-major
  /// ([k, experts, slots/k, hidden]), in which chunk j's rows of every expert are one contiguous
  /// block, so that the planner can exchange and multiply them as views (docs/decomposition.md).
  std::size_t chunks = 1;
  [[nodiscard]] std::size_t tokens() const noexcept { return groups * group; }
  [[nodiscard]] std::size_t slots() const noexcept { return groups * capacity; } ///< rows per expert
  /// @brief The row of expert e's slot `slot` of group g.
  [[nodiscard]] std::size_t row(std::size_t e, std::size_t g, std::size_t slot) const noexcept {
    const std::size_t s = g * capacity + slot, per_chunk = slots() / chunks;
    return (s / per_chunk * experts + e) * per_chunk + s % per_chunk;
  }
};

/// @brief Workspace floats of moe_route (a group's choices and their probabilities, the counts).
[[nodiscard]] inline std::size_t moe_route_workspace_floats(const moe_shape& s) {
  return 2 * s.group * s.top_k + s.experts;
}
/// @brief Workspace floats of the kernels that need each pair's slot (as i32).
[[nodiscard]] inline std::size_t moe_slots_workspace_floats(const moe_shape& s) { return s.tokens() * s.experts; }

namespace detail {

inline void softmax_row(const float* logits, float* p, std::size_t n) {
  float mx = logits[0];
  for (std::size_t e = 1; e < n; ++e) mx = std::max(mx, logits[e]);
  float sum = 0;
  for (std::size_t e = 0; e < n; ++e) sum += p[e] = std::exp(logits[e] - mx);
  for (std::size_t e = 0; e < n; ++e) p[e] /= sum;
}

// The top_k entries of p[n] by value, ties to the lower index, into `chosen`.
inline void top_k(const float* p, std::size_t n, std::size_t k, std::int32_t* chosen) {
  for (std::size_t j = 0; j < k; ++j) {
    std::int32_t best = -1;
    for (std::size_t e = 0; e < n; ++e) {
      if (std::find(chosen, chosen + j, static_cast<std::int32_t>(e)) != chosen + j) continue;
      if (best < 0 || p[e] > p[static_cast<std::size_t>(best)]) best = static_cast<std::int32_t>(e);
    }
    chosen[j] = best;
  }
}

// dlogits = p ⊙ (dp − Σ p·dp) for one row, p the softmax of the logits.
inline void softmax_backward_row(const float* p, const float* dp, float* dlogits, std::size_t n) {
  float dot = 0;
  for (std::size_t e = 0; e < n; ++e) dot += p[e] * dp[e];
  for (std::size_t e = 0; e < n; ++e) dlogits[e] = p[e] * (dp[e] - dot);
}

inline void check_moe(const moe_shape& s, const char* kernel) {
  CONCERTO_CHECK(s.group > 0 && s.experts > 0 && s.top_k > 0 && s.top_k <= s.experts,
                 std::string(kernel) + ": top_k " + std::to_string(s.top_k) + " must be between 1 and the " +
                     std::to_string(s.experts) + " experts, with a group of at least one token");
}

} // namespace detail

/// @brief Each (token, expert)'s slot, -1 where the gate is zero; throws when an expert has more
/// routed tokens in a group than capacity (gates that moe_route did not make).
inline void moe_slots(std::span<const float> gates, const moe_shape& s, std::span<std::int32_t> slot) {
  detail::require_size(gates, s.tokens() * s.experts, "moe_slots", "gates");
  detail::require_size(slot, s.tokens() * s.experts, "moe_slots", "slot");
  for (std::size_t g = 0; g < s.groups; ++g)
    for (std::size_t e = 0; e < s.experts; ++e) {
      std::int32_t next = 0;
      for (std::size_t t = g * s.group; t < (g + 1) * s.group; ++t) {
        const auto at = t * s.experts + e;
        if (gates[at] == 0.0f) {
          slot[at] = -1;
          continue;
        }
        CONCERTO_CHECK(static_cast<std::size_t>(next) < s.capacity,
                       "moe: expert " + std::to_string(e) + " has more than its capacity of " + std::to_string(s.capacity) +
                           " tokens in group " + std::to_string(g) + " (the gates do not come from moe_route)");
        slot[at] = next++;
      }
    }
}

/// @brief gates[tokens, experts] from logits[tokens, experts] (see the file comment);
/// `scratch` holds moe_route_workspace_floats(s).
inline void moe_route(std::span<const float> logits, std::span<float> gates, const moe_shape& s, std::span<float> scratch) {
  detail::check_moe(s, "moe_route");
  detail::require_size(logits, s.tokens() * s.experts, "moe_route", "logits");
  detail::require_size(gates, s.tokens() * s.experts, "moe_route", "gates");
  detail::require_size(scratch, moe_route_workspace_floats(s), "moe_route", "scratch");
  const std::size_t E = s.experts, K = s.top_k;
  auto* chosen = reinterpret_cast<std::int32_t*>(scratch.data());
  float* prob = scratch.data() + s.group * K;
  auto* used = reinterpret_cast<std::int32_t*>(prob + s.group * K);
  for (std::size_t g = 0; g < s.groups; ++g) {
    const std::size_t first = g * s.group;
    for (std::size_t t = 0; t < s.group; ++t) {
      float* row = gates.data() + (first + t) * E;
      detail::softmax_row(logits.data() + (first + t) * E, row, E);
      detail::top_k(row, E, K, chosen + t * K);
      for (std::size_t j = 0; j < K; ++j) prob[t * K + j] = row[chosen[t * K + j]];
      std::fill(row, row + E, 0.0f);
    }
    std::fill(used, used + E, 0);
    for (std::size_t j = 0; j < K; ++j)
      for (std::size_t t = 0; t < s.group; ++t) {
        const auto e = static_cast<std::size_t>(chosen[t * K + j]);
        if (static_cast<std::size_t>(used[e]) >= s.capacity) continue; // dropped: over capacity
        ++used[e];
        gates[(first + t) * E + e] = std::max(prob[t * K + j], FLT_MIN);
      }
  }
}

/// @brief out[experts, groups·capacity, hidden]: each kept pair's token in its expert's slot,
/// zero elsewhere. `slot` is moe_slots' (computed here).
inline void moe_dispatch(std::span<const float> x, std::span<const float> gates, std::span<float> out, const moe_shape& s,
                         std::span<std::int32_t> slot) {
  detail::require_size(x, s.tokens() * s.hidden, "moe_dispatch", "x");
  detail::require_size(out, s.experts * s.slots() * s.hidden, "moe_dispatch", "out");
  moe_slots(gates, s, slot);
  std::fill(out.begin(), out.end(), 0.0f);
  for (std::size_t t = 0; t < s.tokens(); ++t)
    for (std::size_t e = 0; e < s.experts; ++e)
      if (const auto c = slot[t * s.experts + e]; c >= 0) {
        const auto row = s.row(e, t / s.group, static_cast<std::size_t>(c));
        std::memcpy(out.data() + row * s.hidden, x.data() + t * s.hidden, s.hidden * sizeof(float));
      }
}

/// @brief dx[tokens, hidden] = Σ over a token's kept pairs of its slot's gradient.
inline void moe_dispatch_grad(std::span<const float> dout, std::span<const float> gates, std::span<float> dx,
                              const moe_shape& s, std::span<std::int32_t> slot) {
  detail::require_size(dout, s.experts * s.slots() * s.hidden, "moe_dispatch_grad", "dout");
  detail::require_size(dx, s.tokens() * s.hidden, "moe_dispatch_grad", "dx");
  moe_slots(gates, s, slot);
  std::fill(dx.begin(), dx.end(), 0.0f);
  for (std::size_t t = 0; t < s.tokens(); ++t)
    for (std::size_t e = 0; e < s.experts; ++e)
      if (const auto c = slot[t * s.experts + e]; c >= 0) {
        const float* src = dout.data() + s.row(e, t / s.group, static_cast<std::size_t>(c)) * s.hidden;
        float* dst = dx.data() + t * s.hidden;
        for (std::size_t h = 0; h < s.hidden; ++h) dst[h] += src[h];
      }
}

/// @brief out[tokens, hidden] = Σ_e gates[t, e]·y[e, slot(t, e)].
inline void moe_combine(std::span<const float> y, std::span<const float> gates, std::span<float> out, const moe_shape& s,
                        std::span<std::int32_t> slot) {
  detail::require_size(y, s.experts * s.slots() * s.hidden, "moe_combine", "y");
  detail::require_size(out, s.tokens() * s.hidden, "moe_combine", "out");
  moe_slots(gates, s, slot);
  std::fill(out.begin(), out.end(), 0.0f);
  for (std::size_t t = 0; t < s.tokens(); ++t)
    for (std::size_t e = 0; e < s.experts; ++e)
      if (const auto c = slot[t * s.experts + e]; c >= 0) {
        const float gate = gates[t * s.experts + e];
        const float* src = y.data() + s.row(e, t / s.group, static_cast<std::size_t>(c)) * s.hidden;
        float* dst = out.data() + t * s.hidden;
        for (std::size_t h = 0; h < s.hidden; ++h) dst[h] += gate * src[h];
      }
}

/// @brief dy = each kept pair's gate times the token's gradient (zero in empty slots), and
/// dgates = dout·y over each kept pair's slot (zero elsewhere).
inline void moe_combine_grad(std::span<const float> dout, std::span<const float> y, std::span<const float> gates,
                             std::span<float> dy, std::span<float> dgates, const moe_shape& s, std::span<std::int32_t> slot) {
  detail::require_size(dout, s.tokens() * s.hidden, "moe_combine_grad", "dout");
  detail::require_size(y, s.experts * s.slots() * s.hidden, "moe_combine_grad", "y");
  detail::require_size(dy, y.size(), "moe_combine_grad", "dy");
  detail::require_size(dgates, s.tokens() * s.experts, "moe_combine_grad", "dgates");
  moe_slots(gates, s, slot);
  std::fill(dy.begin(), dy.end(), 0.0f);
  for (std::size_t t = 0; t < s.tokens(); ++t)
    for (std::size_t e = 0; e < s.experts; ++e) {
      const auto at = t * s.experts + e;
      const auto c = slot[at];
      if (c < 0) {
        dgates[at] = 0.0f;
        continue;
      }
      const auto row = s.row(e, t / s.group, static_cast<std::size_t>(c)) * s.hidden;
      const float* g = dout.data() + t * s.hidden;
      float dot = 0;
      for (std::size_t h = 0; h < s.hidden; ++h) {
        dy[row + h] = gates[at] * g[h];
        dot += g[h] * y[row + h];
      }
      dgates[at] = dot;
    }
}

/// @brief The balance loss's value before its weight, summed over the `s.groups` groups of
/// `logits` [tokens, experts]: Σ_g experts·Σ_e f_ge·P_ge (f_ge the share of group g's top-k
/// choices naming e, before capacity; P_ge e's mean probability). 1 per group when the router is
/// perfectly balanced, up to `experts` when every token goes to one expert. moe_route_grad adds
/// this sum's gradient (times weight / the step's groups); the forward pass does not compute it.
[[nodiscard]] inline double moe_balance_sum(std::span<const float> logits, const moe_shape& s) {
  detail::check_moe(s, "moe_balance_sum");
  const std::size_t E = s.experts, K = s.top_k;
  detail::require_size(logits, s.tokens() * E, "moe_balance_sum", "logits");
  std::vector<float> p(E);
  std::vector<double> share(E), mean(E);
  std::vector<std::int32_t> chosen(K);
  double sum = 0;
  for (std::size_t g = 0; g < s.groups; ++g) {
    std::fill(share.begin(), share.end(), 0.0);
    std::fill(mean.begin(), mean.end(), 0.0);
    for (std::size_t t = g * s.group; t < (g + 1) * s.group; ++t) {
      detail::softmax_row(logits.data() + t * E, p.data(), E);
      detail::top_k(p.data(), E, K, chosen.data());
      for (std::size_t j = 0; j < K; ++j) share[static_cast<std::size_t>(chosen[j])] += 1.0 / static_cast<double>(s.group * K);
      for (std::size_t e = 0; e < E; ++e) mean[e] += p[e] / static_cast<double>(s.group);
    }
    double group_loss = 0;
    for (std::size_t e = 0; e < E; ++e) group_loss += share[e] * mean[e];
    sum += static_cast<double>(E) * group_loss;
  }
  return sum;
}

/// @brief Workspace floats of moe_route_grad.
[[nodiscard]] inline std::size_t moe_route_grad_workspace_floats(const moe_shape& s) { return 3 * s.experts + s.top_k; }

/// @brief dlogits[tokens, experts]: the softmax backward of the kept pairs' gate gradient plus
/// the balance loss's, `aux_scale`·experts·f_ge/(group·top_k·group) for each expert e of group g
/// (`aux_scale` = weight / the step's groups, times dloss; f_ge, a count of top-k choices, is
/// not differentiated). `scratch` holds moe_route_grad_workspace_floats(s).
inline void moe_route_grad(std::span<const float> logits, std::span<const float> gates, std::span<const float> dgates,
                           std::span<float> dlogits, const moe_shape& s, float aux_scale, std::span<float> scratch) {
  detail::check_moe(s, "moe_route_grad");
  const std::size_t E = s.experts, K = s.top_k;
  for (const auto* operand : {&logits, &gates, &dgates})
    detail::require_size(*operand, s.tokens() * E, "moe_route_grad", "logits, gates and dgates");
  detail::require_size(dlogits, s.tokens() * E, "moe_route_grad", "dlogits");
  detail::require_size(scratch, moe_route_grad_workspace_floats(s), "moe_route_grad", "scratch");
  float *p = scratch.data(), *dp = p + E, *count = dp + E;
  auto* chosen = reinterpret_cast<std::int32_t*>(count + E);
  const float per = aux_scale * static_cast<float>(E) / static_cast<float>(s.group * K * s.group);
  for (std::size_t g = 0; g < s.groups; ++g) {
    std::fill(count, count + E, 0.0f);
    for (std::size_t t = g * s.group; t < (g + 1) * s.group; ++t) {
      detail::softmax_row(logits.data() + t * E, p, E);
      detail::top_k(p, E, K, chosen);
      for (std::size_t j = 0; j < K; ++j) count[chosen[j]] += 1.0f;
    }
    for (std::size_t t = g * s.group; t < (g + 1) * s.group; ++t) {
      detail::softmax_row(logits.data() + t * E, p, E);
      for (std::size_t e = 0; e < E; ++e)
        dp[e] = (gates[t * E + e] != 0.0f ? dgates[t * E + e] : 0.0f) + per * count[e];
      detail::softmax_backward_row(p, dp, dlogits.data() + t * E, E);
    }
  }
}

} // namespace concerto::runtime::cpu
