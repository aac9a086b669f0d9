// The CPU convolution kernels (runtime/cpu/convolution.hpp, one thread) at the shapes of
// examples/wresnet and examples/vit (16 images of 16 × 16, as one of 2 data-parallel ranks
// holds them): forward, the image's gradient and the kernel's, each timed alone (median of
// --reps), their GFLOP/s, and the rate of one BLAS product of the same FLOPs (m = output
// positions, n = output channels, k = the patch) for the "% of our product rate" the issue
// sizes them by. `--csv` prints one line per shape for bench/cpu_kernels/conv_vs_torch.py,
// which times PyTorch's CPU convolution (oneDNN) on the same shapes in the same run. The ViT's
// patch embedding is timed a second way too: the image cut into patches by views and one
// transpose (cpu::swap_dims: unflatten, transpose<1>, flatten in the DSL) and one product, its
// gradients a product each and the transpose back (the path a user who reshapes would run).
//
//   build/bench/cpu_kernels/cpu-conv [--reps 9] [--csv]
#include <concerto/core/statistics.hpp>
#include <concerto/runtime/cpu/kernels.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

using namespace concerto;
namespace cpu = concerto::runtime::cpu;

namespace {

template <class F>
double median_ms(int reps, F&& f) {
  f(); // warm: pages touched, BLAS buffers made
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  return median(ms);
}

std::vector<float> random(std::size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

// The ViT patch shape of the table (16 images 16 × 16 × 3, 4 × 4 patches, 64 channels) as views,
// a transpose and products: forward = transpose + product, dx = product + transpose back, dw = product.
void patches_by_reshape(int reps, std::mt19937& rng) {
  constexpr std::size_t n = 16, side = 16, c = 3, p = 4, out = 64, grid = side / p;
  constexpr std::size_t positions = n * grid * grid, patch = p * p * c;
  const auto x = random(n * side * side * c, rng), w = random(patch * out, rng), dy = random(positions * out, rng);
  std::vector<float> patches(x.size()), y(positions * out), dpatches(x.size()), dx(x.size()), dw(w.size());
  // x [n·grid, p, grid, p·c] -> [n·grid, grid, p, p·c]: the patches' rows [positions, patch].
  const double fwd = median_ms(reps, [&] {
    cpu::swap_dims(x, patches, n * grid, p, grid, p * c);
    cpu::matmul(patches, w, y, positions, out, patch);
  });
  const double gin = median_ms(reps, [&] {
    cpu::matmul(dy, w, dpatches, positions, patch, out, {.trans_b = true});
    cpu::swap_dims(dpatches, dx, n * grid, grid, p, p * c);
  });
  const double gw = median_ms(reps, [&] { cpu::matmul(patches, dy, dw, patch, out, positions, {.trans_a = true}); });
  const double flops = 3 * 2.0 * positions * out * patch;
  std::printf("%-18s %9.4f %9.3f %9.3f %9.3f %9.2f %9s %10s\n", "vit patch reshape", flops / 1e9, fwd, gin, gw,
              flops / ((fwd + gin + gw) * 1e6), "", "");
}

} // namespace

int main(int argc, char** argv) {
  int reps = 9;
  bool csv = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (flag == "--csv") csv = true;
    else {
      std::fprintf(stderr, "cpu-conv: unknown option '%s' (--reps N, --csv)\n", flag.c_str());
      return 2;
    }
  }
  cpu::init_blas_threads();
  struct shape {
    const char* what;
    ir::conv_geometry g;
  };
  // batch, height, width, in, out, kernel_h, kernel_w, stride, padding
  const shape shapes[] = {
      {"wrn stem 3x3", {16, 16, 16, 3, 16, 3, 3, 1, 1}},      {"wrn s1 1x1 reduce", {16, 16, 16, 32, 16, 1, 1, 1, 0}},
      {"wrn s1 3x3", {16, 16, 16, 16, 16, 3, 3, 1, 1}},       {"wrn s1 1x1 expand", {16, 16, 16, 16, 32, 1, 1, 1, 0}},
      {"wrn s2 3x3 /2", {16, 16, 16, 32, 32, 3, 3, 2, 1}},    {"wrn s3 3x3 /2", {16, 8, 8, 64, 64, 3, 3, 2, 1}},
      {"wrn w2 s1 3x3", {16, 16, 16, 32, 32, 3, 3, 1, 1}},    {"vit patch 4x4 /4", {16, 16, 16, 3, 64, 4, 4, 4, 0}},
  };
  std::mt19937 rng(3);
  if (!csv)
    std::printf("%-18s %9s %9s %9s %9s %9s %9s %10s\n", "convolution", "GFLOP", "fwd ms", "dx ms", "dw ms", "GFLOP/s", "gemm GF/s",
                "of gemm");
  for (const auto& s : shapes) {
    const auto& g = s.g;
    const auto x = random(static_cast<std::size_t>(g.x_values()), rng), w = random(static_cast<std::size_t>(g.w_values()), rng),
               dy = random(static_cast<std::size_t>(g.y_values()), rng);
    std::vector<float> y(dy.size()), dx(x.size()), dw(w.size()), ws(cpu::conv2d_workspace_floats(g));
    const double fwd = median_ms(reps, [&] { cpu::conv2d(x, w, y, g, ws); });
    const double gin = median_ms(reps, [&] { cpu::conv2d_grad_input(dy, w, dx, g, ws); });
    const double gw = median_ms(reps, [&] { cpu::conv2d_grad_weight(x, dy, dw, g, false, ws); });
    // One product of the same FLOPs: the patches [positions, patch] times the kernel [patch, out].
    const auto m = static_cast<std::size_t>(g.positions()), n = static_cast<std::size_t>(g.out_channels),
               k = static_cast<std::size_t>(g.patch());
    const auto a = random(m * k, rng), b = random(k * n, rng);
    std::vector<float> c(m * n);
    const double gemm = median_ms(reps, [&] { cpu::matmul(a, b, c, m, n, k); });
    const double flops = 3 * g.flops(); // forward and both gradients
    const double rate = flops / ((fwd + gin + gw) * 1e6), gemm_rate = g.flops() / (gemm * 1e6);
    if (csv)
      std::printf("%s,%lld,%lld,%lld,%lld,%lld,%lld,%lld,%lld,%lld,%.6f,%.6f,%.6f,%.6f\n", s.what, static_cast<long long>(g.batch),
                  static_cast<long long>(g.height), static_cast<long long>(g.width), static_cast<long long>(g.in_channels),
                  static_cast<long long>(g.out_channels), static_cast<long long>(g.kernel_h), static_cast<long long>(g.kernel_w),
                  static_cast<long long>(g.stride), static_cast<long long>(g.padding), fwd, gin, gw, gemm);
    else
      std::printf("%-18s %9.4f %9.3f %9.3f %9.3f %9.2f %9.2f %9.0f%%\n", s.what, flops / 1e9, fwd, gin, gw, rate, gemm_rate,
                  100 * rate / gemm_rate);
  }
  if (!csv) patches_by_reshape(reps, rng);
  return 0;
}
