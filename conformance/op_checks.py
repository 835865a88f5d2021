"""Op-level checks: a backend's kernels against dense attention and exact cache writes."""

from __future__ import annotations

import itertools
import random

import torch

from .op_cases import context_lengths, make_case
from .results import DTYPE_NAMES, CheckResult, compare, tolerance_text

FULL_GRID = dict(block_sizes=(8, 16, 32), head_sizes=(64, 80, 96, 128, 256), groups=(1, 4, 8), long=1000)
QUICK_GRID = dict(block_sizes=(16,), head_sizes=(64, 128), groups=(1, 4), long=300)
NUM_KV_HEADS = 2


def supported_dtypes(ops) -> tuple:
    return tuple(ops.supported_dtypes)


def checked_dtypes(ops, quick: bool) -> tuple:
    dtypes = supported_dtypes(ops)
    if quick:
        dtypes = tuple(d for d in dtypes if d in (torch.float32, torch.bfloat16)) or dtypes[:1]
    return dtypes


def _grid(quick: bool, dtype):
    g = QUICK_GRID if quick else FULL_GRID
    for bs, hs, grp in itertools.product(g["block_sizes"], g["head_sizes"], g["groups"]):
        yield bs, hs, grp, dtype, g["long"]


def _label(bs, hs, grp, dt) -> str:
    return f"block_size={bs} head_size={hs} gqa={grp}:1 {DTYPE_NAMES[dt]}"


def _per_request_errors(out, case, dtype) -> str:
    """Which requests are off, with their context lengths: the clue to what is wrong."""
    bad, start = [], 0
    for r, (q_len, ctx) in enumerate(zip(case.query_lens, case.context_lens)):
        ok, err = compare(out[start : start + q_len], case.expected[start : start + q_len], dtype)
        if not ok:
            bad.append(f"request {r} (context {ctx}, {q_len} new) off by {err:.3g}")
        start += q_len
    return "; ".join(bad[:4]) + (" ..." if len(bad) > 4 else "")


def _check_attention(result: CheckResult, ops, case, dtype, label: str, phase: str) -> None:
    if phase == "decode":
        out = ops.decode_attention(case.query, case.kv_cache, case.decode_metadata(), case.scale)
    else:
        out = ops.prefill_attention(case.query, case.kv_cache, case.prefill_metadata(), case.scale)
    ok, err = compare(out, case.expected, dtype)
    result.record(ok, err, None if ok else f"{label}: {_per_request_errors(out, case, dtype)}")


def check_decode(ops, quick: bool, device, dtype) -> CheckResult:
    res = CheckResult(f"decode_attention {DTYPE_NAMES[dtype]}", tolerance_text((dtype,)))
    for i, (bs, hs, grp, dt, long) in enumerate(_grid(quick, dtype)):
        ctx = context_lengths(bs, long)
        # and a wide batch of mixed lengths (backends may split or reorder large batches)
        rng = random.Random(i)
        wide = ctx + [rng.randint(1, 3 * bs + 5) for _ in range(14)]
        for lens in (ctx, wide):
            case = make_case([1] * len(lens), lens, bs, hs, NUM_KV_HEADS, grp, dt, seed=i, device=device)
            _check_attention(res, ops, case, dt, f"{_label(bs, hs, grp, dt)} contexts {lens[:6]}...", "decode")
    return res


def check_prefill(ops, quick: bool, device, dtype, chunked: bool) -> CheckResult:
    name = "chunked_prefill_attention" if chunked else "prefill_attention"
    res = CheckResult(f"{name} {DTYPE_NAMES[dtype]}", tolerance_text((dtype,)))
    for i, (bs, hs, grp, dt, long) in enumerate(_grid(quick, dtype)):
        ctx = context_lengths(bs, long)
        if chunked:  # new tokens after a cached prefix, within and across block edges
            q_lens = [1, max(1, bs - 2), 3, bs + 1, 50]
            ctx = [bs + 1, 2 * bs, bs + 3, 3 * bs, long]
        else:
            q_lens = list(ctx)
        case = make_case(q_lens, ctx, bs, hs, NUM_KV_HEADS, grp, dt, seed=100 + i, device=device)
        _check_attention(
            res, ops, case, dt, f"{_label(bs, hs, grp, dt)} (query, context) {list(zip(q_lens, ctx))}", "prefill"
        )
    return res


def check_shared_blocks(ops, device) -> CheckResult:
    """Two or three requests whose tables share their first blocks (prefix hit or fork)."""
    res = CheckResult("shared_blocks", tolerance_text((torch.float32,)))
    for bs in (8, 16):
        for phase, q_lens in (("decode", [1, 1, 1]), ("prefill", [5, 2 * bs + 1, 1])):
            case = make_case(
                q_lens,
                [3 * bs + 1, 4 * bs - 1, 2 * bs + 1],
                bs,
                64,
                NUM_KV_HEADS,
                4,
                share_prefix_blocks=2,
                seed=bs,
                device=device,
            )
            _check_attention(res, ops, case, torch.float32, f"block_size={bs} {phase}", phase)
    return res


