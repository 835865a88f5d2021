// The cuda-native device code: K/V writes, paged attention with context partitions and a
// reduction ("v2"), and block copies. Launched by kernels.cu; tests/cuda_emulation runs the same
// code on the CPU (a thread per CUDA thread) to check its numerics without a GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

#include "kernels.h"

namespace pagedllm {
namespace kernels {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 128;  // context positions whose scores sit in shared memory at once
static_assert(kMaxHeadSize <= 2 * kThreads, "the weighted sum gives each thread two output dimensions");

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// An 8-bit code as float32, before its row's scale (KVCodes): int8 by conversion; fp8 by placing
// its bits (sign-extended, the extension's copies cleared) at the top of a float32's and one
// multiply by 2^(127 - bias), the formats' subnormals landing on float32's.
__device__ __forceinline__ float widen_code(uint8_t byte, int codes) {
  const int32_t s = static_cast<int8_t>(byte);
  const uint32_t u = static_cast<uint32_t>(s);
  if (codes == 1) return static_cast<float>(s);
  if (codes == 2) return __uint_as_float((u << 20) & 0x87f00000u) * 1.329227995784916e36f;  // 2^120
  return __uint_as_float((u << 21) & 0x8fe00000u) * 5.192296858534828e33f;                  // 2^112
}

// float32 -> an 8-bit code, rounding to nearest even as torch's casts do; v is within the
// format's range (its row was divided by the scale)
__device__ __forceinline__ uint8_t code_of(float v, int codes) {
  if (codes == 1) return static_cast<uint8_t>(static_cast<int8_t>(rintf(v)));
  uint32_t bits = __float_as_uint(v);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  bits &= 0x7fffffffu;
  if (codes == 2) {
    if (bits < 0x3c800000u) return sign | static_cast<uint8_t>(rintf(__uint_as_float(bits) * 512.f));
    bits += ((1u << 19) - 1) + ((bits >> 20) & 1u);
    const uint32_t code = (bits >> 20) - (120u << 3);
    return sign | static_cast<uint8_t>(code < 0x7eu ? code : 0x7eu);
  }
  if (bits < 0x38800000u) return sign | static_cast<uint8_t>(rintf(__uint_as_float(bits) * 65536.f));
  bits += ((1u << 20) - 1) + ((bits >> 21) & 1u);
  const uint32_t code = (bits >> 21) - (112u << 2);
  return sign | static_cast<uint8_t>(code < 0x7bu ? code : 0x7bu);
}

// N consecutive elements read or written as one access (16 bytes: one ld.global.v4).
template <typename T, int N> struct alignas(sizeof(T) * N) Packed {
  T v[N];
};

// Elements of T in one 16-byte load; head sizes must be a multiple of it (kHeadSizeMultiple).
template <typename T> constexpr int kVec = 16 / sizeof(T);
static_assert(kHeadSizeMultiple % kVec<__half> == 0 && kHeadSizeMultiple % kVec<float> == 0, "");

__host__ __device__ constexpr int pow2_at_least(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

// Sum / max over aligned groups of `width` lanes (a power of two <= 32); every lane of the
// warp must call it.
__device__ __forceinline__ float lanes_sum(float x, int width) {
  for (int offset = width / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// The weighted sum over values: `dims_threads` threads own two output dimensions each, and the
// block's kThreads / dims_threads slices of them take alternate positions.
__host__ __device__ constexpr int value_dims_threads(int head_size) { return pow2_at_least(head_size / 2); }

// Floats of dynamic shared memory for `group` query heads: running max, sum and rescale factor
// per head, then q [group][head_size] and scores [group][kChunk], which after the context loop
// hold each slice's accumulators [slices][group][head_size].
__host__ __device__ constexpr int attention_smem_floats(int group, int head_size) {
  const int slices = kThreads / value_dims_threads(head_size);
  const int loop = group * (head_size + kChunk), partials = slices * group * head_size;
  return 3 * group + (loop > partials ? loop : partials);
}

// Where position pos of a request (block table `table`) keeps KV head kvh's K or V row.
__device__ __forceinline__ int64_t slot_offset(const int* table, int pos, int block_size, int kvh,
                                               int64_t stride_block, int64_t stride_slot, int64_t stride_head) {
  return static_cast<int64_t>(table[pos / block_size]) * stride_block + (pos % block_size) * stride_slot +
         kvh * stride_head;
}

template <typename T>
__global__ void write_kv_kernel(const T* __restrict__ key, const T* __restrict__ value, T* __restrict__ k_cache,
                                T* __restrict__ v_cache, const int64_t* __restrict__ slot_mapping, int kv_heads,
                                int head_size, int block_size, int64_t key_stride_t, int64_t key_stride_h,
                                int64_t value_stride_t, int64_t value_stride_h, int64_t cache_stride_block,
                                int64_t cache_stride_slot, int64_t cache_stride_head) {
  const int t = blockIdx.x;
  const int64_t slot = slot_mapping[t];
  if (slot < 0) return;
  const int64_t base = (slot / block_size) * cache_stride_block + (slot % block_size) * cache_stride_slot;
  for (int i = threadIdx.x; i < kv_heads * head_size; i += blockDim.x) {
    const int h = i / head_size, d = i % head_size;
    const int64_t dst = base + h * cache_stride_head + d;
    k_cache[dst] = key[t * key_stride_t + h * key_stride_h + d];
    v_cache[dst] = value[t * value_stride_t + h * value_stride_h + d];
  }
}

// write_kv into an 8-bit cache: a thread per (token, K or V, KV head) row finds its absmax and
// writes its codes and scale (kernels.h launch_write_kv_codes).
template <typename T>
__global__ void write_kv_codes_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                      uint8_t* __restrict__ k_cache, uint8_t* __restrict__ v_cache,
                                      float* __restrict__ k_scales, float* __restrict__ v_scales,
                                      const int64_t* __restrict__ slot_mapping, int codes, int kv_heads,
                                      int head_size, int block_size, int64_t key_stride_t, int64_t key_stride_h,
                                      int64_t value_stride_t, int64_t value_stride_h, int64_t cache_stride_block,
                                      int64_t cache_stride_slot, int64_t cache_stride_head,
                                      int64_t scale_stride_block, int64_t scale_stride_slot) {
  const int t = blockIdx.x;
  const int64_t slot = slot_mapping[t];
  if (slot < 0) return;
  const int64_t block = slot / block_size, offset = slot % block_size;
  const float top = codes == 1 ? 127.f : codes == 2 ? 448.f : 57344.f;
  for (int i = threadIdx.x; i < 2 * kv_heads; i += blockDim.x) {
    const bool is_value = i >= kv_heads;
    const int h = i % kv_heads;
    const T* x = is_value ? value + t * value_stride_t + h * value_stride_h : key + t * key_stride_t + h * key_stride_h;
    float absmax = 0.f;
    for (int d = 0; d < head_size; ++d) absmax = fmaxf(absmax, fabsf(to_float(x[d])));
    const float scale = absmax > 0.f ? absmax / top : 1.f;
    uint8_t* dst = (is_value ? v_cache : k_cache) + block * cache_stride_block + offset * cache_stride_slot +
                   h * cache_stride_head;
    for (int d = 0; d < head_size; ++d) dst[d] = code_of(fminf(fmaxf(to_float(x[d]) / scale, -top), top), codes);
    (is_value ? v_scales : k_scales)[block * scale_stride_block + offset * scale_stride_slot + h] = scale;
  }
}

// One block per (row, KV head, context partition), for the group's query heads. GROUP is the
// compile-time bound on the group (the accumulators are indexed by constants, so they stay in
// registers); the actual group, num_heads / kv_heads, may be smaller. Launch bounds of 4 blocks
// per SM (at most 128 registers): without a minimum, ptxas spills the 16-head kernel at 72.
template <typename T, int GROUP>
__global__ void __launch_bounds__(kThreads, 4) paged_attention_kernel(
    T* __restrict__ out, const T* __restrict__ query, const void* __restrict__ k_cache_raw,
    const void* __restrict__ v_cache_raw, const int* __restrict__ block_tables, const int* __restrict__ row_request,
    const int* __restrict__ row_position, int num_heads, int kv_heads, int head_size, int block_size,
    int max_blocks_per_request, float scale, int window, float soft_cap, int64_t q_stride_row, int64_t q_stride_head,
    int64_t out_stride_row, int64_t out_stride_head, int64_t cache_stride_block, int64_t cache_stride_slot,
    int64_t cache_stride_head, int partition_size, int partitions, float* __restrict__ part_out,
    float* __restrict__ part_max, float* __restrict__ part_sum, int codes, const float* __restrict__ k_scales,
    const float* __restrict__ v_scales, int64_t scale_stride_block, int64_t scale_stride_slot) {
  // codes (KVCodes) is the same for every thread: its branches below do not diverge
  const T* k_cache = static_cast<const T*>(k_cache_raw);
  const T* v_cache = static_cast<const T*>(v_cache_raw);
  const uint8_t* k_codes = static_cast<const uint8_t*>(k_cache_raw);
  const uint8_t* v_codes = static_cast<const uint8_t*>(v_cache_raw);
  constexpr int VEC = kVec<T>;
  constexpr int K_ITERS = kMaxHeadSize / (32 * VEC) > 0 ? kMaxHeadSize / (32 * VEC) : 1;
  const int row = blockIdx.x, kvh = blockIdx.y, part = blockIdx.z;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int group = num_heads / kv_heads;
  const int request = row_request[row];
  const int context = row_position[row] + 1;
  // a window that starts past this partition leaves it empty, as a partition past the context is
  const int start = window > 0 ? max(part * partition_size, context - window) : part * partition_size;
  // one partition (prefill rows, short decodes) is the whole context, however long
  const int end = partitions == 1 ? context : min(part * partition_size + partition_size, context);
  const int* table = block_tables + static_cast<int64_t>(request) * max_blocks_per_request;

  extern __shared__ float smem[];
  float* run_max = smem;
  float* run_sum = run_max + group;
  float* rescale = run_sum + group;
  float* q_s = rescale + group;
  float* scores = q_s + group * head_size;
  float* partials = q_s;

  if (start >= end) {  // a partition outside this row's context (or window) contributes nothing
    if (partitions > 1 && tid < group) {
      const int64_t idx = (static_cast<int64_t>(row) * num_heads + kvh * group + tid) * partitions + part;
      part_max[idx] = -FLT_MAX;
      part_sum[idx] = 0.f;
    }
    return;
  }
  for (int i = tid; i < group * head_size; i += kThreads) {
    const int g = i / head_size, d = i % head_size;
    q_s[i] = to_float(query[row * q_stride_row + (kvh * group + g) * q_stride_head + d]);
  }
  if (tid < group) {
    run_max[tid] = -FLT_MAX;
    run_sum[tid] = 0.f;
  }

  // scores: lanes_per_pos lanes read one position's K row in VEC-element loads, so a warp
  // takes 32 / lanes_per_pos positions at once
  const int vecs = head_size / VEC;
  const int lanes_per_pos = min(32, pow2_at_least(vecs));
  const int pos_per_warp = 32 / lanes_per_pos;
  const int sub = lane / lanes_per_pos, sub_lane = lane % lanes_per_pos;
  // weighted values: see value_dims_threads
  const int dims_threads = value_dims_threads(head_size);
  const int slices = kThreads / dims_threads;
  const int slice = tid / dims_threads, pair = tid % dims_threads;
  const bool owns = pair < head_size / 2;

  float acc[GROUP][2];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) acc[g][0] = acc[g][1] = 0.f;
  __syncthreads();

  for (int chunk = start; chunk < end; chunk += kChunk) {
    const int n = min(kChunk, end - chunk);
    // 1. scores; one read of K serves every query head of the group
    for (int base = warp * pos_per_warp; base < n; base += kWarps * pos_per_warp) {
      const int t = base + sub;
      const bool valid = t < n;  // lanes past the chunk still join the shuffles
      const int64_t off =
          valid ? slot_offset(table, chunk + t, block_size, kvh, cache_stride_block, cache_stride_slot, cache_stride_head)
                : 0;
      float k[K_ITERS][VEC];
#pragma unroll
      for (int it = 0; it < K_ITERS; ++it) {
        const int v = sub_lane + it * lanes_per_pos;
        if (valid && v < vecs && codes) {  // VEC codes in 4-byte loads (a row starts on 4 bytes)
#pragma unroll
          for (int w = 0; w < VEC / 4; ++w) {
            const Packed<uint8_t, 4> x = *reinterpret_cast<const Packed<uint8_t, 4>*>(k_codes + off + v * VEC + 4 * w);
#pragma unroll
            for (int i = 0; i < 4; ++i) k[it][4 * w + i] = widen_code(x.v[i], codes);
          }
        } else if (valid && v < vecs) {
          const Packed<T, VEC> x = *reinterpret_cast<const Packed<T, VEC>*>(k_cache + off + v * VEC);
#pragma unroll
          for (int i = 0; i < VEC; ++i) k[it][i] = to_float(x.v[i]);
        } else {
#pragma unroll
          for (int i = 0; i < VEC; ++i) k[it][i] = 0.f;
        }
      }
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        if (g >= group) break;
        float dot = 0.f;
#pragma unroll
        for (int it = 0; it < K_ITERS; ++it) {
          const int v = sub_lane + it * lanes_per_pos;
          if (v >= vecs) continue;
          const float* q = q_s + g * head_size + v * VEC;
#pragma unroll
          for (int i = 0; i < VEC; ++i) dot += q[i] * k[it][i];
        }
        dot = lanes_sum(dot, lanes_per_pos);
        if (valid && sub_lane == 0) {
          if (codes) dot *= k_scales[slot_offset(table, chunk + t, block_size, kvh, scale_stride_block,
                                                 scale_stride_slot, 1)];
          const float s = dot * scale;
          scores[g * kChunk + t] = soft_cap > 0.f ? soft_cap * tanhf(s / soft_cap) : s;
        }
      }
    }
    __syncthreads();
    // 2. online softmax bookkeeping, a warp per query head
    for (int g = warp; g < group; g += kWarps) {
      float m = -FLT_MAX;
      for (int t = lane; t < n; t += 32) m = fmaxf(m, scores[g * kChunk + t]);
      m = warp_max(m);
      if (lane == 0) {
        const float new_max = fmaxf(run_max[g], m);
        rescale[g] = __expf(run_max[g] - new_max);
        run_max[g] = new_max;
      }
    }
    __syncthreads();
    for (int i = tid; i < group * kChunk; i += kThreads) {
      const int g = i / kChunk, t = i % kChunk;
      if (t < n) scores[i] = __expf(scores[i] - run_max[g]);
    }
    __syncthreads();
    for (int g = warp; g < group; g += kWarps) {
      float s = 0.f;
      for (int t = lane; t < n; t += 32) s += scores[g * kChunk + t];
      s = lanes_sum(s, 32);
      if (lane == 0) run_sum[g] = run_sum[g] * rescale[g] + s;
    }
    // 3. weighted values: one read of V serves the whole group; a warp reads a contiguous row
    if (owns) {
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        if (g >= group) break;
        acc[g][0] *= rescale[g];
        acc[g][1] *= rescale[g];
      }
#pragma unroll 4
      for (int t = slice; t < n; t += slices) {
        const int64_t off =
            slot_offset(table, chunk + t, block_size, kvh, cache_stride_block, cache_stride_slot, cache_stride_head);
        float v0, v1;
        if (codes) {
          const Packed<uint8_t, 2> x = *reinterpret_cast<const Packed<uint8_t, 2>*>(v_codes + off + 2 * pair);
          const float row_scale =
              v_scales[slot_offset(table, chunk + t, block_size, kvh, scale_stride_block, scale_stride_slot, 1)];
          v0 = widen_code(x.v[0], codes) * row_scale, v1 = widen_code(x.v[1], codes) * row_scale;
        } else {
          const Packed<T, 2> x = *reinterpret_cast<const Packed<T, 2>*>(v_cache + off + 2 * pair);
          v0 = to_float(x.v[0]), v1 = to_float(x.v[1]);
        }
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
          if (g >= group) break;
          const float p = scores[g * kChunk + t];
          acc[g][0] += p * v0;
          acc[g][1] += p * v1;
        }
      }
    }
    __syncthreads();
  }

