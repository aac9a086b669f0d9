#pragma once
// Stands in for the CUDA Toolkit's cuda_fp16.h in the emulated test targets: the IEEE half type
// and its conversions (round to nearest even, overflow to infinity, NaN kept), on the host,
// through concerto's own (core/float16.hpp), which the GPU kernels call too.
#include <concerto/core/float16.hpp>

#include <cstdint>

struct __half {
  std::uint16_t bits;
};

inline __half __float2half(float f) { return {concerto::to_f16(f)}; }
inline float __half2float(__half h) { return concerto::from_f16(h.bits); }
