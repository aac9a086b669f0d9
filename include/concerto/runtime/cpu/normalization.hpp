#pragma once
/// @file
/// @brief Row-wise CPU kernels: layer and RMS normalisation and softmax, forward and backward.
///
/// Every array is a row-major `[rows, cols]` fp32 block; per-row statistics are `[rows]`.

#include <concerto/runtime/cpu/detail/check.hpp>
#include <concerto/runtime/cpu/detail/fast_math.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>

namespace concerto::runtime::cpu {

/// @brief Each row's mean and 1/√(variance + eps): layernorm's statistics, which its forward
/// saves and its backward tasks recompute (the same function, so the same values).
inline void layernorm_stats(std::span<const float> x, std::span<float> mean, std::span<float> rstd, std::size_t rows,
                            std::size_t cols, float eps = 1e-5f) {
  detail::require_size(x, rows * cols, "layernorm", "x");
  detail::require_size(mean, rows, "layernorm", "mean");
  detail::require_size(rstd, rows, "layernorm", "rstd");
  CONCERTO_CHECK(cols > 0 || rows == 0, "layernorm: a row needs at least one column");
  const float inv_cols = 1.0f / static_cast<float>(cols);
  for (std::size_t r = 0; r < rows; ++r) {
    const float* px = x.data() + r * cols;
    const float mu = detail::lane_sum(cols, [px](std::size_t c) { return px[c]; }) * inv_cols;
    // Two passes: the variance from squared deviations does not cancel the way E[x²]-E[x]² does.
    const float sq = detail::lane_sum(cols, [px, mu](std::size_t c) { return (px[c] - mu) * (px[c] - mu); });
    mean[r] = mu;
    rstd[r] = 1.0f / std::sqrt(sq * inv_cols + eps);
  }
}

/// @brief Layer normalisation over the last dimension:
/// `out = (x - mean)·rstd·gamma + beta`, `rstd = 1/√(var + eps)` (biased variance).
///
/// Saves `mean[rows]` and `rstd[rows]` for `layernorm_grad`, which also needs x and gamma.
/// out must not alias x.
/// @code
/// cpu::layernorm(x, gamma, beta, y, mean, rstd, tokens, hidden);
/// @endcode
inline void layernorm(std::span<const float> x, std::span<const float> gamma,
                      std::span<const float> beta, std::span<float> out, std::span<float> mean,
                      std::span<float> rstd, std::size_t rows, std::size_t cols, float eps = 1e-5f) {
  detail::require_size(gamma, cols, "layernorm", "gamma");
  detail::require_size(beta, cols, "layernorm", "beta");
  detail::require_size(out, rows * cols, "layernorm", "out");
  layernorm_stats(x, mean, rstd, rows, cols, eps); // checks x, mean, rstd and cols
  const float* pg = gamma.data();
  const float* pb = beta.data();
  for (std::size_t r = 0; r < rows; ++r) {
    const float* px = x.data() + r * cols;
    float* po = out.data() + r * cols;
    const float mu = mean[r], rs = rstd[r];
    for (std::size_t c = 0; c < cols; ++c) po[c] = (px[c] - mu) * rs * pg[c] + pb[c];
  }
}

/// @brief Backward of `layernorm`: dx from dout, and the parameter gradients
/// `dgamma[c] = Σ_r dout·x̂`, `dbeta[c] = Σ_r dout`, with `x̂ = (x - mean)·rstd`.
///
/// `dx = rstd·(g - mean_c(g) - x̂·mean_c(g·x̂))` where `g = dout·gamma`. With `accumulate`,
/// dgamma and dbeta are added to; dx is always overwritten. dx must not alias dout or x. Empty
/// dgamma and dbeta: dx alone (a graph's separate tasks sum them).
inline void layernorm_grad(std::span<const float> dout, std::span<const float> x,
                           std::span<const float> gamma, std::span<const float> mean,
                           std::span<const float> rstd, std::span<float> dx, std::span<float> dgamma,
                           std::span<float> dbeta, std::size_t rows, std::size_t cols,
                           bool accumulate = false) {
  detail::require_size(dout, rows * cols, "layernorm_grad", "dout");
  detail::require_size(x, rows * cols, "layernorm_grad", "x");
  detail::require_size(gamma, cols, "layernorm_grad", "gamma");
  detail::require_size(mean, rows, "layernorm_grad", "mean");
  detail::require_size(rstd, rows, "layernorm_grad", "rstd");
  detail::require_size(dx, rows * cols, "layernorm_grad", "dx");
  const bool sums = !dgamma.empty() || !dbeta.empty();
  if (sums) {
    detail::require_size(dgamma, cols, "layernorm_grad", "dgamma");
    detail::require_size(dbeta, cols, "layernorm_grad", "dbeta");
  }
  const float* pgam = gamma.data();
  float* pdg = dgamma.data();
  float* pdb = dbeta.data();
  if (sums && !accumulate)
    for (std::size_t c = 0; c < cols; ++c) pdg[c] = pdb[c] = 0.0f;
  const float inv_cols = cols > 0 ? 1.0f / static_cast<float>(cols) : 0.0f;
  for (std::size_t r = 0; r < rows; ++r) {
    const float* pgo = dout.data() + r * cols;
    const float* px = x.data() + r * cols;
    float* pdx = dx.data() + r * cols;
    const float mu = mean[r];
    const float rs = rstd[r];
    const float mg = detail::lane_sum(cols, [pgo, pgam](std::size_t c) { return pgo[c] * pgam[c]; }) * inv_cols;
    const float mgx =
        detail::lane_sum(cols, [=](std::size_t c) { return pgo[c] * pgam[c] * ((px[c] - mu) * rs); }) * inv_cols;
    if (sums)
      for (std::size_t c = 0; c < cols; ++c) {
        pdg[c] += pgo[c] * ((px[c] - mu) * rs);
        pdb[c] += pgo[c];
      }
    for (std::size_t c = 0; c < cols; ++c) {
      const float xhat = (px[c] - mu) * rs;
      pdx[c] = rs * (pgo[c] * pgam[c] - mg - xhat * mgx);
    }
  }
}

/// @brief `rstd[r] = 1/√(mean_c(x²) + eps)` per row: RMSNorm's one statistic (its backward
/// recomputes it rather than keeping it between tasks).
inline void rmsnorm_stats(std::span<const float> x, std::span<float> rstd, std::size_t rows, std::size_t cols,
                          float eps = 1e-5f) {
  detail::require_size(x, rows * cols, "rmsnorm_stats", "x");
  detail::require_size(rstd, rows, "rmsnorm_stats", "rstd");
  CONCERTO_CHECK(cols > 0 || rows == 0, "rmsnorm: a row needs at least one column");
  const float inv_cols = 1.0f / static_cast<float>(cols);
  for (std::size_t r = 0; r < rows; ++r) {
    const float* px = x.data() + r * cols;
    const float sq = detail::lane_sum(cols, [px](std::size_t c) { return px[c] * px[c]; });
    rstd[r] = 1.0f / std::sqrt(sq * inv_cols + eps);
  }
}

/// @brief RMS normalisation over the last dimension (Llama's): `out = x·rstd·gain`,
/// `rstd = 1/√(mean(x²) + eps)`. No centring and no shift, so one statistic per row.
///
/// Saves `rstd[rows]` for `rmsnorm_grad`. out may alias x.
/// @code
/// cpu::rmsnorm(x, gain, y, rstd, tokens, hidden);
/// @endcode
inline void rmsnorm(std::span<const float> x, std::span<const float> gain, std::span<float> out,
                    std::span<float> rstd, std::size_t rows, std::size_t cols, float eps = 1e-5f) {
  detail::require_size(gain, cols, "rmsnorm", "gain");
  detail::require_size(out, rows * cols, "rmsnorm", "out");
  rmsnorm_stats(x, rstd, rows, cols, eps);
  const float* pg = gain.data();
  for (std::size_t r = 0; r < rows; ++r) {
    const float* px = x.data() + r * cols;
    float* po = out.data() + r * cols;
    const float rs = rstd[r];
    for (std::size_t c = 0; c < cols; ++c) po[c] = px[c] * rs * pg[c];
  }
}

/// @brief Backward of `rmsnorm` for its input: `dx = rstd·(g - x̂·mean_c(g·x̂))`, with
/// `g = dout·gain` and `x̂ = x·rstd`. dx must not alias dout or x.
inline void rmsnorm_grad(std::span<const float> dout, std::span<const float> x, std::span<const float> gain,
                         std::span<const float> rstd, std::span<float> dx, std::size_t rows, std::size_t cols) {
  detail::require_size(dout, rows * cols, "rmsnorm_grad", "dout");
  detail::require_size(x, rows * cols, "rmsnorm_grad", "x");
  detail::require_size(gain, cols, "rmsnorm_grad", "gain");
  detail::require_size(rstd, rows, "rmsnorm_grad", "rstd");
  detail::require_size(dx, rows * cols, "rmsnorm_grad", "dx");
  const float* pgain = gain.data();
  const float inv_cols = cols > 0 ? 1.0f / static_cast<float>(cols) : 0.0f;
  for (std::size_t r = 0; r < rows; ++r) {
    const float* pgo = dout.data() + r * cols;
    const float* px = x.data() + r * cols;
    float* pdx = dx.data() + r * cols;
    const float rs = rstd[r];
    float sum_gx = 0.0f;
    for (std::size_t c = 0; c < cols; ++c) sum_gx += pgo[c] * pgain[c] * px[c] * rs;
    const float mgx = sum_gx * inv_cols;
    for (std::size_t c = 0; c < cols; ++c) pdx[c] = rs * (pgo[c] * pgain[c] - px[c] * rs * mgx);
  }
}

/// @brief Backward of `rmsnorm` for its gain: `dgain[c] = Σ_r dout·x̂`. With `accumulate`,
/// added to dgain.
inline void rmsnorm_grad_gain(std::span<const float> dout, std::span<const float> x, std::span<const float> rstd,
                              std::span<float> dgain, std::size_t rows, std::size_t cols, bool accumulate = false) {
  detail::require_size(dout, rows * cols, "rmsnorm_grad_gain", "dout");
  detail::require_size(x, rows * cols, "rmsnorm_grad_gain", "x");
  detail::require_size(rstd, rows, "rmsnorm_grad_gain", "rstd");
  detail::require_size(dgain, cols, "rmsnorm_grad_gain", "dgain");
  float* pdg = dgain.data();
  if (!accumulate)
    for (std::size_t c = 0; c < cols; ++c) pdg[c] = 0.0f;
  for (std::size_t r = 0; r < rows; ++r) {
    const float* pgo = dout.data() + r * cols;
    const float* px = x.data() + r * cols;
    const float rs = rstd[r];
    for (std::size_t c = 0; c < cols; ++c) pdg[c] += pgo[c] * px[c] * rs;
  }
}

/// @brief Row-wise softmax, stable: the row maximum is subtracted before exp. out may alias x.
///
/// The backward needs only the output (keep it).
inline void softmax(std::span<const float> x, std::span<float> out, std::size_t rows, std::size_t cols) {
  detail::require_size(x, rows * cols, "softmax", "x");
  detail::require_size(out, rows * cols, "softmax", "out");
  for (std::size_t r = 0; r < rows; ++r) {
    const float* px = x.data() + r * cols;
    float* po = out.data() + r * cols;
    float m = -INFINITY;
    for (std::size_t c = 0; c < cols; ++c) m = px[c] > m ? px[c] : m;
    // exp in its own loop, which vectorises; the float sum cannot (reassociation).
    for (std::size_t c = 0; c < cols; ++c) po[c] = detail::exp_approx(px[c] - m);
    float sum = 0.0f;
    for (std::size_t c = 0; c < cols; ++c) sum += po[c];
    const float inv = 1.0f / sum;
    for (std::size_t c = 0; c < cols; ++c) po[c] *= inv;
  }
}

/// @brief Backward of `softmax` from its output y: `dx = y·(dy - Σ_c dy·y)`. dx may alias dy.
inline void softmax_grad(std::span<const float> y, std::span<const float> dy, std::span<float> dx,
                         std::size_t rows, std::size_t cols) {
  detail::require_size(y, rows * cols, "softmax_grad", "y");
  detail::require_size(dy, rows * cols, "softmax_grad", "dy");
  detail::require_size(dx, rows * cols, "softmax_grad", "dx");
  for (std::size_t r = 0; r < rows; ++r) {
    const float* py = y.data() + r * cols;
    const float* pg = dy.data() + r * cols;
    float* pd = dx.data() + r * cols;
    float dot = 0.0f;
    for (std::size_t c = 0; c < cols; ++c) dot += pg[c] * py[c];
    for (std::size_t c = 0; c < cols; ++c) pd[c] = py[c] * (pg[c] - dot);
  }
}

// ---- batch normalisation: per channel over the rows of x [rows, channels] ----------------------------

namespace detail {
// Per-channel sums of f(r, c) and g(r, c) over the rows, in double (E[x²] − E[x]² needs their low
// bits), a block of channels at a time on the stack.
template <class F, class G>
inline void channel_sums(std::span<float> sums, std::size_t rows, std::size_t cols, F&& f, G&& g) {
  constexpr std::size_t block = 256;
  double acc[2 * block];
  for (std::size_t c0 = 0; c0 < cols; c0 += block) {
    const std::size_t width = std::min(block, cols - c0);
    std::fill(acc, acc + 2 * width, 0.0);
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < width; ++c) {
        acc[c] += f(r, c0 + c);
        acc[width + c] += g(r, c0 + c);
      }
    for (std::size_t c = 0; c < width; ++c) {
      sums[c0 + c] = static_cast<float>(acc[c]);
      sums[cols + c0 + c] = static_cast<float>(acc[width + c]);
    }
  }
}
} // namespace detail

