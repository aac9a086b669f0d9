#pragma once
/// @file
/// @brief Elementwise CPU kernels and their gradients: add, scale, bias, GELU, ReLU, SiLU, products, SwiGLU.
///
/// All arrays are fp32 and contiguous; a `[rows, cols]` array is row-major. The loops are plain
/// indexed loops over raw pointers so that the compiler vectorises them (with a run-time
/// overlap check, since nothing is declared restrict); where the doc says an output may alias
/// an input, it may be the very same span (in place), never a shifted one.

#include <concerto/runtime/cpu/detail/check.hpp>
#include <concerto/runtime/cpu/detail/fast_math.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>

namespace concerto::runtime::cpu {

/// @brief `out = a + b`. out may alias a or b.
inline void add(std::span<const float> a, std::span<const float> b, std::span<float> out) {
  detail::require_size(b, a.size(), "add", "b");
  detail::require_size(out, a.size(), "add", "out");
  const float* pa = a.data();
  const float* pb = b.data();
  float* po = out.data();
  const std::size_t n = a.size();
  for (std::size_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
}

/// @brief `acc += x`: accumulates a gradient (a tensor read by two consumers, micro-batches).
/// @code
/// cpu::add_inplace(dx, dx_from_residual);
/// @endcode
inline void add_inplace(std::span<float> acc, std::span<const float> x) {
  detail::require_size(x, acc.size(), "add_inplace", "x");
  float* pa = acc.data();
  const float* px = x.data();
  const std::size_t n = acc.size();
  for (std::size_t i = 0; i < n; ++i) pa[i] += px[i];
}

/// @brief `out = alpha·x`. out may alias x; its gradient is `scale(dout, alpha, dx)`.
inline void scale(std::span<const float> x, float alpha, std::span<float> out) {
  detail::require_size(out, x.size(), "scale", "out");
  const float* px = x.data();
  float* po = out.data();
  const std::size_t n = x.size();
  for (std::size_t i = 0; i < n; ++i) po[i] = alpha * px[i];
}

/// @brief `out[r,c] = x[r,c] + bias[c]` on a `[rows, cols]` array. out may alias x.
/// @code
/// cpu::matmul(x, w, y, rows, out, in, {.trans_b = true});
/// cpu::bias_add(y, b, y, rows, out);
/// @endcode
inline void bias_add(std::span<const float> x, std::span<const float> bias, std::span<float> out,
                     std::size_t rows, std::size_t cols) {
  detail::require_size(x, rows * cols, "bias_add", "x");
  detail::require_size(bias, cols, "bias_add", "bias");
  detail::require_size(out, rows * cols, "bias_add", "out");
  const float* pb = bias.data();
  for (std::size_t r = 0; r < rows; ++r) {
    const float* px = x.data() + r * cols;
    float* po = out.data() + r * cols;
    for (std::size_t c = 0; c < cols; ++c) po[c] = px[c] + pb[c];
  }
}

/// @brief `out[r, c] = x[r, c] · table[c]`: x times a table of its last dims broadcast over the
/// rows (a per-channel scale, LayerScale); its x-gradient is the same product of dout.
inline void scale_table(std::span<const float> x, std::span<const float> table, std::span<float> out, std::size_t rows,
                        std::size_t cols) {
  detail::require_size(x, rows * cols, "scale_table", "x");
  detail::require_size(table, cols, "scale_table", "table");
  detail::require_size(out, rows * cols, "scale_table", "out");
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) out[r * cols + c] = x[r * cols + c] * table[c];
}

/// @brief The table's gradient of scale_table: `dtable[c] = Σ_r x[r, c]·dout[r, c]` (`+=` with accumulate).
inline void scale_table_grad(std::span<const float> x, std::span<const float> dout, std::span<float> dtable, std::size_t rows,
                             std::size_t cols, bool accumulate = false) {
  detail::require_size(x, rows * cols, "scale_table_grad", "x");
  detail::require_size(dout, rows * cols, "scale_table_grad", "dout");
  detail::require_size(dtable, cols, "scale_table_grad", "dtable");
  if (!accumulate) std::fill(dtable.begin(), dtable.end(), 0.0f);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) dtable[c] += x[r * cols + c] * dout[r * cols + c];
}

