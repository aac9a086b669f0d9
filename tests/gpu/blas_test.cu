// The cuBLASLt products against the CPU matmul, for every flag combination and bf16 and f16
// inputs, on random data with fixed seeds. Skips (exit code 4) where no GPU is visible.
#include "gpu_testing.hpp"

#include <concerto/core/float16.hpp>
#include <concerto/runtime/cpu/kernels.hpp>
#include <concerto/runtime/cuda/blas.hpp>
#include <concerto/runtime/cuda/stream.hpp>

#include <catch2/catch_test_macros.hpp>

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace cpu = concerto::runtime::cpu;
namespace cu = concerto::runtime::cuda;
using gpu_testing::dev;
using gpu_testing::random;
using gpu_testing::check_close;

namespace {
std::vector<float> round_bf16(const std::vector<float>& x, std::vector<__nv_bfloat16>& out) {
  std::vector<float> r(x.size());
  out.resize(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    out[i] = __float2bfloat16(x[i]);
    r[i] = __bfloat162float(out[i]);
  }
  return r;
}
} // namespace

TEST_CASE("cuBLASLt products match the CPU matmul for every flag combination", "[gpu][kernels][matmul]") {
  CONCERTO_REQUIRE_GPU();
  cu::stream s;
  cu::blas_handle lt;
  cu::device_buffer ws(cu::gemm::default_workspace);
  const std::size_t m = 45, n = 70, k = 33, batch = 3;
  const auto a = random(batch * m * k, 71), b = random(batch * k * n, 72), c0 = random(batch * m * n, 73);
  dev<float> da(a), db(b);
  for (const bool ta : {false, true})
    for (const bool tb : {false, true})
      for (const bool acc : {false, true}) {
        DYNAMIC_SECTION("fp32, trans_a " << ta << ", trans_b " << tb << ", accumulate " << acc) {
          const cpu::matmul_options o{.trans_a = ta, .trans_b = tb, .accumulate = acc, .alpha = 0.5f};
          auto want = c0;
          cpu::matmul_batched(a, b, want, batch, m, n, k, o);
          dev<float> dc(c0);
          cu::gemm g(lt, {.m = m, .n = n, .k = k, .batch = batch, .trans_a = ta, .trans_b = tb, .accumulate = acc, .alpha = 0.5f},
                     ws.size());
          g.run(lt, da.p(), db.p(), dc.p(), ws.data(), s.get());
          check_close(dc.get(), want, 1e-4f, 1e-5f);
        }
      }
  SECTION("bf16 inputs accumulate in fp32, into an fp32 or a bf16 output") {
    std::vector<__nv_bfloat16> ha, hb;
    const auto ra = round_bf16(std::vector<float>(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(m * k)), ha);
    const auto rb = round_bf16(std::vector<float>(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(k * n)), hb);
    std::vector<float> want(m * n);
    cpu::matmul(ra, rb, want, m, n, k, {.trans_b = false});
    dev<__nv_bfloat16> ga(ha), gb(hb);
    dev<float> c32(m * n);
    cu::gemm g32(lt, {.m = m, .n = n, .k = k, .ab = cu::gemm_type::bf16, .c = cu::gemm_type::f32}, ws.size());
    g32.run(lt, ga.p(), gb.p(), c32.p(), ws.data(), s.get());
    check_close(c32.get(), want, 1e-4f, 1e-4f);
    dev<__nv_bfloat16> c16(m * n);
    cu::gemm g16(lt, {.m = m, .n = n, .k = k, .ab = cu::gemm_type::bf16, .c = cu::gemm_type::bf16}, ws.size());
    g16.run(lt, ga.p(), gb.p(), c16.p(), ws.data(), s.get());
    std::vector<float> got;
    for (const auto x : c16.get()) got.push_back(__bfloat162float(x));
    check_close(got, want, 8e-3f, 1e-3f); // bf16 keeps 8 bits of mantissa
  }
  SECTION("f16 inputs accumulate in fp32, into an fp32 or an f16 output; a bf16 output is refused") {
    const auto half = [](const std::vector<float>& x, std::size_t count, std::vector<float>& rounded) {
      std::vector<std::uint16_t> out(count);
      rounded.resize(count);
      for (std::size_t i = 0; i < count; ++i) {
        out[i] = concerto::to_f16(x[i]);
        rounded[i] = concerto::from_f16(out[i]);
      }
      return out;
    };
    std::vector<float> ra, rb;
    dev<std::uint16_t> ga(half(a, m * k, ra)), gb(half(b, k * n, rb));
    std::vector<float> want(m * n);
    cpu::matmul(ra, rb, want, m, n, k, {.trans_b = false});
    dev<float> c32(m * n);
    cu::gemm g32(lt, {.m = m, .n = n, .k = k, .ab = cu::gemm_type::f16, .c = cu::gemm_type::f32}, ws.size());
    g32.run(lt, ga.p(), gb.p(), c32.p(), ws.data(), s.get());
    check_close(c32.get(), want, 1e-4f, 1e-4f);
    dev<std::uint16_t> c16(m * n);
    cu::gemm g16(lt, {.m = m, .n = n, .k = k, .ab = cu::gemm_type::f16, .c = cu::gemm_type::f16}, ws.size());
    g16.run(lt, ga.p(), gb.p(), c16.p(), ws.data(), s.get());
    std::vector<float> got;
    for (const auto x : c16.get()) got.push_back(concerto::from_f16(x));
    check_close(got, want, 1e-3f, 1e-4f); // f16 keeps 11 bits of mantissa
    CHECK_THROWS(cu::gemm(lt, {.m = m, .n = n, .k = k, .ab = cu::gemm_type::f16, .c = cu::gemm_type::bf16}, ws.size()));
  }
}
