#pragma once
/// @file
/// @brief Causal multi-head self-attention on the CPU, forward and backward.
///
/// Layout: q and out are separate fp32 buffers `[batch, seq, heads·head_dim]` row-major, head h
/// occupying columns `[h·head_dim, (h+1)·head_dim)` of a row: exactly what a projection `x·W`
/// writes, and a tensor-parallel shard of whole heads is the same layout with fewer heads. k and
/// v are `[batch, seq, kv_heads·head_dim]`: with grouped-query attention, `group` consecutive q
/// heads share one kv head (kv_heads = heads / group when both are split alike; a rank holding
/// some q heads and every kv head reads the ones of its q heads, see attention_shape::kv_of).
/// Heads are addressed in place through the BLAS leading dimension, never copied.
///
/// The forward saves only the log-sum-exp of each score row, `lse[batch, heads, seq]`; the
/// backward recomputes the probabilities from q, k and lse (one extra `seq×seq×head_dim` product
/// per head) rather than keeping `batch·heads·seq²` probabilities alive between the passes.

#include <concerto/runtime/cpu/detail/check.hpp>
#include <concerto/runtime/cpu/detail/fast_math.hpp>
#include <concerto/runtime/cpu/matmul.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>

namespace concerto::runtime::cpu {

/// @brief Extents of a (grouped-query) causal attention call: q holds `heads` heads, k and v
/// `kv_heads` (default: as many); local q head h reads kv head (first_head + h) / group - kv_first_head.
struct attention_shape {
  std::size_t batch = 1;
  std::size_t seq = 1;
  std::size_t heads = 1;
  std::size_t head_dim = 1;
  std::size_t kv_heads = 0;      ///< 0: heads
  std::size_t group = 1;         ///< q heads per kv head
  std::size_t first_head = 0;    ///< global index of this call's first q head
  std::size_t kv_first_head = 0; ///< global index of this call's first kv head
  bool causal = true;            ///< position i sees 0..i (a decoder); false: every position (an encoder, axial attention)

