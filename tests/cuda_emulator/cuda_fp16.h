// Shim of CUDA's float16 header for tests/cuda_emulator: the type and its round-to-nearest-even
// conversions (GCC's _Float16).
#pragma once

#include "ks_emulator.h"

struct __half {
  _Float16 value;
};

inline float __half2float(__half x) { return static_cast<float>(x.value); }
inline __half __float2half_rn(float f) { return {static_cast<_Float16>(f)}; }
