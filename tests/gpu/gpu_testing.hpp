#pragma once
// Shared by the CUDA tests: the skip when no device is present, device copies of host vectors,
// random data with fixed seeds, and an element-wise comparison that names the first mismatch.
#include <concerto/runtime/cuda/check.hpp>
#include <concerto/runtime/cuda/memory.hpp>

#include <catch2/catch_test_macros.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#define CONCERTO_REQUIRE_GPU()                                                                     \
  do {                                                                                             \
    if (::concerto::runtime::cuda::device_count() == 0)                                            \
      SKIP("no CUDA device visible (cudaGetDeviceCount gives 0): GPU tests need a GPU");           \
  } while (false)

namespace gpu_testing {

// A device copy of a host vector, read back with `get`.
template <class T>
struct dev {
  concerto::runtime::cuda::device_buffer buf;
  std::size_t n = 0;
  explicit dev(const std::vector<T>& host) : buf(host.size() * sizeof(T)), n(host.size()) {
    if (n > 0) concerto::runtime::cuda::check(cudaMemcpy(buf.data(), host.data(), n * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  explicit dev(std::size_t count) : buf(count * sizeof(T)), n(count) {}
  T* p() const { return buf.as<T>(); }
  std::vector<T> get() const {
    std::vector<T> out(n);
    concerto::runtime::cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (n > 0) concerto::runtime::cuda::check(cudaMemcpy(out.data(), buf.data(), n * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return out;
  }
};

inline std::vector<float> random(std::size_t n, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

inline std::vector<std::int32_t> random_ids(std::size_t n, std::int32_t classes, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int32_t> d(0, classes - 1);
  std::vector<std::int32_t> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// |got - want| <= atol + rtol·|want| everywhere; reports the first index that fails.
inline void check_close(const std::vector<float>& got, const std::vector<float>& want, float rtol = 1e-4f,
                        float atol = 1e-5f) {
  REQUIRE(got.size() == want.size());
  REQUIRE(!want.empty());
  std::size_t bad = want.size();
  for (std::size_t i = 0; i < want.size() && bad == want.size(); ++i)
    if (!(std::abs(got[i] - want[i]) <= atol + rtol * std::abs(want[i]))) bad = i;
  if (bad != want.size()) {
    INFO("first mismatch at " << bad << ": GPU " << got[bad] << ", CPU " << want[bad]);
    CHECK(false);
  }
  if (want.size() == 1) return;
  bool varied = false; // a constant reference would let a broken kernel pass
  for (const auto x : want) varied = varied || x != want.front();
  CHECK(varied);
}

} // namespace gpu_testing
