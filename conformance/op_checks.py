"""Op-level checks: a backend's kernels against dense attention and exact cache writes.

Each attention check walks its cases once and records every dtype the backend supports into
that dtype's row, so a 16-bit case's float64 reference is computed once for both 16-bit
dtypes. Beyond the grid of block sizes, head sizes and GQA ratios, the cases a port gets
wrong: contexts of 2k-8k tokens (partitioned decode), decode batches of 64-256 requests,
scores of 20-100 (a softmax that does not subtract its max overflows) with scales other
than head_size**-0.5, and writes across a large pool.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import torch

from .kv_dtype_checks import check_kv_cache_dtypes
from .multi_token_checks import check_multi_token_decode
from .op_cases import context_lengths, make_case
from .results import DTYPE_NAMES, CheckResult, compare, tolerance_text

FULL_GRID = dict(block_sizes=(8, 16, 32), head_sizes=(64, 80, 96, 128, 256), groups=(1, 4, 8), long=1000)
LARGE_BLOCKS = dict(block_sizes=(64, 128), head_sizes=(64, 128), groups=(1, 4))  # full suite only
QUICK_LONG = 300
NUM_KV_HEADS = 2


@dataclass(frozen=True)
class Case:
    """One batch for one op: which requests, on which cache shape, and what it is for."""

    what: str
    query_lens: tuple
    context_lens: tuple
    block_size: int
    head_size: int
    group: int
    seed: int
    scale: float | None = None
    dominant_logits: tuple | None = None
    share_prefix_blocks: int = 0
    window: int | None = None
    soft_cap: float | None = None
    kv_heads: int = NUM_KV_HEADS
    model: str = ""  # the real model whose attention shape this is

    def label(self, dtype) -> str:
        scale = "" if self.scale is None else f" scale={self.scale:.4g}"
        limits = "".join(f" {k}={v}" for k, v in (("window", self.window), ("soft_cap", self.soft_cap)) if v)
        shape = f"block_size={self.block_size} head_size={self.head_size} gqa={self.group}:1"
        if self.model:
            shape = f"{self.model} ({self.kv_heads * self.group} heads, {self.kv_heads} KV) {shape}"
        return f"{self.what}: {shape}{scale}{limits} {DTYPE_NAMES[dtype]}"

    def build(self, dtype, device):
        return make_case(
            list(self.query_lens),
            list(self.context_lens),
            self.block_size,
            self.head_size,
            self.kv_heads,
            self.group,
            dtype,
            share_prefix_blocks=self.share_prefix_blocks,
            seed=self.seed,
            device=device,
            scale=self.scale,
            dominant_logits=list(self.dominant_logits) if self.dominant_logits else None,
            window=self.window,
            soft_cap=self.soft_cap,
        )


def checked_dtypes(ops, only=None) -> tuple:
    """Every supported dtype (--quick too: a dtype's first check must not be a GPU run's),
    or those of `only` (--dtype)."""
    dtypes = tuple(ops.supported_dtypes)
    if only:
        missing = [DTYPE_NAMES[d] for d in only if d not in dtypes]
        if missing:
            raise ValueError(f"--dtype {', '.join(missing)}: not among the backend's supported dtypes")
        dtypes = tuple(d for d in dtypes if d in only)
    return dtypes


def _supported(values, declared) -> tuple:
    return tuple(v for v in values if declared is None or v in declared)


def grid_points(ops, quick: bool) -> list[tuple[int, int, int]]:
    """(block_size, head_size, gqa) points the backend declares support for. --quick: block
    size 16, the smallest and the largest head size, GQA 1, 4 and 8, one point each."""
    block_sizes = _supported(FULL_GRID["block_sizes"], ops.supported_block_sizes)
    head_sizes = _supported(FULL_GRID["head_sizes"], ops.supported_head_sizes)
    if quick:
        bs = 16 if 16 in block_sizes else block_sizes[0]
        middle = 128 if 128 in head_sizes else head_sizes[0]
        return [(bs, head_sizes[0], 1), (bs, middle, 4), (bs, head_sizes[-1], 8)]
    points = list(itertools.product(block_sizes, head_sizes, FULL_GRID["groups"]))
    large = _supported(LARGE_BLOCKS["block_sizes"], ops.supported_block_sizes)
    large_heads = _supported(LARGE_BLOCKS["head_sizes"], ops.supported_head_sizes)
    return points + list(itertools.product(large, large_heads, LARGE_BLOCKS["groups"]))


def _long_point(ops) -> tuple[int, int, int]:
    block_sizes = _supported((16, *FULL_GRID["block_sizes"]), ops.supported_block_sizes)
    head_sizes = _supported((128, *FULL_GRID["head_sizes"]), ops.supported_head_sizes)
    return block_sizes[0], head_sizes[0], 4


def decode_cases(ops, quick: bool) -> list[Case]:
    long = QUICK_LONG if quick else FULL_GRID["long"]
    cases = []
    for i, (bs, hs, grp) in enumerate(grid_points(ops, quick)):
        ctx = context_lengths(bs, long)
        # and a wide batch of mixed lengths (backends may split or reorder large batches)
        rng = random.Random(i)
        wide = ctx + [rng.randint(1, 3 * bs + 5) for _ in range(14)]
        for lens in (ctx, wide):
            cases.append(Case(f"contexts {lens[:6]}...", (1,) * len(lens), tuple(lens), bs, hs, grp, seed=i))
    bs, hs, grp = _long_point(ops)
    # past one 512/1024-token partition, with short rows in the same batch
    for lens in [(1, bs + 1, 1500, 4097)] if quick else [(1, bs + 1, 2048, 4097), (3, 8192, 700)]:
        cases.append(Case(f"long contexts {list(lens)}", (1,) * len(lens), lens, bs, hs, grp, seed=7))
    for n in (96,) if quick else (64, 256):  # the default max_num_seqs is 256
        rng = random.Random(n)
        longest = 3 * bs + 5 if quick else 600  # --quick: the long contexts are the case above
        lens = tuple(rng.randint(1, longest) if r % 16 == 0 else rng.randint(1, 3 * bs + 5) for r in range(n))
        cases.append(Case(f"a batch of {n} requests", (1,) * n, lens, bs, hs, grp, seed=n))
    return cases


def prefill_cases(ops, quick: bool, chunked: bool) -> list[Case]:
    long = QUICK_LONG if quick else FULL_GRID["long"]
    cases = []
    for i, (bs, hs, grp) in enumerate(grid_points(ops, quick)):
        ctx = context_lengths(bs, long)
        if chunked:  # new tokens after a cached prefix, within and across block edges
            q_lens = [1, max(1, bs - 2), 3, bs + 1, 50]
            ctx = [bs + 1, 2 * bs, bs + 3, 3 * bs, long]
        else:
            q_lens = list(ctx)
        what = f"(query, context) {list(zip(q_lens, ctx))}"
        cases.append(Case(what, tuple(q_lens), tuple(ctx), bs, hs, grp, seed=100 + i))
    bs, hs, grp = _long_point(ops)
    if chunked:  # the last chunks of long prompts
        pairs = [(16, 4112), (64, 2048)] if quick else [(16, 4112), (64, 8192), (1, 2049)]
    else:
        pairs = [] if quick else [(2048, 2048), (5, 5)]
    if pairs:
        q_lens, ctx = zip(*pairs)
        cases.append(Case(f"long (query, context) {pairs}", q_lens, ctx, bs, hs, grp, seed=11))
    return cases


def large_score_cases(ops, quick: bool) -> list[Case]:
    """Decode and prefill cases (named so) where one key per request dominates with scores 20,
    50 and 100; the scale is not always head_size**-0.5."""
    points = grid_points(ops, True)
    points = points[:1] + points[-1:] if quick else points
    cases = []
    for i, (bs, hs, grp) in enumerate(points):
        scale = None if i % 2 == 0 else 1.0 / hs
        cases.append(Case("decode", (1, 1, 1), (1, bs + 1, 700), bs, hs, grp, 200 + i, scale, (20.0, 50.0, 100.0)))
        cases.append(Case("prefill", (1, 5, 40), (40, 100, 40), bs, hs, grp, 300 + i, scale, (100.0, 20.0, 50.0)))
    return cases


def window_cases(ops, quick: bool) -> list[Case]:
    """Sliding-window attention (supports_sliding_window) in decode, prefill and chunked
    prefill: windows shorter than a block, equal to one, not a multiple of one, and longer
    than the context; contexts far past the window; a window that starts inside a block."""
    bs, hs, grp = _long_point(ops)
    long = 120 if quick else FULL_GRID["long"]  # quick: still three times the longer window
    cases = []
    windows = (5, 2 * bs + 5) if quick else (5, bs, 2 * bs + 5, long + 10)
    for i, window in enumerate(windows):
        ctx = (1, window - 1 if window > 1 else 1, window, window + 1, bs + 3, long)
        cases.append(Case("decode", (1,) * len(ctx), ctx, bs, hs, grp, seed=400 + i, window=window))
        q_lens = (bs + 3, long)
        cases.append(Case("prefill", q_lens, q_lens, bs, hs, grp, seed=410 + i, window=window))
        q_lens, ctx = (1, 7, bs + 1, 40), (bs + 1, 3 * bs, 2 * bs + 3, long)  # after a cached prefix
        cases.append(Case("prefill", q_lens, ctx, bs, hs, grp, seed=420 + i, window=window))
    if not quick:  # past a decode partition
        cases.append(Case("decode", (1, 1, 1), (700, 4097, 2500), bs, hs, grp, seed=430, window=1000))
    return cases


def soft_cap_cases(ops, quick: bool) -> list[Case]:
    """Soft-capped scores (supports_soft_cap: Gemma 2's 50), with scores large enough that a
    missing cap changes the answer. (Windows and caps together: Gemma 2's end-to-end rows.)"""
    bs, hs, grp = _long_point(ops)
    cases = []
    for i, cap in enumerate((5.0,) if quick else (50.0, 5.0)):
        for phase, q_lens, ctx in (("decode", (1, 1, 1), (1, bs + 1, 300)), ("prefill", (1, 5, 40), (40, 100, 40))):
            dominant = (20.0, 60.0, 100.0)
            cases.append(Case(phase, q_lens, ctx, bs, hs, grp, 500 + i, dominant_logits=dominant, soft_cap=cap))
    return cases


def check_limits(ops, quick: bool, dtypes, what: str) -> list[CheckResult]:
    """The sliding_window or soft_cap rows: skipped, saying so, where the backend does not
    declare the feature (a model that needs it is refused on that backend)."""
    cases = {"sliding_window": window_cases, "soft_cap": soft_cap_cases}[what]
    rows = _rows(what, dtypes)
    if not ops.supports(what):
        for row in rows.values():
            row.skipped = f"not declared (AttentionOps.supports_{what}); models that need it are refused"
        return list(rows.values())
    for spec in cases(ops, quick):
        for dt in dtypes:
            _check(rows[dt], ops, spec, spec.what, dt, ops.device)
    return list(rows.values())


def _rows(name: str, dtypes) -> dict:
    return {dt: CheckResult(f"{name} {DTYPE_NAMES[dt]}", tolerance_text((dt,))) for dt in dtypes}


def _per_request_errors(out, case, dtype) -> str:
    """Which requests are off, with their context lengths: the clue to what is wrong."""
    bad, start = [], 0
    for r, (q_len, ctx) in enumerate(zip(case.query_lens, case.context_lens)):
        ok, err = compare(out[start : start + q_len], case.expected[start : start + q_len], dtype)
        if not ok:
            bad.append(f"request {r} (context {ctx}, {q_len} new) off by {err:.3g}")
        start += q_len
    return "; ".join(bad[:4]) + (" ..." if len(bad) > 4 else "")


def _run_op(ops, case, phase: str):
    if phase == "decode":
        return ops.decode_attention(case.query, case.kv_cache, case.decode_metadata(), case.scale, **case.limits())
    return ops.prefill_attention(case.query, case.kv_cache, case.prefill_metadata(), case.scale, **case.limits())


def _check(row: CheckResult, ops, spec: Case, phase: str, dtype, device) -> None:
    """One case in one dtype; an op that raises fails this case, not the whole row."""
    label = spec.label(dtype)
    try:
        case = spec.build(dtype, device)
        out = _run_op(ops, case, phase)
    except Exception as e:  # noqa: BLE001 - report, do not crash
        row.record(False, float("inf"), f"{label}: raised {type(e).__name__}: {e}")
        return
    ok, err = compare(out, case.expected, dtype)
    row.record(ok, err, None if ok else f"{label}: {_per_request_errors(out, case, dtype)}")


def check_attention(ops, quick: bool, phase: str, dtypes) -> list[CheckResult]:
    """One row per dtype for decode, prefill or chunked_prefill, each case in every dtype."""
    name = {"decode": "decode_attention", "prefill": "prefill_attention", "chunked": "chunked_prefill_attention"}
    rows = _rows(name[phase], dtypes)
    cases = decode_cases(ops, quick) if phase == "decode" else prefill_cases(ops, quick, phase == "chunked")
    for spec in cases:
        for dt in dtypes:
            _check(rows[dt], ops, spec, "decode" if phase == "decode" else "prefill", dt, ops.device)
    return list(rows.values())


# attention shapes of real models, from their config.json: (name, query heads, KV heads, head
# size, sliding window or None, attention soft cap or None)
MODEL_SHAPES = (
    ("Llama 3 8B", 32, 8, 128, None, None),
    ("Llama 3 70B", 64, 8, 128, None, None),
    ("Qwen3 8B", 32, 8, 128, None, None),
    ("Qwen3 0.6B", 16, 8, 128, None, None),
    ("Gemma 2 9B", 16, 8, 256, 4096, 50.0),
    ("Gemma 3 4B", 8, 4, 256, 1024, None),
    ("Mixtral 8x7B", 32, 8, 128, None, None),
    ("Phi-3 mini", 32, 32, 96, 2047, None),
)


QUICK_MODEL_SHAPES = ("Qwen3 0.6B", "Gemma 3 4B")  # few heads (an interpreter's time), head 256, a window


def model_shape_cases(ops, quick: bool) -> list[Case]:
    """Decode and (chunked) prefill at each real model's heads, GQA ratio and head size, with
    its window and soft cap where it has them (windowed contexts run past the window in the
    full suite). Shapes the backend does not declare are left out."""
    bs = _supported((16, 32, 8), ops.supported_block_sizes)[0]
    cases = []
    shapes = [s for s in MODEL_SHAPES if s[0] in QUICK_MODEL_SHAPES] if quick else MODEL_SHAPES
    for i, (model, heads, kv_heads, head, window, cap) in enumerate(shapes):
        if ops.supported_head_sizes is not None and head not in ops.supported_head_sizes:
            continue
        window = window if window and ops.supports("sliding_window") else None
        cap = cap if cap and ops.supports("soft_cap") else None
        long = window + 40 if window and not quick else 2 * bs + 5
        shape = dict(kv_heads=kv_heads, model=model, window=window, soft_cap=cap)
        group = heads // kv_heads
        cases.append(Case("decode", (1, 1, 1), (1, bs + 1, long), bs, head, group, seed=700 + i, **shape))
        cases.append(Case("prefill", (bs + 3, 7), (bs + 3, long), bs, head, group, seed=720 + i, **shape))
    return cases


def check_model_shapes(ops, quick: bool, dtypes) -> list[CheckResult]:
    rows = _rows("model_shapes", dtypes)
    cases = model_shape_cases(ops, quick)
    for row in rows.values() if not cases else ():
        row.skipped = "no real model's head size is among the declared ones"
    for spec in cases:
        for dt in dtypes:
            _check(rows[dt], ops, spec, spec.what, dt, ops.device)
    return list(rows.values())


def check_large_scores(ops, quick: bool, dtypes) -> list[CheckResult]:
    rows = _rows("large_scores", dtypes)
    for spec in large_score_cases(ops, quick):
        for dt in dtypes:
            _check(rows[dt], ops, spec, spec.what, dt, ops.device)
    return list(rows.values())


def check_shared_blocks(ops, device) -> CheckResult:
    """Two or three requests whose tables share their first blocks (prefix hit or fork)."""
    res = CheckResult("shared_blocks", tolerance_text((torch.float32,)))
    for bs in (8, 16):
        for phase, q_lens in (("decode", (1, 1, 1)), ("prefill", (5, 2 * bs + 1, 1))):
            ctx = (3 * bs + 1, 4 * bs - 1, 2 * bs + 1)
            spec = Case(phase, q_lens, ctx, bs, 64, 4, seed=bs, share_prefix_blocks=2)
            _check(res, ops, spec, phase, torch.float32, device)
    return res


def check_output_buffers(ops, device) -> CheckResult:
    """The model calls decode, then prefill, and only then concatenates both outputs: the
    decode output must still hold its values after the prefill call."""
    res = CheckResult("output_buffers", tolerance_text((torch.float32,)))
    decode = Case("decode", (1, 1), (17, 40), 16, 64, 4, seed=5).build(torch.float32, device)
    prefill = Case("prefill", (7, 30), (7, 60), 16, 64, 4, seed=6).build(torch.float32, device)
    out_decode = _run_op(ops, decode, "decode")
    kept = out_decode.clone()
    out_prefill = _run_op(ops, prefill, "prefill")
    for what, out, case in (("prefill", out_prefill, prefill), ("decode after the prefill call", out_decode, decode)):
        ok, err = compare(out, case.expected, torch.float32)
        changed = what != "prefill" and not torch.equal(out_decode, kept)
        note = " (the prefill call overwrote the buffer decode returned)" if changed else ""
        res.record(ok, err, None if ok else f"{what}: off by {err:.3g}{note}")
    return res


def _where_is(flat: torch.Tensor, row: torch.Tensor) -> list[int]:
    """Slots of flat [slots, KVH, D] that hold exactly `row`."""
    return (flat == row).flatten(1).all(1).nonzero().flatten().tolist()


def check_write_kv(ops, quick: bool, device, dtypes) -> CheckResult:
    """Each token's K/V lands in exactly its slot; nothing else in the cache changes — in a small
    pool, and across a pool of 4096 blocks (the highest slot included)."""
    res = CheckResult("write_kv")
    gen = torch.Generator().manual_seed(0)
    block_sizes = _supported((8, 16) if quick else (8, 16, 32), ops.supported_block_sizes) or (
        ops.supported_block_sizes[0],
    )
    shapes = [(bs, 12, 23) for bs in block_sizes] + [(block_sizes[-1], 4096, 64)]
    for (bs, num_blocks, tokens), dt in itertools.product(shapes, dtypes):
        kvh, hs = 2, 64
        cache = torch.randn(2, num_blocks, bs, kvh, hs, generator=gen).to(dt)
        # never block 0; the pool's very last slot among them
        slots = torch.randperm((num_blocks - 1) * bs - 1, generator=gen)[: tokens - 1] + bs
        slots = torch.cat([slots, torch.tensor([num_blocks * bs - 1])])
        key = torch.randn(tokens, kvh, hs, generator=gen).to(dt)
        value = torch.randn(tokens, kvh, hs, generator=gen).to(dt)
        before = cache.clone()
        dev_cache = cache.to(device)
        ops.write_kv(key.to(device), value.to(device), dev_cache, slots.to(device))
        flat_after = dev_cache.cpu().view(2, -1, kvh, hs)
        flat_before = before.view(2, -1, kvh, hs)
        problems = []
        for t, slot in enumerate(slots.tolist()):
            if not torch.equal(flat_after[0, slot], key[t]) or not torch.equal(flat_after[1, slot], value[t]):
                found = _where_is(flat_after[0], key[t])
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
            f"block_size={bs} {num_blocks} blocks {DTYPE_NAMES[dt]}: " + "; ".join(problems[:3]) if problems else None,
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


def check_argmax(ops, device) -> CheckResult:
    """Greedy decoding's argmax (AttentionOps.argmax): torch.argmax's answer exactly, ties to
    the first index and NaN to the first NaN included, on rows off any vector width."""
    res = CheckResult("argmax")
    gen = torch.Generator().manual_seed(2)
    for vocab in (1, 13, 4096, 32003):
        scores = torch.randn(6, vocab, generator=gen)
        scores[1] = 0.0
        scores[2, vocab // 2] = float("nan")
        scores[3, vocab // 3] = scores[3, -1] = 1e4
        scores[4] = float("-inf")
        scores[5, -1] = float("inf")
        want = scores.argmax(dim=-1)
        got = ops.argmax(scores.to(device)).cpu()
        ok = got.shape == want.shape and torch.equal(got.long(), want)
        res.record(ok, 0.0 if ok else 1.0, None if ok else f"vocab {vocab}: {got.tolist()}, want {want.tolist()}")
    return res


def check_token_bitmask(ops, device) -> CheckResult:
    """Structured outputs' mask (AttentionOps.apply_token_bitmask): exactly the disallowed
    tokens become -inf and no other logit changes — random masks, rows with one token allowed
    (the first, the last, one in a last partial word), all allowed, vocabularies that are not a
    multiple of 32, and every sign of int32 word."""
    res = CheckResult("token_bitmask")
    gen = torch.Generator().manual_seed(5)
    for vocab in (7, 32, 100, 4096, 32003):
        words = (vocab + 31) // 32
        logits = torch.randn(6, vocab, generator=gen)
        allowed = torch.rand(6, vocab, generator=gen) < 0.5
        allowed[1] = False
        allowed[1, 0] = True
        allowed[2] = False
        allowed[2, vocab - 1] = True  # in the last, maybe partial, word
        allowed[3] = True
        allowed[4] = False
        allowed[4, 31 if vocab > 31 else vocab - 1] = True  # bit 31: a negative int32 word
        padded = torch.zeros(6, words * 32, dtype=torch.bool)
        padded[:, :vocab] = allowed
        weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
        bitmask = (padded.view(6, words, 32).long() * weights).sum(-1)
        bitmask = torch.where(bitmask >= 1 << 31, bitmask - (1 << 32), bitmask).to(torch.int32)
        want = logits.masked_fill(~allowed, float("-inf"))
        got = logits.to(device).clone()
        ops.apply_token_bitmask(got, bitmask.to(device))
        got = got.cpu()
        ok = got.shape == want.shape and torch.equal(got, want)
        failure = None
        if not ok:
            wrong = (got != want).nonzero().tolist()[:4]
            failure = f"vocab {vocab}: logits at (row, token) {wrong} differ from the mask's answer"
        res.record(ok, 0.0 if ok else 1.0, failure)
    return res


def check_lora(ops, device, dtype) -> CheckResult:
    """Multi-LoRA's product (AttentionOps.add_lora): four resident adapters of ranks 8 to 64
    (one zero-padded from a smaller rank), rows of each and of none (slot -1) mixed in one
    batch, in runs and alone, against float64 each row by itself; B in the layout the backend
    declares (lora_b_transposed)."""
    res = CheckResult(f"lora {DTYPE_NAMES[dtype]}", tolerance_text([dtype]))
    gen = torch.Generator().manual_seed(7)
    rand = lambda *shape, std=1.0: (torch.randn(*shape, generator=gen) * std).to(dtype)
    for rank, rows, width_in, width_out in ((8, 13, 72, 40), (16, 37, 96, 160), (64, 96, 256, 136)):
        lora_a, lora_b = rand(4, rank, width_in, std=0.1), rand(4, width_out, rank, std=0.1)
        lora_a[2, rank // 2 :] = 0  # an adapter of half the rank, padded
        lora_b[2, :, rank // 2 :] = 0
        scales = torch.tensor([2.0, 0.5, 1.0, 16.0 / rank])
        slots = torch.randint(-1, 4, (rows,), generator=gen, dtype=torch.int32)
        slots[:4] = torch.tensor([3, 3, -1, 0], dtype=torch.int32)  # a run, a base row, another adapter
        x, out = rand(rows, width_in), rand(rows, width_out)
        want = out.double().clone()
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                want[t] += (x[t].double() @ lora_a[s].double().T) @ lora_b[s].double().T * scales[s].item()
        got, b = out.to(device), lora_b.to(device)
        if ops.lora_b_transposed:  # as the worker keeps it for this backend: [S, r, out] storage
            b = b.transpose(1, 2).contiguous().transpose(1, 2)
        ops.add_lora(got, x.to(device), lora_a.to(device), b, slots.to(device), scales.to(device))
        ok, err = compare(got, want, dtype)
        failure = None
        if not ok:
            wrong = [t for t in range(rows) if not compare(got[t], want[t], dtype)[0]][:4]
            failure = f"rank {rank}: rows {wrong} (slots {[slots[t].item() for t in wrong]}) off by {err:.3g}"
        res.record(ok, err, failure)
    return res


def op_checks(ops, quick: bool = False, only_dtypes=None) -> list[tuple[str, object]]:
    """(name, a call that makes its rows) for every op check, so that one that raises costs
    only its own rows. only_dtypes: check just these (the backend must support them)."""
    device = ops.device
    dtypes = checked_dtypes(ops, only_dtypes)
    return [
        ("write_kv", lambda: check_write_kv(ops, quick, device, dtypes)),
        ("decode_attention", lambda: check_attention(ops, quick, "decode", dtypes)),
        ("prefill_attention", lambda: check_attention(ops, quick, "prefill", dtypes)),
        ("chunked_prefill_attention", lambda: check_attention(ops, quick, "chunked", dtypes)),
        ("large_scores", lambda: check_large_scores(ops, quick, dtypes)),
        ("model_shapes", lambda: check_model_shapes(ops, quick, dtypes)),
        ("sliding_window", lambda: check_limits(ops, quick, dtypes, "sliding_window")),
        ("soft_cap", lambda: check_limits(ops, quick, dtypes, "soft_cap")),
        ("kv_cache", lambda: check_kv_cache_dtypes(ops, quick, dtypes, _long_point(ops))),
        ("multi_token_decode", lambda: check_multi_token_decode(ops, quick, dtypes, _long_point(ops))),
        ("shared_blocks", lambda: check_shared_blocks(ops, device)),
        ("output_buffers", lambda: check_output_buffers(ops, device)),
        ("copy_blocks / swap_blocks", lambda: check_copy_and_swap(ops, device)),
        ("argmax", lambda: check_argmax(ops, device)),
        ("token_bitmask", lambda: check_token_bitmask(ops, device)),
        ("lora", lambda: [check_lora(ops, device, d) for d in dtypes]),
    ]
