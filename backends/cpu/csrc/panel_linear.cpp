// Linear layers on weights packed in panels: out = x W^T (+ bias), x and out float32, W
// bfloat16, float16 or float32. A 16-bit weight is widened in registers where it is used, so a
// 16-bit model moves 2 bytes a weight (decoding is bound by that) and computes in float32 (the
// CPUs this project runs on have no 16-bit arithmetic short of AVX-512 BF16). float32 weights
// take the same tile: on AVX2 CPUs it beats oneDNN's packed float32 GEMM at every shape measured
// (docs/bench/README.md), most of all at the few rows of a small decode batch.
//
// W comes packed in panels of PANEL output features (native.pack_panel_weight, once at load):
// panel p holds W[p*PANEL : (p+1)*PANEL, :] transposed, [k][PANEL], the last one zero-padded,
// bfloat16 rows interleaved (panel_row). A 6 x 16 register tile of out (12 accumulators) takes, per input channel, one
// 16-wide row of the panel (2 vector loads) and 6 broadcast values of x: 8 loads for 12 FMAs
// and no horizontal sums, as BLAS microkernels do. k runs in slices of K_BLOCK and the rows of
// x in blocks of X_BLOCK_BYTES, so a panel's slice stays in L1 while a block's row tiles meet it
// and the block stays in L2 while every panel meets it.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "half.h"

namespace {

using pagedllm::bf16;
using pagedllm::f16;

constexpr int64_t PANEL = 16;
constexpr int64_t K_BLOCK = 256;
constexpr int MR = 6;  // rows of x per tile
// rows of x per block: ~64 KB of them (32-64 KB measured best here, for 200-4,096 rows: the
// whole of x, as before, fell to 67-90 GFLOP/s on the larger shapes, ~125 blocked)
constexpr int64_t X_BLOCK_BYTES = 64 << 10;

#ifdef PAGEDLLM_AVX2
// One 16-wide row of a panel as two float32 vectors: columns 0-7 and 8-15. bfloat16 rows are
// packed interleaved (c0 c8 c1 c9 ... c7 c15), so one 32-byte load and a shift and a mask
// widen them: a bfloat16 is the top half of its float32.
inline void panel_row(const bf16* p, __m256& lo, __m256& hi) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
#ifdef PAGEDLLM_F16C
inline void panel_row(const f16* p, __m256& lo, __m256& hi) { lo = pagedllm::load8(p), hi = pagedllm::load8(p + 8); }
#endif
inline void panel_row(const float* p, __m256& lo, __m256& hi) { lo = _mm256_loadu_ps(p), hi = _mm256_loadu_ps(p + 8); }
#endif

// The column of element j of a packed panel row (see panel_row).
template <class T>
constexpr int64_t panel_column(int64_t j) {
  return std::is_same_v<T, bf16> ? (j % 2) * 8 + j / 2 : j;
}

// acc = x[0:M] (rows x_stride apart) . panel slice [len][PANEL], into tile[M][PANEL].
template <int M, class T>
inline void tile(const float* x, int64_t x_stride, const T* panel, int64_t len, float* result) {
  int64_t i = 0;
#ifdef PAGEDLLM_AVX2
#ifndef PAGEDLLM_F16C
  if constexpr (!std::is_same_v<T, f16>)
#endif
  {
    __m256 acc[M][2];
    for (int a = 0; a < M; ++a) acc[a][0] = acc[a][1] = _mm256_setzero_ps();
    for (; i < len; ++i) {
      __m256 w0, w1;
      panel_row(panel + i * PANEL, w0, w1);
      for (int a = 0; a < M; ++a) {
        const __m256 xv = _mm256_broadcast_ss(x + a * x_stride + i);
        acc[a][0] = _mm256_fmadd_ps(xv, w0, acc[a][0]);
        acc[a][1] = _mm256_fmadd_ps(xv, w1, acc[a][1]);
      }
    }
    for (int a = 0; a < M; ++a) {
      _mm256_storeu_ps(result + a * PANEL, acc[a][0]);
      _mm256_storeu_ps(result + a * PANEL + 8, acc[a][1]);
    }
    return;
  }
#endif
  float acc[M][PANEL] = {};
  for (; i < len; ++i)
    for (int a = 0; a < M; ++a) {
      const float xv = x[a * x_stride + i];
#pragma omp simd
      for (int64_t j = 0; j < PANEL; ++j) acc[a][panel_column<T>(j)] += xv * pagedllm::to_float(panel[i * PANEL + j]);
    }
  for (int a = 0; a < M; ++a)
    for (int64_t j = 0; j < PANEL; ++j) result[a * PANEL + j] = acc[a][j];
}

// tile<M> for the 1-6 rows at x.
template <class T>
inline void tile_rows(int64_t rows, const float* x, int64_t x_stride, const T* panel, int64_t len, float* result) {
  switch (rows) {
    case 6: tile<6>(x, x_stride, panel, len, result); break;
    case 5: tile<5>(x, x_stride, panel, len, result); break;
    case 4: tile<4>(x, x_stride, panel, len, result); break;
    case 3: tile<3>(x, x_stride, panel, len, result); break;
    case 2: tile<2>(x, x_stride, panel, len, result); break;
    default: tile<1>(x, x_stride, panel, len, result);
  }
}

// A decode step's few rows (one tile): each thread streams its own panels whole, start to
// end, with one barrier for the call; the blocked loop below meets a barrier every K_BLOCK
// input channels and jumps between panels as often, which kept one request's decode well
// below the machine's bandwidth. The arithmetic is the blocked loop's, operation for operation:
// each K_BLOCK slice summed from zero in a tile, the slices added to the first one (plus the
// bias, or 0) in order, so a row's bits do not depend on the path or on the other rows.
template <class T>
void panel_linear_few_rows(const float* x, int64_t m, const T* packed, int64_t n, int64_t k, const float* bias,
                           float* out, int num_threads) {
  const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    const T* panel = packed + p * k * PANEL;
    const int64_t n0 = p * PANEL, cols = std::min(PANEL, n - n0);
    float total[MR * PANEL], result[MR * PANEL];
    for (int64_t k0 = 0; k0 < k; k0 += K_BLOCK) {
      const int64_t len = std::min(K_BLOCK, k - k0);
      tile_rows(m, x + k0, k, panel + k0 * PANEL, len, result);
      for (int64_t a = 0; a < m; ++a)
        for (int64_t j = 0; j < cols; ++j) {
          float& t = total[a * PANEL + j];
          const float r = result[a * PANEL + j];
          t = k0 == 0 ? r + (bias ? bias[n0 + j] : 0.f) : t + r;
        }
    }
    for (int64_t a = 0; a < m; ++a) std::copy(total + a * PANEL, total + a * PANEL + cols, out + a * n + n0);
  }
}

