"""The verification step of speculative decoding, as a backend sees it: a batch where some
requests decode one token and others score their last token plus a proposal (2 to K+1 query
tokens) against a long cached context. The runner sends the one-token rows to
decode_attention and the others to prefill_attention, in one step; each proposed token must
see the context and the proposal's tokens before it, not the ones after.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .op_cases import make_case
from .results import DTYPE_NAMES, CheckResult, compare, tolerance_text

NUM_KV_HEADS = 2
BLOCK_SIZES = (8, 16, 32, 64, 128)  # what the full suite walks (where declared)


def batches(block_size: int, quick: bool) -> list[tuple[tuple, tuple]]:
    """(query lengths, context lengths), one-token rows first as the runner orders them;
    query lengths 1..17 (K up to 16), contexts across block edges and past 2k tokens."""
    bs = block_size
    if quick:
        return [((1, 1, 2, 5, 17, 3), (1, 1500, 1025, 700, 600, bs + 2))]
    return [
        ((1, 1, 1, 2, 3, 5, 9, 17), (1, bs + 1, 2048, 4097, 2 * bs + 1, 1500, 600, 3000)),
        ((1, 4, 4, 8, 16), (700, bs, bs + 4, 4097, 17)),  # proposals across block edges
    ]


def run_as_the_runner_does(ops, case):
    """The one-token rows through decode_attention, the rest through prefill_attention; the
    two outputs concatenated in the batch's order."""
    n = sum(1 for q in case.query_lens if q == 1)
    decodes, rest = (
        replace(
            case,
            query=case.query[part],
            query_lens=case.query_lens[part],
            context_lens=case.context_lens[part],
            block_tables=case.block_tables[part],
        )
        for part in (slice(None, n), slice(n, None))
    )
    parts = []
    if n:
        parts.append(ops.decode_attention(decodes.query, case.kv_cache, decodes.decode_metadata(), case.scale))
    if rest.query_lens:
        parts.append(ops.prefill_attention(rest.query, case.kv_cache, rest.prefill_metadata(), case.scale))
    return torch.cat(parts)


def _off_rows(out, case, dtype) -> str:
    """Which requests are off, and at which of their query tokens: the clue to a port that
    handles one query token per row (its early tokens see the proposal's later ones; the
    last token, which may see everything, is right)."""
    bad, start = [], 0
    for q_len, ctx in zip(case.query_lens, case.context_lens):
        wrong = [t for t in range(q_len) if not compare(out[start + t], case.expected[start + t], dtype)[0]]
        if wrong:
            bad.append(f"request with {q_len} query tokens at context {ctx} wrong at tokens {wrong[:5]}")
        start += q_len
    return "; ".join(bad[:3]) + (" ..." if len(bad) > 3 else "")


def check_multi_token_decode(ops, quick: bool, dtypes, point: tuple[int, int, int]) -> list[CheckResult]:
    """A row per dtype: the batches at every declared block size (--quick: the long-context
    point's), at the point's head size and GQA group."""
    rows = {dt: CheckResult(f"multi_token_decode {DTYPE_NAMES[dt]}", tolerance_text((dt,))) for dt in dtypes}
    _, head_size, group = point
    declared = ops.supported_block_sizes
    block_sizes = [point[0]] if quick else [b for b in BLOCK_SIZES if declared is None or b in declared]
    for i, bs in enumerate(block_sizes):
        for j, (q_lens, c_lens) in enumerate(batches(bs, quick)):
            for dt in dtypes:
                label = f"block_size={bs} (query, context) {list(zip(q_lens, c_lens))[:4]}... {DTYPE_NAMES[dt]}"
                try:
                    case = make_case(
                        list(q_lens),
                        list(c_lens),
                        bs,
                        head_size,
                        NUM_KV_HEADS,
                        group,
                        dt,
                        seed=800 + 10 * i + j,
                        device=ops.device,
                    )
                    out = run_as_the_runner_does(ops, case)
                except Exception as e:  # noqa: BLE001 - report, do not crash
                    rows[dt].record(False, float("inf"), f"{label}: raised {type(e).__name__}: {e}")
                    continue
                ok, err = compare(out, case.expected, dt)
                rows[dt].record(ok, err, None if ok else f"{label}: {_off_rows(out, case, dt)}")
    return list(rows.values())