  if (slices > 1) {  // add the other slices' sums into slice 0's
    if (owns && slice > 0) {
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        if (g >= group) break;
        float* dst = partials + (static_cast<int64_t>(slice) * group + g) * head_size + 2 * pair;
        dst[0] = acc[g][0];
        dst[1] = acc[g][1];
      }
    }
    __syncthreads();
    if (owns && slice == 0) {
      for (int s = 1; s < slices; ++s) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
          if (g >= group) break;
          const float* src = partials + (static_cast<int64_t>(s) * group + g) * head_size + 2 * pair;
          acc[g][0] += src[0];
          acc[g][1] += src[1];
        }
      }
    }
  }
  if (owns && slice == 0) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      if (g >= group) break;
      const int h = kvh * group + g;
      const float inv = 1.f / run_sum[g];
      const int d = 2 * pair;
      if (partitions == 1) {
        T* dst = out + row * out_stride_row + h * out_stride_head + d;
        dst[0] = from_float<T>(acc[g][0] * inv);
        dst[1] = from_float<T>(acc[g][1] * inv);
      } else {
        float* dst = part_out + ((static_cast<int64_t>(row) * num_heads + h) * partitions + part) * head_size + d;
        dst[0] = acc[g][0] * inv;
        dst[1] = acc[g][1] * inv;
      }
    }
  }
  if (partitions > 1 && tid < group) {
    const int64_t idx = (static_cast<int64_t>(row) * num_heads + kvh * group + tid) * partitions + part;
    part_max[idx] = run_max[tid];
    part_sum[idx] = run_sum[tid];
  }
}

