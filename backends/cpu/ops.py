"""The reference attention ops in plain torch: the numerical ground truth for every backend.

Attention follows transformers' eager attention step for step — scores in the model dtype,
softmax in float32, probabilities cast back — so in bfloat16 and float16 the reference
rounds where the oracle rounds, not only in float32.

K/V are gathered one KV head at a time with index_select: from the cache's
[block, slot, head, dim] layout that yields each head's [tokens, dim] matrix contiguous in
one copy, ~3x faster than gathering every head and transposing (and advanced indexing is
~10x slower than index_select)."""

from __future__ import annotations

import torch

from ..attention import AttentionOps, DecodeMetadata, PrefillMetadata
from .packed_linear import pack_linear_layers


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor,
           scale: float) -> torch.Tensor:
    """q [..., M, D], k/v [..., S, D], hidden [..., M, S] (True: may not attend) -> [..., M, D]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def gather_head(kv_cache: torch.Tensor, which: int, head: int, blocks: torch.Tensor) -> torch.Tensor:
    """[len(blocks) * block_size, D]: one KV head's K (which=0) or V (1) over the blocks."""
    return kv_cache[which, :, :, head].index_select(0, blocks).flatten(0, 1)


class CpuAttentionOps(AttentionOps):
    name = "cpu"

    def prepare_model(self, model) -> None:
        pack_linear_layers(model)

    def write_kv(self, key, value, kv_cache, slot_mapping):
        num_kv_heads, head_size = key.shape[1], key.shape[2]
        kv_cache[0].view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        kv_cache[1].view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))

    def decode_attention(self, query, kv_cache, meta: DecodeMetadata, scale):
        num_seqs, num_heads, head_size = query.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        group = num_heads // num_kv_heads
        max_blocks = -(-meta.max_context_len // block_size)
        blocks = meta.block_tables[:, :max_blocks].reshape(-1).long()
        q = query.view(num_seqs, num_kv_heads, group, head_size).to(kv_cache.dtype)
        positions = torch.arange(max_blocks * block_size, device=query.device)
        hidden = (positions[None, :] >= meta.context_lens[:, None])[:, None, :]  # [D, 1, S]
        out = torch.empty_like(q)
        for h in range(num_kv_heads):
            keys = gather_head(kv_cache, 0, h, blocks).view(num_seqs, -1, head_size)
            values = gather_head(kv_cache, 1, h, blocks).view(num_seqs, -1, head_size)
            out[:, h] = attend(q[:, h], keys, values, hidden, scale)
        return out.view(num_seqs, num_heads, head_size).to(query.dtype)

    def prefill_attention(self, query, kv_cache, meta: PrefillMetadata, scale):
        _, num_heads, head_size = query.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        group = num_heads // num_kv_heads
        out = torch.empty_like(query)
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens, meta.context_lens_list)):
            blocks = meta.block_tables[i, :-(-ctx_len // block_size)].long()
            # [KVH, G * q_len, Dh]: the G query heads that share a KV head, stacked
            q = query[start:start + q_len].to(kv_cache.dtype).view(q_len, num_kv_heads, group, head_size)
            q = q.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_size)
            # query j sits at position ctx_len - q_len + j and sees keys up to that position
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
            k_pos = torch.arange(ctx_len, device=query.device)
            hidden = (k_pos[None, :] > q_pos[:, None]).repeat(group, 1)
            o = torch.empty_like(q)
            for h in range(num_kv_heads):
                keys = gather_head(kv_cache, 0, h, blocks)[:ctx_len]
                values = gather_head(kv_cache, 1, h, blocks)[:ctx_len]
                o[h] = attend(q[h], keys, values, hidden, scale)
            o = o.view(num_kv_heads, group, q_len, head_size).permute(2, 0, 1, 3)
            out[start:start + q_len] = o.reshape(q_len, num_heads, head_size).to(query.dtype)
            start += q_len
        return out
