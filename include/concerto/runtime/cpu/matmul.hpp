#pragma once
/// @file
/// @brief Matrix products on the CPU through CBLAS (forward and backward) and the BLAS thread setting.
///
/// Layout: every matrix is fp32, row-major and contiguous. `C[m,n] = alpha * op(A) * op(B)`
/// where op(A) is `[m,k]` and op(B) is `[k,n]`; A is stored `[m,k]`, or `[k,m]` when `trans_a`;
/// B is stored `[k,n]`, or `[n,k]` when `trans_b`.

#include <concerto/runtime/cpu/detail/check.hpp>

#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <span>
#include <string>

// Weak, so that a CBLAS without this OpenBLAS extension still links; the address is null there.
extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace concerto::runtime::cpu {

/// @brief Sets the number of threads the BLAS may use in this process.
///
/// Each MPI rank is one process and the ranks already fill the cores, so the executor calls
/// this with 1 (the default) before the first step; a threaded BLAS inside every rank would
/// oversubscribe the machine.
/// @return true when the BLAS took the setting (OpenBLAS); false when the linked BLAS has no
///         such control (the call is then a no-op).
/// @code
/// concerto::runtime::cpu::init_blas_threads();  // one BLAS thread per rank
/// @endcode
inline bool init_blas_threads(int threads = 1) {
  CONCERTO_CHECK(threads >= 1, "init_blas_threads: threads must be at least 1, got " +
                                   std::to_string(threads));
  if (openblas_set_num_threads == nullptr) return false;
  openblas_set_num_threads(threads);
  return true;
}

/// @brief How `matmul` reads its operands and writes its result.
struct matmul_options {
  bool trans_a = false;    ///< A is stored [k, m] and used transposed
  bool trans_b = false;    ///< B is stored [n, k] and used transposed
  bool accumulate = false; ///< C += alpha·op(A)·op(B) (beta = 1) instead of overwriting C
  float alpha = 1.0f;      ///< scale of the product
};

namespace detail {

inline int blas_int(std::size_t v, const char* what) {
  CONCERTO_CHECK(v <= static_cast<std::size_t>(INT_MAX),
                 std::string("matmul: extent `") + what + "` = " + std::to_string(v) +
                     " exceeds the 32-bit BLAS interface");
  return static_cast<int>(v);
}

// Row-major sgemm with explicit leading dimensions, so attention can address one head inside
// a [seq, heads*head_dim] row without copying it out.
inline void gemm(bool trans_a, bool trans_b, std::size_t m, std::size_t n, std::size_t k,
                 float alpha, const float* a, std::size_t lda, const float* b, std::size_t ldb,
                 float beta, float* c, std::size_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    // BLAS implementations disagree on k == 0 with beta == 0 (some leave NaNs in C); do it here.
    for (std::size_t i = 0; i < m; ++i) {
      float* row = c + i * ldc;
      for (std::size_t j = 0; j < n; ++j) row[j] = beta == 0.0f ? 0.0f : beta * row[j];
    }
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              blas_int(m, "m"), blas_int(n, "n"), blas_int(k, "k"), alpha, a,
              blas_int(std::max<std::size_t>(lda, 1), "lda"), b,
              blas_int(std::max<std::size_t>(ldb, 1), "ldb"), beta, c,
              blas_int(std::max<std::size_t>(ldc, 1), "ldc"));
}

inline void gemm_batched(std::size_t batch, std::size_t m, std::size_t n, std::size_t k,
                         const float* a, const float* b, float* c, const matmul_options& o) {
  const std::size_t lda = o.trans_a ? m : k;
  const std::size_t ldb = o.trans_b ? k : n;
  for (std::size_t i = 0; i < batch; ++i)
    gemm(o.trans_a, o.trans_b, m, n, k, o.alpha, a + i * m * k, lda, b + i * k * n, ldb,
         o.accumulate ? 1.0f : 0.0f, c + i * m * n, n);
}

inline void matmul_grad_batched(std::size_t batch, std::size_t m, std::size_t n, std::size_t k,
                                const float* a, const float* b, const float* dc, float* da,
                                float* db, const matmul_options& fwd, bool accumulate) {
  // With Ā = op(A), B̄ = op(B): dĀ = dC·B̄ᵀ and dB̄ = Āᵀ·dC; a transposed operand gets the
  // transpose of that, which is again a single gemm with the flags rearranged.
  for (std::size_t i = 0; i < batch; ++i) {
    const float* ai = a + i * m * k;
    const float* bi = b + i * k * n;
    const float* dci = dc + i * m * n;
    if (da != nullptr) {
      float* dai = da + i * m * k;
      matmul_options o{.accumulate = accumulate, .alpha = fwd.alpha};
      if (!fwd.trans_a) { // dA[m,k] = dC[m,n] · op(B)ᵀ
        o.trans_b = !fwd.trans_b;
        gemm_batched(1, m, k, n, dci, bi, dai, o);
      } else { // dA[k,m] = op(B)[k,n] · dCᵀ
        o.trans_a = fwd.trans_b;
        o.trans_b = true;
        gemm_batched(1, k, m, n, bi, dci, dai, o);
      }
    }
    if (db != nullptr) {
      float* dbi = db + i * k * n;
      matmul_options o{.accumulate = accumulate, .alpha = fwd.alpha};
      if (!fwd.trans_b) { // dB[k,n] = op(A)ᵀ · dC
        o.trans_a = !fwd.trans_a;
        gemm_batched(1, k, n, m, ai, dci, dbi, o);
      } else { // dB[n,k] = dCᵀ · op(A)
        o.trans_a = true;
        o.trans_b = fwd.trans_a;
        gemm_batched(1, n, k, m, dci, ai, dbi, o);
      }
    }
  }
}

} // namespace detail

