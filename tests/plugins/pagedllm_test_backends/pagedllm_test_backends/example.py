"""A minimal third-party backend written against the public interface only: one loop per
request, torch's scaled_dot_product_attention on the gathered blocks."""

import torch
import torch.nn.functional as F

from pagedllm.backends.attention import AttentionOps


class ExampleOps(AttentionOps):
    name = "example"
    supported_dtypes = (torch.float32, torch.bfloat16)

    def write_kv(self, key, value, kv_cache, slot_mapping):
        heads, size = key.shape[1], key.shape[2]
        kv_cache[0].view(-1, heads, size)[slot_mapping] = key.to(kv_cache.dtype)
        kv_cache[1].view(-1, heads, size)[slot_mapping] = value.to(kv_cache.dtype)

    def _one(self, q, kv_cache, blocks, context_len, scale):
        """q [L, H, D] for the last L positions of a context_len-token sequence."""
        _, _, _, kv_heads, size = kv_cache.shape
        k = kv_cache[0][blocks].reshape(-1, kv_heads, size)[:context_len].float()
        v = kv_cache[1][blocks].reshape(-1, kv_heads, size)[:context_len].float()
        group = q.shape[1] // kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q_len = q.shape[0]
        allowed = torch.arange(context_len)[None, :] <= torch.arange(context_len - q_len, context_len)[:, None]
        out = F.scaled_dot_product_attention(
            q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale
        )
        return out.transpose(0, 1).to(q.dtype)

    def decode_attention(self, query, kv_cache, meta, scale):
        bs = kv_cache.shape[2]
        outs = []
        for i, ctx in enumerate(meta.context_lens.tolist()):
            blocks = meta.block_tables[i, : -(-ctx // bs)].long()
            outs.append(self._one(query[i : i + 1], kv_cache, blocks, ctx, scale))
        return torch.cat(outs)

    def prefill_attention(self, query, kv_cache, meta, scale):
        bs = kv_cache.shape[2]
        outs, start = [], 0
        for i, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_list)):
            blocks = meta.block_tables[i, : -(-ctx // bs)].long()
            outs.append(self._one(query[start : start + q_len], kv_cache, blocks, ctx, scale))
            start += q_len
        return torch.cat(outs)
