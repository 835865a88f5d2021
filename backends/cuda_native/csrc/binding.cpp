// torch bindings of the cuda-native kernels. The caller passes the CUDA stream as an integer
// handle (torch.cuda.current_stream().cuda_stream), so this file needs no CUDA headers.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>

#include "kernels.h"

namespace {

using pagedllm::DType;

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::Float32;
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    default: TORCH_CHECK(false, "cuda-native: unsupported dtype ", t.scalar_type());
  }
}

void* stream_of(int64_t handle) { return reinterpret_cast<void*>(handle); }

void check_launch(const char* error, const char* kernel) {
  TORCH_CHECK(error == nullptr, "cuda-native: the ", kernel, " kernel failed to launch: ", error);
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "cuda-native: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.stride(-1) == 1, "cuda-native: ", name, " must be contiguous in its last dimension");
}

// key/value [T, KVH, D]; k_cache/v_cache [N, bs, KVH, D]; slot_mapping [T] int64
void write_kv(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache,
              at::Tensor slot_mapping, int64_t stream) {
  check_cuda(key, "key");
  check_cuda(k_cache, "k_cache");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type(), "cuda-native: key and cache dtypes differ");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "cuda-native: slot_mapping must be int64");
  check_launch(pagedllm::launch_write_kv(dtype_of(key), key.data_ptr(), value.data_ptr(), k_cache.data_ptr(),
                                         v_cache.data_ptr(), slot_mapping.data_ptr<int64_t>(), key.size(0),
                                         key.size(1), key.size(2), k_cache.size(1), key.stride(0), key.stride(1),
                                         value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1),
                                         k_cache.stride(2), stream_of(stream)),
               "write_kv");
}

// write_kv into an 8-bit cache: key/value [T, KVH, D] of the model dtype; k_cache/v_cache
// [N, bs, KVH, D] of bytes (int8-typed views); k_scales/v_scales [N, bs, KVH] float32; codes: KVCodes
void write_kv_codes(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache, at::Tensor k_scales,
                    at::Tensor v_scales, at::Tensor slot_mapping, int64_t codes, int64_t stream) {
  check_cuda(key, "key");
  check_cuda(k_cache, "k_cache");
  TORCH_CHECK(k_cache.element_size() == 1 && k_scales.scalar_type() == at::kFloat,
              "cuda-native: an 8-bit cache holds bytes and float32 scales");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "cuda-native: slot_mapping must be int64");
  check_launch(pagedllm::launch_write_kv_codes(
                   dtype_of(key), static_cast<pagedllm::KVCodes>(codes), key.data_ptr(), value.data_ptr(),
                   k_cache.data_ptr(), v_cache.data_ptr(), k_scales.data_ptr<float>(), v_scales.data_ptr<float>(),
                   slot_mapping.data_ptr<int64_t>(), key.size(0), key.size(1), key.size(2), k_cache.size(1),
                   key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_cache.stride(0),
                   k_cache.stride(1), k_cache.stride(2), k_scales.stride(0), k_scales.stride(1), stream_of(stream)),
               "write_kv_codes");
}