/// @brief sums [2, cols] = (Σ_r x, Σ_r x²) per channel.
inline void batchnorm_stats(std::span<const float> x, std::span<float> sums, std::size_t rows, std::size_t cols) {
  detail::require_size(x, rows * cols, "batchnorm_stats", "x");
  detail::require_size(sums, 2 * cols, "batchnorm_stats", "sums");
  detail::channel_sums(
      sums, rows, cols, [&](std::size_t r, std::size_t c) { return static_cast<double>(x[r * cols + c]); },
      [&](std::size_t r, std::size_t c) { return static_cast<double>(x[r * cols + c]) * x[r * cols + c]; });
}

/// @brief scale [3, cols] = (mean, 1/σ, gamma/σ) from sums over `count` rows: σ = √(var + eps),
/// var = Σx²/count − mean² (the biased variance, at least 0).
inline void batchnorm_scale(std::span<const float> sums, std::span<const float> gamma, std::span<float> scale, std::size_t cols,
                            std::size_t count, float eps) {
  detail::require_size(sums, 2 * cols, "batchnorm_scale", "sums");
  detail::require_size(gamma, cols, "batchnorm_scale", "gamma");
  detail::require_size(scale, 3 * cols, "batchnorm_scale", "scale");
  CONCERTO_CHECK(count > 0, "batchnorm_scale: statistics over 0 rows");
  for (std::size_t c = 0; c < cols; ++c) {
    const double mean = static_cast<double>(sums[c]) / static_cast<double>(count);
    const double var = std::max(static_cast<double>(sums[cols + c]) / static_cast<double>(count) - mean * mean, 0.0);
    const double rstd = 1.0 / std::sqrt(var + static_cast<double>(eps));
    scale[c] = static_cast<float>(mean);
    scale[cols + c] = static_cast<float>(rstd);
    scale[2 * cols + c] = static_cast<float>(rstd * gamma[c]);
  }
}