/// @brief `C[m,n] = alpha·op(A)·op(B)` (or `+=` with `accumulate`), one cblas_sgemm.
///
/// Sizes: a holds m·k floats, b k·n, c m·n (checked). C must not alias A or B.
/// @code
/// // y[rows, out] = x[rows, in] · w[out, in]ᵀ
/// cpu::matmul(x, w, y, rows, out, in, {.trans_b = true});
/// @endcode
inline void matmul(std::span<const float> a, std::span<const float> b, std::span<float> c,
                   std::size_t m, std::size_t n, std::size_t k, const matmul_options& options = {}) {
  detail::require_size(a, m * k, "matmul", "a");
  detail::require_size(b, k * n, "matmul", "b");
  detail::require_size(c, m * n, "matmul", "c");
  detail::gemm_batched(1, m, n, k, a.data(), b.data(), c.data(), options);
}

/// @brief `batch` independent products; operand i starts at `i·m·k` in a, `i·k·n` in b, `i·m·n` in c.
///
/// A product whose B is shared across the batch is one `matmul` with m = batch·rows instead.
inline void matmul_batched(std::span<const float> a, std::span<const float> b, std::span<float> c,
                           std::size_t batch, std::size_t m, std::size_t n, std::size_t k,
                           const matmul_options& options = {}) {
  detail::require_size(a, batch * m * k, "matmul_batched", "a");
  detail::require_size(b, batch * k * n, "matmul_batched", "b");
  detail::require_size(c, batch * m * n, "matmul_batched", "c");
  detail::gemm_batched(batch, m, n, k, a.data(), b.data(), c.data(), options);
}

/// @brief Backward of `matmul(a, b, c, m, n, k, forward)`: da and db from dc.
///
/// da and db have the stored layout of a and b (transposed when the forward flag says so) and
/// include `forward.alpha`; `forward.accumulate` plays no part. Either may be empty to skip it
/// (an input that needs no gradient). With `accumulate`, the gradients are added to da and db
/// (micro-batches, a parameter used twice); otherwise they overwrite them.
/// @code
/// cpu::matmul(x, w, y, rows, out, in, {.trans_b = true});
/// cpu::matmul_grad(x, w, dy, dx, dw, rows, out, in, {.trans_b = true}, /*accumulate=*/true);
/// @endcode
inline void matmul_grad(std::span<const float> a, std::span<const float> b, std::span<const float> dc,
                        std::span<float> da, std::span<float> db, std::size_t m, std::size_t n,
                        std::size_t k, const matmul_options& forward = {}, bool accumulate = false) {
  detail::require_size(a, m * k, "matmul_grad", "a");
  detail::require_size(b, k * n, "matmul_grad", "b");
  detail::require_size(dc, m * n, "matmul_grad", "dc");
  detail::require_size_or_empty(da, m * k, "matmul_grad", "da");
  detail::require_size_or_empty(db, k * n, "matmul_grad", "db");
  detail::matmul_grad_batched(1, m, n, k, a.data(), b.data(), dc.data(),
                              da.empty() ? nullptr : da.data(), db.empty() ? nullptr : db.data(),
                              forward, accumulate);
}

/// @brief Backward of `matmul_batched`, with the conventions of `matmul_grad`.
inline void matmul_batched_grad(std::span<const float> a, std::span<const float> b,
                                std::span<const float> dc, std::span<float> da, std::span<float> db,
                                std::size_t batch, std::size_t m, std::size_t n, std::size_t k,
                                const matmul_options& forward = {}, bool accumulate = false) {
  detail::require_size(a, batch * m * k, "matmul_batched_grad", "a");
  detail::require_size(b, batch * k * n, "matmul_batched_grad", "b");
  detail::require_size(dc, batch * m * n, "matmul_batched_grad", "dc");
  detail::require_size_or_empty(da, batch * m * k, "matmul_batched_grad", "da");
  detail::require_size_or_empty(db, batch * k * n, "matmul_batched_grad", "db");
  detail::matmul_grad_batched(batch, m, n, k, a.data(), b.data(), dc.data(),
                              da.empty() ? nullptr : da.data(), db.empty() ? nullptr : db.data(),
                              forward, accumulate);
}

} // namespace concerto::runtime::cpu
