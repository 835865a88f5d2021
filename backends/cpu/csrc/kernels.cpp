// Attention over paged K/V (float32, bfloat16 or float16 blocks, float32 arithmetic, or on
// bfloat16 blocks AVX-512 BF16's dot products where asked), read in place from the blocks (no
// gather); RMSNorm, the rotary embedding, the gated MLP's activation and argmax in float32.
//
// Built with -fopenmp; inside a torch process the dynamic loader resolves libgomp to the copy
// torch already loaded, so both share one thread pool.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "half.h"

namespace {

using pagedllm::bf16;
using pagedllm::e4m3;
using pagedllm::e5m2;
using pagedllm::f16;

// An 8-bit cache's scales for one block of one row: row t, KV head g at k[t * kv_heads + g];
// `weighted` holds the probabilities times V's scales. Null k: the cache holds values.
struct BlockScales {
  const float* k = nullptr;
  const float* v = nullptr;
  float* weighted = nullptr;
  int64_t kv_heads = 0;
};

// HS > 0: the head size known at compile time (the common ones), so loops over it unroll and
// per-head accumulators stay in registers; HS = 0: any head size.
template <int64_t HS, class T>
inline float dot(const float* __restrict a, const T* __restrict b, int64_t n) {
  const int64_t len = HS ? HS : n;
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < len; ++i) s += a[i] * pagedllm::to_float(b[i]);
  return s;
}

// Whether blocks of T are read in place (widened in registers) at head size HS, or widened into
// a float32 buffer first: in place needs the vector loads of half.h and a compile-time head size.
template <int64_t HS, class T>
constexpr bool in_place() {
  if constexpr (std::is_same_v<T, float>) return true;
#ifdef PAGEDLLM_AVX512
  if (HS > 0 && HS % 16 == 0) return true;
#endif
#ifdef PAGEDLLM_AVX2
#ifndef PAGEDLLM_F16C
  if constexpr (std::is_same_v<T, f16>) return false;
#endif
  return HS > 0 && HS % 8 == 0;
#else
  return false;
#endif
}

// exp(x), Cephes' expf: range reduction by ln 2 and a degree-6 polynomial, within 2 ulp of
// std::exp; unlike std::exp, loops calling it vectorize. x is clamped to [-87, 88], where the
// 2^n scale stays a normal float (exp(-87) ~ 1.6e-38: zero for every use here).
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

#ifdef PAGEDLLM_AVX2
// exp_clamped on eight lanes: the same reduction and polynomial. (GCC leaves the scalar one's
// loops scalar — the bit cast of the 2^n scale — which cost a quarter of attention's time.)
inline __m256 exp8_clamped(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// s[0:n] = exp(s[0:n] - m); returns their sum
inline float exp_shifted(float* s, int64_t n, float m) {
  int64_t t = 0;
  float total = 0.f;
#ifdef PAGEDLLM_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sums = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8_clamped(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, e);
    sums = _mm256_add_ps(sums, e);
  }
  total = horizontal_sum(sums);
#endif
  for (; t < n; ++t) {
    s[t] = exp_clamped(s[t] - m);
    total += s[t];
  }
  return total;
}

inline float max_of(const float* s, int64_t n, float m) {
  int64_t t = 0;
#ifdef PAGEDLLM_AVX2
  if (n >= 8) {
    __m256 mv = _mm256_set1_ps(m);
    for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    m = horizontal_max(mv);
  }
#endif
  for (; t < n; ++t) m = std::max(m, s[t]);
  return m;
}

// A request's blocks lie anywhere in the pool, so the hardware prefetcher loses the trail at
// every block boundary: the next block's K and V are fetched into L2 while this one is
// computed, a few cache lines at every step of the computation. (Issued all at once, at the
// start of a block, most prefetches found the miss queues full and were dropped: no effect.)
bool prefetch_on = true;  // pagedllm_set_prefetch: benchmarks/bench_placement.py measures both

struct Prefetcher {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t bytes = 0, done = 0, per_step = 0;

  void start(const void* k_next, const void* v_next, int64_t nbytes, int64_t steps) {
    k = static_cast<const char*>(k_next), v = static_cast<const char*>(v_next);
    bytes = prefetch_on ? nbytes : 0, done = 0;
    per_step = (nbytes / 64 + steps - 1) / steps * 64;
  }
  void stop() { bytes = done = 0; }
  // not inlined: inlined into the row loops, it let GCC compile a row's arithmetic one way
  // while a prefetch was running and another way when not, so a row's output depended on
  // whether another row followed it in its group (a few ulps; tests/test_decode_replay.py)
  __attribute__((noinline)) void step() {
    for (const int64_t end = std::min(bytes, done + per_step); done < end; done += 64) {
      __builtin_prefetch(k + done, 0, 1);
      __builtin_prefetch(v + done, 0, 1);
    }
  }
};

#ifdef PAGEDLLM_AVX2
// The eight sums of eight vectors, as one vector: lane j = sum of the lanes of v[j].
inline __m256 sums_of_eight(const __m256* v) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
#endif
#ifdef PAGEDLLM_AVX512
// the sum of v's two 256-bit halves
inline __m256 fold_halves(__m512 v) {
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return _mm256_add_ps(_mm512_castps512_ps256(v), high);
}
#endif

// scores[h][t] = q_h . k_t * scale for the n tokens of one block, head by head so that the
// query head stays in registers across the block's tokens; with AVX2, eight tokens at a time,
// their eight dot products summed across lanes together instead of one by one.
template <int64_t HS, class T>
void block_scores(const float* q, const T* k, int64_t n, int64_t num_heads, int64_t group,
                  int64_t head_size, int64_t token_stride, int64_t score_stride, float scale,
                  float* scores, Prefetcher& pf) {
  const int64_t hs = HS ? HS : head_size;
  for (int64_t h = 0; h < num_heads; ++h) {
    const float* qh = q + h * hs;
    const T* kh = k + (h / group) * hs;
    float* sh = scores + h * score_stride;
    int64_t t = 0;
#ifdef PAGEDLLM_AVX512
    if (hs % 16 == 0) {
      const __m256 scale_v = _mm256_set1_ps(scale);
      for (; t + 8 <= n; t += 8) {
        __m512 acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < hs; d += 16) {
          const __m512 qv = _mm512_loadu_ps(qh + d);
          for (int j = 0; j < 8; ++j)
            acc[j] = _mm512_fmadd_ps(qv, pagedllm::load16(kh + (t + j) * token_stride + d), acc[j]);
        }
        __m256 halves[8];
        for (int j = 0; j < 8; ++j) halves[j] = fold_halves(acc[j]);
        _mm256_storeu_ps(sh + t, _mm256_mul_ps(sums_of_eight(halves), scale_v));
        pf.step();
      }
    }
#endif
#ifdef PAGEDLLM_AVX2
    if (hs % 8 == 0) {
      const __m256 scale_v = _mm256_set1_ps(scale);
      for (; t + 8 <= n; t += 8) {
        __m256 acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < hs; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qh + d);
          for (int j = 0; j < 8; ++j)
            acc[j] = _mm256_fmadd_ps(qv, pagedllm::load8(kh + (t + j) * token_stride + d), acc[j]);
        }
        _mm256_storeu_ps(sh + t, _mm256_mul_ps(sums_of_eight(acc), scale_v));
        pf.step();
      }
    }
