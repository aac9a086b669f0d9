#pragma once
// The tensors both sides of the safetensors interop test write and expect: the same formulas as
// safetensors_check.py, in float32 arithmetic, so every value compares exactly.
#include <cstdint>
#include <string>
#include <vector>

namespace interop {

struct expected_tensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::vector<float> values;
};

// "exact": multiples of 1/16 in [-50/16, 50/16], exact in f32, bf16 and f16;
// "sevenths": (i + 1) / 7 in f32, which bf16 must round (to nearest even on both sides).
inline std::vector<expected_tensor> tensors() {
  expected_tensor exact{"layers.0.exact", {3, 5, 7}, {}}, sevenths{"sevenths", {40, 3}, {}};
  for (std::int64_t i = 0; i < 3 * 5 * 7; ++i) exact.values.push_back(static_cast<float>((i * 37) % 101 - 50) / 16.0f);
  for (std::int64_t i = 0; i < 120; ++i) sevenths.values.push_back(static_cast<float>(i + 1) / 7.0f);
  return {exact, sevenths};
}

} // namespace interop
