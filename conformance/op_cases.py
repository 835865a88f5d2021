"""Paged-attention op cases with a dense answer computed directly (float64), for any backend.

A case is a batch of requests, each with its own dense K/V history. The K/V is written into
a paged cache through shuffled, non-contiguous block tables (block 0 never used), optionally
with requests sharing leading blocks, and the backend's op must reproduce dense attention.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [L, H, D] at the last L of S positions; k/v [S, KVH, D]; causal; float64."""
    q_len, num_heads, _ = q.shape
    ctx = k.shape[0]
    group = num_heads // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.double(), k) * scale
    q_pos = torch.arange(ctx - q_len, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v)


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
) -> PagedCase:
    """Requests r with context_lens[r] tokens of which the last query_lens[r] are queries.
    With share_prefix_blocks, every request's first blocks are the same physical blocks, and
    their K/V is the same tokens' (as after a prefix-cache hit or a fork)."""
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
    kv = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=dtype)
    kv.normal_(generator=gen)  # garbage in unused slots: an op that reads them fails
    scale = head_size**-0.5
    shared_k = torch.randn(shared * block_size, num_kv_heads, head_size, generator=gen)
    shared_v = torch.randn(shared * block_size, num_kv_heads, head_size, generator=gen)
    queries, expected = [], []
    for table, q_len, ctx in zip(tables, query_lens, context_lens):
        k = torch.randn(ctx, num_kv_heads, head_size, generator=gen)
        v = torch.randn(ctx, num_kv_heads, head_size, generator=gen)
        n = min(ctx, shared * block_size)
        k[:n], v[:n] = shared_k[:n], shared_v[:n]
        k, v = k.to(dtype), v.to(dtype)  # the reference sees what the cache holds
        slots = slots_of(table, range(ctx), block_size)
        kv[0].view(-1, num_kv_heads, head_size)[slots] = k
        kv[1].view(-1, num_kv_heads, head_size)[slots] = v
        q = torch.randn(q_len, num_heads, head_size, generator=gen).to(dtype)
        queries.append(q)
        expected.append(dense_attention(q, k, v, scale))
    width = max(blocks_per)
    table_t = torch.zeros(len(tables), width, dtype=torch.int32)
    for r, t in enumerate(tables):
        table_t[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return PagedCase(
        kv.to(device),
        torch.cat(queries).to(device),
        list(query_lens),
        list(context_lens),
        table_t.to(device),
        torch.cat(expected),
        scale,
    )


def slots_of(block_ids: list[int], positions, block_size: int) -> torch.Tensor:
    """Cache slot of each position of a request with this block table."""
    pos = torch.as_tensor(list(positions), dtype=torch.long)
    return torch.as_tensor(block_ids, dtype=torch.long)[pos // block_size] * block_size + pos % block_size


def context_lengths(block_size: int, long: int = 1000) -> list[int]:
    """The edges that matter: 1, around one block, and long."""
    return [1, block_size - 1, block_size, block_size + 1, long]
