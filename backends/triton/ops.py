"""The `cuda-triton` backend: the attention ops as Triton kernels (kernels.py).

On a CUDA device the kernels are compiled by Triton; with TRITON_INTERPRET=1 they run on the
CPU through Triton's interpreter (slowly), which is how CI without a GPU checks them."""

from __future__ import annotations

import os

import torch

from pagedllm.backends.attention import AttentionOps, DecodeMetadata, PrefillMetadata, last_dim_contiguous
from pagedllm.backends.gpu.platform import CudaPlatform
from pagedllm.core.utils import cdiv


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# Decode's tile of context positions and warps per program on a GPU. Chosen from ptxas' register
# counts for sm_90 (benchmarks/kernel_registers.py: 64 x 8 warps, 64 registers, no spills; 32 x
# 4, the earlier choice, 72), not yet from a GPU timing: gpu_decode_bandwidth.py times each.
DECODE_TILE, DECODE_WARPS = 64, 8


def decode_config(interpret: bool) -> tuple[int, int]:
    """(tile, num_warps), PAGEDLLM_TRITON_DECODE_TILE / _WARPS overriding the defaults."""
    tile = int(os.environ.get("PAGEDLLM_TRITON_DECODE_TILE", 128 if interpret else DECODE_TILE))
    warps = int(os.environ.get("PAGEDLLM_TRITON_DECODE_WARPS", DECODE_WARPS))
    if tile < 16 or tile & (tile - 1) or warps not in (1, 2, 4, 8, 16):
        raise ValueError(
            f"PAGEDLLM_TRITON_DECODE_TILE must be a power of two >= 16 (got {tile}) and "
            f"PAGEDLLM_TRITON_DECODE_WARPS one of 1, 2, 4, 8, 16 (got {warps})"
        )
    return tile, warps


# an 8-bit cache's code dtype -> the kernels' KV_CODES
KV_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