#endif
    if (t < n) {
      for (; t < n; ++t) sh[t] = dot<HS, T>(qh, kh + t * token_stride, hs) * scale;
      pf.step();
    }
  }
}

// acc[h] += sum_t p[h][t] * v_t over the block's n tokens, head by head, the head's sum kept in
// a local array (registers, when HS is known) instead of memory for every token.
template <int64_t HS, class T>
void block_values(const float* p, const T* v, int64_t n, int64_t num_heads, int64_t group,
                  int64_t head_size, int64_t token_stride, int64_t score_stride, float* acc, Prefetcher& pf) {
  const int64_t hs = HS ? HS : head_size;
  for (int64_t h = 0; h < num_heads; ++h) {
    const T* vh = v + (h / group) * hs;
    const float* ph = p + h * score_stride;
    float* a = acc + h * hs;
#ifdef PAGEDLLM_AVX512
    if constexpr (HS > 0 && HS % 16 == 0) {
      __m512 sum[HS / 16];
      for (int64_t d = 0; d < HS / 16; ++d) sum[d] = _mm512_loadu_ps(a + 16 * d);
      for (int64_t t = 0; t < n; ++t) {
        const __m512 w = _mm512_set1_ps(ph[t]);
        const T* vt = vh + t * token_stride;
        for (int64_t d = 0; d < HS / 16; ++d) sum[d] = _mm512_fmadd_ps(w, pagedllm::load16(vt + 16 * d), sum[d]);
        if (t % 8 == 7 || t + 1 == n) pf.step();
      }
      for (int64_t d = 0; d < HS / 16; ++d) _mm512_storeu_ps(a + 16 * d, sum[d]);
      continue;
    }
#endif
    if constexpr (HS > 0 && !std::is_same_v<T, float>) {
#ifdef PAGEDLLM_AVX2
      __m256 sum[HS / 8];
      for (int64_t d = 0; d < HS / 8; ++d) sum[d] = _mm256_loadu_ps(a + 8 * d);
      for (int64_t t = 0; t < n; ++t) {
        const __m256 w = _mm256_set1_ps(ph[t]);
        const T* vt = vh + t * token_stride;
        for (int64_t d = 0; d < HS / 8; ++d) sum[d] = _mm256_fmadd_ps(w, pagedllm::load8(vt + 8 * d), sum[d]);
        if (t % 8 == 7 || t + 1 == n) pf.step();
      }
      for (int64_t d = 0; d < HS / 8; ++d) _mm256_storeu_ps(a + 8 * d, sum[d]);
#endif
    } else if constexpr (HS > 0) {
      float sum[HS];
      for (int64_t d = 0; d < HS; ++d) sum[d] = a[d];
      for (int64_t t = 0; t < n; ++t) {
        const float w = ph[t];
        const float* vt = vh + t * token_stride;
#pragma omp simd
        for (int64_t d = 0; d < HS; ++d) sum[d] += w * vt[d];
        if (t % 8 == 7 || t + 1 == n) pf.step();
      }
      for (int64_t d = 0; d < HS; ++d) a[d] = sum[d];
    } else {
      for (int64_t t = 0; t < n; ++t) {
        const float w = ph[t];
        const T* vt = vh + t * token_stride;
#pragma omp simd
        for (int64_t d = 0; d < hs; ++d) a[d] += w * pagedllm::to_float(vt[d]);
        if (t % 8 == 7 || t + 1 == n) pf.step();
      }
    }
  }
}

// Gemma 2's soft-capping: scores[h][0:n] = cap * tanh(score / cap); cap <= 0: unchanged.
inline void cap_scores(float* scores, int64_t n, int64_t num_heads, int64_t score_stride, float cap) {
  if (cap <= 0.f) return;
  const float inv = 1.f / cap;
  for (int64_t h = 0; h < num_heads; ++h)
    for (float *s = scores + h * score_stride, *e = s + n; s != e; ++s) *s = cap * std::tanh(*s * inv);
}

// scores[h][t] *= K's scale of token t for head h's KV head
inline void scale_scores(float* scores, const BlockScales& bs, int64_t n, int64_t num_heads, int64_t group,
                         int64_t score_stride) {
  for (int64_t h = 0; h < num_heads; ++h) {
    const float* k = bs.k + h / group;
    float* s = scores + h * score_stride;
    for (int64_t t = 0; t < n; ++t) s[t] *= k[t * bs.kv_heads];
  }
}

// weighted[h][t] = p[h][t] * V's scale of token t for head h's KV head
inline const float* weigh_probabilities(const float* p, const BlockScales& bs, int64_t n, int64_t num_heads,
                                        int64_t group, int64_t score_stride) {
  for (int64_t h = 0; h < num_heads; ++h) {
    const float* v = bs.v + h / group;
    const float* ph = p + h * score_stride;
    float* w = bs.weighted + h * score_stride;
    for (int64_t t = 0; t < n; ++t) w[t] = ph[t] * v[t * bs.kv_heads];
  }
  return bs.weighted;
}

// The online softmax over one more chunk of blocks: scores[h][0:n] become exp(score - running
// max); the running sums and the unnormalised outputs are rescaled to the new max.
inline void softmax_update(float* scores, int64_t n, int64_t num_heads, int64_t head_size, int64_t score_stride,
                           float* max, float* sum, float* acc) {
  for (int64_t h = 0; h < num_heads; ++h) {
    float* s = scores + h * score_stride;
    const float m = max_of(s, n, max[h]);
    const float rescale = exp_clamped(max[h] - m);  // ~0 on the first chunk
    const float block_sum = exp_shifted(s, n, m);
    sum[h] = sum[h] * rescale + block_sum;
    max[h] = m;
    if (rescale != 1.f)
      for (float *a = acc + h * head_size, *e = a + head_size; a != e; ++a) *a *= rescale;
  }
}

#ifdef PAGEDLLM_AVX512_BF16
// bfloat16 blocks on AVX-512 BF16's dot products (vdpbf16ps: pairs of bfloat16 products,
// exact, summed into float32), head sizes a multiple of 32. The query and the softmax's
// probabilities are rounded to bfloat16 first, as transformers' bfloat16 attention holds
// them; a third to a sixth of the instructions of widening every K/V value to float32.
inline __m512bh as_bf16x32(__m512i v) { return reinterpret_cast<__m512bh&>(v); }
inline __m512bh load_bf16x32(const bf16* p) { return as_bf16x32(_mm512_loadu_si512(p)); }

// out[0:n] = x[0:n] rounded to bfloat16 (to nearest even), zeros up to the next multiple of 16
inline void round_to_bf16(const float* x, int64_t n, bf16* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 valid = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m256bh r = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(valid, x + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), reinterpret_cast<const __m256i&>(r));
  }
}

