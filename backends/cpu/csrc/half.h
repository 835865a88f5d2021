// bfloat16 and float16 storage read as float32: the cpu kernels compute in float32 whatever the
// tensors hold, so a 16-bit value costs its 2 bytes of memory traffic and one conversion.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_AVX2 1
#endif
#if defined(PAGEDLLM_AVX2) && defined(__AVX512F__)
#define PAGEDLLM_AVX512 1
#endif
#if defined(PAGEDLLM_AVX512) && defined(__AVX512BF16__)
#define PAGEDLLM_AVX512_BF16 1
#endif

namespace pagedllm {

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return bits_to_float(static_cast<uint32_t>(x.bits) << 16); }

// IEEE binary16 -> binary32, exact (every half is a float): subnormals, infinities and NaNs kept.
inline float to_float(f16 x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1fu;
  const uint32_t mantissa = x.bits & 0x3ffu;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // mantissa * 2^-24
    return sign ? -magnitude : magnitude;
  }
  return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

#ifdef PAGEDLLM_AVX2
// eight 16-bit values from p as a float32 vector
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#ifdef __F16C__
#define PAGEDLLM_F16C 1
inline __m256 load8(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif
#endif

#ifdef PAGEDLLM_AVX512
// sixteen values from p as a float32 vector
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#endif

// out[0:n] = src[0:n] as float32
template <class T>
inline void widen(const T* __restrict src, int64_t n, float* __restrict out) {
  int64_t i = 0;
#ifdef PAGEDLLM_AVX2
#ifndef PAGEDLLM_F16C
  if constexpr (!std::is_same_v<T, f16>)
#endif
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, load8(src + i));
#endif
  for (; i < n; ++i) out[i] = to_float(src[i]);
}

}  // namespace pagedllm
