"""Backends with one classic bug each (the conformance suite must catch every one), one that
declares narrow support, and two that crash (the engine must give up on them cleanly)."""

import os
from dataclasses import replace

import torch

from pagedllm.backends.attention import DecodeMetadata
from pagedllm.backends.cpu import CpuAttentionOps


class SlotOffByOne(CpuAttentionOps):
    """Writes each token one slot past the one the core chose."""

    name = "broken-slot-off-by-one"

    def write_kv(self, key, value, kv_cache, slot_mapping):
        limit = kv_cache.shape[1] * kv_cache.shape[2] - 1
        super().write_kv(key, value, kv_cache, (slot_mapping + 1).clamp(max=limit))


class NoSoftmaxScale(CpuAttentionOps):
    """Forgets the 1/sqrt(head_size) scale before the softmax."""

    name = "broken-no-softmax-scale"

    def decode_attention(self, query, kv_cache, meta, scale):
        return super().decode_attention(query, kv_cache, meta, 1.0)

    def prefill_attention(self, query, kv_cache, meta, scale):
        return super().prefill_attention(query, kv_cache, meta, 1.0)


def _first_block_everywhere(tables):
    tables = tables.clone()
    tables[:, 1:] = tables[:, :1]
    return tables


class FirstBlockOnly(CpuAttentionOps):
    """Reads a request's first block in place of all the others."""

    name = "broken-first-block-only"

    def decode_attention(self, query, kv_cache, meta, scale):
        return super().decode_attention(
            query, kv_cache, replace(meta, block_tables=_first_block_everywhere(meta.block_tables)), scale
        )

    def prefill_attention(self, query, kv_cache, meta, scale):
        return super().prefill_attention(
            query, kv_cache, replace(meta, block_tables=_first_block_everywhere(meta.block_tables)), scale
        )


class NeedsHardware(CpuAttentionOps):
    """A backend for hardware this machine does not have."""

    name = "needs-hardware"

    @staticmethod
    def unavailable_reason():
        return "no XPU device"


class CrashOnStart(CpuAttentionOps):
    """A backend whose worker fails while starting, every time (as a missing kernel would)."""

    name = "crash-on-start"

    def __init__(self):
        raise RuntimeError("crash-on-start: its kernels are missing")


class CrashMidRun(CpuAttentionOps):
    """A backend whose worker process dies at its first decode, every time."""

    name = "crash-mid-run"

    def decode_attention(self, query, kv_cache, meta, scale):
        os._exit(3)