// The query heads of a GQA group read the same K and V rows: P of them (1 or 2) go through
// each row's loads (and the values' interleaving) together, each head's arithmetic in the same
// order as alone, so a head's result does not depend on P.
template <int64_t HS, int P>
void block_scores_dot(const bf16* q, const bf16* k, int64_t n, int64_t num_heads, int64_t group,
                      int64_t token_stride, int64_t score_stride, float scale, float* scores, Prefetcher& pf) {
  constexpr int64_t C = HS / 32;
  const __m256 scale_v = _mm256_set1_ps(scale);
  for (int64_t h0 = 0; h0 < num_heads; h0 += P) {
    __m512bh qv[P][C];
    for (int i = 0; i < P; ++i)
      for (int64_t c = 0; c < C; ++c) qv[i][c] = load_bf16x32(q + (h0 + i) * HS + 32 * c);
    const bf16* kh = k + (h0 / group) * HS;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
      __m512 acc[P][8];
      for (int j = 0; j < 8; ++j) {
        for (int i = 0; i < P; ++i) acc[i][j] = _mm512_setzero_ps();
        for (int64_t c = 0; c < C; ++c) {
          const __m512bh kv = load_bf16x32(kh + (t + j) * token_stride + 32 * c);
          for (int i = 0; i < P; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], qv[i][c], kv);
        }
      }
      for (int i = 0; i < P; ++i) {
        __m256 halves[8];
        for (int j = 0; j < 8; ++j) halves[j] = fold_halves(acc[i][j]);
        _mm256_storeu_ps(scores + (h0 + i) * score_stride + t, _mm256_mul_ps(sums_of_eight(halves), scale_v));
      }
      pf.step();
    }
    if (t < n) {
      for (; t < n; ++t)
        for (int i = 0; i < P; ++i) {
          __m512 acc = _mm512_setzero_ps();
          for (int64_t c = 0; c < C; ++c)
            acc = _mm512_dpbf16_ps(acc, qv[i][c], load_bf16x32(kh + t * token_stride + 32 * c));
          scores[(h0 + i) * score_stride + t] = _mm512_reduce_add_ps(acc) * scale;
        }
      pf.step();
    }
  }
}