def check_write_kv(ops, quick: bool, device) -> CheckResult:
    """Each token's K/V lands in exactly its slot; nothing else in the cache changes."""
    res = CheckResult("write_kv")
    gen = torch.Generator().manual_seed(0)
    for bs, dt in itertools.product((8, 16) if quick else (8, 16, 32), supported_dtypes(ops)):
        num_blocks, kvh, hs, tokens = 12, 2, 64, 23
        cache = torch.randn(2, num_blocks, bs, kvh, hs, generator=gen).to(dt)
        slots = torch.randperm((num_blocks - 1) * bs, generator=gen)[:tokens] + bs  # never block 0
        key = torch.randn(tokens, kvh, hs, generator=gen).to(dt)
        value = torch.randn(tokens, kvh, hs, generator=gen).to(dt)
        before = cache.clone()
        dev_cache = cache.to(device)
        ops.write_kv(key.to(device), value.to(device), dev_cache, slots.to(device))
        after = dev_cache.cpu()
        flat_after = after.view(2, -1, kvh, hs)
        flat_before = before.view(2, -1, kvh, hs)
        problems = []
        for t, slot in enumerate(slots.tolist()):
            if not torch.equal(flat_after[0, slot], key[t]) or not torch.equal(flat_after[1, slot], value[t]):
                found = [s for s in range(flat_after.shape[1]) if torch.equal(flat_after[0, s], key[t])]
                where = f"it is at slot {found[0]} instead" if found else "it is nowhere in the cache"
                problems.append(
                    f"token {t}'s K/V should be at slot {slot} (block {slot // bs}, offset {slot % bs}); {where}"
                )
        untouched = torch.ones(flat_after.shape[1], dtype=torch.bool)
        untouched[slots] = False
        changed = (flat_after[:, untouched] != flat_before[:, untouched]).flatten(2).any(-1).any(0)
        if changed.any():
            idx = untouched.nonzero().flatten()[changed].tolist()
            problems.append(f"slots that no token maps to were changed: {idx[:6]}")
        res.record(
            not problems,
            0.0 if not problems else 1.0,
            f"block_size={bs} {DTYPE_NAMES[dt]}: " + "; ".join(problems[:3]) if problems else None,
        )
    return res


def check_copy_and_swap(ops, device) -> CheckResult:
    res = CheckResult("copy_blocks / swap_blocks")
    gen = torch.Generator().manual_seed(1)
    caches = torch.randn(3, 2, 10, 8, 2, 16, generator=gen)
    before = caches.clone()
    dev = caches.to(device)
    ops.copy_blocks(dev, [(1, 7), (2, 8), (3, 9)])
    after = dev.cpu()
    ok = torch.equal(after[:, :, 7:10], before[:, :, 1:4]) and torch.equal(after[:, :, :7], before[:, :, :7])
    res.record(
        ok,
        0.0 if ok else 1.0,
        None if ok else "copy_blocks: destination blocks do not hold the sources, or other blocks changed",
    )
    host = torch.zeros(3, 2, 4, 8, 2, 16)
    ops.swap_blocks(dev, host, [(4, 0), (6, 3)])
    ok = (
        torch.equal(host[:, :, 0], after[:, :, 4])
        and torch.equal(host[:, :, 3], after[:, :, 6])
        and not host[:, :, 1:3].any()
    )
    res.record(ok, 0.0 if ok else 1.0, None if ok else "swap_blocks device->host: wrong blocks in swap space")
    back = torch.zeros_like(after).to(device)
    ops.swap_blocks(host, back, [(3, 5)])
    ok = torch.equal(back.cpu()[:, :, 5], after[:, :, 6])
    res.record(ok, 0.0 if ok else 1.0, None if ok else "swap_blocks host->device: wrong block restored")
    return res


def op_checks(ops, quick: bool = False) -> list[tuple[str, object]]:
    """(row name, a call that makes the row) for every op check, so that one that raises
    costs only its own row."""
    device = ops.device
    checks = [("write_kv", lambda: check_write_kv(ops, quick, device))]
    for dtype in checked_dtypes(ops, quick):
        name = DTYPE_NAMES[dtype]
        checks += [
            (f"decode_attention {name}", lambda dt=dtype: check_decode(ops, quick, device, dt)),
            (f"prefill_attention {name}", lambda dt=dtype: check_prefill(ops, quick, device, dt, False)),
            (f"chunked_prefill_attention {name}", lambda dt=dtype: check_prefill(ops, quick, device, dt, True)),
        ]
    return checks + [
        ("shared_blocks", lambda: check_shared_blocks(ops, device)),
        ("copy_blocks / swap_blocks", lambda: check_copy_and_swap(ops, device)),
    ]
