"""The speed tier (`pagedllm conformance --perf`): how close the backend's attention kernels come
to what the machine can do, measured in the same run — information, never a pass or a fail.

- decode attention: bytes of K/V (and 8-bit scales) read per second at a batch of 64 requests of
  2,048 tokens each (Llama 3 8B's heads: 32 query heads, 8 KV heads of 128; blocks of 16
  scattered through the pool), as a fraction of the memory bandwidth a probe measures (summing
  a 256 MiB buffer on the device, with every thread on a CPU; the best of a probe before the
  rows and one after);
- prefill attention: the FLOP/s of its two products (Q·Kᵀ and P·V, causal: half the square)
  for 4 prompts of 512 tokens, as a fraction of a square GEMM's rate in the same dtype (or in
  float32, where that is faster).

--quick runs 8 requests of 512 tokens, which a large last-level cache may hold (its fractions
can pass 100% and say little), one 8-bit KV dtype and prefill in the first dtype only.

Per dtype the backend declares, and per 8-bit KV cache dtype (at the model dtype bfloat16).
"""

from __future__ import annotations

import functools
import os
import time

import torch

from pagedllm.backends.attention import DecodeMetadata, PrefillMetadata
from pagedllm.backends.kv_cache import allocate_pool, layer_caches, split_layer_cache
from pagedllm.backends.models.config import DTYPE_NAMES

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 32, 8, 128, 16
DECODE_SHAPE = (64, 2048)  # requests, tokens each
PREFILL_SHAPE = (4, 512)
QUICK_SHAPE = (8, 512)


def _timed(fn, sync, min_seconds: float) -> float:
    """Seconds per call: the best of calls repeated for min_seconds (one at least), after a warm-up."""
    fn()
    sync()
    best, spent = float("inf"), 0.0
    while best == float("inf") or spent < min_seconds:
        t0 = time.perf_counter()
        fn()
        sync()
        took = time.perf_counter() - t0
        best, spent = min(best, took), spent + took
    return best