// acc[h] += sum_t p[h][t] * v_t, two tokens per dot product: rows t and t+1 interleaved value
// by value (unpacklo/hi), against the pair (p_t, p_t+1). The interleaving leaves the sums in
// the order d = 8L + i (lo) and 8L + 4 + i (hi) of lane L, i < 4; `uninterleave` puts it back.
// p16: P rounded rows of probabilities, p16_stride apart.
template <int64_t HS, int P>
void block_values_dot(const float* p, const bf16* v, int64_t n, int64_t num_heads, int64_t group,
                      int64_t token_stride, int64_t score_stride, float* acc, bf16* p16, int64_t p16_stride,
                      Prefetcher& pf) {
  constexpr int64_t C = HS / 32;
  alignas(64) static const int32_t uninterleave[32] = {0,  1,  2,  3,  16, 17, 18, 19, 4,  5,  6,
                                                       7,  20, 21, 22, 23, 8,  9,  10, 11, 24, 25,
                                                       26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  const __m512i first = _mm512_load_si512(uninterleave), second = _mm512_load_si512(uninterleave + 16);
  for (int64_t h0 = 0; h0 < num_heads; h0 += P) {
    const bf16* vh = v + (h0 / group) * HS;
    // an odd n is paired with a 0
    for (int i = 0; i < P; ++i) round_to_bf16(p + (h0 + i) * score_stride, n, p16 + i * p16_stride);
    __m512 lo[P][C], hi[P][C];
    for (int i = 0; i < P; ++i)
      for (int64_t c = 0; c < C; ++c) lo[i][c] = hi[i][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 2) {
      if (t % 8 == 0 && t > 0) pf.step();
      __m512bh w[P];  // (p_t, p_t+1) of each head
      for (int i = 0; i < P; ++i) {
        int32_t pair;
        std::memcpy(&pair, p16 + i * p16_stride + t, sizeof pair);
        w[i] = as_bf16x32(_mm512_set1_epi32(pair));
      }
      const bf16* v0 = vh + t * token_stride;
      for (int64_t c = 0; c < C; ++c) {
        const __m512i a = _mm512_loadu_si512(v0 + 32 * c);
        // past the block's last token the pool holds anything (a NaN times 0 is NaN)
        const __m512i b = t + 1 < n ? _mm512_loadu_si512(v0 + token_stride + 32 * c) : _mm512_setzero_si512();
        const __m512bh ab_lo = as_bf16x32(_mm512_unpacklo_epi16(a, b)), ab_hi = as_bf16x32(_mm512_unpackhi_epi16(a, b));
        for (int i = 0; i < P; ++i) {
          lo[i][c] = _mm512_dpbf16_ps(lo[i][c], ab_lo, w[i]);
          hi[i][c] = _mm512_dpbf16_ps(hi[i][c], ab_hi, w[i]);
        }
      }
    }
    pf.step();
    for (int i = 0; i < P; ++i) {
      float* a = acc + (h0 + i) * HS;
      for (int64_t c = 0; c < C; ++c) {
        float* ac = a + 32 * c;
        _mm512_storeu_ps(ac, _mm512_add_ps(_mm512_loadu_ps(ac), _mm512_permutex2var_ps(lo[i][c], first, hi[i][c])));
        _mm512_storeu_ps(ac + 16,
                         _mm512_add_ps(_mm512_loadu_ps(ac + 16), _mm512_permutex2var_ps(lo[i][c], second, hi[i][c])));
      }
    }
  }
}

#endif

// f(std::integral_constant<int64_t, HS>()): the head sizes compiled for (32, 64, 128), else HS = 0
template <class F>
void with_head_size(int64_t head_size, F&& f) {
  switch (head_size) {
    case 32: f(std::integral_constant<int64_t, 32>()); break;
    case 64: f(std::integral_constant<int64_t, 64>()); break;
    case 128: f(std::integral_constant<int64_t, 128>()); break;
    default: f(std::integral_constant<int64_t, 0>());
  }
}

#ifdef PAGEDLLM_AVX512_BF16
// f(head size, heads per pass) as compile-time constants, for the dot products' head sizes
template <class F>
void with_dot_shape(int64_t head_size, bool head_pairs, F&& f) {
  const auto heads = [&](auto hs) {
    if (head_pairs) f(hs, std::integral_constant<int, 2>());
    else f(hs, std::integral_constant<int, 1>());
  };
  if (head_size == 32) heads(std::integral_constant<int64_t, 32>());
  else if (head_size == 64) heads(std::integral_constant<int64_t, 64>());
  else heads(std::integral_constant<int64_t, 128>());
}
#endif

// One block's scores for one row, into scores[h][0:n] (score_stride apart): K of T read in place,
// or a float32 copy widened into k_wide when in_place<HS, T>() says so. 8-bit codes are widened
// as they are and their scales applied to the scores.
template <int64_t HS, class T>
void scores_of_block(const float* qs, const T* k_block, int64_t n, int64_t num_heads, int64_t group,
                     int64_t head_size, int64_t token_stride, int64_t score_stride, float scale, float* scores,
                     float* k_wide, const BlockScales& bs, Prefetcher& pf) {
  if constexpr (!in_place<HS, T>()) {
    pagedllm::widen(k_block, n * token_stride, k_wide);
    block_scores<HS, float>(qs, k_wide, n, num_heads, group, head_size, token_stride, score_stride, scale, scores, pf);
  } else {
    block_scores<HS, T>(qs, k_block, n, num_heads, group, head_size, token_stride, score_stride, scale, scores, pf);
  }
  if (bs.k) scale_scores(scores, bs, n, num_heads, group, score_stride);
}

// acc[h] += the block's probabilities p[h][0:n] times its V rows (an 8-bit cache's V scales
// folded into the probabilities first), V read in place or widened into v_wide as above.
template <int64_t HS, class T>
void values_of_block(const float* p, const T* v_block, int64_t n, int64_t num_heads, int64_t group,
                     int64_t head_size, int64_t token_stride, int64_t score_stride, float* acc, float* v_wide,
                     const BlockScales& bs, Prefetcher& pf) {
  if (bs.k) p = weigh_probabilities(p, bs, n, num_heads, group, score_stride);
  if constexpr (!in_place<HS, T>()) {
    pagedllm::widen(v_block, n * token_stride, v_wide);
    block_values<HS, float>(p, v_wide, n, num_heads, group, head_size, token_stride, score_stride, acc, pf);
  } else {
    block_values<HS, T>(p, v_block, n, num_heads, group, head_size, token_stride, score_stride, acc, pf);
  }
}

// The online softmax is updated once per chunk of up to this many tokens (whole blocks), not once
// per block: its per-head bookkeeping (the running max, a rescale of the output) cost a quarter
// of bfloat16 decode attention's time at 16-token blocks (perf, 300-token contexts).
constexpr int64_t SOFTMAX_CHUNK_TOKENS = 128;

// Attention of query rows over paged K/V. Row r belongs to the request whose block table is
// block_tables[row_table[r]] and attends to its first row_context[r] tokens (window > 0: to the
// last `window` of them): a decode is one row per request; a prefill chunk of a request one row
// per new token, each with its causal limit. soft_cap > 0: scores are soft-capped (Gemma 2).
// q, out: [num_rows, num_heads, head_size] float32; k_cache, v_cache: [num_blocks, block_size,
// num_kv_heads, head_size] of T; block_tables: [*, table_stride].
// Rows go to threads a few at a time, each row in one pass with an online softmax over chunks of
// whole blocks (SOFTMAX_CHUNK_TOKENS): the chunk's scores block by block (each block's token rows,
// all KV heads, contiguous, read front to back for every query head), one softmax update, then
// its values block by block. Where a head size has no in-place path, 16-bit blocks are widened
// to float32 into a per-thread buffer first (they stay in L1/L2 for the block's computation).
// An 8-bit cache (T int8_t, e4m3, e5m2) has block_stride elements from block to block (its
// scales sit after each block's codes) and k_scales/v_scales: [num_blocks, scale_block_stride]
// float32, token t of a block, KV head g at t * num_kv_heads + g.
template <class T>
void paged_attention(const float* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,
                     int64_t table_stride, const int32_t* row_table, const int32_t* row_context, int64_t num_rows,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t block_size, float scale,
                     int64_t window, float soft_cap, float* out, int num_threads, bool dot_products,
                     int64_t block_stride = 0, const float* k_scales = nullptr, const float* v_scales = nullptr,
                     int64_t scale_block_stride = 0) {
  constexpr bool widened = !std::is_same_v<T, float>;  // head sizes other than 32, 64 and 128 need the buffers
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_size;
  if (block_stride == 0) block_stride = block_size * token_stride;
  const int64_t block_elements = block_size * token_stride;
  const int64_t chunk_blocks = std::max<int64_t>(1, SOFTMAX_CHUNK_TOKENS / block_size);
  const int64_t score_stride = chunk_blocks * block_size;  // a head's scores of one chunk
#ifdef PAGEDLLM_AVX512_BF16
  const bool dot = std::is_same_v<T, bf16> && dot_products && (head_size == 32 || head_size == 64 || head_size == 128);
  const bool head_pairs = dot && group % 2 == 0;  // the dot products take a GQA group's heads two at a time
  // passes over a block's tokens: one per query head, or per pair of heads on the dot products
  const int64_t passes = head_pairs ? num_heads / 2 : num_heads;
#else
  (void)dot_products;
  const int64_t passes = num_heads;
#endif
  // prefetch steps in one pass over n tokens: one per 8 tokens. pf.step() is a call, and a call
  // in a token loop spills the loop's vector registers around it: with a step per token in the
  // values, bfloat16 decode attention (128 rows of 200 tokens, one layer of the demo model,
  // in-process) took 0.35-0.44 ms where it takes 0.26-0.29 now.
  const auto steps_for = [passes](int64_t n) { return passes * ((n + 7) / 8); };
#pragma omp parallel num_threads(num_threads)
  {
    // per query head: a chunk's scores, running max and sum, unnormalised output
    std::vector<float> scores(num_heads * score_stride), max(num_heads), sum(num_heads),
        acc(num_heads * head_size), k_wide(widened ? block_elements : 0), v_wide(widened ? block_elements : 0),
        weighted(k_scales ? num_heads * score_stride : 0);
#ifdef PAGEDLLM_AVX512_BF16
    // the row's query and a head's probabilities in bfloat16, for the dot products
    const int64_t p16_stride = (block_size + 15) / 16 * 16;
    std::vector<bf16> q16(dot ? num_heads * head_size : 0), p16(dot ? 2 * p16_stride : 0);
#endif
    Prefetcher pf;
    // rows are handed out a few at a time, so that a row's last block can prefetch the next
    // row's first (without it a row starts on a cold block: 8% of decode attention's time at
    // 160-token contexts, a third at 37)
    const int64_t chunk = std::clamp<int64_t>(num_rows / (4 * std::max(num_threads, 1)), 1, 8);
#pragma omp for schedule(dynamic, 1)
    for (int64_t first = 0; first < num_rows; first += chunk)
    for (int64_t row = first, last = std::min(num_rows, first + chunk); row < last; ++row) {
      const int64_t ctx = row_context[row];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;  // the first position seen
      const int32_t* table = block_tables + row_table[row] * table_stride;
      const float* qs = q + row * num_heads * head_size;
      std::fill(max.begin(), max.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
#ifdef PAGEDLLM_AVX512_BF16
      if (dot) round_to_bf16(qs, num_heads * head_size, q16.data());
#endif
      // block b of the row: its first token seen (the window may start inside it), how many
      // after it, where they lie, and an 8-bit cache's scales for them
      const auto skip_of = [&](int64_t b) { return std::max<int64_t>(0, lo - b * block_size); };
      const auto count_of = [&](int64_t b) { return std::min(block_size, ctx - b * block_size) - skip_of(b); };
      const auto offset_of = [&](int64_t b) { return table[b] * block_stride + skip_of(b) * token_stride; };
      const auto scales_of = [&](int64_t b) {
        BlockScales bs;
        if (k_scales) {
          const int64_t at = table[b] * scale_block_stride + skip_of(b) * num_kv_heads;
          bs.k = k_scales + at, bs.v = v_scales + at, bs.weighted = weighted.data(), bs.kv_heads = num_kv_heads;
        }
        return bs;
      };
      // the next row's first block, prefetched while this row's last chunk is computed
      const auto prefetch_next_row = [&](int64_t steps) {
        if (row + 1 < last && row_context[row + 1] > 0) {
          const int64_t next_ctx = row_context[row + 1];
          const int64_t next_block = window > 0 ? std::max<int64_t>(0, next_ctx - window) / block_size : 0;
          const int64_t at = block_tables[row_table[row + 1] * table_stride + next_block] * block_stride;
          const int64_t rows = std::min<int64_t>(block_size, next_ctx - next_block * block_size);
          pf.start(k_cache + at, v_cache + at, rows * token_stride * sizeof(T), steps);
        } else {
          pf.stop();
        }
      };
      const auto prefetch_block = [&](int64_t b, int64_t steps) {
        const int64_t at = table[b] * block_stride;
        const int64_t rows = std::min(block_size, ctx - b * block_size);
        pf.start(k_cache + at, v_cache + at, rows * token_stride * sizeof(T), steps);
      };
      const auto block_scores_at = [&](int64_t b, float* s) {
        const int64_t n = count_of(b);
        const T* k_block = k_cache + offset_of(b);
#ifdef PAGEDLLM_AVX512_BF16
        if constexpr (std::is_same_v<T, bf16>) {
          if (dot) {
            with_dot_shape(head_size, head_pairs, [&](auto hs, auto pairs) {
              block_scores_dot<decltype(hs)::value, decltype(pairs)::value>(q16.data(), k_block, n, num_heads, group,
                                                                             token_stride, score_stride, scale, s, pf);
            });
            return;
          }
        }
#endif
        with_head_size(head_size, [&](auto hs) {
          scores_of_block<decltype(hs)::value, T>(qs, k_block, n, num_heads, group, head_size, token_stride,
                                                  score_stride, scale, s, k_wide.data(), scales_of(b), pf);
        });
      };
      const auto block_values_at = [&](int64_t b, const float* p) {
        const int64_t n = count_of(b);
        const T* v_block = v_cache + offset_of(b);
#ifdef PAGEDLLM_AVX512_BF16
        if constexpr (std::is_same_v<T, bf16>) {
          if (dot) {
            with_dot_shape(head_size, head_pairs, [&](auto hs, auto pairs) {
              block_values_dot<decltype(hs)::value, decltype(pairs)::value>(
                  p, v_block, n, num_heads, group, token_stride, score_stride, acc.data(), p16.data(), p16_stride, pf);
            });
            return;
          }
        }
#endif
        with_head_size(head_size, [&](auto hs) {
          values_of_block<decltype(hs)::value, T>(p, v_block, n, num_heads, group, head_size, token_stride,
                                                  score_stride, acc.data(), v_wide.data(), scales_of(b), pf);
        });
      };
      const int64_t end_block = (ctx + block_size - 1) / block_size;
      for (int64_t c0 = lo / block_size; c0 < end_block; c0 += chunk_blocks) {
        const int64_t c1 = std::min(end_block, c0 + chunk_blocks);
        int64_t filled = 0, value_steps = 0;  // the chunk's tokens so far; its values' prefetch steps
        for (int64_t b = c0; b < c1; ++b) {
          // the next block of the chunk is fetched while this one's scores are computed; the
          // chunk's first came in during the previous chunk's (or row's) values
          if (b + 1 < c1) prefetch_block(b + 1, steps_for(count_of(b)));
          else pf.stop();
          block_scores_at(b, scores.data() + filled);
          cap_scores(scores.data() + filled, count_of(b), num_heads, score_stride, soft_cap);
          filled += count_of(b);
          value_steps += steps_for(count_of(b));
        }
        softmax_update(scores.data(), filled, num_heads, head_size, score_stride, max.data(), sum.data(), acc.data());
        if (c1 < end_block) prefetch_block(c1, value_steps);
        else prefetch_next_row(value_steps);
        filled = 0;
        for (int64_t b = c0; b < c1; ++b) {
          block_values_at(b, scores.data() + filled);
          filled += count_of(b);
        }
      }
      float* os = out + row * num_heads * head_size;
      for (int64_t h = 0; h < num_heads; ++h) {
        const float inv = ctx > 0 ? 1.f / sum[h] : 0.f;
        for (int64_t d = 0; d < head_size; ++d) os[h * head_size + d] = acc[h * head_size + d] * inv;
      }
    }
  }
}

// The replayed bfloat16 step's element formats (pagedllm_*_mixed's `formats`)
constexpr int MIXED_X_BF16 = 1, MIXED_OUT_BF16 = 2;

// float32 -> bfloat16, to nearest, ties to even, as torch's casts round (a NaN stays a NaN)
inline bf16 to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((bits >> 16) | 0x40u)};
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return bf16{static_cast<uint16_t>(bits >> 16)};
}
inline void store(float* p, float v) { *p = v; }
inline void store(bf16* p, float v) { *p = to_bf16(v); }

