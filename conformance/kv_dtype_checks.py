"""The 8-bit KV cache rows (contract v5): for each format a backend declares, write_kv must store
every (token, KV head) row within the format's rounding, and the attention kernels must read
codes times scales, in decode, prefill and chunked prefill, with the query in each model dtype.

Tolerances, derived from the formats:
- write_kv: a value x in a row whose largest magnitude is m, read back as code * scale, is off
  by at most rel * |x| + sub * m / top: rel is half the format's relative step (2^-4 for e4m3's 3
  mantissa bits, 2^-3 for e5m2's 2, 0 for int8), sub half the step below the smallest normal
  (2^-10 for e4m3, 2^-17 for e5m2; int8: half a code, 0.5), top the format's largest value;
  plus float32 rounding (1e-6 * m). A scale that loses the row (1, or zero) fails it.
- attention: against float64 attention over what the cache holds (the codes times their
  scales, read back): the query dtype's usual tolerance, since quantization error is not the
  kernel's, on outputs divided by their KV head's magnitude. Every case has a KV head whose K
  and V are 1e4 times the other's — a naive cast overflows e4m3's 448, wraps int8 — with a
  query scaled down to keep its scores in range.
"""

from __future__ import annotations

import random

import torch

from pagedllm.backends.kv_cache import FORMAT_MAX, KV_CODE_DTYPES, allocate_pool, dequantize, layer_caches
from pagedllm.core.utils import cdiv

from .op_cases import PagedCase, dense_attention
from .results import DTYPE_NAMES, CheckResult, compare, tolerance_text

# half the relative step of a normal value, half the absolute step below the smallest normal
# (in units of a scale): what rounding to nearest may cost a value
ROUNDING = {torch.float8_e4m3fn: (2.0**-4, 2.0**-10), torch.float8_e5m2: (2.0**-3, 2.0**-17), torch.int8: (0.0, 0.5)}
LARGE = 1e4  # magnitude of the large KV head's K and V (float16 holds its values)
NUM_KV_HEADS = 2


def kv_dtype_cases(bs: int, quick: bool) -> list[tuple[str, tuple, tuple]]:
    """(phase, query lengths, context lengths) per case. --quick: a decode batch, and a prefill
    of a fresh prompt beside a chunk after a cached prefix (Triton's interpreter pays seconds
    a case). bs: the block size."""
    if quick:
        return [("decode", (1, 1, 1), (1, bs + 1, 40)), ("prefill", (5, 7), (5, 2 * bs + 8))]
    return [
        ("decode", (1,) * 5, (1, bs - 1, bs + 1, 3 * bs + 5, 1000)),
        ("prefill", (bs + 3, 40), (bs + 3, 40)),
        ("prefill", (1, 7, bs + 1), (bs + 1, 3 * bs, 1000)),  # after a cached prefix
        ("decode", (1, 1), (2500, 4097)),  # past a decode partition
    ]


def _history(context_lens, head_size, seed) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each request's K and V [ctx, KVH, D] float32: KV head 1 LARGE times KV head 0."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.tensor([1.0, LARGE]).view(1, NUM_KV_HEADS, 1)
    keys = [torch.randn(c, NUM_KV_HEADS, head_size, generator=gen) * magnitude for c in context_lens]
    values = [torch.randn(c, NUM_KV_HEADS, head_size, generator=gen) * magnitude for c in context_lens]
    return keys, values


def write_bound(x: torch.Tensor, code_dtype: torch.dtype) -> torch.Tensor:
    """How far write_kv may put each value of rows x [..., D] (float64)."""
    rel, sub = ROUNDING[code_dtype]
    row_max = x.abs().amax(dim=-1, keepdim=True)
    return rel * x.abs() + sub * row_max / FORMAT_MAX[code_dtype] + 1e-6 * row_max


