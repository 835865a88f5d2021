// The cuda-native kernels: K/V writes, paged attention with context partitions and a reduction
// ("v2"), and block copies. Plain CUDA: no torch headers, so it compiles on its own with nvcc.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>

#include "kernels.h"

namespace pagedllm {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 128;  // context positions whose scores sit in shared memory at once
constexpr int kPerLane = kMaxHeadSize / 32;
constexpr int kPerThread = kMaxHeadSize / kThreads;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
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

// Shared memory: q [group][head_size], scores [group][kChunk], running max / sum / rescale
// factor [group] each.
template <typename T>
__global__ void __launch_bounds__(kThreads) paged_attention_kernel(
    T* __restrict__ out, const T* __restrict__ query, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ row_request, const int* __restrict__ row_position,
    int num_heads, int kv_heads, int head_size, int block_size, int max_blocks_per_request, float scale,
    int64_t q_stride_row, int64_t q_stride_head, int64_t out_stride_row, int64_t out_stride_head,
    int64_t cache_stride_block, int64_t cache_stride_slot, int64_t cache_stride_head, int partition_size,
    int partitions, float* __restrict__ part_out, float* __restrict__ part_max, float* __restrict__ part_sum) {
  const int row = blockIdx.x, kvh = blockIdx.y, part = blockIdx.z;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int group = num_heads / kv_heads;
  const int request = row_request[row];
  const int context = row_position[row] + 1;
  const int start = part * partition_size;
  const int end = min(start + partition_size, context);
  const int* table = block_tables + static_cast<int64_t>(request) * max_blocks_per_request;

  extern __shared__ float smem[];
  float* q_s = smem;
  float* scores = q_s + group * head_size;
  float* run_max = scores + group * kChunk;
  float* run_sum = run_max + group;
  float* rescale = run_sum + group;

  if (start >= end) {  // a partition past this row's context contributes nothing
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
  float acc[kMaxGroup][kPerThread];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g)
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) acc[g][j] = 0.f;
  __syncthreads();

  for (int chunk = start; chunk < end; chunk += kChunk) {
    const int n = min(kChunk, end - chunk);
    // 1. scores: each warp takes whole positions; its lanes split the head dimension, and one
    //    read of K serves every query head of the group
    for (int t = warp; t < n; t += kWarps) {
      const int pos = chunk + t;
      const int64_t off = static_cast<int64_t>(table[pos / block_size]) * cache_stride_block +
                          (pos % block_size) * cache_stride_slot + kvh * cache_stride_head;
      float k[kPerLane];
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int d = lane + 32 * i;
        k[i] = d < head_size ? to_float(k_cache[off + d]) : 0.f;
      }
      for (int g = 0; g < group; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const int d = lane + 32 * i;
          if (d < head_size) dot += q_s[g * head_size + d] * k[i];
        }
        dot = warp_sum(dot);
        if (lane == 0) scores[g * kChunk + t] = dot * scale;
      }
    }
    __syncthreads();
    // 2. online softmax bookkeeping, one thread per query head
    if (tid < group) {
      float chunk_max = -FLT_MAX;
      for (int t = 0; t < n; ++t) chunk_max = fmaxf(chunk_max, scores[tid * kChunk + t]);
      const float new_max = fmaxf(run_max[tid], chunk_max);
      rescale[tid] = __expf(run_max[tid] - new_max);
      run_max[tid] = new_max;
    }
    __syncthreads();
    for (int i = tid; i < group * kChunk; i += kThreads) {
      const int g = i / kChunk, t = i % kChunk;
      if (t < n) scores[i] = __expf(scores[i] - run_max[g]);
    }
    __syncthreads();
    if (tid < group) {
      float chunk_sum = 0.f;
      for (int t = 0; t < n; ++t) chunk_sum += scores[tid * kChunk + t];
      run_sum[tid] = run_sum[tid] * rescale[tid] + chunk_sum;
    }
    // 3. weighted values: each thread owns a few output dimensions of every head; one read of
    //    V serves the whole group, and neighbouring threads read neighbouring elements
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int d = tid + j * kThreads;
      if (d >= head_size) continue;
      for (int g = 0; g < group; ++g) acc[g][j] *= rescale[g];
      for (int t = 0; t < n; ++t) {
        const int pos = chunk + t;
        const int64_t off = static_cast<int64_t>(table[pos / block_size]) * cache_stride_block +
                            (pos % block_size) * cache_stride_slot + kvh * cache_stride_head;
        const float v = to_float(v_cache[off + d]);
        for (int g = 0; g < group; ++g) acc[g][j] += scores[g * kChunk + t] * v;
      }
    }
    __syncthreads();
  }

  for (int g = 0; g < group; ++g) {
    const int h = kvh * group + g;
    const float inv = 1.f / run_sum[g];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int d = tid + j * kThreads;
      if (d >= head_size) continue;
      if (partitions == 1) {
        out[row * out_stride_row + h * out_stride_head + d] = from_float<T>(acc[g][j] * inv);
      } else {
        const int64_t idx = (static_cast<int64_t>(row) * num_heads + h) * partitions + part;
        part_out[idx * head_size + d] = acc[g][j] * inv;
      }
    }
    if (partitions > 1 && tid == 0) {
      const int64_t idx = (static_cast<int64_t>(row) * num_heads + h) * partitions + part;
      part_max[idx] = run_max[g];
      part_sum[idx] = run_sum[g];
    }
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