// f(x, out) with x and out as the pointer types `formats` names
template <class F>
void with_formats(const void* x, void* out, int formats, F&& f) {
  const bool x16 = formats & MIXED_X_BF16, out16 = formats & MIXED_OUT_BF16;
  if (x16 && out16) f(static_cast<const bf16*>(x), static_cast<bf16*>(out));
  else if (x16) f(static_cast<const bf16*>(x), static_cast<float*>(out));
  else if (out16) f(static_cast<const float*>(x), static_cast<bf16*>(out));
  else f(static_cast<const float*>(x), static_cast<float*>(out));
}

// x[0]^2 + ... + x[n-1]^2 in one fixed order whatever calls it: a reduction the compiler
// vectorizes on its own sums in an order it picks per loop, and the float32 and the bfloat16
// instantiations of a norm then differed in the last bit of a few rows (a replayed bfloat16 step
// must equal the eager one bit for bit).
inline float sum_of_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#ifdef PAGEDLLM_AVX512
  __m512 sums = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    sums = _mm512_fmadd_ps(v, v, sums);
  }
  total = _mm512_reduce_add_ps(sums);
#elif defined(PAGEDLLM_AVX2)
  __m256 sums = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    sums = _mm256_fmadd_ps(v, v, sums);
  }
  total = horizontal_sum(sums);
#endif
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for rows of `size` values; the order of
// operations of transformers' LlamaRMSNorm in float32.
template <class TO>
void rms_norm(const float* x, const float* weight, float eps, TO* out, int64_t rows, int64_t size, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * size >= 16384)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * size;
    TO* o = out + r * size;
    const float inv = 1.f / std::sqrt(sum_of_squares(xr, size) / static_cast<float>(size) + eps);
#pragma omp simd
    for (int64_t i = 0; i < size; ++i) store(o + i, weight[i] * (xr[i] * inv));
  }
}

// residual[r] += x[r], then out[r] = RMSNorm(residual[r]) as above: the residual connection and
// the next norm in one call (two torch ops and a temporary less per layer).
template <class TX, class TO>
void add_rms_norm(const TX* x, float* residual, const float* weight, float eps, TO* out, int64_t rows, int64_t size,
                  int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * size >= 16384)
  for (int64_t r = 0; r < rows; ++r) {
    const TX* xr = x + r * size;
    float* res = residual + r * size;
    TO* o = out + r * size;
#pragma omp simd
    for (int64_t i = 0; i < size; ++i) res[i] += pagedllm::to_float(xr[i]);
    const float inv = 1.f / std::sqrt(sum_of_squares(res, size) / static_cast<float>(size) + eps);
#pragma omp simd
    for (int64_t i = 0; i < size; ++i) store(o + i, weight[i] * (res[i] * inv));
  }
}