def _run_case(
    ops, kv_dtype: str, dtype, point, phase, query_lens, context_lens, seed
) -> tuple[str | None, float, bool]:
    """(what failed or None, worst attention error, whether it passed) of one case at `point`
    (block size, head size, GQA group)."""
    device, (bs, hs, group) = ops.device, point
    code_dtype = KV_CODE_DTYPES[kv_dtype]
    keys, values = _history(context_lens, hs, seed)
    blocks_each = [cdiv(c, bs) for c in context_lens]
    num_blocks = 1 + sum(blocks_each) + 3
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for n in blocks_each:
        tables.append(ids[at : at + n])
        at += n
    width = max(blocks_each)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    slots = torch.tensor(
        [t[p // bs] * bs + p % bs for t, c in zip(tables, context_lens) for p in range(c)], device=device
    )
    pool = allocate_pool(kv_dtype, 1, num_blocks, bs, NUM_KV_HEADS, hs, dtype, device)
    cache, scales = layer_caches(pool, kv_dtype, bs, NUM_KV_HEADS, hs)[0]
    k_all, v_all = torch.cat(keys), torch.cat(values)
    ops.write_kv(k_all.to(device, dtype), v_all.to(device, dtype), cache, slots, kv_scales=scales)
    # what the cache holds, read back: each request's K/V as codes times scales
    held = dequantize(cache.cpu(), scales.cpu())  # [2, N, bs, KVH, D]
    flat = held.view(2, -1, NUM_KV_HEADS, hs)
    stored_k, stored_v = flat[0][slots.cpu()], flat[1][slots.cpu()]
    # the written inputs are the dtype's rounding of the float32 history
    written = torch.stack([k_all.to(dtype).float(), v_all.to(dtype).float()])
    error = (torch.stack([stored_k, stored_v]).double() - written.double()).abs()
    if not (error <= write_bound(written.double(), code_dtype)).all():
        worst = float((error - write_bound(written.double(), code_dtype)).max())
        return f"write_kv: a value off by {worst:.3g} beyond the {kv_dtype} rounding bound", float("inf"), False
    gen = torch.Generator().manual_seed(seed + 1)
    num_heads = NUM_KV_HEADS * group
    shrink = torch.tensor([1.0] * group + [1.0 / LARGE] * group).view(1, num_heads, 1)
    query = torch.randn(sum(query_lens), num_heads, hs, generator=gen) * shrink
    query = query.to(dtype)
    scale = hs**-0.5
    expected, start, at = [], 0, 0
    for q_len, ctx in zip(query_lens, context_lens):
        k, v = stored_k[at : at + ctx], stored_v[at : at + ctx]
        expected.append(dense_attention(query[start : start + q_len].float(), k, v, scale))
        start, at = start + q_len, at + ctx
    case = PagedCase(
        kv_cache=cache,
        query=query.to(device),
        query_lens=list(query_lens),
        context_lens=list(context_lens),
        block_tables=block_tables,
        expected=torch.cat(expected),
        scale=scale,
    )
    try:
        if phase == "decode":
            out = ops.decode_attention(case.query, cache, case.decode_metadata(), scale, kv_scales=scales)
        else:
            out = ops.prefill_attention(case.query, cache, case.prefill_metadata(), scale, kv_scales=scales)
    except Exception as e:  # noqa: BLE001 - report, do not crash
        return f"raised {type(e).__name__}: {e}", float("inf"), False
    ok, err = compare(out.cpu().double() * shrink, case.expected * shrink, dtype)
    return (None if ok else f"attention off by {err:.3g}"), err, ok


def check_kv_cache_dtypes(ops, quick: bool, dtypes, point: tuple[int, int, int]) -> list[CheckResult]:
    """A row per 8-bit format: skipped where the backend does not declare it. point: (block
    size, head size, GQA group) the cases run at (op_checks' long-context point)."""
    rows = []
    for kv_dtype in KV_CODE_DTYPES:
        row = CheckResult(f"kv_cache {kv_dtype}", "write: the format's rounding; attention: " + tolerance_text(dtypes))
        rows.append(row)
        problem = ops.unsupported_kv_cache_dtype(kv_dtype, point[1])
        if problem:
            row.skipped = f"not declared (AttentionOps.supported_kv_cache_dtypes); {problem} is refused"
            continue
        for i, (phase, q_lens, ctx) in enumerate(kv_dtype_cases(point[0], quick)):
            for dt in dtypes:
                label = f"{phase} contexts {list(ctx)[:5]} query {DTYPE_NAMES[dt]}"
                try:
                    failure, err, ok = _run_case(ops, kv_dtype, dt, point, phase, q_lens, ctx, seed=700 + i)
                except Exception as e:  # noqa: BLE001 - report, do not crash
                    failure, err, ok = f"raised {type(e).__name__}: {e}", float("inf"), False
                row.record(ok, err, None if ok else f"{label}: {failure}")
    return rows