def _cache_args(kv_cache, kv_scales) -> tuple[torch.Tensor, torch.Tensor, tuple, int]:
    """(K cache, V cache, the kernels' scale arguments, KV_CODES): an 8-bit cache's codes go
    in as int8 (the kernels widen them by their bits), with its scales and their strides."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if kv_scales is None:
        return k_cache, v_cache, (k_cache, v_cache, 0, 0), 0
    scales = (kv_scales[0], kv_scales[1], kv_scales.stride(1), kv_scales.stride(2))
    return k_cache.view(torch.int8), v_cache.view(torch.int8), scales, KV_CODES[kv_cache.dtype]


class TritonAttentionOps(CudaPlatform, AttentionOps):
    name = "cuda-triton"
    supports_sliding_window = True
    supports_soft_cap = True
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")

    def __init__(self):
        reason = self.unavailable_reason()
        if reason:
            raise RuntimeError(f"{self.name}: {reason}")
        from . import kernels

        self.k = kernels
        self.interpret = _interpreting()
        # under the interpreter the device is the CPU (CudaPlatform then answers as a host
        # does), but the pool stays the worker's own, so that CPU tests take the GPU's paths,
        # recovery by recompute among them
        self.device = "cpu" if self.interpret else "cuda"
        # the interpreter runs one Python step per tile and pays per program: big tiles keep it
        # quick; the partition is the GPU's (contexts past 512 tokens take the split-and-reduce
        # path under test too, and half as many programs as 256-token partitions)
        self.tile = 128 if self.interpret else 32
        self.block_m = 128 if self.interpret else 32
        self.decode_tile, self.decode_warps = decode_config(self.interpret)
        self.partition = 512

    @staticmethod
    def unavailable_reason() -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed (pip install 'pagedllm[triton]')"
        if not _interpreting() and not torch.cuda.is_available():
            return "no CUDA device (set TRITON_INTERPRET=1 to run its kernels on the CPU, slowly)"
        return None

    def _fp32_dots(self, kv_cache) -> bool:
        # an 8-bit cache is widened to float32 (the query stays in the model dtype)
        return kv_cache.dtype in (torch.float32, *KV_CODES) or self.interpret

    # --- ops --------------------------------------------------------------------------------
    def write_kv(self, key, value, kv_cache, slot_mapping, *, kv_scales=None):
        tokens, kv_heads, head_size = key.shape
        if tokens == 0:
            return
        key, value = last_dim_contiguous(key), last_dim_contiguous(value)
        if kv_scales is not None:
            return self._write_codes(key, value, kv_cache, kv_scales, slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        self.k.write_kv_kernel[(tokens, kv_heads)](
            key,
            value,
            k_cache,
            v_cache,
            slot_mapping,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            BLOCK_SIZE=k_cache.shape[1],
            HEAD_DIM=head_size,
            BLOCK_D=_next_pow2(head_size),
        )

    def _write_codes(self, key, value, kv_cache, kv_scales, slot_mapping):
        tokens, kv_heads, head_size = key.shape
        k_cache, v_cache, scales, codes = _cache_args(kv_cache, kv_scales)
        self.k.write_kv_codes_kernel[(tokens, kv_heads)](
            key,
            value,
            k_cache,
            v_cache,
            scales[0],
            scales[1],
            slot_mapping,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            scales[2],
            scales[3],
            BLOCK_SIZE=k_cache.shape[1],
            HEAD_DIM=head_size,
            BLOCK_D=_next_pow2(head_size),
            KV_CODES=codes,
        )

    def decode_attention(
        self, query, kv_cache, meta: DecodeMetadata, scale, *, window=None, soft_cap=None, kv_scales=None
    ):
        num_seqs, num_heads, head_size = query.shape
        _, _, block_size, kv_heads, _ = kv_cache.shape
        group = num_heads // kv_heads
        dtype = query.dtype if kv_scales is not None else kv_cache.dtype
        query = last_dim_contiguous(query).to(dtype)
        out = torch.empty(num_seqs, num_heads, head_size, dtype=dtype, device=query.device)
        if num_seqs == 0:
            return out
        k_cache, v_cache, scales, codes = _cache_args(kv_cache, kv_scales)
        block_d = _next_pow2(head_size)
        splits = cdiv(meta.max_context_len, self.partition)
        split = splits > 1
        if split:
            part_acc = torch.empty(num_seqs, num_heads, splits, block_d, dtype=torch.float32, device=query.device)
            part_max = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=query.device)
            part_sum = torch.empty_like(part_max)
        else:
            part_acc = part_max = part_sum = out  # unused
        tables = meta.block_tables
        self.k.decode_kernel[(num_seqs, kv_heads, splits)](
            query,
            k_cache,
            v_cache,
            tables,
            meta.context_lens,
            out,
            part_acc,
            part_max,
            part_sum,
            scale,
            soft_cap or 0.0,
            window or 0,
            query.stride(0),
            query.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            tables.stride(0),
            out.stride(0),
            out.stride(1),
            num_heads,
            splits,
            *scales,
            GROUP=group,
            BLOCK_G=max(16, _next_pow2(group)),
            HEAD_DIM=head_size,
            BLOCK_D=block_d,
            BLOCK_SIZE=block_size,
            TILE=self.decode_tile,
            PARTITION=self.partition,
            SPLIT=split,
            FP32=self._fp32_dots(kv_cache),
            SOFT_CAP=bool(soft_cap),
            KV_CODES=codes,
            num_warps=self.decode_warps,
        )
        if split:
            self.k.decode_reduce_kernel[(num_seqs, num_heads)](
                part_acc,
                part_max,
                part_sum,
                out,
                out.stride(0),
                out.stride(1),
                num_heads,
                splits,
                HEAD_DIM=head_size,
                BLOCK_D=block_d,
                BLOCK_S=max(2, _next_pow2(splits)),
            )
        return out

    def prefill_attention(
        self, query, kv_cache, meta: PrefillMetadata, scale, *, window=None, soft_cap=None, kv_scales=None
    ):
        num_tokens, num_heads, head_size = query.shape
        _, _, block_size, kv_heads, _ = kv_cache.shape
        dtype = query.dtype if kv_scales is not None else kv_cache.dtype
        query = last_dim_contiguous(query).to(dtype)
        out = torch.empty(num_tokens, num_heads, head_size, dtype=dtype, device=query.device)
        num_reqs = len(meta.query_lens)
        if num_tokens == 0:
            return out
        k_cache, v_cache, scales, codes = _cache_args(kv_cache, kv_scales)
        tables = meta.block_tables
        grid = (num_reqs, cdiv(meta.max_query_len, self.block_m), num_heads)
        self.k.prefill_kernel[grid](
            query,
            k_cache,
            v_cache,
            tables,
            meta.query_start_loc,
            meta.context_lens,
            out,
            scale,
            soft_cap or 0.0,
            window or 0,
            query.stride(0),
            query.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            tables.stride(0),
            out.stride(0),
            out.stride(1),
            *scales,
            GROUP=num_heads // kv_heads,
            HEAD_DIM=head_size,
            BLOCK_D=_next_pow2(head_size),
            BLOCK_SIZE=block_size,
            BLOCK_M=self.block_m,
            TILE=self.tile,
            FP32=self._fp32_dots(kv_cache),
            SOFT_CAP=bool(soft_cap),
            KV_CODES=codes,
        )
        return out

    def add_lora(self, out, x, lora_a, lora_b, slots, scales):
        if x.shape[0] == 0:
            return
        if x.stride(1) != 1:
            x = x.contiguous()
        if out.stride(1) != 1:  # a view of columns with a stride: the default's indexing handles it
            return super().add_lora(out, x, lora_a, lora_b, slots, scales)
        rank = lora_a.shape[1]
        self.k.add_lora_kernel[(x.shape[0],)](
            out,
            x,
            lora_a.contiguous(),
            lora_b.contiguous(),
            slots.to(torch.int32).contiguous(),
            scales.float().contiguous(),
            out.stride(0),
            x.stride(0),
            x.shape[1],
            out.shape[1],
            rank,
            RANK=max(16, _next_pow2(rank)),
            TILE_IN=min(128, max(16, _next_pow2(x.shape[1]))),
            TILE_OUT=min(64, max(16, _next_pow2(out.shape[1]))),
        )

    def copy_blocks(self, kv_caches, pairs):
        if not pairs:
            return
        layers = kv_caches.shape[0] * kv_caches.shape[1]
        flat = kv_caches.view(layers, kv_caches.shape[2], -1)
        pair_t = torch.tensor(pairs, dtype=torch.int64, device=kv_caches.device)
        self.k.copy_blocks_kernel[(len(pairs), layers)](
            flat, pair_t, flat.stride(0), BLOCK_ELEMS=flat.shape[2], CHUNK=min(1024, _next_pow2(flat.shape[2]))
        )
