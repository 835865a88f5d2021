// A replayed step's kernel calls in one call from Python (step_replay.py's OpSegment): each op
// is a kind and its arguments, WORDS int64 words in all, run in order with the step's row count
// and thread count. The kernels are the ones Python calls one at a time otherwise, with the same
// arguments, so the results are the same bits; what goes is ~1.5 us of ctypes and Python per
// call, ~45 calls a decode step.
#include <cstdint>
#include <cstring>

extern "C" {
void pagedllm_panel_linear(int kind, const float* x, int64_t m, const void* packed, int64_t n, int64_t k,
                           const float* bias, float* out, int num_threads);
void pagedllm_rms_norm_f32(const float* x, const float* weight, float eps, float* out, int64_t rows, int64_t size,
                           int num_threads);
void pagedllm_add_rms_norm_f32(const float* x, float* residual, const float* weight, float eps, float* out,
                               int64_t rows, int64_t size, int num_threads);
void pagedllm_rotary_f32(const float* x, int64_t row_stride, const float* cos, const float* sin, float* out,
                         int64_t rows, int64_t heads, int64_t size, int num_threads);
int64_t pagedllm_write_kv(const char* key, int64_t key_stride, const char* value, int64_t value_stride,
                          const int64_t* slots, int64_t num_tokens, int64_t row_bytes, char* k_cache, char* v_cache,
                          int64_t num_slots, int num_threads);
void pagedllm_silu_and_mul_f32(const float* x, float* out, int64_t rows, int64_t size, int num_threads);
#define PAGEDLLM_ATTENTION_DECL(SUFFIX)                                                                           \
  void pagedllm_paged_attention_##SUFFIX(const float* q, const void* k_cache, const void* v_cache,               \
                                         const int32_t* block_tables, int64_t table_stride,                      \
                                         const int32_t* row_table, const int32_t* row_context, int64_t num_rows, \
                                         int64_t num_heads, int64_t num_kv_heads, int64_t head_size,             \
                                         int64_t block_size, float scale, int64_t window, float soft_cap,        \
                                         float* out, int num_threads, int dot_products);
PAGEDLLM_ATTENTION_DECL(f32)
PAGEDLLM_ATTENTION_DECL(bf16)
PAGEDLLM_ATTENTION_DECL(f16)
#undef PAGEDLLM_ATTENTION_DECL
void pagedllm_quantized_gemv_f32(int kind, const float* x, int64_t m, const uint8_t* codes, int64_t row_bytes,
                                 const float* scales, const float* zeros, const float* lut, const float* bias,
                                 int64_t n, int64_t k, int64_t group, float* out, int num_threads);
void pagedllm_argmax_rows_f32(const float* x, int64_t row_stride, int64_t rows, int64_t n, int64_t* out,
                              int num_threads);
void pagedllm_add_lora_f32(float* out, int64_t out_stride, const float* x, int64_t x_stride, int64_t rows,
                           int64_t width_in, int64_t width_out, const float* lora_a, const float* lora_b,
                           int64_t rank, const int32_t* slots, const float* scales, int b_transposed,
                           int num_threads);
int64_t pagedllm_run_ops(const int64_t* ops, int64_t count, int64_t rows, int num_threads);
}

namespace {

// the kinds of op (step_replay.py's OP_KINDS names the same numbers)
enum Kind : int64_t {
  GATHER_ROWS = 1,
  PANEL_LINEAR,
  RMS_NORM,
  ADD_RMS_NORM,
  ROTARY,
  WRITE_KV,
  ATTENTION_F32,
  ATTENTION_BF16,
  ATTENTION_F16,
  SILU_AND_MUL,
  QUANTIZED_GEMV,
  ADD_LORA,
};
constexpr int64_t WORDS = 20;

template <class T>
T* ptr(int64_t word) {
  return reinterpret_cast<T*>(word);
}

// floats travel as the bits of a double
float real(int64_t word) {
  double d;
  std::memcpy(&d, &word, sizeof d);
  return static_cast<float>(d);
}

}  // namespace

