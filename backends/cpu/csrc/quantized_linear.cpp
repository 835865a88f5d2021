// Weight-only quantized linear layers in float32: y = x W^T + b with W stored as int8, int4
// or nf4 codes and a float32 scale (and, for int4, a zero point) per group of input channels.
//
// With AVX2 and FMA, each vector of codes is decoded in registers and multiplied by four rows of
// x at a time; elsewhere (or for groups not a multiple of 16), rows of W are decoded to float32
// one at a time into a per-thread buffer reused by every row of x. Either way a weight costs a
// few vector ops to decode and 4 or 8 bits of memory traffic instead of 16 or 32. For many rows
// of x the caller decodes the whole matrix once instead and hands it to a float32 GEMM.
//
// Code layouts (backends/cpu/quantized_linear.py writes them):
//   int8: one signed byte per weight, row-major [N, K];
//   int4, nf4: two codes per byte, [N, K/2]; within each group of G channels byte j holds
//   channel j in its low nibble and channel j + G/2 in its high one, so that both halves
//   decode as contiguous streams.
#include <cstdint>
#include <vector>

#include "half.h"  // PAGEDLLM_AVX2

namespace {

constexpr int KIND_INT8 = 0;
constexpr int KIND_INT4 = 1;
constexpr int KIND_NF4 = 2;

void decode_row(int kind, const uint8_t* codes, const float* scales, const float* zeros, const float* lut,
                int64_t k, int64_t group, float* w) {
  const int64_t groups = k / group;
  if (kind == KIND_INT8) {
    const int8_t* c = reinterpret_cast<const int8_t*>(codes);
    for (int64_t g = 0; g < groups; ++g) {
      const float s = scales[g];
      const int8_t* cg = c + g * group;
      float* wg = w + g * group;
#pragma omp simd
      for (int64_t i = 0; i < group; ++i) wg[i] = static_cast<float>(cg[i]) * s;
    }
    return;
  }
  const int64_t half = group / 2;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = codes + g * half;
    float* lo = w + g * group;
    float* hi = lo + half;
    const float s = scales[g];
    if (kind == KIND_INT4) {
      const float z = zeros[g];
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        lo[i] = (static_cast<float>(p[i] & 15) - z) * s;
        hi[i] = (static_cast<float>(p[i] >> 4) - z) * s;
      }
    } else {
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        lo[i] = lut[p[i] & 15] * s;
        hi[i] = lut[p[i] >> 4] * s;
      }
    }
  }
}

// Four independent accumulator vectors: one would leave the FMA units waiting on its latency.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  constexpr int64_t W = 32;
  float acc[W] = {};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
#pragma omp simd
    for (int64_t j = 0; j < W; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < W; ++j) s += acc[j];
  return s;
}

#ifdef PAGEDLLM_AVX2
// Rows of x multiplied by one weight row without a float32 copy of it: each code vector is
// decoded in registers and used by every row of x at once. Per group, sum (q - z) x * s =
// s * (sum q x) - s * z * (sum x); the sums of x per group (xsum) are the caller's.
inline __m256 int8_vector(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline void nibble_vectors(const uint8_t* p, __m256i& lo, __m256i& hi) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_and_si256(bytes, _mm256_set1_epi32(15));
  hi = _mm256_srli_epi32(bytes, 4);
}