// Rotary embedding (transformers' rotate_half form) of rows of `heads` vectors of `size` values:
// x row t at x + t * row_stride, its heads contiguous; cos/sin [rows, size]; out [rows, heads,
// size] contiguous. out = x * cos + rotate_half(x) * sin, one pass instead of five torch ops.
template <class TX, class TO>
void rotary(const TX* x, int64_t row_stride, const float* cos, const float* sin, TO* out, int64_t rows,
            int64_t heads, int64_t size, int num_threads) {
  const int64_t half = size / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * heads * size >= 16384)
  for (int64_t t = 0; t < rows; ++t) {
    const float* c = cos + t * size;
    const float* s = sin + t * size;
    for (int64_t h = 0; h < heads; ++h) {
      const TX* xh = x + t * row_stride + h * size;
      TO* o = out + (t * heads + h) * size;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i)
        store(o + i, pagedllm::to_float(xh[i]) * c[i] - pagedllm::to_float(xh[i + half]) * s[i]);
#pragma omp simd
      for (int64_t i = half; i < size; ++i)
        store(o + i, pagedllm::to_float(xh[i]) * c[i] + pagedllm::to_float(xh[i - half]) * s[i]);
    }
  }
}

#ifdef PAGEDLLM_AVX2
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// to_bf16 on eight lanes
inline void store8(bf16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i halves = _mm256_blendv_epi8(rounded, quiet, nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(halves), _mm256_extracti128_si256(halves, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
#endif

// The gated MLP's activation: x[r] = [gate | up], each `size` values; out[r] = silu(gate) * up.
template <class TX, class TO>
void silu_and_mul(const TX* x, TO* out, int64_t rows, int64_t size, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * size >= 16384)
  for (int64_t r = 0; r < rows; ++r) {
    const TX* gate = x + r * 2 * size;
    const TX* up = gate + size;
    TO* o = out + r * size;
    int64_t i = 0;
#ifdef PAGEDLLM_AVX2
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= size; i += 8) {
      const __m256 g = pagedllm::load8(gate + i);
      const __m256 e = exp8_clamped(_mm256_sub_ps(_mm256_setzero_ps(), g));
      store8(o + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), pagedllm::load8(up + i)));
    }
#endif
    for (; i < size; ++i) {
      const float g = pagedllm::to_float(gate[i]);
      store(o + i, g / (1.f + exp_clamped(-g)) * pagedllm::to_float(up[i]));
    }
  }
}

// add_lora's halves (pagedllm_add_lora_f32): NR ranks of one row, and the 16 outputs at o0 of
// NK rows, each with NR / NK independent vector accumulators.
constexpr int64_t LORA_W = 16;

template <int NR>
inline void lora_shrink(const float* __restrict x, const float* __restrict a, int64_t width_in, float* u,
                        float scale) {
  float acc[NR][LORA_W] = {};
  const int64_t whole = width_in / LORA_W * LORA_W;
  for (int64_t i = 0; i < whole; i += LORA_W)
    for (int q = 0; q < NR; ++q) {
#pragma omp simd
      for (int64_t l = 0; l < LORA_W; ++l) acc[q][l] += x[i + l] * a[q * width_in + i + l];
    }
  for (int q = 0; q < NR; ++q) {
    float sum = 0.f;
    for (int64_t l = 0; l < LORA_W; ++l) sum += acc[q][l];
    for (int64_t i = whole; i < width_in; ++i) sum += x[i] * a[q * width_in + i];
    u[q] = sum * scale;
  }
}

template <int NK>
inline void lora_expand(const float* __restrict tile, int64_t tile_stride, int64_t rank, const float* u,
                        const int64_t* rows, float* out, int64_t out_stride, int64_t o0, int64_t width) {
  float acc[NK][LORA_W] = {};
  for (int64_t r = 0; r < rank; ++r)
    for (int q = 0; q < NK; ++q) {
      const float ur = u[q * rank + r];
#pragma omp simd
      for (int64_t j = 0; j < LORA_W; ++j) acc[q][j] += ur * tile[r * tile_stride + j];
    }
  for (int q = 0; q < NK; ++q) {
    float* ot = out + rows[q] * out_stride + o0;
    for (int64_t j = 0; j < width; ++j) ot[j] += acc[q][j];
  }
}

}  // namespace

extern "C" {

#define PAGEDLLM_ATTENTION(SUFFIX, T)                                                                            \
  void pagedllm_paged_attention_##SUFFIX(const float* q, const void* k_cache, const void* v_cache,               \
                                         const int32_t* block_tables, int64_t table_stride,                      \
                                         const int32_t* row_table, const int32_t* row_context, int64_t num_rows, \
                                         int64_t num_heads, int64_t num_kv_heads, int64_t head_size,             \
                                         int64_t block_size, float scale, int64_t window, float soft_cap,        \
                                         float* out, int num_threads, int dot_products) {                        \
    paged_attention(q, static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), block_tables,             \
                    table_stride, row_table, row_context, num_rows, num_heads, num_kv_heads, head_size,          \
                    block_size, scale, window, soft_cap, out, num_threads, dot_products != 0);                   \
  }
void pagedllm_set_prefetch(int on) { prefetch_on = on != 0; }

// whether bfloat16 attention can run on AVX-512 BF16's dot products (the dot_products argument)
int pagedllm_bf16_dot_products() {
#ifdef PAGEDLLM_AVX512_BF16
  return 1;
#else
  return 0;
#endif
}

PAGEDLLM_ATTENTION(f32, float)
PAGEDLLM_ATTENTION(bf16, bf16)
PAGEDLLM_ATTENTION(f16, f16)

// the same over an 8-bit cache: the block strides and the scales of paged_attention
#define PAGEDLLM_QUANTIZED_ATTENTION(SUFFIX, T)                                                                  \
  void pagedllm_paged_attention_##SUFFIX(const float* q, const void* k_cache, const void* v_cache,               \
                                         const int32_t* block_tables, int64_t table_stride,                      \
                                         const int32_t* row_table, const int32_t* row_context, int64_t num_rows, \
                                         int64_t num_heads, int64_t num_kv_heads, int64_t head_size,             \
                                         int64_t block_size, float scale, int64_t window, float soft_cap,        \
                                         float* out, int num_threads, int64_t block_stride,                      \
                                         const float* k_scales, const float* v_scales,                           \
                                         int64_t scale_block_stride) {                                           \
    paged_attention(q, static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), block_tables,             \
                    table_stride, row_table, row_context, num_rows, num_heads, num_kv_heads, head_size,          \
                    block_size, scale, window, soft_cap, out, num_threads, false, block_stride, k_scales,        \
                    v_scales, scale_block_stride);                                                               \
  }
PAGEDLLM_QUANTIZED_ATTENTION(i8, int8_t)
PAGEDLLM_QUANTIZED_ATTENTION(e4m3, e4m3)
PAGEDLLM_QUANTIZED_ATTENTION(e5m2, e5m2)
#undef PAGEDLLM_ATTENTION

void pagedllm_rms_norm_f32(const float* x, const float* weight, float eps, float* out, int64_t rows,
                           int64_t size, int num_threads) {
  rms_norm(x, weight, eps, out, rows, size, num_threads);
}

