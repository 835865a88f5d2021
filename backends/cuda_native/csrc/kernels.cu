// Launchers of the cuda-native kernels (kernels.cuh): each picks the kernel's template
// arguments and grid, and returns its launch error.
#include <cuda_runtime.h>

#include <type_traits>

#include "kernels.cuh"

namespace pagedllm {
namespace {

using namespace kernels;

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

template <typename T> struct WriteKvCodes {
  static void run(int codes, const void* key, const void* value, void* k_cache, void* v_cache, float* k_scales,
                  float* v_scales, const int64_t* slots, int tokens, int kv_heads, int head_size, int block_size,
                  int64_t kst, int64_t ksh, int64_t vst, int64_t vsh, int64_t csb, int64_t css, int64_t csh,
                  int64_t ssb, int64_t sss, cudaStream_t stream) {
    const int threads = min(256, ((2 * kv_heads + 31) / 32) * 32);
    write_kv_codes_kernel<T><<<tokens, threads, 0, stream>>>(
        static_cast<const T*>(key), static_cast<const T*>(value), static_cast<uint8_t*>(k_cache),
        static_cast<uint8_t*>(v_cache), k_scales, v_scales, slots, codes, kv_heads, head_size, block_size, kst, ksh,
        vst, vsh, csb, css, csh, ssb, sss);
  }
};

template <typename T> struct Attention {
  template <int GROUP, typename... Args>
  static void launch(dim3 grid, size_t smem, cudaStream_t stream, Args... args) {
    paged_attention_kernel<T, GROUP><<<grid, kThreads, smem, stream>>>(args...);
  }
  static void run(void* out, const void* query, const void* k_cache, const void* v_cache, const int* tables,
                  const int* row_request, const int* row_position, int rows, int num_heads, int kv_heads,
                  int head_size, int block_size, int max_blocks, float scale, int window, float soft_cap,
                  int64_t qsr, int64_t qsh, int64_t osr,
                  int64_t osh, int64_t csb, int64_t css, int64_t csh, int partition_size, int partitions,
                  float* part_out, float* part_max, float* part_sum, int codes, const float* k_scales,
                  const float* v_scales, int64_t ssb, int64_t sss, cudaStream_t stream) {
    const int group = num_heads / kv_heads;
    const size_t smem = sizeof(float) * attention_smem_floats(group, head_size);
    const dim3 grid(rows, kv_heads, partitions);
    // the group's compile-time bound: the next power of two, so five kernels serve groups 1-16
    const auto go = [&](auto bound) {
      launch<decltype(bound)::value>(grid, smem, stream, static_cast<T*>(out), static_cast<const T*>(query), k_cache,
                                     v_cache, tables, row_request, row_position, num_heads, kv_heads, head_size,
                                     block_size, max_blocks, scale, window, soft_cap, qsr, qsh, osr, osh, csb, css,
                                     csh, partition_size, partitions, part_out, part_max, part_sum, codes, k_scales,
                                     v_scales, ssb, sss);
    };
    static_assert(kMaxGroup == 16, "the dispatch below covers groups up to 16");
    if (group <= 1) go(std::integral_constant<int, 1>());
    else if (group <= 2) go(std::integral_constant<int, 2>());
    else if (group <= 4) go(std::integral_constant<int, 4>());
    else if (group <= 8) go(std::integral_constant<int, 8>());
    else go(std::integral_constant<int, 16>());
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

template <typename T> struct AddLora {
  static void run(void* out, const void* x, const void* lora_a, const void* lora_b, const int* slots,
                  const float* scales, int rows, int width_in, int width_out, int rank, int64_t osr, int64_t xsr,
                  cudaStream_t stream) {
    add_lora_kernel<T><<<rows, kThreads, sizeof(float) * rank, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(x), static_cast<const T*>(lora_a), static_cast<const T*>(lora_b),
        slots, scales, width_in, width_out, rank, osr, xsr);
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

const char* launch_write_kv_codes(DType dtype, KVCodes codes, const void* key, const void* value, void* k_cache,
                                  void* v_cache, float* k_scales, float* v_scales, const int64_t* slot_mapping,
                                  int tokens, int kv_heads, int head_size, int block_size, int64_t key_stride_t,
                                  int64_t key_stride_h, int64_t value_stride_t, int64_t value_stride_h,
                                  int64_t cache_stride_block, int64_t cache_stride_slot, int64_t cache_stride_head,
                                  int64_t scale_stride_block, int64_t scale_stride_slot, void* stream) {
  if (tokens == 0) return nullptr;
  dispatch<WriteKvCodes>(dtype, static_cast<int>(codes), key, value, k_cache, v_cache, k_scales, v_scales,
                         slot_mapping, tokens, kv_heads, head_size, block_size, key_stride_t, key_stride_h,
                         value_stride_t, value_stride_h, cache_stride_block, cache_stride_slot, cache_stride_head,
                         scale_stride_block, scale_stride_slot, static_cast<cudaStream_t>(stream));
  return launch_error();
}

const char* launch_paged_attention(DType dtype, void* out, const void* query, const void* k_cache, const void* v_cache,
                            const int* block_tables, const int* row_request, const int* row_position, int rows,
                            int num_heads, int kv_heads, int head_size, int block_size, int max_blocks_per_request,
                            float scale, int window, float soft_cap, int64_t q_stride_row, int64_t q_stride_head,
                            int64_t out_stride_row,
                            int64_t out_stride_head, int64_t cache_stride_block, int64_t cache_stride_slot,
                            int64_t cache_stride_head, int partition_size, int partitions, float* part_out,
                            float* part_max, float* part_sum, KVCodes codes, const float* k_scales,
                            const float* v_scales, int64_t scale_stride_block, int64_t scale_stride_slot,
                            void* stream) {
  if (rows == 0) return nullptr;
  dispatch<Attention>(dtype, out, query, k_cache, v_cache, block_tables, row_request, row_position, rows, num_heads,
                      kv_heads, head_size, block_size, max_blocks_per_request, scale, window, soft_cap,
                      q_stride_row, q_stride_head,
                      out_stride_row, out_stride_head, cache_stride_block, cache_stride_slot, cache_stride_head,
                      partition_size, partitions, part_out, part_max, part_sum, static_cast<int>(codes), k_scales,
                      v_scales, scale_stride_block, scale_stride_slot, static_cast<cudaStream_t>(stream));
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

const char* launch_add_lora(DType dtype, void* out, const void* x, const void* lora_a, const void* lora_b,
                            const int* slots, const float* scales, int rows, int width_in, int width_out, int rank,
                            int64_t out_stride_row, int64_t x_stride_row, void* stream) {
  if (rows == 0 || rank == 0) return nullptr;
  dispatch<AddLora>(dtype, out, x, lora_a, lora_b, slots, scales, rows, width_in, width_out, rank, out_stride_row,
                    x_stride_row, static_cast<cudaStream_t>(stream));
  return launch_error();
}

}  // namespace pagedllm