template <class T>
void panel_linear(const float* x, int64_t m, const T* packed, int64_t n, int64_t k, const float* bias, float* out,
                  int num_threads) {
  if (m <= MR) return panel_linear_few_rows(x, m, packed, n, k, bias, out, num_threads);
  const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(num_threads)
  for (int64_t k0 = 0; k0 < k; k0 += K_BLOCK) {
    const int64_t len = std::min(K_BLOCK, k - k0);
    // rows of x in blocks that stay in L2 while every panel meets them
    const int64_t m_block = std::max<int64_t>(MR, X_BLOCK_BYTES / (len * 4) / MR * MR);
    for (int64_t m0 = 0; m0 < m; m0 += m_block) {
      const int64_t m1 = std::min(m, m0 + m_block);
      // static: a thread keeps the same panels (and the same out columns) for every block
#pragma omp for schedule(static)
      for (int64_t p = 0; p < panels; ++p) {
        const T* panel = packed + p * k * PANEL + k0 * PANEL;
        const int64_t n0 = p * PANEL, cols = std::min(PANEL, n - n0);
        float result[MR * PANEL];
        for (int64_t i = m0; i < m1; i += MR) {
          const int64_t rows = std::min<int64_t>(MR, m1 - i);
          const float* xt = x + i * k + k0;
          tile_rows(rows, xt, k, panel, len, result);
          for (int64_t a = 0; a < rows; ++a) {
            float* o = out + (i + a) * n + n0;
            const float* r = result + a * PANEL;
            if (k0 == 0)
              for (int64_t j = 0; j < cols; ++j) o[j] = r[j] + (bias ? bias[n0 + j] : 0.f);
            else
              for (int64_t j = 0; j < cols; ++j) o[j] += r[j];
          }
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// out [m, n] float32 = x [m, k] float32 . W^T (+ bias [n] float32); W packed as above,
// [ceil(n / 16), k, 16]; kind 0: bfloat16, 1: float16, 2: float32.
void pagedllm_panel_linear(int kind, const float* x, int64_t m, const void* packed, int64_t n, int64_t k,
                           const float* bias, float* out, int num_threads) {
  if (kind == 0)
    panel_linear(x, m, static_cast<const bf16*>(packed), n, k, bias, out, num_threads);
  else if (kind == 2)
    panel_linear(x, m, static_cast<const float*>(packed), n, k, bias, out, num_threads);
  else
    panel_linear(x, m, static_cast<const f16*>(packed), n, k, bias, out, num_threads);
}

}  // extern "C"
