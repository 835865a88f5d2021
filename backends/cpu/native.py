"""The cpu backend's compiled kernels (csrc/): paged attention over float32, bfloat16 or float16
blocks, RMSNorm, the gated MLP's activation, linear layers on panel-packed weights (16-bit or
float32), and quantized linear layers (int8, int4, nf4 weights). All compute in float32.

Plain C++ with OpenMP, no torch headers, called through ctypes. It is built for this machine
(-march=native) when the package is installed (setup.py, kernel_build.py) into the package's
prebuilt/ folder; where that library does not match (another CPU, changed sources, no compiler
at install) it builds with the system compiler on first use into ~/.cache/pagedllm/cpu_kernels,
keyed the same way. Where no compiler is found or the build fails, or with
PAGEDLLM_CPU_KERNELS=0, the backend keeps its plain-torch path; `unavailable_reason()` says why.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import os

import torch

from pagedllm.backends.host import cpuinfo_fields
from pagedllm.core.cache_dir import cache_root

from . import kernel_build

DISABLE_ENV = "PAGEDLLM_CPU_KERNELS"
SOURCES = kernel_build.SOURCES

ATTENTION_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
# 8-bit KV caches (backends/kv_cache.py): the attention kernel's suffix and write_kv's format
QUANTIZED_SUFFIX = {torch.int8: "i8", torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
QUANTIZED_FORMAT = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
PANEL_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
# pagedllm_*_mixed's `formats` (csrc/kernels.cpp): the input, the output in bfloat16
MIXED_X_BF16, MIXED_OUT_BF16 = 1, 2

_p = ctypes.c_void_p
_i64 = ctypes.c_int64


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags (/proc/cpuinfo), empty where they cannot be read."""
    return set(kernel_build.cpu_flags_line().decode().partition(":")[2].split())


def cpu_vendor_family() -> tuple[str, int]:
    """This CPU's vendor_id and family number (/proc/cpuinfo); ("", 0) where they cannot be read."""
    info = cpuinfo_fields()
    family = info.get("cpu family", "0")
    return info.get("vendor_id", ""), int(family) if family.isdigit() else 0