template <template <typename> class F, typename... Args>
void dispatch(DType dtype, Args&&... args) {
  switch (dtype) {
    case DType::Float32: F<float>::run(args...); break;
    case DType::Float16: F<__half>::run(args...); break;
    case DType::BFloat16: F<__nv_bfloat16>::run(args...); break;
  }
}

template <typename T> struct WriteKv {
  static void run(const void* key, const void* value, void* k_cache, void* v_cache, const int64_t* slots, int tokens,
                  int kv_heads, int head_size, int block_size, int64_t kst, int64_t ksh, int64_t vst, int64_t vsh,
                  int64_t csb, int64_t css, int64_t csh, cudaStream_t stream) {
    const int threads = min(1024, ((kv_heads * head_size + 31) / 32) * 32);
    write_kv_kernel<T><<<tokens, threads, 0, stream>>>(
        static_cast<const T*>(key), static_cast<const T*>(value), static_cast<T*>(k_cache), static_cast<T*>(v_cache),
        slots, kv_heads, head_size, block_size, kst, ksh, vst, vsh, csb, css, csh);
  }
};

template <typename T> struct Attention {
  static void run(void* out, const void* query, const void* k_cache, const void* v_cache, const int* tables,
                  const int* row_request, const int* row_position, int rows, int num_heads, int kv_heads,
                  int head_size, int block_size, int max_blocks, float scale, int64_t qsr, int64_t qsh, int64_t osr,
                  int64_t osh, int64_t csb, int64_t css, int64_t csh, int partition_size, int partitions,
                  float* part_out, float* part_max, float* part_sum, cudaStream_t stream) {
    const int group = num_heads / kv_heads;
    const size_t smem = sizeof(float) * (group * head_size + group * kChunk + 3 * group);
    dim3 grid(rows, kv_heads, partitions);
    paged_attention_kernel<T><<<grid, kThreads, smem, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(query), static_cast<const T*>(k_cache),
        static_cast<const T*>(v_cache), tables, row_request, row_position, num_heads, kv_heads, head_size,
        block_size, max_blocks, scale, qsr, qsh, osr, osh, csb, css, csh, partition_size, partitions, part_out,
        part_max, part_sum);
  }
};