void pagedllm_add_rms_norm_f32(const float* x, float* residual, const float* weight, float eps, float* out,
                               int64_t rows, int64_t size, int num_threads) {
  add_rms_norm(x, residual, weight, eps, out, rows, size, num_threads);
}

// The same with bfloat16 where a replayed bfloat16 step has it (decode_replay.py): x as oneDNN's
// bfloat16 GEMMs leave it, out rounded for the next GEMM (formats: MIXED_X_BF16 | MIXED_OUT_BF16).
void pagedllm_rms_norm_mixed(const float* x, const float* weight, float eps, void* out, int64_t rows, int64_t size,
                             int formats, int num_threads) {
  if (formats & MIXED_OUT_BF16) rms_norm(x, weight, eps, static_cast<bf16*>(out), rows, size, num_threads);
  else rms_norm(x, weight, eps, static_cast<float*>(out), rows, size, num_threads);
}

void pagedllm_add_rms_norm_mixed(const void* x, float* residual, const float* weight, float eps, void* out,
                                 int64_t rows, int64_t size, int formats, int num_threads) {
  with_formats(x, out, formats, [&](const auto* xt, auto* ot) {
    add_rms_norm(xt, residual, weight, eps, ot, rows, size, num_threads);
  });
}

// A row into the cache, with non-temporal stores where it is made of aligned 32-byte pieces: a
// slot's lines are seldom in cache, and a plain store first reads each of them from memory.
inline void copy_row(char* dst, const char* src, int64_t bytes) {
#ifdef PAGEDLLM_AVX2
  if (bytes % 32 == 0 && reinterpret_cast<uintptr_t>(dst) % 32 == 0) {
    for (int64_t i = 0; i < bytes; i += 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

// The step's new K and V rows into their cache slots: token t's row (row_bytes, at key + t *
// key_stride and value + t * value_stride) to slot slots[t] of k_cache / v_cache. Returns the
// number of slots outside [0, num_slots); when there are any, nothing is written.
int64_t pagedllm_write_kv(const char* key, int64_t key_stride, const char* value, int64_t value_stride,
                          const int64_t* slots, int64_t num_tokens, int64_t row_bytes, char* k_cache, char* v_cache,
                          int64_t num_slots, int num_threads) {
  int64_t bad = 0;
  for (int64_t t = 0; t < num_tokens; ++t) bad += slots[t] < 0 || slots[t] >= num_slots;
  if (bad) return bad;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens >= 256)
  for (int64_t t = 0; t < num_tokens; ++t) {
    copy_row(k_cache + slots[t] * row_bytes, key + t * key_stride, row_bytes);
    copy_row(v_cache + slots[t] * row_bytes, value + t * value_stride, row_bytes);
  }
#ifdef PAGEDLLM_AVX2
  _mm_sfence();
#endif
  return 0;
}

// float32 -> the 8-bit formats, rounding to nearest, ties to even, as torch's casts do; v is
// within the format's range (the row was divided by its scale)
inline uint8_t to_e4m3(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  bits &= 0x7fffffffu;
  if (bits < 0x3c800000u)  // below 2^-6, the smallest normal: multiples of 2^-9
    return sign | static_cast<uint8_t>(std::nearbyint(pagedllm::bits_to_float(bits) * 512.f));
  bits += ((1u << 19) - 1) + ((bits >> 20) & 1u);  // round the mantissa to 3 bits
  return sign | static_cast<uint8_t>(std::min<uint32_t>((bits >> 20) - (120u << 3), 0x7eu));
}

inline uint8_t to_e5m2(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  bits &= 0x7fffffffu;
  if (bits < 0x38800000u)  // below 2^-14: multiples of 2^-16
    return sign | static_cast<uint8_t>(std::nearbyint(pagedllm::bits_to_float(bits) * 65536.f));
  bits += ((1u << 20) - 1) + ((bits >> 21) & 1u);  // round the mantissa to 2 bits
  return sign | static_cast<uint8_t>(std::min<uint32_t>((bits >> 21) - (112u << 2), 0x7bu));
}

// One (token, KV head) row of float32 into codes of `format` (0 int8, 1 e4m3, 2 e5m2) and its
// scale: absmax / the format's largest value (1 for a row of zeros).
inline void quantize_row(const float* x, int64_t n, int format, uint8_t* codes, float* scale) {
  static constexpr float top[3] = {127.f, 448.f, 57344.f};
  float absmax = 0.f;
  for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::fabs(x[i]));
  const float s = absmax > 0.f ? absmax / top[format] : 1.f;
  *scale = s;
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::min(std::max(x[i] / s, -top[format]), top[format]);
    codes[i] = format == 0 ? static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(v)))
               : format == 1 ? to_e4m3(v)
                             : to_e5m2(v);
  }
}

// write_kv into an 8-bit cache: token t's K and V rows (float32, num_kv_heads * head_size at key
// + t * key_stride) quantized into slot slots[t]: codes at block * block_bytes + (offset *
// num_kv_heads + g) * head_size of k_codes / v_codes, scales at block * scale_block_stride +
// offset * num_kv_heads + g of k_scales / v_scales. Returns the number of slots outside
// [0, num_slots); when there are any, nothing is written.
int64_t pagedllm_write_kv_quantized(const float* key, int64_t key_stride, const float* value, int64_t value_stride,
                                    const int64_t* slots, int64_t num_tokens, int64_t num_kv_heads,
                                    int64_t head_size, int format, uint8_t* k_codes, uint8_t* v_codes,
                                    float* k_scales, float* v_scales, int64_t block_size, int64_t block_bytes,
                                    int64_t scale_block_stride, int64_t num_slots, int num_threads) {
  int64_t bad = 0;
  for (int64_t t = 0; t < num_tokens; ++t) bad += slots[t] < 0 || slots[t] >= num_slots;
  if (bad) return bad;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens >= 64)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    for (int64_t g = 0; g < num_kv_heads; ++g) {
      const int64_t code_at = block * block_bytes + (offset * num_kv_heads + g) * head_size;
      const int64_t scale_at = block * scale_block_stride + offset * num_kv_heads + g;
      quantize_row(key + t * key_stride + g * head_size, head_size, format, k_codes + code_at, k_scales + scale_at);
      quantize_row(value + t * value_stride + g * head_size, head_size, format, v_codes + code_at,
                   v_scales + scale_at);
    }
  }
  return 0;
}

void pagedllm_rotary_f32(const float* x, int64_t row_stride, const float* cos, const float* sin, float* out,
                         int64_t rows, int64_t heads, int64_t size, int num_threads) {
  rotary(x, row_stride, cos, sin, out, rows, heads, size, num_threads);
}

void pagedllm_rotary_mixed(const void* x, int64_t row_stride, const float* cos, const float* sin, void* out,
                           int64_t rows, int64_t heads, int64_t size, int formats, int num_threads) {
  with_formats(x, out, formats, [&](const auto* xt, auto* ot) {
    rotary(xt, row_stride, cos, sin, ot, rows, heads, size, num_threads);
  });
}