/// @brief The scale for evaluation, from the running statistics [2, cols] (mean, variance)
/// instead of a batch's sums.
inline void batchnorm_scale_running(std::span<const float> running, std::span<const float> gamma, std::span<float> scale,
                                    std::size_t cols, float eps) {
  detail::require_size(running, 2 * cols, "batchnorm_scale", "running");
  detail::require_size(gamma, cols, "batchnorm_scale", "gamma");
  detail::require_size(scale, 3 * cols, "batchnorm_scale", "scale");
  for (std::size_t c = 0; c < cols; ++c) {
    const double rstd = 1.0 / std::sqrt(std::max(static_cast<double>(running[cols + c]), 0.0) + static_cast<double>(eps));
    scale[c] = running[c];
    scale[cols + c] = static_cast<float>(rstd);
    scale[2 * cols + c] = static_cast<float>(rstd * gamma[c]);
  }
}

/// @brief The running statistics [2, cols] (mean, variance) moved towards this batch's by
/// `momentum`: r ← (1 − m)·r + m·batch, the batch's variance unbiased (count / (count − 1)), as
/// a framework's BatchNorm keeps them for evaluation. The sums are those of batchnorm_stats.
inline void batchnorm_track(std::span<const float> sums, std::span<float> running, std::size_t cols, std::size_t count,
                            float momentum) {
  detail::require_size(sums, 2 * cols, "batchnorm_track", "sums");
  detail::require_size(running, 2 * cols, "batchnorm_track", "running");
  CONCERTO_CHECK(count > 0, "batchnorm_track: statistics over 0 rows");
  const double n = static_cast<double>(count), m = static_cast<double>(momentum);
  for (std::size_t c = 0; c < cols; ++c) {
    const double mean = static_cast<double>(sums[c]) / n;
    const double var = std::max(static_cast<double>(sums[cols + c]) / n - mean * mean, 0.0) * (count > 1 ? n / (n - 1) : 1.0);
    running[c] = static_cast<float>((1 - m) * running[c] + m * mean);
    running[cols + c] = static_cast<float>((1 - m) * running[cols + c] + m * var);
  }
}