// out/query [rows, H, D]; caches [N, bs, KVH, D]; block_tables [R, max_blocks] int32;
// row_request/row_position [rows] int32. codes != 0 (KVCodes): the caches hold bytes, with
// k_scales/v_scales [N, bs, KVH] float32 (else empty).
void paged_attention(at::Tensor out, at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                     at::Tensor block_tables, at::Tensor row_request, at::Tensor row_position,
                     double scale, int64_t window, double soft_cap, int64_t partition_size, at::Tensor part_out, at::Tensor part_max,
                     at::Tensor part_sum, int64_t codes, at::Tensor k_scales, at::Tensor v_scales, int64_t stream) {
  check_cuda(query, "query");
  check_cuda(k_cache, "k_cache");
  const int num_heads = query.size(1), head_size = query.size(2), kv_heads = k_cache.size(2);
  TORCH_CHECK(head_size <= pagedllm::kMaxHeadSize, "cuda-native: head size ", head_size, " > ",
              pagedllm::kMaxHeadSize);
  TORCH_CHECK(head_size % pagedllm::kHeadSizeMultiple == 0, "cuda-native: head size ", head_size,
              " is not a multiple of ", pagedllm::kHeadSizeMultiple, " (K/V are read in 16-byte loads)");
  for (const at::Tensor* cache : {&k_cache, &v_cache}) {
    // 16-byte loads of values; 4-byte loads of codes (an 8-bit block is codes then scales)
    const int64_t whole = codes ? 4 : pagedllm::kHeadSizeMultiple, start = codes ? 4 : 16;
    TORCH_CHECK(reinterpret_cast<uintptr_t>(cache->data_ptr()) % start == 0 && cache->stride(0) % whole == 0 &&
                    cache->stride(1) % whole == 0 && cache->stride(2) % whole == 0,
                "cuda-native: the K/V caches must start on ", start, " bytes and have strides of whole ", whole,
                " elements");
  }
  TORCH_CHECK(codes == 0 || (k_cache.element_size() == 1 && k_scales.scalar_type() == at::kFloat),
              "cuda-native: an 8-bit cache holds bytes and float32 scales");
  TORCH_CHECK(num_heads % kv_heads == 0 && num_heads / kv_heads <= pagedllm::kMaxGroup,
              "cuda-native: query heads per KV head must divide and be <= ", pagedllm::kMaxGroup);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && row_request.scalar_type() == at::kInt &&
                  row_position.scalar_type() == at::kInt,
              "cuda-native: block tables and row indices must be int32");
  const int partitions = part_max.numel() == 0 ? 1 : part_max.size(2);
  check_launch(pagedllm::launch_paged_attention(
      dtype_of(query), out.data_ptr(), query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
      block_tables.data_ptr<int>(), row_request.data_ptr<int>(), row_position.data_ptr<int>(), query.size(0),
      num_heads, kv_heads, head_size, k_cache.size(1), block_tables.size(1), static_cast<float>(scale),
      static_cast<int>(window), static_cast<float>(soft_cap),
      query.stride(0), query.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
      k_cache.stride(2), partition_size, partitions, part_out.data_ptr<float>(), part_max.data_ptr<float>(),
      part_sum.data_ptr<float>(), static_cast<pagedllm::KVCodes>(codes),
      codes ? k_scales.data_ptr<float>() : nullptr, codes ? v_scales.data_ptr<float>() : nullptr,
      codes ? k_scales.stride(0) : 0, codes ? k_scales.stride(1) : 0, stream_of(stream)),
               "paged_attention");
  if (partitions > 1) {
    check_launch(pagedllm::launch_reduce(dtype_of(out), out.data_ptr(), part_out.data_ptr<float>(),
                                         part_max.data_ptr<float>(), part_sum.data_ptr<float>(), query.size(0),
                                         num_heads, head_size, partitions, out.stride(0), out.stride(1),
                                         stream_of(stream)),
                 "reduce");
  }
}

// caches [layers, N, block_elems] (contiguous); pairs [n, 2] int64 on the device
void copy_blocks(at::Tensor caches, at::Tensor pairs, int64_t stream) {
  check_cuda(caches, "caches");
  check_launch(pagedllm::launch_copy_blocks(dtype_of(caches), caches.data_ptr(), pairs.data_ptr<int64_t>(),
                                            pairs.size(0), caches.size(0), caches.stride(0), caches.size(2),
                                            stream_of(stream)),
               "copy_blocks");
}

// out [rows, out] and x [rows, in] (values contiguous), lora_a [slots, rank, in], lora_b [slots, out, rank]
// (contiguous, out's dtype), scales float32 [slots], slots int32 [rows]
void add_lora(at::Tensor out, at::Tensor x, at::Tensor lora_a, at::Tensor lora_b, at::Tensor slots,
              at::Tensor scales, int64_t stream) {
  check_cuda(out, "out");
  check_launch(pagedllm::launch_add_lora(dtype_of(out), out.data_ptr(), x.data_ptr(), lora_a.data_ptr(),
                                         lora_b.data_ptr(), slots.data_ptr<int>(), scales.data_ptr<float>(),
                                         x.size(0), x.size(1), out.size(1), lora_a.size(1), out.stride(0),
                                         x.stride(0), stream_of(stream)),
               "add_lora");
}

}  // namespace

// Registered as torch operators (torch.ops.pagedllm_native.*) rather than a Python module: the
// dispatcher's headers are a fraction of torch/extension.h's, and CUDA graphs capture them as is.
TORCH_LIBRARY(pagedllm_native, m) {
  m.def("write_kv", &write_kv);          // store K/V of new tokens at their slots
  m.def("write_kv_codes", &write_kv_codes);  // the same into an 8-bit cache, with each row's scale
  m.def("paged_attention", &paged_attention);  // attention over paged K/V, one query token per row
  m.def("copy_blocks", &copy_blocks);    // copy KV blocks (copy-on-write) in every layer
  m.def("add_lora", &add_lora);          // multi-LoRA: each row's adapter's shrink and expand
}