/// @brief Bias gradient: `dbias[c] = Σ_r dout[r,c]` (the column sums); dx of bias_add is dout itself.
///
/// With `accumulate` the sums are added to dbias instead of overwriting it.
inline void bias_add_grad(std::span<const float> dout, std::span<float> dbias, std::size_t rows,
                          std::size_t cols, bool accumulate = false) {
  detail::require_size(dout, rows * cols, "bias_add_grad", "dout");
  detail::require_size(dbias, cols, "bias_add_grad", "dbias");
  float* pd = dbias.data();
  if (!accumulate)
    for (std::size_t c = 0; c < cols; ++c) pd[c] = 0.0f;
  // Row after row, so the inner loop runs along contiguous memory and vectorises.
  for (std::size_t r = 0; r < rows; ++r) {
    const float* pg = dout.data() + r * cols;
    for (std::size_t c = 0; c < cols; ++c) pd[c] += pg[c];
  }
}

namespace detail {
inline constexpr float gelu_k0 = 0.7978845608028654f; // sqrt(2/pi)
inline constexpr float gelu_k1 = 0.044715f;
} // namespace detail

/// @brief GELU, tanh approximation: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`. out may alias x
/// only when the caller no longer needs x: the backward reads the input x.
CONCERTO_VECTOR_KERNEL inline void gelu(std::span<const float> x, std::span<float> out) {
  detail::require_size(out, x.size(), "gelu", "out");
  const float* px = x.data();
  float* po = out.data();
  const std::size_t n = x.size();
  for (std::size_t i = 0; i < n; ++i) {
    const float v = px[i];
    const float t = detail::tanh_approx(detail::gelu_k0 * (v + detail::gelu_k1 * v * v * v));
    po[i] = 0.5f * v * (1.0f + t);
  }
}

/// @brief `dx = dout · gelu'(x)` from the forward's input x. dx may alias dout.
CONCERTO_VECTOR_KERNEL inline void gelu_grad(std::span<const float> x, std::span<const float> dout, std::span<float> dx) {
  detail::require_size(dout, x.size(), "gelu_grad", "dout");
  detail::require_size(dx, x.size(), "gelu_grad", "dx");
  const float* px = x.data();
  const float* pg = dout.data();
  float* pd = dx.data();
  const std::size_t n = x.size();
  for (std::size_t i = 0; i < n; ++i) {
    const float v = px[i];
    const float t = detail::tanh_approx(detail::gelu_k0 * (v + detail::gelu_k1 * v * v * v));
    const float dinner = detail::gelu_k0 * (1.0f + 3.0f * detail::gelu_k1 * v * v);
    pd[i] = pg[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * dinner);
  }
}

/// @brief `out = max(x, 0)`. out may alias x (the backward can use the output instead of x).
inline void relu(std::span<const float> x, std::span<float> out) {
  detail::require_size(out, x.size(), "relu", "out");
  const float* px = x.data();
  float* po = out.data();
  const std::size_t n = x.size();
  for (std::size_t i = 0; i < n; ++i) po[i] = px[i] > 0.0f ? px[i] : 0.0f;
}

/// @brief `dx = x > 0 ? dout : 0`, where x is the forward's input or its output (same sign
/// test); the derivative at 0 is taken as 0. dx may alias dout.
inline void relu_grad(std::span<const float> x, std::span<const float> dout, std::span<float> dx) {
  detail::require_size(dout, x.size(), "relu_grad", "dout");
  detail::require_size(dx, x.size(), "relu_grad", "dx");
  const float* px = x.data();
  const float* pg = dout.data();
  float* pd = dx.data();
  const std::size_t n = x.size();
  for (std::size_t i = 0; i < n; ++i) {
    const float g = pg[i]; // loaded unconditionally, so the select becomes a vector blend
    pd[i] = px[i] > 0.0f ? g : 0.0f;
  }
}

namespace detail {
inline float sigmoid(float x) { return 1.0f / (1.0f + exp_approx(-x)); }
} // namespace detail