/// @brief y = (x − mean)·gamma/σ + beta per channel, from the scale of batchnorm_scale.
inline void batchnorm(std::span<const float> x, std::span<const float> scale, std::span<const float> beta, std::span<float> y,
                      std::size_t rows, std::size_t cols) {
  detail::require_size(x, rows * cols, "batchnorm", "x");
  detail::require_size(scale, 3 * cols, "batchnorm", "scale");
  detail::require_size(beta, cols, "batchnorm", "beta");
  detail::require_size(y, rows * cols, "batchnorm", "y");
  const float* mean = scale.data();
  const float* g = scale.data() + 2 * cols;
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) y[r * cols + c] = (x[r * cols + c] - mean[c]) * g[c] + beta[c];
}

/// @brief sums [2, cols] = (Σ_r dy, Σ_r dy·x̂) per channel, x̂ = (x − mean)/σ: dbeta and dgamma
/// over these rows.
inline void batchnorm_grad_stats(std::span<const float> x, std::span<const float> scale, std::span<const float> dy,
                                 std::span<float> sums, std::size_t rows, std::size_t cols) {
  detail::require_size(x, rows * cols, "batchnorm_grad_stats", "x");
  detail::require_size(scale, 3 * cols, "batchnorm_grad_stats", "scale");
  detail::require_size(dy, rows * cols, "batchnorm_grad_stats", "dy");
  detail::require_size(sums, 2 * cols, "batchnorm_grad_stats", "sums");
  const float* mean = scale.data();
  const float* rstd = scale.data() + cols;
  detail::channel_sums(
      sums, rows, cols, [&](std::size_t r, std::size_t c) { return static_cast<double>(dy[r * cols + c]); },
      [&](std::size_t r, std::size_t c) {
        return static_cast<double>(dy[r * cols + c]) * ((x[r * cols + c] - mean[c]) * rstd[c]);
      });
}