def _gathered(query, kv_cache, table, context_len):
    """One request's K/V [S, H, D] in float32, its KV heads repeated for the query heads."""
    _, _, block_size, kv_heads, size = kv_cache.shape
    blocks = table[: -(-context_len // block_size)].long()
    k = kv_cache[0][blocks].reshape(-1, kv_heads, size)[:context_len].float()
    v = kv_cache[1][blocks].reshape(-1, kv_heads, size)[:context_len].float()
    group = query.shape[1] // kv_heads
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


class SplitKWithoutRescale(CpuAttentionOps):
    """Decode in 1024-token partitions, each with its own max, combined by their sums alone:
    the exp(max_i - max) factor is forgotten. Right while a context fits one partition."""

    name = "broken-split-k-combine"
    partition = 1024

    def decode_attention(self, query, kv_cache, meta, scale):
        out = torch.empty_like(query)
        for i, ctx in enumerate(meta.context_lens.tolist()):
            k, v = _gathered(query, kv_cache, meta.block_tables[i], ctx)
            q = query[i].float()  # [H, D]
            weighted, sums = 0.0, 0.0
            for start in range(0, ctx, self.partition):
                scores = torch.einsum("hd,shd->hs", q, k[start : start + self.partition]) * scale
                p = (scores - scores.max(-1, keepdim=True).values).exp()
                weighted = weighted + torch.einsum("hs,shd->hd", p, v[start : start + self.partition])
                sums = sums + p.sum(-1, keepdim=True)
            out[i] = (weighted / sums).to(query.dtype)
        return out


class ReusedChunkBuffer(CpuAttentionOps):
    """Decodes a batch in chunks of 64 requests into one preallocated buffer and concatenates
    views of it at the end, so every chunk comes out as the last one. Right up to 64 requests."""

    name = "broken-reused-chunk-buffer"
    chunk = 64

    def decode_attention(self, query, kv_cache, meta, scale):
        buffer = torch.empty((self.chunk, *query.shape[1:]), dtype=query.dtype)
        views = []
        for start in range(0, query.shape[0], self.chunk):
            rows = slice(start, start + self.chunk)
            sub = replace(meta, block_tables=meta.block_tables[rows], context_lens=meta.context_lens[rows])
            result = super().decode_attention(query[rows], kv_cache, sub, scale)
            buffer[: result.shape[0]] = result
            views.append(buffer[: result.shape[0]])
        return torch.cat(views)


class ArgmaxLastOfTies(CpuAttentionOps):
    """A hand-written argmax that keeps the last of equal largest values (>= where > belongs):
    right on random logits, wrong wherever two tie."""

    name = "broken-argmax-last-of-ties"

    def argmax(self, scores):
        return scores.shape[-1] - 1 - scores.flip(-1).argmax(dim=-1)


class LoraOneSlot(CpuAttentionOps):
    """A multi-LoRA product that reads the first row's adapter for every row (one slot for the
    whole batch): right for a batch of one adapter, wrong wherever adapters mix."""

    name = "broken-lora-one-slot"

    def add_lora(self, out, x, lora_a, lora_b, slots, scales):
        super().add_lora(out, x, lora_a, lora_b, torch.full_like(slots, int(slots[0])), scales)


class SoftmaxWithoutMax(CpuAttentionOps):
    """exp(score) / sum(exp(score)) in float32 without subtracting the max first: fine for
    scores of a few units, inf/inf = NaN once a score passes ~88."""

    name = "broken-softmax-without-max"

    def _attend(self, query, kv_cache, table, context_len, scale):
        k, v = _gathered(query, kv_cache, table, context_len)
        q_len = query.shape[0]
        scores = torch.einsum("lhd,shd->hls", query.float(), k) * scale
        allowed = torch.arange(context_len)[None, :] <= torch.arange(context_len - q_len, context_len)[:, None]
        e = scores.exp() * allowed
        return torch.einsum("hls,shd->lhd", e / e.sum(-1, keepdim=True), v).to(query.dtype)

    def decode_attention(self, query, kv_cache, meta, scale):
        return torch.cat(
            [
                self._attend(query[i : i + 1], kv_cache, meta.block_tables[i], ctx, scale)
                for i, ctx in enumerate(meta.context_lens.tolist())
            ]
        )

    def prefill_attention(self, query, kv_cache, meta, scale):
        outs, start = [], 0
        for i, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_list)):
            outs.append(self._attend(query[start : start + q_len], kv_cache, meta.block_tables[i], ctx, scale))
            start += q_len
        return torch.cat(outs)


class NarrowSupport(CpuAttentionOps):
    """A port that declares what it supports: the suite tests only that, the engine refuses the rest."""

    name = "narrow-support"
    supported_dtypes = (torch.float32,)
    supported_block_sizes = (16,)
    supported_head_sizes = (16, 64)
    max_context_len = 512
    supported_kv_cache_dtypes = ("auto", "int8")


class FromTheFuture(CpuAttentionOps):
    """Written against a backend contract this pagedllm does not know yet."""

    name = "future-contract"
    contract_version = 99


class VersionOne(CpuAttentionOps):
    """Written against contract version 1 (before the platform face): runs on its defaults."""

    name = "version-one"
    contract_version = 1


class BitmaskLastWordDropped(CpuAttentionOps):
    """Applies a structured-output mask word by word, but forgets the last, partial word: the
    last tokens of a vocabulary that is not a multiple of 32 are never masked."""

    name = "broken-bitmask-last-word"

    def apply_token_bitmask(self, logits, bitmask):
        whole = logits.shape[-1] // 32
        super().apply_token_bitmask(logits[:, : whole * 32], bitmask[:, :whole])


class WindowIgnored(CpuAttentionOps):
    """Declares sliding-window attention and takes the keyword, but attends to the whole context."""

    name = "broken-window-ignored"

    def decode_attention(self, query, kv_cache, meta, scale, *, window=None, soft_cap=None):
        return super().decode_attention(query, kv_cache, meta, scale, soft_cap=soft_cap)

    def prefill_attention(self, query, kv_cache, meta, scale, *, window=None, soft_cap=None):
        return super().prefill_attention(query, kv_cache, meta, scale, soft_cap=soft_cap)


