// The CPU dispatch's matrix products (runtime/dispatch.hpp, one thread) with f32 operands and
// with bf16 operands (widened to f32 around the same sgemm, the result rounded back: a bf16
// step's products), at the shapes of the emulated cluster's GPT and Llama (width 256, 512 tokens
// per rank) and one square; GFLOP/s and the share of one core's f32 peak.
//
//   build/bench/cpu_kernels/cpu-kernels [--peak-gflops G] [--reps 9]
//
// The peak is measured, not taken from the clock a VM reports (which omits boost): twelve
// independent chains of 8-wide fused multiply-adds (AVX2 + FMA) for 0.2 s, the best of 5; pass
// --peak-gflops to use another.
#include <concerto/core/bfloat16.hpp>
#include <concerto/core/statistics.hpp>
#include <concerto/ir/builder.hpp>
#include <concerto/runtime/cpu/kernels.hpp>
#include <concerto/runtime/dispatch.hpp>

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

using namespace concerto;

namespace {

// GFLOP/s of twelve independent FMA chains (enough to keep two FMA pipes of 4-5 cycles' latency busy).
__attribute__((target("avx2,fma"))) double fma_peak_gflops() {
  double best = 0;
  for (int trial = 0; trial < 5; ++trial) {
    __m256 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(0.001f * static_cast<float>(i));
    const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
    std::int64_t iterations = 0;
    const auto start = std::chrono::steady_clock::now();
    double seconds = 0;
    while (seconds < 0.2) {
      for (int r = 0; r < 4096; ++r)
        for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], x, y);
      iterations += 4096;
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    __m256 sum = acc[0];
    for (int i = 1; i < 12; ++i) sum = _mm256_add_ps(sum, acc[i]);
    volatile float sink = _mm256_cvtss_f32(sum); // keeps the chains
    (void)sink;
    best = std::max(best, static_cast<double>(iterations) * 12 * 8 * 2 / seconds / 1e9);
  }
  return best;
}

// Median milliseconds of one product m x k times k x n with operands of type t.
double time_product(std::int64_t m, std::int64_t n, std::int64_t k, ir::dtype t, int reps) {
  ir::builder b("product");
  const auto a = b.buffer("a", {m, k}, ir::buffer_role::activation, t);
  const auto w = b.buffer("w", {k, n}, ir::buffer_role::activation, t);
  const auto c = b.buffer("c", {m, n}, ir::buffer_role::activation, t);
  b.matmul("mm", a, w, c, m, n, k);
  const auto g = std::move(b).finish();
  const auto call = runtime::decode(g, g.tasks[0]);
  runtime::host_arena mem(g, runtime::make_layout(g, runtime::workspace_bytes(g)));
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1, 1);
  for (const auto id : {a, w}) {
    auto bytes = mem.bytes(id);
    if (t == ir::dtype::f32) {
      for (auto& v : mem.f32(id)) v = u(rng);
    } else {
      auto* h = reinterpret_cast<std::uint16_t*>(bytes.data());
      for (std::size_t i = 0; i < bytes.size() / 2; ++i) h[i] = to_bf16(u(rng));
    }
  }
  const runtime::kernel_settings settings{};
  runtime::run_kernel(call, mem, settings); // warm: pages touched, BLAS buffers made
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    runtime::run_kernel(call, mem, settings);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  return median(ms);
}

} // namespace

int main(int argc, char** argv) {
  double peak = 0;
  int reps = 9;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--peak-gflops") peak = std::atof(argv[i + 1]);
    else if (flag == "--reps") reps = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "cpu-kernels: unknown option '%s' (--peak-gflops G, --reps N)\n", flag.c_str());
      return 2;
    }
  }
  if (peak <= 0) peak = fma_peak_gflops();
  runtime::cpu::init_blas_threads();
  struct shape {
    const char* what;
    std::int64_t m, n, k;
  };
  const shape shapes[] = {{"qkv (GPT)", 512, 768, 256},      {"fc1 (GPT)", 512, 1024, 256}, {"fc2 (GPT)", 512, 256, 1024},
                          {"w1/w3 (Llama)", 512, 688, 256}, {"head 256->256", 512, 256, 256}, {"square", 1024, 1024, 1024}};
  std::printf("one core, f32 peak %.1f GFLOP/s (measured FMA chains, or --peak-gflops), median of %d\n", peak, reps);
  std::printf("%-16s %16s %10s %8s %10s %8s %10s\n", "product", "m x n x k", "f32 ms", "f32 %pk", "bf16 ms", "bf16 %pk",
              "bf16/f32");
  for (const auto& s : shapes) {
    const double flops = 2.0 * static_cast<double>(s.m * s.n * s.k);
    const double f = time_product(s.m, s.n, s.k, ir::dtype::f32, reps);
    const double h = time_product(s.m, s.n, s.k, ir::dtype::bf16, reps);
    char dims[40];
    std::snprintf(dims, sizeof dims, "%lldx%lldx%lld", static_cast<long long>(s.m), static_cast<long long>(s.n),
                  static_cast<long long>(s.k));
    std::printf("%-16s %16s %10.3f %7.1f%% %10.3f %7.1f%% %10.2f\n", s.what, dims, f, 100 * flops / (f * 1e6) / peak, h,
                100 * flops / (h * 1e6) / peak, h / f);
  }
  return 0;
}
