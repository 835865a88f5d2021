// The emulation's __half: the compiler's _Float16 (IEEE binary16, round to nearest even).
#pragma once
#include "cuda_runtime.h"

struct __half {
  _Float16 value;
};
inline float __half2float(__half h) { return static_cast<float>(h.value); }
inline __half __float2half(float f) { return __half{static_cast<_Float16>(f)}; }