def _library_path(cxx: str) -> str:
    """The library built for this machine: the one installed beside the package (setup.py
    builds it at install), else the cache's, built now where it is missing."""
    name = kernel_build.library_name(cxx)
    prebuilt = os.path.join(kernel_build.PREBUILT, name)
    if os.path.exists(prebuilt):
        return prebuilt
    target = os.path.join(cache_root("cpu_kernels"), name)
    if os.path.exists(target):
        return target
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # processes starting together: one builds, the others wait
        if not os.path.exists(target):
            kernel_build.compile_to(cxx, target)
    return target


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None, f"{DISABLE_ENV}=0"
    cxx = kernel_build.compiler()
    if cxx is None:
        return None, "no C++ compiler found (g++ or $CXX)"
    try:
        lib = ctypes.CDLL(_library_path(cxx))
    except (OSError, RuntimeError) as e:
        return None, f"building {', '.join(map(os.path.basename, SOURCES))}: {e}"
    # q, k, v, tables, table stride, row table, row context, rows, heads, KV heads, head size,
    # block size, scale, window, soft cap, out, threads, dot products
    attention = [_p, _p, _p, _p, _i64, _p, _p, *[_i64] * 5, ctypes.c_float, _i64, ctypes.c_float, _p]
    attention += [ctypes.c_int, ctypes.c_int]
    # ... then block stride, K scales, V scales, scale block stride (no dot products)
    quantized_attention = [*attention[:-1], _i64, _p, _p, _i64]
    signatures = {
        **{f"pagedllm_paged_attention_{suffix}": attention for suffix in ATTENTION_SUFFIX.values()},
        **{f"pagedllm_paged_attention_{suffix}": quantized_attention for suffix in QUANTIZED_SUFFIX.values()},
        "pagedllm_set_prefetch": [ctypes.c_int],
        "pagedllm_bf16_dot_products": [],
        "pagedllm_panel_linear": [ctypes.c_int, _p, _i64, _p, _i64, _i64, _p, _p, ctypes.c_int],
        "pagedllm_rms_norm_f32": [_p, _p, ctypes.c_float, _p, _i64, _i64, ctypes.c_int],
        "pagedllm_add_rms_norm_f32": [_p, _p, _p, ctypes.c_float, _p, _i64, _i64, ctypes.c_int],
        # key, key stride, value, value stride, slots, tokens, row bytes, K cache, V cache, slots, threads
        "pagedllm_write_kv": [_p, _i64, _p, _i64, _p, _i64, _i64, _p, _p, _i64, ctypes.c_int],
        # key, key stride, value, value stride, slots, tokens, KV heads, head size, format, K codes,
        # V codes, K scales, V scales, block size, block bytes, scale block stride, slots, threads
        "pagedllm_write_kv_quantized": [_p, _i64, _p, _i64, _p, *[_i64] * 3, ctypes.c_int, *[_p] * 4]
        + [*[_i64] * 4, ctypes.c_int],
        "pagedllm_silu_and_mul_f32": [_p, _p, _i64, _i64, ctypes.c_int],
        "pagedllm_argmax_rows_f32": [_p, _i64, _i64, _i64, _p, ctypes.c_int],
        # out, out stride, x, x stride, rows, in, out width, A, B, rank, slots, scales, B transposed, threads
        "pagedllm_add_lora_f32": [_p, _i64, _p, *[_i64] * 4, _p, _p, _i64, _p, _p, ctypes.c_int, ctypes.c_int],
        "pagedllm_apply_token_bitmask_f32": [_p, _i64, _p, _i64, _i64, _i64, ctypes.c_int],
        "pagedllm_rotary_f32": [_p, _i64, _p, _p, _p, _i64, _i64, _i64, ctypes.c_int],
        # the replayed bfloat16 step's: the f32 signatures with a MIXED_* `formats` before threads
        "pagedllm_rms_norm_mixed": [_p, _p, ctypes.c_float, _p, _i64, _i64, ctypes.c_int, ctypes.c_int],
        "pagedllm_add_rms_norm_mixed": [_p, _p, _p, ctypes.c_float, _p, _i64, _i64, ctypes.c_int, ctypes.c_int],
        "pagedllm_silu_and_mul_mixed": [_p, _p, _i64, _i64, ctypes.c_int, ctypes.c_int],
        "pagedllm_rotary_mixed": [_p, _i64, _p, _p, _p, _i64, _i64, _i64, ctypes.c_int, ctypes.c_int],
        "pagedllm_quantized_gemv_f32": [
            ctypes.c_int,
            _p,
            _i64,
            _p,
            _i64,
            _p,
            _p,
            _p,
            _p,
            _i64,
            _i64,
            _i64,
            _p,
            ctypes.c_int,
        ],
        "pagedllm_dequantize_f32": [ctypes.c_int, _p, _i64, _p, _p, _p, _i64, _i64, _i64, _p, ctypes.c_int],
        "pagedllm_run_ops": [_p, _i64, _i64, ctypes.c_int],  # ops, count, rows, threads (csrc/step_program.cpp)
        # ops, count, LM head, logits, logits stride, vocab, rows, threads, advance, ids, positions,
        # context, slots, tables, table_of, num_blocks, table stride, block size, tokens
        "pagedllm_greedy_step": [_p, _i64, _p, _p, _i64, _i64, _i64, ctypes.c_int, ctypes.c_int, *[_p] * 7]
        + [_i64, _i64, _p],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, argtypes
    lib.pagedllm_bf16_dot_products.restype = ctypes.c_int
    lib.pagedllm_write_kv.restype = ctypes.c_int64
    lib.pagedllm_write_kv_quantized.restype = ctypes.c_int64
    lib.pagedllm_run_ops.restype = ctypes.c_int64
    lib.pagedllm_greedy_step.restype = ctypes.c_int64
    return lib, None


def unavailable_reason() -> str | None:
    return _load()[1]


def _library() -> ctypes.CDLL:
    lib, reason = _load()
    if lib is None:
        raise RuntimeError(f"cpu kernels unavailable: {reason}")
    return lib


def _float32(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {t.dtype}")
    return t.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of float32 x."""
    x, weight = _float32("x", x), _float32("weight", weight)
    out = torch.empty_like(x)
    _library().pagedllm_rms_norm_f32(
        x.data_ptr(),
        weight.data_ptr(),
        eps,
        out.data_ptr(),
        x.numel() // x.shape[-1],
        x.shape[-1],
        torch.get_num_threads(),
    )
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place, float32 contiguous), then RMSNorm of the sum: one pass."""
    x, weight = _float32("x", x), _float32("weight", weight)
    if residual.dtype != torch.float32 or not residual.is_contiguous() or residual.shape != x.shape:
        raise ValueError(f"residual must be a contiguous float32 tensor shaped like x {tuple(x.shape)}")
    out = torch.empty_like(x)
    _library().pagedllm_add_rms_norm_f32(
        x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        eps,
        out.data_ptr(),
        x.numel() // x.shape[-1],
        x.shape[-1],
        torch.get_num_threads(),
    )
    return out


def fits_write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether write_kv takes these: key and value [T, KVH, D] of the cache's dtype, each row's
    heads contiguous (the columns of a fused projection will do), one contiguous layer's cache."""
    head_size = key.shape[-1]
    rows_fit = all(
        t.dim() == 3
        and t.dtype == kv_cache.dtype
        and t.shape == key.shape
        and t.stride(2) == 1
        and t.stride(1) == head_size
        for t in (key, value)
    )
    return rows_fit and kv_cache.is_contiguous() and kv_cache.shape[-2:] == key.shape[1:]


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Token t's key and value into slot slot_mapping[t] of one layer's cache [2, num_blocks,
    block_size, KVH, D], as fits_write_kv describes them."""
    if not fits_write_kv(key, value, kv_cache):
        raise ValueError("write_kv: key and value must be [T, KVH, D] rows of the cache's dtype, the cache contiguous")
    num_tokens, num_kv_heads, head_size = key.shape
    row = num_kv_heads * head_size
    slots = slot_mapping.to(torch.int64).contiguous()
    if slots.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must hold one slot per token ({num_tokens}), got {tuple(slots.shape)}")
    size = key.element_size()
    bad = _library().pagedllm_write_kv(
        key.data_ptr(),
        key.stride(0) * size,
        value.data_ptr(),
        value.stride(0) * size,
        slots.data_ptr(),
        num_tokens,
        row * size,
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        kv_cache[0].numel() // row,
        torch.get_num_threads(),
    )
    if bad:
        raise IndexError(f"write_kv: {bad} slot(s) outside the cache's {kv_cache[0].numel() // row} slots")


def write_kv_quantized(
    key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """write_kv into an 8-bit cache (kv_cache.QuantizedKV's cache and scales): each (token, KV
    head) row quantized as kv_cache.quantize does."""
    num_tokens, num_kv_heads, head_size = key.shape
    if cache.dtype not in QUANTIZED_FORMAT or cache.shape[-2:] != key.shape[1:] or value.shape != key.shape:
        raise ValueError("write_kv: key and value must be [T, KVH, D] rows of the cache's heads")
    if not (cache[0, 0].is_contiguous() and scales[0, 0].is_contiguous() and scales.dtype == torch.float32):
        raise ValueError("write_kv: each block of the cache and of its scales must be contiguous")
    key, value = (_rows_float32(t) for t in (key, value))
    slots = slot_mapping.to(torch.int64).contiguous()
    if slots.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must hold one slot per token ({num_tokens}), got {tuple(slots.shape)}")
    num_blocks, block_size = cache.shape[1], cache.shape[2]
    bad = _library().pagedllm_write_kv_quantized(
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        slots.data_ptr(),
        num_tokens,
        num_kv_heads,
        head_size,
        QUANTIZED_FORMAT[cache.dtype],
        cache[0].data_ptr(),
        cache[1].data_ptr(),
        scales[0].data_ptr(),
        scales[1].data_ptr(),
        block_size,
        cache.stride(1),
        scales.stride(1),
        num_blocks * block_size,
        torch.get_num_threads(),
    )
    if bad:
        raise IndexError(f"write_kv: {bad} slot(s) outside the cache's {num_blocks * block_size} slots")


def _rows_float32(t: torch.Tensor) -> torch.Tensor:
    """t [T, KVH, D] as float32 with each token's heads contiguous (a row stride of its own)."""
    t = t.float()
    if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        t = t.contiguous()
    return t


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] float32 = [gate | up] -> silu(gate) * up [..., I]."""
    x = _float32("x", x)
    size = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], size, dtype=x.dtype)
    _library().pagedllm_silu_and_mul_f32(
        x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], size, torch.get_num_threads()
    )
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a 2-D float32 tensor (rows may be strided; values contiguous),
    NaNs and ties answered as torch answers them."""
    x = _float32("x", x)
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax_rows needs a non-empty 2-D tensor, got shape {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _library().pagedllm_argmax_rows_f32(
        x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads()
    )
    return out


def add_lora(out, x, lora_a, lora_b, slots, scales) -> None:
    """AttentionOps.add_lora for float32 (rows of x and out may be strided, values contiguous)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if out.stride(1) != 1:
        raise ValueError("add_lora needs out's rows contiguous")
    lora_a = lora_a.contiguous()
    transposed = lora_b_transposed(lora_b)
    if not transposed:
        lora_b = lora_b.contiguous()
    slots, scales = slots.to(torch.int32).contiguous(), scales.float().contiguous()
    _library().pagedllm_add_lora_f32(
        out.data_ptr(),
        out.stride(0),
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        x.shape[1],
        out.shape[1],
        lora_a.data_ptr(),
        lora_b.data_ptr(),
        lora_a.shape[1],
        slots.data_ptr(),
        scales.data_ptr(),
        transposed,
        torch.get_num_threads(),
    )


def lora_b_transposed(lora_b: torch.Tensor) -> bool:
    """Whether B [S, out, r] is the transposed view of contiguous [S, r, out] storage."""
    _, width_out, rank = lora_b.shape
    return lora_b.stride() == (rank * width_out, 1, width_out)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """AttentionOps.apply_token_bitmask for 2-D float32 logits (rows may be strided, values
    contiguous) and an int32 bitmask of whole rows: -inf where a token's bit is clear."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("apply_token_bitmask needs 2-D float32 logits with contiguous rows")
    mask = bitmask.to(torch.int32).contiguous()
    if mask.dim() != 2 or mask.shape[0] != logits.shape[0] or mask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"a bitmask of shape {tuple(mask.shape)} does not cover logits {tuple(logits.shape)}")
    _library().pagedllm_apply_token_bitmask_f32(
        logits.data_ptr(),
        logits.stride(0),
        mask.data_ptr(),
        mask.shape[1],
        logits.shape[0],
        logits.shape[1],
        torch.get_num_threads(),
    )


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of float32 x [T, heads, D] (rows may be strided, each row's heads
    contiguous: the q/k columns of the fused projection), cos/sin [T, 1, D] float32: a
    contiguous [T, heads, D], as models/rope.py's rotate computes it."""
    rows, heads, size = x.shape
    if x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != size or size % 2:
        raise ValueError("x must be float32 [T, heads, D] with each row's heads contiguous and D even")
    cos, sin = (_float32(name, t).reshape(rows, size) for name, t in (("cos", cos), ("sin", sin)))
    out = torch.empty(rows, heads, size, dtype=torch.float32)
    _library().pagedllm_rotary_f32(
        x.data_ptr(),
        x.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        out.data_ptr(),
        rows,
        heads,
        size,
        torch.get_num_threads(),
    )
    return out


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_table: torch.Tensor,
    row_context: torch.Tensor,
    scale: float,
    dot_products: bool = False,
    window: int | None = None,
    soft_cap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [R, H, Dh], one row per query token; k_cache/v_cache [N, bs, KVH, Dh] float32,
    bfloat16 or float16, contiguous; block_tables [S, max_blocks] int32; row r uses table
    row_table[r] and attends to its first row_context[r] tokens (at most max_blocks * bs).
    Computes in float32; returns [R, H, Dh] in the query's dtype. dot_products: bfloat16
    blocks of head size 32, 64 or 128 go to AVX-512 BF16's dot products where the kernels were
    built for them (bfloat16_dot_products()), the query and the probabilities rounded to
    bfloat16 first; elsewhere it changes nothing. window: a row sees only the last `window`
    of its tokens; soft_cap: scores soft-capped (AttentionOps.supports_soft_cap).
    k_scales/v_scales [N, bs, KVH] float32: the caches hold 8-bit codes (int8, float8_e4m3fn,
    float8_e5m2; kv_cache.py's layout: each block's rows contiguous, any block stride)."""
    num_rows, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    quantized = k_scales is not None
    suffix = (QUANTIZED_SUFFIX if quantized else ATTENTION_SUFFIX).get(k_cache.dtype)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if suffix is None or t.dtype != k_cache.dtype or not _blocks_fit(t, quantized):
            raise ValueError(f"{name} must be contiguous blocks of the dtype of k_cache, got {t.dtype}")
    if quantized and not all(
        t.dtype == torch.float32 and _blocks_fit(t, True) and t.stride(0) == k_scales.stride(0)
        for t in (k_scales, v_scales)
    ):
        raise ValueError("k_scales/v_scales must be [N, bs, KVH] float32 with each block's rows contiguous")
    q = query.float().contiguous()
    block_tables, row_table, row_context = (
        t.to(torch.int32).contiguous() for t in (block_tables, row_table, row_context)
    )
    out = torch.empty_like(q)
    args = [
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        row_table.data_ptr(),
        row_context.data_ptr(),
        num_rows,
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        scale,
        window or 0,
        soft_cap or 0.0,
        out.data_ptr(),
        torch.get_num_threads(),
    ]
    if quantized:
        args += [k_cache.stride(0), k_scales.data_ptr(), v_scales.data_ptr(), k_scales.stride(0)]
    else:
        args.append(int(dot_products))
    getattr(_library(), f"pagedllm_paged_attention_{suffix}")(*args)
    return out.to(query.dtype)


def _blocks_fit(t: torch.Tensor, any_block_stride: bool) -> bool:
    """Whether each block of t [N, ...] is one contiguous run (and, unless any_block_stride,
    the blocks follow each other)."""
    if not any_block_stride:
        return t.is_contiguous()
    return t[0].is_contiguous() and t.stride(0) >= t[0].numel()


def bfloat16_dot_products() -> bool:
    """Whether the kernels were built for AVX-512 BF16 (paged_attention's dot_products)."""
    return bool(_library().pagedllm_bf16_dot_products())


PANEL = 16  # output features per panel of a packed weight (csrc/panel_linear.cpp)


def pack_panel_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [N, K] bfloat16, float16 or float32 weight in panel_linear's layout: [ceil(N / 16), K,
    16], panel p holding rows 16p..16p+15 transposed, the last zero-padded; in bfloat16 each
    16-wide row interleaved, columns 0 8 1 9 ... 7 15 (csrc/panel_linear.cpp's panel_row). Same
    dtype, same bytes (+ padding)."""
    if weight.dtype not in PANEL_KINDS or weight.dim() != 2:
        raise ValueError(
            f"weight must be a 2-d bfloat16, float16 or float32 matrix, got {weight.dtype} {tuple(weight.shape)}"
        )
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight.detach()
    if weight.dtype == torch.bfloat16:
        padded = padded.view(panels, 2, PANEL // 2, k).transpose(1, 2)
    return padded.reshape(panels, PANEL, k).transpose(1, 2).contiguous()


def set_prefetch(on: bool) -> None:
    """Whether attention prefetches each request's next block (on by default; for measuring)."""
    _library().pagedllm_set_prefetch(int(on))


def panel_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 times W^T, W [out_features, K] packed by pack_panel_weight and read in
    place, plus bias (float32): [M, out_features] float32."""
    if packed.dtype not in PANEL_KINDS or packed.dim() != 3 or packed.shape[2] != PANEL:
        raise ValueError("the weight must come from pack_panel_weight")
    if not -(-out_features // PANEL) == packed.shape[0]:
        raise ValueError(f"out_features {out_features} does not fit a packed weight of {packed.shape[0]} panels")
    x = _float32("x", x)
    if bias is not None:
        bias = _float32("bias", bias)
    k = packed.shape[1]
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    _library().pagedllm_panel_linear(
        PANEL_KINDS[packed.dtype],
        x.data_ptr(),
        x.shape[0],
        packed.contiguous().data_ptr(),
        out_features,
        k,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


QUANTIZED_KINDS = {"int8": 0, "int4": 1, "nf4": 2}


def quantized_args(kind, codes, scales, zeros, lut) -> tuple:
    """pagedllm_quantized_gemv_f32's and pagedllm_dequantize_f32's arguments for the weight:
    (kind id, codes, row bytes, scales, zeros, lut)."""
    return (
        QUANTIZED_KINDS[kind],
        codes.data_ptr(),
        codes.stride(0) * codes.element_size(),
        scales.data_ptr(),
        None if zeros is None else zeros.data_ptr(),
        None if lut is None else lut.data_ptr(),
    )


def quantized_gemv(x, kind, codes, scales, zeros, lut, bias, k: int, group: int) -> torch.Tensor:
    """x [M, K] float32 contiguous times the quantized W^T (layouts: csrc/quantized_linear.cpp),
    plus bias: [M, N] float32."""
    n = codes.shape[0]
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    kind_id, codes_p, row_bytes, scales_p, zeros_p, lut_p = quantized_args(kind, codes, scales, zeros, lut)
    _library().pagedllm_quantized_gemv_f32(
        kind_id,
        x.data_ptr(),
        x.shape[0],
        codes_p,
        row_bytes,
        scales_p,
        zeros_p,
        lut_p,
        None if bias is None else bias.data_ptr(),
        n,
        k,
        group,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def dequantize(kind, codes, scales, zeros, lut, k: int, group: int) -> torch.Tensor:
    """The quantized weight as float32 [N, K]."""
    n = codes.shape[0]
    out = torch.empty(n, k, dtype=torch.float32)
    kind_id, codes_p, row_bytes, scales_p, zeros_p, lut_p = quantized_args(kind, codes, scales, zeros, lut)
    _library().pagedllm_dequantize_f32(
        kind_id, codes_p, row_bytes, scales_p, zeros_p, lut_p, n, k, group, out.data_ptr(), torch.get_num_threads()
    )
    return out
