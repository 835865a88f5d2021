"""The KV pool's layout in memory, for the model's dtype and for the 8-bit KV cache dtypes.

`auto` (the model's dtype): the pool is [L, 2, N, block_size, KVH, D] of that dtype.

8-bit (`fp8_e4m3`, `fp8_e5m2`, `int8`): every (token, KV head) row of K or V has its own
float32 scale, absmax / the format's largest value, computed when the row is written; the row
holds round(x / scale) in the format. A block keeps its scales beside its codes, so that
whatever moves blocks (copy-on-write copies, swap, a recovered worker reading the shared pool)
moves the scales with them: the pool is bytes, [L, 2, N, block_bytes], and one block of K (or
V) is

    codes  [block_size, KVH, D] of the format (1 byte each), then
    scales [block_size, KVH] float32.

The attention ops see a layer's cache as `cache` [2, N, block_size, KVH, D] of the format (a
view whose block stride is block_bytes, not block_size * KVH * D) and `kv_scales`
[2, N, block_size, KVH] float32 (a view of the same memory): value = code * scale.
Per-row scales need no calibration and no checkpoint scales; they cost 4 bytes per row (6% of a
64-wide row) and bound every element's error by the format's relative step at the row's
absmax, whatever magnitudes other tokens and heads have.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedllm.core.protocol import KVSpec

from .models.config import DTYPE_NAMES

# the engine's names (core/config.py KV_CACHE_DTYPES) -> the code dtype
KV_CODE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
# the largest magnitude of each format: a row's absmax is stored as this code
FORMAT_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}
SCALE_BYTES = 4


class QuantizedKV(NamedTuple):
    """One layer's 8-bit cache, as the attention ops take it."""

    cache: torch.Tensor  # [2, N, block_size, KVH, D] codes
    scales: torch.Tensor  # [2, N, block_size, KVH] float32


def is_quantized(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in KV_CODE_DTYPES


def pool_shape(
    kv_cache_dtype: str, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
):
    if is_quantized(kv_cache_dtype):
        return (num_layers, 2, num_blocks, block_size * num_kv_heads * (head_size + SCALE_BYTES))
    return (num_layers, 2, num_blocks, block_size, num_kv_heads, head_size)


def allocate_pool(
    kv_cache_dtype: str, num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype, device="cpu"
) -> torch.Tensor:
    """A zeroed pool (all scales zero: every value reads as 0)."""
    shape = pool_shape(kv_cache_dtype, num_layers, num_blocks, block_size, num_kv_heads, head_size)
    return torch.zeros(shape, dtype=pool_dtype(kv_cache_dtype, dtype), device=device)


def pool_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The element type the pool's memory is viewed as."""
    return torch.uint8 if is_quantized(kv_cache_dtype) else dtype


def layer_caches(pool: torch.Tensor, kv_cache_dtype: str, block_size: int, num_kv_heads: int, head_size: int):
    """What each layer's attention takes: the pool itself (indexable by layer) for `auto`, else a
    QuantizedKV view per layer."""
    if not is_quantized(kv_cache_dtype):
        return pool
    code_dtype = KV_CODE_DTYPES[kv_cache_dtype]
    codes_bytes = block_size * num_kv_heads * head_size
    layers = []
    for layer in pool:
        two, num_blocks = layer.shape[:2]
        codes = layer[..., :codes_bytes].view(code_dtype).view(two, num_blocks, block_size, num_kv_heads, head_size)
        scales = layer[..., codes_bytes:].view(torch.float32).view(two, num_blocks, block_size, num_kv_heads)
        layers.append(QuantizedKV(codes, scales))
    return layers


def split_layer_cache(kv_cache) -> tuple[torch.Tensor, dict]:
    """(the cache tensor, the keyword arguments the ops take with it) for one layer's cache."""
    if isinstance(kv_cache, QuantizedKV):
        return kv_cache.cache, {"kv_scales": kv_cache.scales}
    return kv_cache, {}


def quantize(x: torch.Tensor, code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., D] -> (codes [..., D] of code_dtype, scales [...] float32), value = code *
    scale: the reference of what write_kv stores (round to nearest, ties to even)."""
    x = x.float()
    top = FORMAT_MAX[code_dtype]
    absmax = x.abs().amax(dim=-1)
    scales = torch.where(absmax > 0, absmax / top, torch.ones_like(absmax))
    scaled = (x / scales.unsqueeze(-1)).clamp(-top, top)
    if code_dtype == torch.int8:
        scaled = scaled.round()
    return scaled.to(code_dtype), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., D] with scales [...] -> float32 values."""
    return codes.float() * scales.unsqueeze(-1)


def write_quantized(key, value, cache: torch.Tensor, scales: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The reference write_kv of an 8-bit cache: token t's rows, quantized, into slot
    slot_mapping[t] (cache and scales as QuantizedKV has them)."""
    block_size = cache.shape[2]
    slots = slot_mapping.long()
    blocks, offsets = slots // block_size, slots % block_size
    for which, rows in ((0, key), (1, value)):
        codes, row_scales = quantize(rows, cache.dtype)
        cache[which][blocks, offsets] = codes
        scales[which][blocks, offsets] = row_scales


def kv_spec_of(model, kv_cache_dtype: str) -> KVSpec:
    """What a model's KV takes in the pool, as the worker reports it (core.protocol.KVSpec)."""
    cfg = model.config
    return KVSpec(
        num_layers=cfg.num_layers,
        num_kv_heads=model.shards.num_kv_heads,
        head_size=cfg.head_dim,
        dtype=DTYPE_NAMES[cfg.dtype],
        kv_cache_dtype=kv_cache_dtype,
    )