// lut[idx] for 16 entries: two 8-entry permutes, chosen between by bit 3 of idx.
inline __m256 lookup16(__m256i idx, __m256 lut_lo, __m256 lut_hi) {
  const __m256 a = _mm256_permutevar8x32_ps(lut_lo, idx);
  const __m256 b = _mm256_permutevar8x32_ps(lut_hi, idx);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int MR>
void rows_times_weight_row(int kind, const uint8_t* codes, const float* scales, const float* zeros,
                           const float* lut, const float* x, const float* xsum, int64_t k, int64_t group,
                           float* result) {
  const int64_t groups = k / group;
  __m256 total[MR];
  float zero_terms[MR];
  for (int m = 0; m < MR; ++m) total[m] = _mm256_setzero_ps(), zero_terms[m] = 0.f;
  const __m256 lut_lo = lut ? _mm256_loadu_ps(lut) : _mm256_setzero_ps();
  const __m256 lut_hi = lut ? _mm256_loadu_ps(lut + 8) : _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc0[MR], acc1[MR];
    for (int m = 0; m < MR; ++m) acc0[m] = acc1[m] = _mm256_setzero_ps();
    const float* xg = x + g * group;
    if (kind == KIND_INT8) {
      const uint8_t* c = codes + g * group;
      for (int64_t i = 0; i < group; i += 16) {
        const __m256 d0 = int8_vector(c + i), d1 = int8_vector(c + i + 8);
        for (int m = 0; m < MR; ++m) {
          acc0[m] = _mm256_fmadd_ps(d0, _mm256_loadu_ps(xg + m * k + i), acc0[m]);
          acc1[m] = _mm256_fmadd_ps(d1, _mm256_loadu_ps(xg + m * k + i + 8), acc1[m]);
        }
      }
    } else {
      const int64_t half = group / 2;
      const uint8_t* p = codes + g * half;
      for (int64_t i = 0; i < half; i += 8) {
        __m256i lo, hi;
        nibble_vectors(p + i, lo, hi);
        const __m256 d0 = kind == KIND_INT4 ? _mm256_cvtepi32_ps(lo) : lookup16(lo, lut_lo, lut_hi);
        const __m256 d1 = kind == KIND_INT4 ? _mm256_cvtepi32_ps(hi) : lookup16(hi, lut_lo, lut_hi);
        for (int m = 0; m < MR; ++m) {
          acc0[m] = _mm256_fmadd_ps(d0, _mm256_loadu_ps(xg + m * k + i), acc0[m]);
          acc1[m] = _mm256_fmadd_ps(d1, _mm256_loadu_ps(xg + m * k + i + half), acc1[m]);
        }
      }
    }
    const __m256 s = _mm256_set1_ps(scales[g]);
    for (int m = 0; m < MR; ++m) {
      total[m] = _mm256_fmadd_ps(_mm256_add_ps(acc0[m], acc1[m]), s, total[m]);
      if (zeros) zero_terms[m] += scales[g] * zeros[g] * xsum[m * groups + g];
    }
  }
  for (int m = 0; m < MR; ++m) result[m] = hsum(total[m]) - zero_terms[m];
}
#endif

}  // namespace

extern "C" {

// out [m, n] = x [m, k] . W^T (+ bias [n]); W's rows are row_bytes apart in `codes`, its
// scales (and zeros) k / group per row.
void pagedllm_quantized_gemv_f32(int kind, const float* x, int64_t m, const uint8_t* codes, int64_t row_bytes,
                                 const float* scales, const float* zeros, const float* lut, const float* bias,
                                 int64_t n, int64_t k, int64_t group, float* out, int num_threads) {
  const int64_t groups = k / group;
#ifdef PAGEDLLM_AVX2
  if (group % 16 == 0) {
    std::vector<float> xsum(zeros ? m * groups : 0);
    for (int64_t i = 0; i < static_cast<int64_t>(xsum.size()); ++i) {
      const float* xg = x + (i / groups) * k + (i % groups) * group;
      float t = 0.f;
      for (int64_t j = 0; j < group; ++j) t += xg[j];
      xsum[i] = t;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < n; ++r) {
      const uint8_t* c = codes + r * row_bytes;
      const float* s = scales + r * groups;
      const float* z = zeros ? zeros + r * groups : nullptr;
      const float b = bias ? bias[r] : 0.f;
      float result[4];
      int64_t i = 0;
      for (; i + 4 <= m; i += 4) {
        rows_times_weight_row<4>(kind, c, s, z, lut, x + i * k, xsum.data() + i * groups, k, group, result);
        for (int j = 0; j < 4; ++j) out[(i + j) * n + r] = result[j] + b;
      }
      for (; i < m; ++i) {
        rows_times_weight_row<1>(kind, c, s, z, lut, x + i * k, xsum.data() + i * groups, k, group, result);
        out[i * n + r] = result[0] + b;
      }
    }
    return;
  }
#endif
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> w(k);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      decode_row(kind, codes + r * row_bytes, scales + r * groups, zeros ? zeros + r * groups : nullptr, lut, k,
                 group, w.data());
      const float b = bias ? bias[r] : 0.f;
      for (int64_t i = 0; i < m; ++i) out[i * n + r] = dot(x + i * k, w.data(), k) + b;
    }
  }
}

// out [n, k] float32 = W.
void pagedllm_dequantize_f32(int kind, const uint8_t* codes, int64_t row_bytes, const float* scales,
                             const float* zeros, const float* lut, int64_t n, int64_t k, int64_t group, float* out,
                             int num_threads) {
  const int64_t groups = k / group;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t r = 0; r < n; ++r)
    decode_row(kind, codes + r * row_bytes, scales + r * groups, zeros ? zeros + r * groups : nullptr, lut, k,
               group, out + r * k);
}

}  // extern "C"