  [[nodiscard]] constexpr std::size_t kv() const noexcept { return kv_heads == 0 ? heads : kv_heads; }
  /// Floats in q and out (and their gradients).
  [[nodiscard]] constexpr std::size_t q_floats() const noexcept { return batch * seq * heads * head_dim; }
  /// Floats in each of k and v (and their gradients).
  [[nodiscard]] constexpr std::size_t kv_floats() const noexcept { return batch * seq * kv() * head_dim; }
  /// Floats in the saved log-sum-exp.
  [[nodiscard]] constexpr std::size_t lse_floats() const noexcept { return batch * heads * seq; }
  /// The kv head local q head h reads.
  [[nodiscard]] constexpr std::size_t kv_of(std::size_t h) const noexcept { return (first_head + h) / group - kv_first_head; }
  /// The last key position query i sees.
  [[nodiscard]] constexpr std::size_t last_key(std::size_t i) const noexcept { return causal ? i : seq - 1; }
};

/// @brief Workspace `causal_attention` needs: one `seq×seq` score block.
[[nodiscard]] constexpr std::size_t causal_attention_workspace_floats(const attention_shape& s) noexcept {
  return s.seq * s.seq;
}

/// @brief Workspace `causal_attention_grad` needs: two `seq×seq` blocks (probabilities and their gradient).
[[nodiscard]] constexpr std::size_t causal_attention_grad_workspace_floats(const attention_shape& s) noexcept {
  return 2 * s.seq * s.seq;
}

namespace detail {

inline void check_attention_args(const char* kernel, const attention_shape& s, std::size_t q,
                                 std::size_t k, std::size_t v, std::size_t lse) {
  const std::size_t n = s.q_floats(), nkv = s.kv_floats();
  CONCERTO_CHECK(s.group > 0 && s.first_head / s.group >= s.kv_first_head && s.kv_of(s.heads - 1) < s.kv(),
                 std::string(kernel) + ": q heads [" + std::to_string(s.first_head) + ", " +
                     std::to_string(s.first_head + s.heads) + ") in groups of " + std::to_string(s.group) +
                     " read kv heads outside the " + std::to_string(s.kv()) + " from " + std::to_string(s.kv_first_head));
  CONCERTO_CHECK(q == n, std::string(kernel) + ": `q` holds " + std::to_string(q) +
                             " floats, batch·seq·heads·head_dim = " + std::to_string(n));
  CONCERTO_CHECK(k == nkv, std::string(kernel) + ": `k` holds " + std::to_string(k) +
                               " floats, batch·seq·kv_heads·head_dim = " + std::to_string(nkv));
  CONCERTO_CHECK(v == nkv, std::string(kernel) + ": `v` holds " + std::to_string(v) +
                               " floats, batch·seq·kv_heads·head_dim = " + std::to_string(nkv));
  CONCERTO_CHECK(lse == s.lse_floats(), std::string(kernel) + ": `lse` holds " + std::to_string(lse) +
                                            " floats, batch·heads·seq = " + std::to_string(s.lse_floats()));
}

inline void require_workspace(const char* kernel, std::size_t have, std::size_t need) {
  CONCERTO_CHECK(have >= need, std::string(kernel) + ": `workspace` holds " + std::to_string(have) + " floats, " + kernel +
                                   "_workspace_floats() = " + std::to_string(need));
}

// The sizes both kernels walk q, k and v with: sequence, head size, the row strides of q and of
// k/v, and the softmax's 1/√head_dim.
struct attention_walk {
  std::size_t seq, head_dim, q_stride, kv_stride;
  float scale;
};
inline attention_walk walk_of(const attention_shape& s) {
  return {s.seq, s.head_dim, s.heads * s.head_dim, s.kv() * s.head_dim, 1.0f / std::sqrt(static_cast<float>(s.head_dim))};
}

} // namespace detail

/// @brief `out = softmax(q·kᵀ/√head_dim + causal mask)·v` per batch and head (without the mask
/// when `shape.causal` is false); saves `lse`.
///
/// Position i attends to positions 0..i. `workspace` holds at least
/// `causal_attention_workspace_floats(shape)` floats; nothing is allocated.
/// @code
/// cpu::attention_shape s{.batch = 2, .seq = 64, .heads = 4, .head_dim = 16};
/// std::vector<float> ws(cpu::causal_attention_workspace_floats(s)), lse(s.lse_floats());
/// cpu::causal_attention(q, k, v, out, lse, ws, s);
/// @endcode
inline void causal_attention(std::span<const float> q, std::span<const float> k,
                             std::span<const float> v, std::span<float> out, std::span<float> lse,
                             std::span<float> workspace, const attention_shape& shape) {
  detail::check_attention_args("causal_attention", shape, q.size(), k.size(), v.size(), lse.size());
  detail::require_size(out, shape.q_floats(), "causal_attention", "out");
  detail::require_workspace("causal_attention", workspace.size(), causal_attention_workspace_floats(shape));
  const auto [T, D, ld, ldkv, scale] = detail::walk_of(shape);
  float* p = workspace.data();
  for (std::size_t b = 0; b < shape.batch; ++b) {
    for (std::size_t h = 0; h < shape.heads; ++h) {
      const std::size_t off = b * T * ld + h * D, kv_off = b * T * ldkv + shape.kv_of(h) * D;
      float* row_lse = lse.data() + (b * shape.heads + h) * T;
      // The full square is computed and the upper triangle ignored: one BLAS call beats T small ones.
      detail::gemm(false, true, T, T, D, scale, q.data() + off, ld, k.data() + kv_off, ldkv, 0.0f, p, T);
      for (std::size_t i = 0; i < T; ++i) {
        float* pi = p + i * T;
        float m = -INFINITY;
        const std::size_t last = shape.last_key(i);
        for (std::size_t j = 0; j <= last; ++j) m = pi[j] > m ? pi[j] : m;
        // exp in its own loop, which vectorises; the float sum cannot (reassociation).
        for (std::size_t j = 0; j <= last; ++j) pi[j] = detail::exp_approx(pi[j] - m);
        float sum = 0.0f;
        for (std::size_t j = 0; j <= last; ++j) sum += pi[j];
        const float inv = 1.0f / sum;
        for (std::size_t j = 0; j <= last; ++j) pi[j] *= inv;
        for (std::size_t j = last + 1; j < T; ++j) pi[j] = 0.0f;
        row_lse[i] = m + std::log(sum);
      }
      detail::gemm(false, false, T, D, T, 1.0f, p, T, v.data() + kv_off, ldkv, 0.0f, out.data() + off, ld);
    }
  }
}

/// @brief Backward of `causal_attention`: dq, dk, dv (overwritten) from dout, q, k, v and the saved lse.
///
/// `workspace` holds at least `causal_attention_grad_workspace_floats(shape)` floats.
/// The gradients must not alias the inputs.
/// @code
/// std::vector<float> ws(cpu::causal_attention_grad_workspace_floats(s));
/// cpu::causal_attention_grad(q, k, v, dout, lse, dq, dk, dv, ws, s);
/// @endcode
inline void causal_attention_grad(std::span<const float> q, std::span<const float> k,
                                  std::span<const float> v, std::span<const float> dout,
                                  std::span<const float> lse, std::span<float> dq, std::span<float> dk,
                                  std::span<float> dv, std::span<float> workspace,
                                  const attention_shape& shape) {
  detail::check_attention_args("causal_attention_grad", shape, q.size(), k.size(), v.size(), lse.size());
  const std::size_t n = shape.q_floats(), nkv = shape.kv_floats();
  detail::require_size(dout, n, "causal_attention_grad", "dout");
  detail::require_size(dq, n, "causal_attention_grad", "dq");
  detail::require_size(dk, nkv, "causal_attention_grad", "dk");
  detail::require_size(dv, nkv, "causal_attention_grad", "dv");
  detail::require_workspace("causal_attention_grad", workspace.size(), causal_attention_grad_workspace_floats(shape));
  const auto [T, D, ld, ldkv, scale] = detail::walk_of(shape);
  float* p = workspace.data();
  float* dp = workspace.data() + T * T;
  // A kv head's gradient sums over the q heads of its group (and, on a rank holding every kv
  // head but some q heads, over this rank's q heads only: a partial sum the caller reduces).
  std::fill(dk.begin(), dk.end(), 0.0f);
  std::fill(dv.begin(), dv.end(), 0.0f);
  for (std::size_t b = 0; b < shape.batch; ++b) {
    for (std::size_t h = 0; h < shape.heads; ++h) {
      const std::size_t off = b * T * ld + h * D, kv_off = b * T * ldkv + shape.kv_of(h) * D;
      const float* row_lse = lse.data() + (b * shape.heads + h) * T;
      detail::gemm(false, true, T, T, D, scale, q.data() + off, ld, k.data() + kv_off, ldkv, 0.0f, p, T);
      for (std::size_t i = 0; i < T; ++i) {
        float* pi = p + i * T;
        const float l = row_lse[i];
        const std::size_t last = shape.last_key(i);
        for (std::size_t j = 0; j <= last; ++j) pi[j] = detail::exp_approx(pi[j] - l);
        for (std::size_t j = last + 1; j < T; ++j) pi[j] = 0.0f;
      }
      detail::gemm(true, false, T, D, T, 1.0f, p, T, dout.data() + off, ld, 1.0f, dv.data() + kv_off, ldkv);
      detail::gemm(false, true, T, T, D, 1.0f, dout.data() + off, ld, v.data() + kv_off, ldkv, 0.0f, dp, T);
      // dS = P∘(dP - rowsum(P∘dP)); masked entries have P = 0, so they come out 0.
      for (std::size_t i = 0; i < T; ++i) {
        const float* pi = p + i * T;
        float* dpi = dp + i * T;
        float dot = 0.0f;
        for (std::size_t j = 0; j <= shape.last_key(i); ++j) dot += pi[j] * dpi[j];
        for (std::size_t j = 0; j < T; ++j) dpi[j] = pi[j] * (dpi[j] - dot);
      }
      detail::gemm(false, false, T, D, T, scale, dp, T, k.data() + kv_off, ldkv, 0.0f, dq.data() + off, ld);
      detail::gemm(true, false, T, D, T, scale, dp, T, q.data() + off, ld, 1.0f, dk.data() + kv_off, ldkv);
    }
  }
}

} // namespace concerto::runtime::cpu