template <typename T> struct Reduce {
  static void run(void* out, const float* part_out, const float* part_max, const float* part_sum, int rows,
                  int num_heads, int head_size, int partitions, int64_t osr, int64_t osh, cudaStream_t stream) {
    reduce_kernel<T><<<dim3(rows, num_heads), kThreads, 0, stream>>>(
        static_cast<T*>(out), part_out, part_max, part_sum, num_heads, head_size, partitions, osr, osh);
  }
};

template <typename T> struct CopyBlocks {
  static void run(void* caches, const int64_t* pairs, int num_pairs, int layers, int64_t layer_stride,
                  int64_t block_elems, cudaStream_t stream) {
    copy_blocks_kernel<T><<<dim3(num_pairs, layers), 256, 0, stream>>>(static_cast<T*>(caches), pairs,
                                                                        layer_stride, block_elems);
  }
};

// The error of the launch just made (bad configuration, no kernel image for this GPU, ...);
// reading it also clears it, so it cannot surface later at an unrelated call.
const char* launch_error() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace

const char* launch_write_kv(DType dtype, const void* key, const void* value, void* k_cache, void* v_cache,
                     const int64_t* slot_mapping, int tokens, int kv_heads, int head_size, int block_size,
                     int64_t key_stride_t, int64_t key_stride_h, int64_t value_stride_t, int64_t value_stride_h,
                     int64_t cache_stride_block, int64_t cache_stride_slot, int64_t cache_stride_head,
                     void* stream) {
  if (tokens == 0) return nullptr;
  dispatch<WriteKv>(dtype, key, value, k_cache, v_cache, slot_mapping, tokens, kv_heads, head_size, block_size,
                    key_stride_t, key_stride_h, value_stride_t, value_stride_h, cache_stride_block,
                    cache_stride_slot, cache_stride_head, static_cast<cudaStream_t>(stream));
  return launch_error();
}

const char* launch_paged_attention(DType dtype, void* out, const void* query, const void* k_cache, const void* v_cache,
                            const int* block_tables, const int* row_request, const int* row_position, int rows,
                            int num_heads, int kv_heads, int head_size, int block_size, int max_blocks_per_request,
                            float scale, int64_t q_stride_row, int64_t q_stride_head, int64_t out_stride_row,
                            int64_t out_stride_head, int64_t cache_stride_block, int64_t cache_stride_slot,
                            int64_t cache_stride_head, int partition_size, int partitions, float* part_out,
                            float* part_max, float* part_sum, void* stream) {
  if (rows == 0) return nullptr;
  dispatch<Attention>(dtype, out, query, k_cache, v_cache, block_tables, row_request, row_position, rows, num_heads,
                      kv_heads, head_size, block_size, max_blocks_per_request, scale, q_stride_row, q_stride_head,
                      out_stride_row, out_stride_head, cache_stride_block, cache_stride_slot, cache_stride_head,
                      partition_size, partitions, part_out, part_max, part_sum, static_cast<cudaStream_t>(stream));
  return launch_error();
}

const char* launch_reduce(DType dtype, void* out, const float* part_out, const float* part_max, const float* part_sum,
                   int rows, int num_heads, int head_size, int partitions, int64_t out_stride_row,
                   int64_t out_stride_head, void* stream) {
  if (rows == 0) return nullptr;
  dispatch<Reduce>(dtype, out, part_out, part_max, part_sum, rows, num_heads, head_size, partitions, out_stride_row,
                   out_stride_head, static_cast<cudaStream_t>(stream));
  return launch_error();
}

const char* launch_copy_blocks(DType dtype, void* caches, const int64_t* pairs, int num_pairs, int layers,
                        int64_t layer_stride, int64_t block_elems, void* stream) {
  if (num_pairs == 0) return nullptr;
  dispatch<CopyBlocks>(dtype, caches, pairs, num_pairs, layers, layer_stride, block_elems,
                       static_cast<cudaStream_t>(stream));
  return launch_error();
}

}  // namespace pagedllm
