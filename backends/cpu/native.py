"""The cpu backend's compiled kernels (csrc/): float32 paged attention, RMSNorm, the gated MLP's
activation, and quantized linear layers (int8, int4, nf4 weights; float32 compute).

Plain C++ with OpenMP, no torch headers: it builds with the system compiler in about a second
on first use, is cached under ~/.cache/pagedllm/cpu_kernels keyed by the source, the compiler
and this CPU's instruction-set flags (it is built with -march=native), and is called through
ctypes. Where no compiler is found or the build fails, or with PAGEDLLM_CPU_KERNELS=0, the
backend keeps its plain-torch path; `unavailable_reason()` says why.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile

import torch

from pagedllm.core.cache_dir import cache_root

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = tuple(os.path.join(_CSRC, name) for name in ("kernels.cpp", "quantized_linear.cpp"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
DISABLE_ENV = "PAGEDLLM_CPU_KERNELS"

_p = ctypes.c_void_p
_i64 = ctypes.c_int64


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def _build(cxx: str) -> str:
    version = subprocess.run([cxx, "--version"], capture_output=True).stdout
    sources = b""
    for path in SOURCES:
        with open(path, "rb") as f:
            sources += f.read()
    key = hashlib.sha256(sources + version + _cpu_flags() + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = os.path.join(cache_root("cpu_kernels"), f"kernels_{key}.so")
    if os.path.exists(target):
        return target
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # processes starting together: one builds, the others wait
        if not os.path.exists(target):
            # build beside the target and rename, so no process can load half a file
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
            os.close(fd)
            try:
                done = subprocess.run([cxx, *FLAGS, *SOURCES, "-o", tmp], capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-500:]}")
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None, f"{DISABLE_ENV}=0"
    cxx = _compiler()
    if cxx is None:
        return None, "no C++ compiler found (g++ or $CXX)"
    try:
        lib = ctypes.CDLL(_build(cxx))
    except (OSError, RuntimeError) as e:
        return None, f"building {', '.join(map(os.path.basename, SOURCES))}: {e}"
    signatures = {
        "pagedllm_paged_attention_f32": [
            _p,
            _p,
            _p,
            _p,
            _i64,
            _p,
            _p,
            _i64,
            _i64,
            _i64,
            _i64,
            _i64,
            ctypes.c_float,
            _p,
            ctypes.c_int,
        ],
        "pagedllm_rms_norm_f32": [_p, _p, ctypes.c_float, _p, _i64, _i64, ctypes.c_int],
        "pagedllm_silu_and_mul_f32": [_p, _p, _i64, _i64, ctypes.c_int],
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
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, argtypes
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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] float32 = [gate | up] -> silu(gate) * up [..., I]."""
    x = _float32("x", x)
    size = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], size, dtype=x.dtype)
    _library().pagedllm_silu_and_mul_f32(
        x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], size, torch.get_num_threads()
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
) -> torch.Tensor:
    """query [R, H, Dh] float32, one row per query token; k_cache/v_cache [N, bs, KVH, Dh]
    float32, contiguous; block_tables [S, max_blocks] int32; row r uses table row_table[r] and
    attends to its first row_context[r] tokens (at most max_blocks * bs). Returns [R, H, Dh]."""
    num_rows, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32")
    query = _float32("query", query)
    block_tables, row_table, row_context = (
        t.to(torch.int32).contiguous() for t in (block_tables, row_table, row_context)
    )
    out = torch.empty_like(query)
    _library().pagedllm_paged_attention_f32(
        query.data_ptr(),
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
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


QUANTIZED_KINDS = {"int8": 0, "int4": 1, "nf4": 2}


def _quantized_args(kind, codes, scales, zeros, lut):
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
    kind_id, codes_p, row_bytes, scales_p, zeros_p, lut_p = _quantized_args(kind, codes, scales, zeros, lut)
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
    kind_id, codes_p, row_bytes, scales_p, zeros_p, lut_p = _quantized_args(kind, codes, scales, zeros, lut)
    _library().pagedllm_dequantize_f32(
        kind_id, codes_p, row_bytes, scales_p, zeros_p, lut_p, n, k, group, out.data_ptr(), torch.get_num_threads()
    )
    return out