class SoftCapIgnored(CpuAttentionOps):
    """Declares soft-capping and takes the keyword, but never caps the scores."""

    name = "broken-soft-cap-ignored"

    def decode_attention(self, query, kv_cache, meta, scale, *, window=None, soft_cap=None):
        return super().decode_attention(query, kv_cache, meta, scale, window=window)

    def prefill_attention(self, query, kv_cache, meta, scale, *, window=None, soft_cap=None):
        return super().prefill_attention(query, kv_cache, meta, scale, window=window)


class KVScaleDropped(CpuAttentionOps):
    """Stores 8-bit K/V with their scales, but its attention reads the codes as the values."""

    name = "broken-kv-scale-dropped"

    def decode_attention(self, query, kv_cache, meta, scale, *, window=None, soft_cap=None, kv_scales=None):
        ones = None if kv_scales is None else torch.ones_like(kv_scales)
        return super().decode_attention(query, kv_cache, meta, scale, window=window, soft_cap=soft_cap, kv_scales=ones)

    def prefill_attention(self, query, kv_cache, meta, scale, *, window=None, soft_cap=None, kv_scales=None):
        ones = None if kv_scales is None else torch.ones_like(kv_scales)
        return super().prefill_attention(query, kv_cache, meta, scale, window=window, soft_cap=soft_cap, kv_scales=ones)


class OneQueryPerDecodeRow(CpuAttentionOps):
    """Sends a short query over a long context (a speculative verification row) to its decode
    kernel, which handles one query token per row: every token of the row sees the whole
    context, the proposal's later tokens included."""

    name = "broken-one-query-per-decode-row"

    def prefill_attention(self, query, kv_cache, meta, scale):
        out = super().prefill_attention(query, kv_cache, meta, scale)
        starts = meta.query_start_loc.tolist()
        for r, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_list)):
            if 2 <= q_len <= 8 and ctx >= 512:
                rows = slice(starts[r], starts[r] + q_len)
                tables = meta.block_tables[r : r + 1].expand(q_len, -1)
                full = torch.full((q_len,), ctx, dtype=torch.int32)
                out[rows] = super().decode_attention(query[rows], kv_cache, DecodeMetadata(tables, full, ctx), scale)
        return out


class BatchSizeDependentSplitK(CpuAttentionOps):
    """Decodes a small batch (two requests or fewer) in two partitions per context, combined
    with the right rescale — as GPU kernels split the keys to fill the device when few requests
    run — and a larger batch in one pass. Within tolerance either way, but a request's bits
    depend on how many run beside it; it declares batch invariance all the same."""

    name = "batch-size-dependent"
    batch_invariant = True

    def decode_attention(self, query, kv_cache, meta, scale):
        if query.shape[0] > 2:
            return super().decode_attention(query, kv_cache, meta, scale)
        out = torch.empty_like(query)
        for i, ctx in enumerate(meta.context_lens.tolist()):
            k, v = _gathered(query, kv_cache, meta.block_tables[i], ctx)
            q = query[i].float()
            parts = []
            for keys in (slice(0, (ctx + 1) // 2), slice((ctx + 1) // 2, ctx)):
                if keys.start == keys.stop:
                    continue
                scores = torch.einsum("hd,shd->hs", q, k[keys]) * scale
                top = scores.max(-1, keepdim=True).values
                p = (scores - top).exp()
                parts.append((top, p.sum(-1, keepdim=True), torch.einsum("hs,shd->hd", p, v[keys])))
            top = torch.stack([t for t, _, _ in parts]).max(0).values
            weighted = sum((t - top).exp() * w for t, _, w in parts)
            sums = sum((t - top).exp() * s for t, s, _ in parts)
            out[i] = (weighted / sums).to(query.dtype)
        return out


class BatchSizeDependentUndeclared(BatchSizeDependentSplitK):
    """The same kernels, honestly declared: not batch invariant."""

    name = "batch-size-dependent-undeclared"
    batch_invariant = False