template <typename T>
__global__ void reduce_kernel(T* __restrict__ out, const float* __restrict__ part_out,
                              const float* __restrict__ part_max, const float* __restrict__ part_sum, int num_heads,
                              int head_size, int partitions, int64_t out_stride_row, int64_t out_stride_head) {
  const int row = blockIdx.x, h = blockIdx.y;
  const int64_t base = (static_cast<int64_t>(row) * num_heads + h) * partitions;
  float global_max = -FLT_MAX;
  for (int p = 0; p < partitions; ++p) global_max = fmaxf(global_max, part_max[base + p]);
  float total = 0.f;
  for (int p = 0; p < partitions; ++p) total += part_sum[base + p] * __expf(part_max[base + p] - global_max);
  for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
    float x = 0.f;
    for (int p = 0; p < partitions; ++p) {
      // a partition past the row's context wrote its max and sum but not its output, which is
      // whatever the buffer held (inf or NaN after the sampler's -inf): skip it, 0 x NaN is NaN
      if (part_sum[base + p] == 0.f) continue;
      const float w = part_sum[base + p] * __expf(part_max[base + p] - global_max);
      x += w * part_out[(base + p) * head_size + d];
    }
    out[row * out_stride_row + h * out_stride_head + d] = from_float<T>(x / total);
  }
}