def memory_bandwidth(device: torch.device, timed) -> float:
    size = 256 << 20
    buf = torch.ones(size // 4, device=device)
    return size / timed(buf.sum)


def machine_peaks(device: torch.device, dtypes, timed) -> dict:
    """The measured memory bandwidth (bytes/s: a sum reads 256 MiB, more than a last-level cache
    holds) and GEMM rate per dtype (FLOP/s: square products, grown until one takes 20 ms)."""
    bandwidth = memory_bandwidth(device, timed)
    gemm = {}
    for dtype in {torch.float32, *dtypes}:
        n = 256
        while True:
            a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
            seconds = timed(lambda a=a, b=b: a @ b, min_seconds=0.0)
            if seconds > 0.02 or n >= 8192:
                break
            n *= 2
        gemm[dtype] = 2 * n**3 / timed(lambda a=a, b=b: a @ b)
    # a kernel may always compute in float32: where torch's GEMM in a dtype is slower (float16
    # on most CPUs), the float32 rate is the reference
    return {"bandwidth": bandwidth, "gemm": {d: max(rate, gemm[torch.float32]) for d, rate in gemm.items()}}


def _pool(ops, kv_dtype: str, dtype, requests: int, tokens: int, device, gen):
    """A one-layer pool whose blocks hold random K/V for `requests` x `tokens`, scattered."""
    per_request = tokens // BLOCK
    num_blocks = requests * per_request + 1
    pool = allocate_pool(kv_dtype, 1, num_blocks, BLOCK, KV_HEADS, HEAD_SIZE, dtype, device)
    cache = layer_caches(pool, kv_dtype, BLOCK, KV_HEADS, HEAD_SIZE)[0]
    tensor, extra = split_layer_cache(cache)
    slots = torch.arange(BLOCK, num_blocks * BLOCK, device=device)
    for lo in range(0, len(slots), 1 << 16):
        part = slots[lo : lo + (1 << 16)]
        k = torch.randn(len(part), KV_HEADS, HEAD_SIZE, generator=gen).to(dtype).to(device)
        ops.write_kv(k, k.flip(0), tensor, part, **extra)
    order = torch.randperm(num_blocks - 1, generator=gen)[: requests * per_request] + 1
    tables = order.view(requests, per_request).to(torch.int32).to(device)
    return tensor, extra, tables


def decode_row(ops, dtype, kv_dtype: str, shape, device, timed) -> dict:
    """The row without its fraction: _speed_rows sets it once the bandwidth probe ran again."""
    requests, tokens = shape
    gen = torch.Generator().manual_seed(0)
    cache, extra, tables = _pool(ops, kv_dtype, dtype, requests, tokens, device, gen)
    lens = torch.full((requests,), tokens, dtype=torch.int32, device=device)
    meta = DecodeMetadata(tables, lens, tokens)
    query = torch.randn(requests, HEADS, HEAD_SIZE, generator=gen).to(dtype).to(device)
    seconds = timed(lambda: ops.decode_attention(query, cache, meta, HEAD_SIZE**-0.5, **extra))
    moved = 2 * requests * tokens * KV_HEADS * HEAD_SIZE * cache.element_size()
    if extra:
        moved += 2 * requests * tokens * KV_HEADS * 4  # a float32 scale per (token, head)
    rate = moved / seconds
    return {
        "bytes_per_s": rate,
        "kernel": "decode attention",
        "dtype": DTYPE_NAMES[dtype],
        "kv_cache_dtype": kv_dtype,
        "shape": f"{requests} x {tokens}",
        "ms": seconds * 1e3,
        "rate": f"{rate / 1e9:.1f} GB/s",
    }


def prefill_row(ops, dtype, shape, peaks, device, timed) -> dict:
    requests, tokens = shape
    gen = torch.Generator().manual_seed(1)
    cache, _, tables = _pool(ops, "auto", dtype, requests, tokens, device, gen)
    starts = torch.arange(0, (requests + 1) * tokens, tokens, dtype=torch.int32, device=device)
    lens = torch.full((requests,), tokens, dtype=torch.int32, device=device)
    meta = PrefillMetadata(tables, starts, lens, [tokens] * requests, [tokens] * requests, tokens, tokens)
    query = torch.randn(requests * tokens, HEADS, HEAD_SIZE, generator=gen).to(dtype).to(device)
    seconds = timed(lambda: ops.prefill_attention(query, cache, meta, HEAD_SIZE**-0.5))
    flops = 2 * 2 * requests * HEADS * HEAD_SIZE * tokens * (tokens + 1) / 2  # two products, causal
    rate = flops / seconds
    return {
        "kernel": "prefill attention",
        "dtype": DTYPE_NAMES[dtype],
        "kv_cache_dtype": "auto",
        "shape": f"{requests} x {tokens}",
        "ms": seconds * 1e3,
        "rate": f"{rate / 1e9:.1f} GFLOP/s",
        "fraction": rate / peaks["gemm"][dtype],
        "of": f"{peaks['gemm'][dtype] / 1e9:.1f} GFLOP/s GEMM measured",
    }


def speed_rows(ops, quick: bool = False) -> list[dict]:
    """Every row of the speed tier for the backend's ops, on every core this process may use
    (checks run before it may have left torch on fewer)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    try:
        return _speed_rows(ops, quick)
    finally:
        torch.set_num_threads(threads)


def _speed_rows(ops, quick: bool) -> list[dict]:
    device = torch.device(ops.device)
    # best of 1 s of calls (--quick: 0.05 s)
    timed = functools.partial(_timed, sync=ops.synchronize, min_seconds=0.05 if quick else 1.0)
    dtypes = [d for d in (torch.float32, torch.bfloat16, torch.float16) if d in ops.supported_dtypes]
    peaks = machine_peaks(device, dtypes, timed)
    decode_shape = QUICK_SHAPE if quick else DECODE_SHAPE
    rows = [decode_row(ops, d, "auto", decode_shape, device, timed) for d in dtypes]
    model_dtype = torch.bfloat16 if torch.bfloat16 in dtypes else dtypes[0]
    kv_dtypes = [k for k in ops.supported_kv_cache_dtypes if not ops.unsupported_kv_cache_dtype(k, HEAD_SIZE)]
    for kv_dtype in [k for k in kv_dtypes if k != "auto"][: 1 if quick else None]:
        rows.append(decode_row(ops, model_dtype, kv_dtype, decode_shape, device, timed))
    prefill_shape = (2, 256) if quick else PREFILL_SHAPE
    rows += [prefill_row(ops, d, prefill_shape, peaks, device, timed) for d in dtypes[: 1 if quick else None]]
    # the probe again: a host's bandwidth wanders (other tenants); the best it showed is the roof
    bandwidth = max(peaks["bandwidth"], memory_bandwidth(device, timed))
    for r in rows:
        if "bytes_per_s" in r:
            r.update(fraction=r.pop("bytes_per_s") / bandwidth, of=f"{bandwidth / 1e9:.1f} GB/s measured")
    return rows


def format_speed(backend: str, rows: list[dict]) -> str:
    lines = [
        f"speed tier — backend {backend} (information, not a pass/fail)",
        "",
        "| kernel | dtype | KV cache | requests x tokens | ms | rate | of the machine | measured peak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kernel']} | {r['dtype']} | {r['kv_cache_dtype']} | {r['shape']} | {r['ms']:.2f} | "
            f"{r['rate']} | {r['fraction']:.0%} | {r['of']} |"
        )
    return "\n".join(lines)
