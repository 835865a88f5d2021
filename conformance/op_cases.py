"""Paged-attention op cases with a dense answer computed directly (float64), for any backend.

A case is a batch of requests, each with its own dense K/V history. The K/V is written into
a paged cache through shuffled, non-contiguous block tables (block 0 never used), optionally
with requests sharing leading blocks, and the backend's op must reproduce dense attention.

Inputs of a 16-bit case are drawn on values that bfloat16 and float16 both hold exactly, so
one float64 reference serves both (the references are most of the suite's time); float32
cases keep full-precision inputs (a kernel that rounds float32 to TF32 or bfloat16 must fail).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from pagedllm.backends.attention import DecodeMetadata, PrefillMetadata
from pagedllm.core.utils import cdiv


@dataclass
class PagedCase:
    kv_cache: torch.Tensor  # [2, num_blocks, bs, KVH, D], filled
    query: torch.Tensor  # [T, H, D], flattened over requests
    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor  # [R, max_blocks] int32
    expected: torch.Tensor  # [T, H, D] float64
    scale: float
    window: int | None = None
    soft_cap: float | None = None

    def limits(self) -> dict:
        """The keyword arguments of the attention ops this case needs (none for plain attention)."""
        return {k: v for k, v in (("window", self.window), ("soft_cap", self.soft_cap)) if v is not None}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv_cache, self.query, self.expected))

    def cast(self, dtype: torch.dtype, device="cpu") -> PagedCase:
        """The same case in `dtype` on `device` (exact when the inputs were drawn for it)."""
        return replace(
            self,
            kv_cache=self.kv_cache.to(device=device, dtype=dtype, copy=True),
            query=self.query.to(device=device, dtype=dtype, copy=True),
            block_tables=self.block_tables.to(device, copy=True),
        )

    def decode_metadata(self) -> DecodeMetadata:
        ctx = torch.tensor(self.context_lens, dtype=torch.int32, device=self.kv_cache.device)
        return DecodeMetadata(self.block_tables, ctx, max(self.context_lens))

    def prefill_metadata(self) -> PrefillMetadata:
        dev = self.kv_cache.device
        qsl = [0]
        for n in self.query_lens:
            qsl.append(qsl[-1] + n)
        return PrefillMetadata(
            block_tables=self.block_tables,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(self.context_lens, dtype=torch.int32, device=dev),
            query_lens=list(self.query_lens),
            context_lens_list=list(self.context_lens),
            max_query_len=max(self.query_lens),
            max_context_len=max(self.context_lens),
        )


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """q [L, H, D] at the last L of S positions; k/v [S, KVH, D]; causal (with a window: the
    last `window` positions up to the query's own); float64. The query heads that share a KV
    head go through one matmul (no repeated K/V)."""
    q_len, num_heads, head_size = q.shape
    ctx, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    q = q.double().view(q_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
    q = q.reshape(num_kv_heads, group * q_len, head_size)
    scores = torch.matmul(q, k.double().permute(1, 2, 0)) * scale  # [KVH, G * L, S]
    if soft_cap:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    q_pos = torch.arange(ctx - q_len, ctx).repeat(group)[:, None]
    k_pos = torch.arange(ctx)[None, :]
    scores.masked_fill_(k_pos > q_pos, float("-inf"))
    if window:
        scores.masked_fill_(k_pos <= q_pos - window, float("-inf"))
    out = torch.matmul(scores.softmax(-1), v.double().transpose(0, 1))  # [KVH, G * L, D]
    return out.view(num_kv_heads, group, q_len, head_size).permute(2, 0, 1, 3).reshape(q_len, num_heads, head_size)


def exact_in(dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    """x rounded to values `dtype` holds; for 16-bit dtypes, values both bfloat16 and float16
    hold (bfloat16's 8-bit significand; magnitudes below float16's smallest normal flushed)."""
    if dtype == torch.float32:
        return x
    x = x.to(torch.bfloat16).float()
    return x.masked_fill(x.abs() < 2.0**-14, 0.0)


def precision_class(dtype: torch.dtype) -> torch.dtype:
    """Dtypes whose cases share inputs and a reference: float32 alone, the 16-bit ones together."""
    return torch.float32 if dtype == torch.float32 else torch.bfloat16


def make_case(
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    head_size: int,
    num_kv_heads: int,
    group: int,
    dtype=torch.float32,
    share_prefix_blocks: int = 0,
    seed: int = 0,
    device="cpu",
    spare_blocks: int = 3,
    scale: float | None = None,
    dominant_logits: list[float] | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
) -> PagedCase:
    """Requests r with context_lens[r] tokens of which the last query_lens[r] are queries.
    With share_prefix_blocks, every request's first blocks are the same physical blocks, and
    their K/V is the same tokens' (as after a prefix-cache hit or a fork). With
    dominant_logits, request r's queries share a direction and one key that all of them see
    scores dominant_logits[r] against them (a softmax that skips subtracting the max
    overflows). window / soft_cap: the answer is sliding-window / soft-capped attention's. The
    returned case is in `dtype` on `device`."""
    return _cached_base_case(
        tuple(query_lens),
        tuple(context_lens),
        block_size,
        head_size,
        num_kv_heads,
        group,
        precision_class(dtype),
        share_prefix_blocks,
        seed,
        spare_blocks,
        scale,
        tuple(dominant_logits) if dominant_logits else None,
        window,
        soft_cap,
    ).cast(dtype, device)


CACHE_BYTES = 512 << 20
_cases: OrderedDict[tuple, PagedCase] = OrderedDict()


def _cached_base_case(*key) -> PagedCase:
    """_base_case's cases kept, the most recently used up to CACHE_BYTES: every dtype of a check
    and every backend run in one process (a test session's, a matrix's) draws the same cases,
    whose references are most of an op run's time. Callers get copies (PagedCase.cast)."""
    case = _cases.get(key)
    if case is not None:
        _cases.move_to_end(key)
        return case
    case = _cases[key] = _base_case(*key)
    total = sum(c.nbytes for c in _cases.values())
    while total > CACHE_BYTES and len(_cases) > 1:
        total -= _cases.popitem(last=False)[1].nbytes
    return case


def _base_case(
    query_lens,
    context_lens,
    block_size,
    head_size,
    num_kv_heads,
    group,
    dtype,
    share_prefix_blocks,
    seed,
    spare_blocks,
    scale,
    dominant_logits,
    window,
    soft_cap,
) -> PagedCase:
    """The case in float32 holding values exact in `dtype`'s precision class, with its reference."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_heads = num_kv_heads * group
    blocks_per = [cdiv(c, block_size) for c in context_lens]
    shared = min([share_prefix_blocks] + blocks_per)
    num_blocks = 1 + shared + sum(b - shared for b in blocks_per) + spare_blocks
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    shared_ids, ids = ids[:shared], ids[shared:]
    tables = []
    for b in blocks_per:
        tables.append(shared_ids + ids[: b - shared])
        ids = ids[b - shared :]
    kv = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size)
    kv.normal_(generator=gen)  # garbage in unused slots: an op that reads them fails
    kv = exact_in(dtype, kv)
    scale = head_size**-0.5 if scale is None else scale
    shared_k = torch.randn(shared * block_size, num_kv_heads, head_size, generator=gen)
    shared_v = torch.randn(shared * block_size, num_kv_heads, head_size, generator=gen)
    queries, expected = [], []
    for r, (table, q_len, ctx) in enumerate(zip(tables, query_lens, context_lens)):
        k = torch.randn(ctx, num_kv_heads, head_size, generator=gen)
        v = torch.randn(ctx, num_kv_heads, head_size, generator=gen)
        n = min(ctx, shared * block_size)
        k[:n], v[:n] = shared_k[:n], shared_v[:n]
        q = torch.randn(q_len, num_heads, head_size, generator=gen)
        if dominant_logits:
            _plant_dominant_key(q, k, ctx - q_len, dominant_logits[r], scale, gen)
        k, v, q = exact_in(dtype, k), exact_in(dtype, v), exact_in(dtype, q)  # what the cache holds
        slots = slots_of(table, range(ctx), block_size)
        kv[0].view(-1, num_kv_heads, head_size)[slots] = k
        kv[1].view(-1, num_kv_heads, head_size)[slots] = v
        queries.append(q)
        expected.append(dense_attention(q, k, v, scale, window, soft_cap))
    width = max(blocks_per)
    table_t = torch.zeros(len(tables), width, dtype=torch.int32)
    for r, t in enumerate(tables):
        table_t[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    queries, expected = torch.cat(queries), torch.cat(expected)
    return PagedCase(kv, queries, list(query_lens), list(context_lens), table_t, expected, scale, window, soft_cap)


def _plant_dominant_key(q: torch.Tensor, k: torch.Tensor, last_visible: int, logit: float, scale: float, gen) -> None:
    """Queries q [L, H, D] get a shared unit direction u (at twice their noise norm), and the
    key at a random position <= last_visible (seen by every query) becomes b*u so that each
    query scores about `logit` against it: other scores stay O(1), so the softmax is all but
    one-hot and its max must be subtracted before exponentiating."""
    head_size = q.shape[-1]
    u = torch.randn(head_size, generator=gen)
    u /= u.norm()
    a = 2.0 * head_size**0.5
    q -= (q @ u)[..., None] * u  # so that the dominant score is `logit`, not about it
    q += a * u
    pos = int(torch.randint(0, last_visible + 1, (1,), generator=gen))
    k[pos] = (logit / (scale * a)) * u


def slots_of(block_ids: list[int], positions, block_size: int) -> torch.Tensor:
    """Cache slot of each position of a request with this block table."""
    pos = torch.as_tensor(list(positions), dtype=torch.long)
    return torch.as_tensor(block_ids, dtype=torch.long)[pos // block_size] * block_size + pos % block_size


def context_lengths(block_size: int, long: int = 1000) -> list[int]:
    """The edges that matter: 1, around one block, and long."""
    return [1, block_size - 1, block_size, block_size + 1, long]