template <typename T>
__global__ void copy_blocks_kernel(T* __restrict__ caches, const int64_t* __restrict__ pairs, int64_t layer_stride,
                                   int64_t block_elems) {
  const int64_t src = pairs[2 * blockIdx.x], dst = pairs[2 * blockIdx.x + 1];
  T* layer = caches + blockIdx.y * layer_stride;
  for (int64_t i = threadIdx.x; i < block_elems; i += blockDim.x)
    layer[dst * block_elems + i] = layer[src * block_elems + i];
}

// Multi-LoRA (BGMV: each row its own adapter): one block per row. Each warp shrinks x[row] onto
// ranks warp, warp + kWarps, ... of its adapter's A [slots, rank, in] (lanes stride the input,
// a shuffle sums them) into shared memory; then each thread expands outputs tid, tid + kThreads,
// ... with B [slots, out, rank] and adds them to out[row]. A row of slot -1 is left as it is.
template <typename T>
__global__ void add_lora_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ lora_a,
                                const T* __restrict__ lora_b, const int* __restrict__ slots,
                                const float* __restrict__ scales, int width_in, int width_out, int rank,
                                int64_t out_stride_row, int64_t x_stride_row) {
  extern __shared__ float smem[];
  float* shrunk = smem;  // [rank]
  const int64_t row = blockIdx.x;
  const int slot = slots[row];
  if (slot < 0) return;  // the whole block leaves together: no barrier is skipped
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* xr = x + row * x_stride_row;
  const T* a = lora_a + static_cast<int64_t>(slot) * rank * width_in;
  for (int r = warp; r < rank; r += kWarps) {
    float acc = 0.f;
    const T* ar = a + static_cast<int64_t>(r) * width_in;
    for (int i = lane; i < width_in; i += 32) acc += to_float(xr[i]) * to_float(ar[i]);
    acc = lanes_sum(acc, 32);
    if (lane == 0) shrunk[r] = acc * scales[slot];
  }
  __syncthreads();
  const T* b = lora_b + static_cast<int64_t>(slot) * width_out * rank;
  T* o = out + row * out_stride_row;
  for (int j = threadIdx.x; j < width_out; j += blockDim.x) {
    float acc = 0.f;
    for (int r = 0; r < rank; ++r) acc += shrunk[r] * to_float(b[static_cast<int64_t>(j) * rank + r]);
    o[j] = from_float<T>(to_float(o[j]) + acc);
  }
}

}  // namespace kernels
}  // namespace pagedllm