// The index of x[0:n]'s largest value, the first of equal ones; the first NaN's where there is
// one (torch.argmax's answer, which takes ~6x as long here: it compares one value at a time).
int64_t argmax_of(const float* x, int64_t n) {
  int64_t i = 1, at = 0;
  float best = x[0];
#ifdef PAGEDLLM_AVX2
  if (n >= 16) {
    // per lane the first largest value and its index; then the lanes' largest, its first index
    __m256 lane_best = _mm256_loadu_ps(x), nan = _mm256_cmp_ps(lane_best, lane_best, _CMP_UNORD_Q);
    __m256i lane_at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), index = lane_at;
    for (i = 8; i + 8 <= n; i += 8) {
      index = _mm256_add_epi32(index, _mm256_set1_epi32(8));
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 greater = _mm256_cmp_ps(v, lane_best, _CMP_GT_OQ);
      lane_best = _mm256_blendv_ps(lane_best, v, greater);
      lane_at = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(lane_at), _mm256_castsi256_ps(index), greater));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan)) {
      for (int64_t j = 0;; ++j)
        if (std::isnan(x[j])) return j;
    }
    alignas(32) float values[8];
    alignas(32) int32_t indices[8];
    _mm256_store_ps(values, lane_best);
    _mm256_store_si256(reinterpret_cast<__m256i*>(indices), lane_at);
    best = values[0], at = indices[0];
    for (int j = 1; j < 8; ++j)
      if (values[j] > best || (values[j] == best && indices[j] < at)) best = values[j], at = indices[j];
  }
#endif
  if (std::isnan(best)) return at;
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > best) best = x[i], at = i;
  }
  return at;
}

// out[r] = argmax of row r: rows of n floats, row_stride apart
void pagedllm_argmax_rows_f32(const float* x, int64_t row_stride, int64_t rows, int64_t n, int64_t* out,
                              int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * n >= 65536)
  for (int64_t r = 0; r < rows; ++r) out[r] = argmax_of(x + r * row_stride, n);
}

// Structured outputs' mask, in place: logits[r, t] = -inf where bit t % 32 of mask[r, t / 32]
// is clear. Whole words of allowed tokens (the common case) are skipped in one test.
void pagedllm_apply_token_bitmask_f32(float* logits, int64_t row_stride, const int32_t* mask, int64_t words,
                                      int64_t rows, int64_t n, int num_threads) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * n >= 65536)
  for (int64_t r = 0; r < rows; ++r) {
    float* x = logits + r * row_stride;
    const uint32_t* m = reinterpret_cast<const uint32_t*>(mask + r * words);
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t bits = m[w];
      if (bits == 0xFFFFFFFFu) continue;
      const int64_t base = w * 32;
      const int64_t end = std::min<int64_t>(32, n - base);
      for (int64_t b = 0; b < end; ++b)
        if (!((bits >> b) & 1u)) x[base + b] = neg_inf;
    }
  }
}

// Multi-LoRA (BGMV: each row its own adapter), in place: out[t] += scale[s] * B[s] (A[s] x[t]) for
// every row t whose slot s = slots[t] >= 0. A: [slots, rank, in], B: [slots, out, rank], both
// contiguous; rows of x and out are row_stride apart. One row's rank-sized product stays on the
// stack; the adapters' A and B are read once per row, from cache where rows share an adapter.
// Rows grouped by slot. Both halves keep several independent accumulators in flight (a
// single chain of FMAs waits on each one's latency, ~4x slower): the shrink takes 4 ranks of
// a row at a time over 16 inputs a step; the expand goes over 16 outputs at a time for 4 rows
// of the slot at once, each adding 16 outputs per rank with one vector FMA, from B stored
// [S, rank, out] (b_transposed: the worker keeps it so for this backend) or else from the
// slot's B for those outputs transposed into a [rank][16] tile first (as long as the expand
// itself at 4 rows a slot). The counts are template arguments so the accumulators stay in
// registers.
void pagedllm_add_lora_f32(float* out, int64_t out_stride, const float* x, int64_t x_stride, int64_t rows,
                           int64_t width_in, int64_t width_out, const float* lora_a, const float* lora_b,
                           int64_t rank, const int32_t* slots, const float* scales, int b_transposed,
                           int num_threads) {
  std::vector<int64_t> order;
  order.reserve(rows);
  for (int64_t t = 0; t < rows; ++t)
    if (slots[t] >= 0) order.push_back(t);
  if (order.empty()) return;
  std::stable_sort(order.begin(), order.end(), [&](int64_t p, int64_t q) { return slots[p] < slots[q]; });
  const int64_t n = static_cast<int64_t>(order.size());
  const int64_t blocks = (width_out + LORA_W - 1) / LORA_W;
  std::vector<float> shrunk(n * rank);
#pragma omp parallel num_threads(num_threads) if (n * (width_in + width_out) * rank >= 65536)
  {
#pragma omp for schedule(static)
    for (int64_t k = 0; k < n; ++k) {
      const int32_t s = slots[order[k]];
      const float* xt = x + order[k] * x_stride;
      const float* a = lora_a + s * rank * width_in;
      float* u = &shrunk[k * rank];
      int64_t r = 0;
      for (; r + 4 <= rank; r += 4) lora_shrink<4>(xt, a + r * width_in, width_in, u + r, scales[s]);
      for (; r < rank; ++r) lora_shrink<1>(xt, a + r * width_in, width_in, u + r, scales[s]);
    }
    std::vector<float> tile(rank * LORA_W);
#pragma omp for schedule(static)
    for (int64_t ob = 0; ob < blocks; ++ob) {
      const int64_t o0 = ob * LORA_W, width = std::min(LORA_W, width_out - o0);
      for (int64_t first = 0; first < n;) {
        const int32_t s = slots[order[first]];
        int64_t last = first;
        while (last < n && slots[order[last]] == s) ++last;
        const float* b = lora_b + s * width_out * rank;
        const float* from = tile.data();
        int64_t stride = LORA_W;
        if (b_transposed && width == LORA_W) {  // a [rank][16] tile in place
          from = b + o0;
          stride = width_out;
        } else if (b_transposed) {
          std::fill(tile.begin(), tile.end(), 0.f);
          for (int64_t r = 0; r < rank; ++r)
            for (int64_t j = 0; j < width; ++j) tile[r * LORA_W + j] = b[r * width_out + o0 + j];
        } else {
          std::fill(tile.begin(), tile.end(), 0.f);
          for (int64_t j = 0; j < width; ++j)
            for (int64_t r = 0; r < rank; ++r) tile[r * LORA_W + j] = b[(o0 + j) * rank + r];
        }
        int64_t k = first;
        for (; k + 4 <= last; k += 4)
          lora_expand<4>(from, stride, rank, &shrunk[k * rank], &order[k], out, out_stride, o0, width);
        for (; k < last; ++k)
          lora_expand<1>(from, stride, rank, &shrunk[k * rank], &order[k], out, out_stride, o0, width);
        first = last;
      }
    }
  }
}

void pagedllm_silu_and_mul_f32(const float* x, float* out, int64_t rows, int64_t size, int num_threads) {
  silu_and_mul(x, out, rows, size, num_threads);
}

void pagedllm_silu_and_mul_mixed(const void* x, void* out, int64_t rows, int64_t size, int formats, int num_threads) {
  with_formats(x, out, formats, [&](const auto* xt, auto* ot) { silu_and_mul(xt, ot, rows, size, num_threads); });
}

}  // extern "C"