/// @brief dx = gamma/σ·(dy − Σdy/count − x̂·Σdy·x̂/count) per channel: the gradient through the
/// batch's statistics as well as the normalisation (`count` rows, the sums' over them).
inline void batchnorm_grad(std::span<const float> x, std::span<const float> scale, std::span<const float> sums,
                           std::span<const float> dy, std::span<float> dx, std::size_t rows, std::size_t cols, std::size_t count) {
  detail::require_size(x, rows * cols, "batchnorm_grad", "x");
  detail::require_size(scale, 3 * cols, "batchnorm_grad", "scale");
  detail::require_size(sums, 2 * cols, "batchnorm_grad", "sums");
  detail::require_size(dy, rows * cols, "batchnorm_grad", "dy");
  detail::require_size(dx, rows * cols, "batchnorm_grad", "dx");
  CONCERTO_CHECK(count > 0, "batchnorm_grad: statistics over 0 rows");
  const float* mean = scale.data();
  const float* rstd = scale.data() + cols;
  const float* g = scale.data() + 2 * cols;
  const float inv = 1.0f / static_cast<float>(count);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) {
      const float xhat = (x[r * cols + c] - mean[c]) * rstd[c];
      dx[r * cols + c] = g[c] * (dy[r * cols + c] - sums[c] * inv - xhat * sums[cols + c] * inv);
    }
}

} // namespace concerto::runtime::cpu