/// @brief SiLU (swish): `x·σ(x)`. out may alias x only when the caller no longer needs x: the
/// backward reads the input x.
CONCERTO_VECTOR_KERNEL inline void silu(std::span<const float> x, std::span<float> out) {
  detail::require_size(out, x.size(), "silu", "out");
  const float* px = x.data();
  float* po = out.data();
  const std::size_t n = x.size();
  for (std::size_t i = 0; i < n; ++i) po[i] = px[i] * detail::sigmoid(px[i]);
}

/// @brief `dx = dout·σ(x)·(1 + x·(1 - σ(x)))` from the forward's input x. dx may alias dout.
CONCERTO_VECTOR_KERNEL inline void silu_grad(std::span<const float> x, std::span<const float> dout, std::span<float> dx) {
  detail::require_size(dout, x.size(), "silu_grad", "dout");
  detail::require_size(dx, x.size(), "silu_grad", "dx");
  const float* px = x.data();
  const float* pg = dout.data();
  float* pd = dx.data();
  const std::size_t n = x.size();
  for (std::size_t i = 0; i < n; ++i) {
    const float s = detail::sigmoid(px[i]);
    pd[i] = pg[i] * s * (1.0f + px[i] * (1.0f - s));
  }
}

/// @brief The logistic function `1 / (1 + e^-x)`, elementwise (AlphaFold's attention gates). out may alias x.
CONCERTO_VECTOR_KERNEL inline void sigmoid(std::span<const float> x, std::span<float> out) {
  detail::require_size(out, x.size(), "sigmoid", "out");
  const float* px = x.data();
  float* po = out.data();
  const std::size_t n = x.size();
  for (std::size_t i = 0; i < n; ++i) po[i] = detail::sigmoid(px[i]);
}

/// @brief `dx = dout·y·(1 - y)` from the forward's output y. dx may alias dout.
CONCERTO_VECTOR_KERNEL inline void sigmoid_grad(std::span<const float> y, std::span<const float> dout, std::span<float> dx) {
  detail::require_size(dout, y.size(), "sigmoid_grad", "dout");
  detail::require_size(dx, y.size(), "sigmoid_grad", "dx");
  const float* py = y.data();
  const float* pg = dout.data();
  float* pd = dx.data();
  const std::size_t n = y.size();
  for (std::size_t i = 0; i < n; ++i) pd[i] = pg[i] * py[i] * (1.0f - py[i]);
}

/// @brief out[o, i] = scale·Σ_e x[o, e, i] over x [outer, extent, inner]: a sum (scale 1) or a
/// mean (1/extent of the whole dim) over one dim.
inline void sum_dim(std::span<const float> x, std::span<float> out, std::size_t outer, std::size_t extent,
                    std::size_t inner, float scale) {
  detail::require_size(x, outer * extent * inner, "sum_dim", "x");
  detail::require_size(out, outer * inner, "sum_dim", "out");
  for (std::size_t o = 0; o < outer; ++o) {
    float* row = out.data() + o * inner;
    std::fill(row, row + inner, 0.0f);
    for (std::size_t e = 0; e < extent; ++e) {
      const float* src = x.data() + (o * extent + e) * inner;
      for (std::size_t i = 0; i < inner; ++i) row[i] += src[i];
    }
    for (std::size_t i = 0; i < inner; ++i) row[i] *= scale;
  }
}
/// @brief dx[o, e, i] = scale·dout[o, i]: the gradient of sum_dim, dout repeated along the dim.
inline void sum_dim_grad(std::span<const float> dout, std::span<float> dx, std::size_t outer, std::size_t extent,
                         std::size_t inner, float scale) {
  detail::require_size(dout, outer * inner, "sum_dim_grad", "dout");
  detail::require_size(dx, outer * extent * inner, "sum_dim_grad", "dx");
  for (std::size_t o = 0; o < outer; ++o)
    for (std::size_t e = 0; e < extent; ++e) {
      float* dst = dx.data() + (o * extent + e) * inner;
      const float* src = dout.data() + o * inner;
      for (std::size_t i = 0; i < inner; ++i) dst[i] = scale * src[i];
    }
}

/// @brief The hyperbolic tangent, elementwise (detail::tanh_approx, which vectorises). out may alias x.
CONCERTO_VECTOR_KERNEL inline void tanh(std::span<const float> x, std::span<float> out) {
  detail::require_size(out, x.size(), "tanh", "out");
  const float* px = x.data();
  float* po = out.data();
  const std::size_t n = x.size();
  for (std::size_t i = 0; i < n; ++i) po[i] = detail::tanh_approx(px[i]);
}

