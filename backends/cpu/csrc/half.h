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
// the 8-bit KV cache formats (backends/kv_cache.py); int8 codes are int8_t
struct e4m3 {
  uint8_t bits;
};
struct e5m2 {
  uint8_t bits;
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

inline float to_float(int8_t x) { return x; }
// e5m2 is the upper byte of a binary16
inline float to_float(e5m2 x) { return to_float(f16{static_cast<uint16_t>(x.bits << 8)}); }
// e4m3 (OCP "fn": bias 7, no infinities; 0x7f/0xff are NaN, never stored here)
inline float to_float(e4m3 x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x80u) << 24;
  const uint32_t exponent = (x.bits >> 3) & 0xfu, mantissa = x.bits & 7u;
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 0.001953125f;  // mantissa * 2^-9
    return sign ? -magnitude : magnitude;
  }
  return bits_to_float(sign | ((exponent + 120) << 23) | (mantissa << 20));
}

#ifdef PAGEDLLM_AVX2
// An fp8 code sign-extended to 32 bits, shifted so that its exponent and mantissa bits sit at
// the top of a float32's (the extension's copies of the sign cleared, the sign kept at bit 31):
// a float32 of value code / 2^(127 - bias), the format's subnormals landing on float32
// subnormals. One multiply restores the value (denormals are not flushed in these processes:
// tests/test_cpu_ops.py reads every code).
inline __m256 fp8_bits(__m128i bytes, int shift, int mask) {
  const __m256i w = _mm256_cvtepi8_epi32(bytes);
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(w, shift), _mm256_set1_epi32(mask)));
}
constexpr int E4M3_SHIFT = 20, E4M3_MASK = static_cast<int>(0x87f00000u);
constexpr int E5M2_SHIFT = 21, E5M2_MASK = static_cast<int>(0x8fe00000u);
constexpr float E4M3_UNIT = 1.329227995784916e36f;  // 2^120
constexpr float E5M2_UNIT = 5.192296858534828e33f;  // 2^112
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const e5m2* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_mul_ps(fp8_bits(bytes, E5M2_SHIFT, E5M2_MASK), _mm256_set1_ps(E5M2_UNIT));
}
inline __m256 load8(const e4m3* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_mul_ps(fp8_bits(bytes, E4M3_SHIFT, E4M3_MASK), _mm256_set1_ps(E4M3_UNIT));
}
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
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 fp8_bits16(const void* p, int shift, int mask) {
  const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(w, shift), _mm512_set1_epi32(mask)));
}
inline __m512 load16(const e5m2* p) {
  return _mm512_mul_ps(fp8_bits16(p, E5M2_SHIFT, E5M2_MASK), _mm512_set1_ps(E5M2_UNIT));
}
inline __m512 load16(const e4m3* p) {
  return _mm512_mul_ps(fp8_bits16(p, E4M3_SHIFT, E4M3_MASK), _mm512_set1_ps(E4M3_UNIT));
}
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
