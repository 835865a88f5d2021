// Launchers of the cuda-native kernels, callable without CUDA or torch headers: tensors are
// passed as raw pointers with their strides, the stream as an opaque handle. Each returns
// nullptr, or the CUDA error of its launch (cudaGetLastError), for the caller to raise.
#pragma once

#include <cstdint>

namespace pagedllm {

enum class DType : int { Float32 = 0, Float16 = 1, BFloat16 = 2 };
// what K/V caches hold: the query's dtype (None), or 8-bit codes with a float32 scale per
// (token, KV head) row, value = code * scale (backends/kv_cache.py)
enum class KVCodes : int { None = 0, Int8 = 1, E4M3 = 2, E5M2 = 3 };

// key/value [tokens, kv_heads, head_size]; caches [num_blocks, block_size, kv_heads, head_size];
// token t goes to slot slot_mapping[t] (negative: skipped).
const char* launch_write_kv(DType dtype, const void* key, const void* value, void* k_cache, void* v_cache,
                     const int64_t* slot_mapping, int tokens, int kv_heads, int head_size, int block_size,
                     int64_t key_stride_t, int64_t key_stride_h, int64_t value_stride_t, int64_t value_stride_h,
                     int64_t cache_stride_block, int64_t cache_stride_slot, int64_t cache_stride_head,
                     void* stream);

// write_kv into an 8-bit cache: each (token, KV head) row of key/value (of dtype) quantized into
// codes (caches of bytes, strides in bytes) and its scale (k_scales/v_scales: float32, a block's
// rows scale_stride_block apart, a slot's heads contiguous).
const char* launch_write_kv_codes(DType dtype, KVCodes codes, const void* key, const void* value, void* k_cache,
                                  void* v_cache, float* k_scales, float* v_scales, const int64_t* slot_mapping,
                                  int tokens, int kv_heads, int head_size, int block_size, int64_t key_stride_t,
                                  int64_t key_stride_h, int64_t value_stride_t, int64_t value_stride_h,
                                  int64_t cache_stride_block, int64_t cache_stride_slot, int64_t cache_stride_head,
                                  int64_t scale_stride_block, int64_t scale_stride_slot, void* stream);

// One "row" is one query token: it belongs to request row_request[row] and attends to the
// positions 0..row_position[row] of that request (causal, the cached prefix included); with
// window > 0 only to the last `window` of them. soft_cap > 0: scores are soft-capped,
// soft_cap * tanh(score / soft_cap), before the softmax (Gemma 2).
// grid: rows x kv_heads x partitions; each block handles the query heads of one KV head.
// partitions > 1: partial results go to part_out [rows, heads, partitions, head_size] and
// part_max / part_sum [rows, heads, partitions], and launch_reduce combines them into out.
// codes != None: the caches hold 8-bit codes (strides in bytes) with k_scales / v_scales as
// launch_write_kv_codes writes them; the query and out keep dtype.
const char* launch_paged_attention(DType dtype, void* out, const void* query, const void* k_cache, const void* v_cache,
                            const int* block_tables, const int* row_request, const int* row_position,
                            int rows, int num_heads, int kv_heads, int head_size, int block_size,
                            int max_blocks_per_request, float scale, int window, float soft_cap,
                            int64_t q_stride_row, int64_t q_stride_head, int64_t out_stride_row,
                            int64_t out_stride_head, int64_t cache_stride_block, int64_t cache_stride_slot,
                            int64_t cache_stride_head, int partition_size, int partitions,
                            float* part_out, float* part_max, float* part_sum, KVCodes codes,
                            const float* k_scales, const float* v_scales, int64_t scale_stride_block,
                            int64_t scale_stride_slot, void* stream);

const char* launch_reduce(DType dtype, void* out, const float* part_out, const float* part_max, const float* part_sum,
                   int rows, int num_heads, int head_size, int partitions, int64_t out_stride_row,
                   int64_t out_stride_head, void* stream);

// caches viewed as [layers, num_blocks, block_elems]; pairs [n, 2] (src, dst) on the device.
const char* launch_copy_blocks(DType dtype, void* caches, const int64_t* pairs, int num_pairs, int layers,
                        int64_t layer_stride, int64_t block_elems, void* stream);

// Multi-LoRA, in place: out[t] += scales[s] * lora_b[s] @ (lora_a[s] @ x[t]) for each row t whose
// slot s = slots[t] >= 0. x [rows, in] and out [rows, out] (rows their strides apart, values
// contiguous), lora_a [slots, rank, in], lora_b [slots, out, rank] contiguous, all of dtype;
// scales float32, slots int32, on the device.
const char* launch_add_lora(DType dtype, void* out, const void* x, const void* lora_a, const void* lora_b,
                            const int* slots, const float* scales, int rows, int width_in, int width_out, int rank,
                            int64_t out_stride_row, int64_t x_stride_row, void* stream);

// Head sizes and GQA groups the attention kernel supports: head sizes up to 256 and a multiple of
// 8 (whole 16-byte loads of 16-bit K/V), groups up to 16.
constexpr int kMaxHeadSize = 256;
constexpr int kHeadSizeMultiple = 8;
constexpr int kMaxGroup = 16;

}  // namespace pagedllm
