"""The `cuda-native` backend: the attention ops as CUDA C++ kernels (csrc/), compiled on first
use. One attention kernel serves decode and prefill: each row is one query token attending to
positions 0..its own of its request, so the ops only build two small index tensors."""

from __future__ import annotations

import torch

from pagedllm.backends.attention import (
    AttentionOps,
    DecodeMetadata,
    PrefillMetadata,
    last_dim_contiguous,
    prefill_token_rows,
)
from pagedllm.backends.gpu.platform import CudaPlatform
from pagedllm.core.utils import cdiv

from .build import load_extension, missing_build_tools

PARTITION = 512  # context positions per program in decode; longer contexts split and reduce
# an 8-bit cache's code dtype -> kernels.h KVCodes
KV_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


class NativeCudaAttentionOps(CudaPlatform, AttentionOps):
    name = "cuda-native"
    supports_sliding_window = True
    supports_soft_cap = True
    supported_head_sizes = tuple(range(8, 257, 8))  # kernels.h: up to 256, whole 16-byte loads
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")

    def __init__(self):
        reason = self.unavailable_reason()
        if reason:
            raise RuntimeError(f"{self.name}: {reason}")
        self.ext = load_extension()
        self._empty = torch.empty(0, dtype=torch.float32, device="cuda")

    @staticmethod
    def unavailable_reason() -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device"
        return missing_build_tools(torch.version.cuda)

    @staticmethod
    def _stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    def write_kv(self, key, value, kv_cache, slot_mapping, *, kv_scales=None):
        if kv_scales is not None:
            self.ext.write_kv_codes(
                last_dim_contiguous(key),
                last_dim_contiguous(value),
                kv_cache[0].view(torch.int8),
                kv_cache[1].view(torch.int8),
                kv_scales[0],
                kv_scales[1],
                slot_mapping,
                KV_CODES[kv_cache.dtype],
                self._stream(),
            )
            return
        self.ext.write_kv(
            last_dim_contiguous(key).to(kv_cache.dtype),
            last_dim_contiguous(value).to(kv_cache.dtype),
            kv_cache[0],
            kv_cache[1],
            slot_mapping,
            self._stream(),
        )

    def _attend(
        self, query, kv_cache, tables, row_request, row_position, scale, partitions, window, soft_cap, kv_scales
    ):
        rows, heads, head_size = query.shape
        dtype = kv_cache.dtype if kv_scales is None else query.dtype
        query = last_dim_contiguous(query).to(dtype)
        out = torch.empty(rows, heads, head_size, dtype=dtype, device=query.device)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        codes, k_scales, v_scales = 0, self._empty, self._empty
        if kv_scales is not None:
            codes, k_scales, v_scales = KV_CODES[kv_cache.dtype], kv_scales[0], kv_scales[1]
            k_cache, v_cache = k_cache.view(torch.int8), v_cache.view(torch.int8)
        if partitions > 1:
            part_out = torch.empty(rows, heads, partitions, head_size, dtype=torch.float32, device=query.device)
            part_max = torch.empty(rows, heads, partitions, dtype=torch.float32, device=query.device)
            part_sum = torch.empty_like(part_max)
        else:
            part_out = part_max = part_sum = self._empty
        self.ext.paged_attention(
            out,
            query,
            k_cache,
            v_cache,
            tables,
            row_request,
            row_position,
            scale,
            window or 0,
            soft_cap or 0.0,
            PARTITION,
            part_out,
            part_max,
            part_sum,
            codes,
            k_scales,
            v_scales,
            self._stream(),
        )
        return out

    def decode_attention(
        self, query, kv_cache, meta: DecodeMetadata, scale, *, window=None, soft_cap=None, kv_scales=None
    ):
        n = query.shape[0]
        rows = torch.arange(n, dtype=torch.int32, device=query.device)
        return self._attend(
            query,
            kv_cache,
            meta.block_tables,
            rows,
            meta.context_lens - 1,
            scale,
            cdiv(meta.max_context_len, PARTITION),
            window,
            soft_cap,
            kv_scales,
        )

    def prefill_attention(
        self, query, kv_cache, meta: PrefillMetadata, scale, *, window=None, soft_cap=None, kv_scales=None
    ):
        request, position = prefill_token_rows(meta, query.shape[0], query.device)
        return self._attend(
            query, kv_cache, meta.block_tables, request.int(), position.int(), scale, 1, window, soft_cap, kv_scales
        )

    def add_lora(self, out, x, lora_a, lora_b, slots, scales):
        if x.stride(1) != 1:
            x = x.contiguous()
        if out.stride(1) != 1 or x.dtype != out.dtype:
            return super().add_lora(out, x, lora_a, lora_b, slots, scales)
        lora_a, lora_b = lora_a.to(out.dtype).contiguous(), lora_b.to(out.dtype).contiguous()
        slots, scales = slots.to(torch.int32).contiguous(), scales.float().contiguous()
        self.ext.add_lora(out, x, lora_a, lora_b, slots, scales, self._stream())

    def copy_blocks(self, kv_caches, pairs):
        if not pairs:
            return
        flat = kv_caches.view(kv_caches.shape[0] * kv_caches.shape[1], kv_caches.shape[2], -1)
        if flat.dtype == torch.uint8:  # an 8-bit pool's blocks (codes and scales) as 4-byte words
            flat = flat.view(torch.float32)
        self.ext.copy_blocks(flat, torch.tensor(pairs, dtype=torch.int64, device=kv_caches.device), self._stream())