/// @brief `dx = dout·(1 - y²)` from the forward's output y. dx may alias dout.
CONCERTO_VECTOR_KERNEL inline void tanh_grad(std::span<const float> y, std::span<const float> dout, std::span<float> dx) {
  detail::require_size(dout, y.size(), "tanh_grad", "dout");
  detail::require_size(dx, y.size(), "tanh_grad", "dx");
  const float* py = y.data();
  const float* pg = dout.data();
  float* pd = dx.data();
  const std::size_t n = y.size();
  for (std::size_t i = 0; i < n; ++i) pd[i] = pg[i] * (1.0f - py[i] * py[i]);
}

/// @brief `out[o, c, r, :] = x[o, r, c, :]` for x `[outer, rows, cols, inner]`: a pair of
/// neighbouring dimensions swapped (outer = 1: the two leading ones, column attention as row
/// attention of the transposed pair representation; an image's patches gathered). Its gradient
/// is the same function with rows and cols exchanged. out must not alias x.
inline void swap_dims(std::span<const float> x, std::span<float> out, std::size_t outer, std::size_t rows,
                      std::size_t cols, std::size_t inner) {
  const auto block = rows * cols * inner;
  detail::require_size(x, outer * block, "transpose", "x");
  detail::require_size(out, outer * block, "transpose", "out");
  for (std::size_t o = 0; o < outer; ++o)
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < cols; ++c)
        std::copy_n(x.data() + o * block + (r * cols + c) * inner, inner, out.data() + o * block + (c * rows + r) * inner);
}

/// @brief `out = a·b`, element by element. out may alias a or b. Its gradients are products too:
/// `da = dout·b`, `db = dout·a`.
inline void mul(std::span<const float> a, std::span<const float> b, std::span<float> out) {
  detail::require_size(b, a.size(), "mul", "b");
  detail::require_size(out, a.size(), "mul", "out");
  const float* pa = a.data();
  const float* pb = b.data();
  float* po = out.data();
  const std::size_t n = a.size();
  for (std::size_t i = 0; i < n; ++i) po[i] = pa[i] * pb[i];
}

/// @brief SwiGLU's gate: `out = silu(gate)·up` (the two halves of Llama's MLP input projection).
/// out may alias up.
CONCERTO_VECTOR_KERNEL inline void swiglu(std::span<const float> gate, std::span<const float> up, std::span<float> out) {
  detail::require_size(up, gate.size(), "swiglu", "up");
  detail::require_size(out, gate.size(), "swiglu", "out");
  const float* pa = gate.data();
  const float* pb = up.data();
  float* po = out.data();
  const std::size_t n = gate.size();
  for (std::size_t i = 0; i < n; ++i) po[i] = pa[i] * detail::sigmoid(pa[i]) * pb[i];
}

/// @brief Backward of `swiglu`: `dgate = dout·up·silu'(gate)`, `dup = dout·silu(gate)`.
/// dgate and dup may not alias the inputs.
CONCERTO_VECTOR_KERNEL inline void swiglu_grad(std::span<const float> gate, std::span<const float> up, std::span<const float> dout,
                        std::span<float> dgate, std::span<float> dup) {
  const std::size_t n = gate.size();
  detail::require_size(up, n, "swiglu_grad", "up");
  detail::require_size(dout, n, "swiglu_grad", "dout");
  detail::require_size(dgate, n, "swiglu_grad", "dgate");
  detail::require_size(dup, n, "swiglu_grad", "dup");
  const float* pa = gate.data();
  const float* pb = up.data();
  const float* pg = dout.data();
  float* pda = dgate.data();
  float* pdb = dup.data();
  for (std::size_t i = 0; i < n; ++i) {
    const float s = detail::sigmoid(pa[i]);
    const float silu_a = pa[i] * s;
    pda[i] = pg[i] * pb[i] * s * (1.0f + pa[i] * (1.0f - s));
    pdb[i] = pg[i] * silu_a;
  }
}

} // namespace concerto::runtime::cpu
