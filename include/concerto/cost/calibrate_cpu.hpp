#pragma once
/// @file
/// @brief Measures this machine for the "cpu" preset: single-threaded sgemm throughput at a
/// few shapes (fitted to the efficiency curve), memory bandwidth (STREAM triad), a vector
/// loop's throughput, the fixed cost of a tiny kernel, and how much a concurrent copy slows
/// compute. Results are cached per machine (cpu_cache.hpp); a bad cache file is reported on
/// stderr and measured again.
///
/// Needs CBLAS: only targets linked to concerto::mpi include this header. Communication links
/// keep the documented shared-memory defaults until the MPI runtime measures them and calls
/// with_links(). The whole measurement takes well under a second on a current core.
///
/// @code
/// #include <concerto/cost/calibrate_cpu.hpp>
/// cost::model m(cost::calibrate_cpu()); // measured once per machine, then read from the cache
/// @endcode

#include <concerto/cost/model.hpp>

#include <cblas.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

namespace concerto::cost {

/// @brief One timed sgemm shape.
struct gemm_sample {
  int m = 0, n = 0, k = 0;
  double us = 0; ///< best time of one call
  [[nodiscard]] double flops() const noexcept { return 2.0 * m * n * static_cast<double>(k); }
};

/// @brief What calibration found, and where it came from.
struct calibration {
  hardware hw;
  bool from_cache = false;
  std::filesystem::path file;       ///< the cache file read or written
  std::vector<gemm_sample> samples; ///< empty when read from the cache
  double fit_rms_log_error = 0;     ///< of the efficiency fit over the samples
};

namespace detail {

using clock = std::chrono::steady_clock;

// OpenBLAS would otherwise use every core; the model describes one rank on one core.
// The previous setting is restored so the caller's process is left as it was.
class single_thread_blas {
public:
  single_thread_blas() {
#ifdef OPENBLAS_VERSION
    previous_ = openblas_get_num_threads();
    openblas_set_num_threads(1);
#endif
  }
  ~single_thread_blas() {
#ifdef OPENBLAS_VERSION
    openblas_set_num_threads(previous_);
#endif
  }
  single_thread_blas(const single_thread_blas&) = delete;
  single_thread_blas& operator=(const single_thread_blas&) = delete;

private:
  [[maybe_unused]] int previous_ = 1;
};

// Best-of time in µs of `fn`, repeated until `budget_us` is spent (at least `min_reps`):
// the minimum is the least disturbed run on a shared machine.
template <class Fn>
double best_us(Fn&& fn, double budget_us, int min_reps = 3) {
  fn(); // warm caches and page tables
  double best = std::numeric_limits<double>::infinity(), spent = 0;
  for (int rep = 0; rep < min_reps || spent < budget_us; ++rep) {
    const auto t0 = clock::now();
    fn();
    const double us = std::chrono::duration<double, std::micro>(clock::now() - t0).count();
    best = std::min(best, us);
    spent += us;
    if (rep > 1000) break;
  }
  return best;
}

struct gemm_buffers {
  std::vector<float> a, b, c;
  explicit gemm_buffers(std::size_t elems) : a(elems, 1.0f), b(elems, 0.5f), c(elems, 0.0f) {}
  void run(int m, int n, int k) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f,
                c.data(), n);
  }
};

// The efficiency factors of model.hpp, without max_efficiency (1 here).
inline double fitted_efficiency(const gemm_sample& s, double half_dim, double half_flops) {
  const double d = std::min({s.m, s.n, s.k});
  const double f = s.flops();
  return d / (d + half_dim) * (f / (f + half_flops));
}

struct fit_result {
  double peak_tflops = 0, half_dim = 0, half_flops = 0, rms_log_error = 0;
};

// Least squares in log time over a grid of the two half points; for each pair the best peak
// has a closed form (the mean log residual), so the search is a few thousand cheap sums.
inline fit_result fit_gemm(const std::vector<gemm_sample>& samples, double launch_us) {
  fit_result best{0, 0, 0, std::numeric_limits<double>::infinity()};
  std::vector<double> dims{0}, flops{0};
  for (double d = 0.5; d <= 1024; d *= std::sqrt(2.0)) dims.push_back(d);
  for (double f = 1e3; f <= 1e10; f *= std::sqrt(2.0)) flops.push_back(f);
  for (double hd : dims)
    for (double hf : flops) {
      // log t = log flops - log(peak · eff) → log peak = mean(log flops - log eff - log t).
      double sum = 0;
      std::vector<double> r;
      r.reserve(samples.size());
      for (const auto& s : samples) {
        const double t = std::max(s.us - launch_us, 0.05 * s.us);
        r.push_back(std::log(s.flops()) - std::log(fitted_efficiency(s, hd, hf)) - std::log(t));
        sum += r.back();
      }
      const double log_peak = sum / static_cast<double>(r.size());
      double sq = 0;
      for (double x : r) sq += (x - log_peak) * (x - log_peak);
      const double rms = std::sqrt(sq / static_cast<double>(r.size()));
      if (rms < best.rms_log_error - 1e-12)
        best = {std::exp(log_peak) / 1e6 /* flop/µs → TFLOP/s */, hd, hf, rms};
    }
  return best;
}