extern "C" {

// Runs `count` ops; returns -1, or the index of the op that refused its input (a K/V slot
// outside the cache, a gathered row outside its table), where the ops after it did not run.
int64_t pagedllm_run_ops(const int64_t* ops, int64_t count, int64_t rows, int num_threads) {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t* a = ops + i * WORDS + 1;
    switch (ops[i * WORDS]) {
      case GATHER_ROWS: {  // out[r] = table[index[r]], row_bytes each; index int64, within [0, a[3])
        const int64_t* index = ptr<const int64_t>(a[1]);
        const int64_t row_bytes = a[2], table_rows = a[3];
        for (int64_t r = 0; r < rows; ++r)
          if (index[r] < 0 || index[r] >= table_rows) return i;
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(ptr<char>(a[4]) + r * row_bytes, ptr<const char>(a[0]) + index[r] * row_bytes, row_bytes);
        break;
      }
      case PANEL_LINEAR:
        pagedllm_panel_linear(static_cast<int>(a[0]), ptr<const float>(a[1]), rows, ptr<const void>(a[2]), a[3], a[4],
                              ptr<const float>(a[5]), ptr<float>(a[6]), num_threads);
        break;
      case RMS_NORM:
        pagedllm_rms_norm_f32(ptr<const float>(a[0]), ptr<const float>(a[1]), real(a[2]), ptr<float>(a[3]), rows, a[4],
                              num_threads);
        break;
      case ADD_RMS_NORM:
        pagedllm_add_rms_norm_f32(ptr<const float>(a[0]), ptr<float>(a[1]), ptr<const float>(a[2]), real(a[3]),
                                  ptr<float>(a[4]), rows, a[5], num_threads);
        break;
      case ROTARY:
        pagedllm_rotary_f32(ptr<const float>(a[0]), a[1], ptr<const float>(a[2]), ptr<const float>(a[3]),
                            ptr<float>(a[4]), rows, a[5], a[6], num_threads);
        break;
      case WRITE_KV:
        if (pagedllm_write_kv(ptr<const char>(a[0]), a[1], ptr<const char>(a[2]), a[3], ptr<const int64_t>(a[4]), rows,
                              a[5], ptr<char>(a[6]), ptr<char>(a[7]), a[8], num_threads))
          return i;
        break;
      case ATTENTION_F32:
      case ATTENTION_BF16:
      case ATTENTION_F16: {
        auto attend = ops[i * WORDS] == ATTENTION_F32    ? pagedllm_paged_attention_f32
                      : ops[i * WORDS] == ATTENTION_BF16 ? pagedllm_paged_attention_bf16
                                                         : pagedllm_paged_attention_f16;
        attend(ptr<const float>(a[0]), ptr<const void>(a[1]), ptr<const void>(a[2]), ptr<const int32_t>(a[3]), a[4],
               ptr<const int32_t>(a[5]), ptr<const int32_t>(a[6]), rows, a[7], a[8], a[9], a[10], real(a[11]), a[12],
               real(a[13]), ptr<float>(a[14]), num_threads, static_cast<int>(a[15]));
        break;
      }
      case SILU_AND_MUL:
        pagedllm_silu_and_mul_f32(ptr<const float>(a[0]), ptr<float>(a[1]), rows, a[2], num_threads);
        break;
      case QUANTIZED_GEMV:
        pagedllm_quantized_gemv_f32(static_cast<int>(a[0]), ptr<const float>(a[1]), rows, ptr<const uint8_t>(a[2]),
                                    a[3], ptr<const float>(a[4]), ptr<const float>(a[5]), ptr<const float>(a[6]),
                                    ptr<const float>(a[7]), a[8], a[9], a[10], ptr<float>(a[11]), num_threads);
        break;
      case ADD_LORA:
        pagedllm_add_lora_f32(ptr<float>(a[0]), a[1], ptr<const float>(a[2]), a[3], rows, a[4], a[5],
                              ptr<const float>(a[6]), ptr<const float>(a[7]), a[8], ptr<const int32_t>(a[9]),
                              ptr<const float>(a[10]), static_cast<int>(a[11]), num_threads);
        break;
      default:
        return i;
    }
  }
  return -1;
}

// A greedy decode step of the same rows as the step before it, whole: with `advance`, the
// step's inputs move on from the last one's (each row's token id from tokens[r], the row's
// position, context length and slot one further, the slot from the row's block table: rows
// of table_stride int32 block ids, row r's at table_of[r], num_blocks[r] of them); then the
// step's ops, the LM head (one op writing logits [rows, logits_stride]) and argmax over each
// row's first `vocab` logits into tokens. Returns -1; the index of the op that refused its
// input; or `count` (the LM head's index) + 1 where a row's next position has no block.
int64_t pagedllm_greedy_step(const int64_t* ops, int64_t count, const int64_t* lm_head, const float* logits,
                             int64_t logits_stride, int64_t vocab, int64_t rows, int num_threads, int advance,
                             int64_t* ids, int64_t* positions, int32_t* context, int64_t* slots,
                             const int32_t* tables, const int32_t* table_of, const int32_t* num_blocks,
                             int64_t table_stride, int64_t block_size, int64_t* tokens) {
  if (advance) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = positions[r] + 1, block = pos / block_size;
      if (block >= num_blocks[r]) return count + 1;
      ids[r] = tokens[r];
      positions[r] = pos;
      context[r] = static_cast<int32_t>(pos + 1);
      slots[r] = static_cast<int64_t>(tables[table_of[r] * table_stride + block]) * block_size + pos % block_size;
    }
  }
  const int64_t failed = pagedllm_run_ops(ops, count, rows, num_threads);
  if (failed >= 0) return failed;
  if (pagedllm_run_ops(lm_head, 1, rows, num_threads) >= 0) return count;
  pagedllm_argmax_rows_f32(logits, logits_stride, rows, vocab, tokens, num_threads);
  return -1;
}

}  // extern "C"