// STREAM triad a = b + s·c over arrays well beyond the last-level cache; bytes counted as
// STREAM does (two reads, one write), the same convention as a compute task's `bytes`.
inline double triad_gbs() {
  constexpr std::size_t n = std::size_t{1} << 22; // 3 × 32 MiB of doubles
  std::vector<double> a(n, 0.0), b(n, 1.0), c(n, 2.0);
  const double us = best_us(
      [&] {
        double* __restrict pa = a.data();
        const double* __restrict pb = b.data();
        const double* __restrict pc = c.data();
        for (std::size_t i = 0; i < n; ++i) pa[i] = pb[i] + 3.0 * pc[i];
      },
      60e3, 3);
  volatile double sink = a[n / 2];
  (void)sink;
  return 3.0 * sizeof(double) * static_cast<double>(n) / (us * 1e3);
}

// An in-cache multiply-add loop: what a non-BLAS kernel of ours reaches when not memory bound.
inline double vector_tflops() {
  constexpr std::size_t n = 2048; // 16 KiB of floats: stays in L1
  std::vector<float> x(n, 1.0f), y(n, 0.0f);
  constexpr int inner = 64;
  const double us = best_us(
      [&] {
        float* __restrict py = y.data();
        const float* __restrict px = x.data();
        for (int r = 0; r < inner; ++r)
          for (std::size_t i = 0; i < n; ++i) py[i] = py[i] * 0.999f + px[i];
      },
      10e3, 5);
  volatile float sink = y[n / 3];
  (void)sink;
  return 2.0 * n * inner / (us * 1e6);
}

// sgemm time with and without a thread copying buffers (what a shared-memory collective does)
// at the same time; the ratio is the contention a planned overlap will meet.
inline double measure_overlap_slowdown(gemm_buffers& buf, int dim) {
  const double alone = best_us([&] { buf.run(dim, dim, dim); }, 30e3, 3);
  std::atomic<bool> stop{false};
  std::thread copier([&stop] {
    std::vector<char> src(std::size_t{16} << 20, 1), dst(src.size());
    while (!stop.load(std::memory_order_relaxed)) std::memcpy(dst.data(), src.data(), src.size());
  });
  const double together = best_us([&] { buf.run(dim, dim, dim); }, 30e3, 3);
  stop = true;
  copier.join();
  // A busy machine can make either run slow; keep the factor within what it can mean.
  return std::clamp(together / alone, 1.0, 2.0);
}

} // namespace detail

/// @brief Measures this machine now, without reading or writing the cache.
[[nodiscard]] inline calibration measure_cpu() {
  detail::single_thread_blas one_thread;
  calibration out;
  out.hw = presets::cpu_defaults(); // keeps the documented link defaults and the name
  out.file = cpu_cache_file();

  constexpr int largest = 768;
  detail::gemm_buffers buf(std::size_t{largest} * largest);
  out.hw.launch_us = std::max(0.05, detail::best_us([&] { buf.run(2, 2, 2); }, 2e3, 50));
  // Square shapes span the size factor; thin ones (small m or k at large flops) separate the
  // shape factor from it.
  const int shapes[][3] = {{16, 16, 16},  {32, 32, 32},   {64, 64, 64},   {128, 128, 128}, {256, 256, 256},
                           {512, 512, 512}, {768, 768, 768}, {8, 768, 768},  {768, 768, 8},   {32, 768, 768},
                           {768, 32, 768}};
  for (const auto& s : shapes) {
    const double us = detail::best_us([&] { buf.run(s[0], s[1], s[2]); }, 12e3, 3);
    out.samples.push_back({s[0], s[1], s[2], us});
  }
  const auto fit = detail::fit_gemm(out.samples, out.hw.launch_us);
  out.hw.peak_tflops = fit.peak_tflops;
  out.hw.max_efficiency = 1.0;
  out.hw.efficiency_half_dim = fit.half_dim;
  out.hw.efficiency_half_flops = fit.half_flops;
  out.fit_rms_log_error = fit.rms_log_error;
  out.hw.mem_bandwidth_gbs = detail::triad_gbs();
  out.hw.vector_tflops = detail::vector_tflops();
  out.hw.overlap_slowdown = detail::measure_overlap_slowdown(buf, 512);
  out.hw.validate();
  return out;
}

/// @brief The "cpu" hardware of this machine: the cached calibration when `use_cache` and a
/// valid cache file exists; otherwise measured and written to the cache. A cache file that is
/// corrupted, truncated or of another version is reported on stderr and replaced. Reports
/// where the numbers came from.
[[nodiscard]] inline calibration calibrate_cpu_report(bool use_cache = true) {
  const auto file = cpu_cache_file();
  if (use_cache) {
    if (auto hw = load_cpu_cache(file)) {
      calibration out;
      out.hw = std::move(*hw);
      out.from_cache = true;
      out.file = file;
      return out;
    }
  }
  auto out = measure_cpu();
  out.file = file;
  try {
    save_cpu_cache(file, out.hw);
  } catch (const concerto::error& e) { // a read-only cache folder costs a re-measure, not a failure
    std::cerr << e.what() << '\n';
  }
  return out;
}

/// @brief The "cpu" hardware of this machine (see calibrate_cpu_report).
/// @code
/// auto hw = cost::calibrate_cpu();
/// auto m = cost::model(cost::with_links(hw, measured_intra, measured_inter));
/// @endcode
[[nodiscard]] inline hardware calibrate_cpu(bool use_cache = true) { return calibrate_cpu_report(use_cache).hw; }

} // namespace concerto::cost
