"""The reference attention ops in plain torch: the numerical ground truth for every backend.
Where they build, compiled kernels (native.py) run instead, in every dtype: attention reading
the blocks in place (decode, prefill and chunked prefill), and the model changes of
model_kernels.py (16-bit models compute in float32 on their 16-bit weights and KV blocks).
PAGEDLLM_CPU_KERNELS=0 turns them off.

The torch path follows transformers' eager attention step for step — scores in the model
dtype, softmax in float32, probabilities cast back — so in bfloat16 and float16 it rounds
where the oracle rounds: bit-identical logits for those who need them.

A request's blocks are gathered whole with index_select (contiguous 'block' rows copy at
memory speed; advanced indexing is ~10x slower, and selecting one head's strided slice ~7x
slower per byte), then laid out head-major once so each head's matmuls read contiguous
memory."""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

from pagedllm.core.utils import cdiv

from ..attention import AttentionOps, DecodeMetadata, PrefillMetadata, prefill_token_rows
from ..kv_cache import dequantize, write_quantized
from ..models.moe import ExpertsMLP
from . import native
from .model_kernels import compute_in_float32, panel_float32_linear, use_fused_kernels, use_panel_linear
from .packed_linear import bfloat16_dot_products, pack_linear_layers
from .quantized_linear import cpu_quantized_linear
from .step_replay import capture_step_replay

REPLAYED_OPS = ("decode_attention", "write_kv", "add_lora")  # what a replayed step calls of this class
DECODE_GROUPS = 4  # at most this many context-length groups per decode batch
DECODE_GROUP_MIN = 8  # requests per group, at least
LORA_ROWS_PER_ROW_KERNEL = 64  # add_lora: the compiled per-row product up to this many rows


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    hidden: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """q [..., M, D], k/v [..., S, D] in float32 holding `dtype` values; hidden [..., M, S]
    (True: may not attend). Rounds to `dtype` exactly where transformers' eager attention
    computing in `dtype` rounds; the GEMMs themselves run in float32, which is faster here
    than 16-bit batched GEMMs and accumulates as they do. Returns [..., M, D] in `dtype`."""
    scores = torch.matmul(q, k.transpose(-1, -2))
    if dtype != torch.float32:
        scores = scores.to(dtype)
    scores = scores * scale
    if soft_cap:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if dtype != torch.float32:
        probs = probs.to(dtype).float()
    return torch.matmul(probs, v).to(dtype)


def gather_heads(
    kv_cache: torch.Tensor, which: int, blocks: torch.Tensor, num_seqs: int, kv_scales: torch.Tensor | None = None
) -> torch.Tensor:
    """K (which=0) or V (1) of the blocks, head-major float32: [KVH, num_seqs, tokens per seq, D]
    (an 8-bit cache's codes times their scales)."""
    _, _, _block_size, num_kv_heads, head_size = kv_cache.shape
    gathered = kv_cache[which].index_select(0, blocks)
    if kv_scales is not None:
        gathered = dequantize(gathered, kv_scales[which].index_select(0, blocks))
    gathered = gathered.view(num_seqs, -1, num_kv_heads, head_size)
    out = torch.empty(
        (num_kv_heads, num_seqs, gathered.shape[1], head_size), dtype=torch.float32, device=kv_cache.device
    )
    return out.copy_(gathered.permute(2, 0, 1, 3))


def keep_freed_memory() -> bool:
    """Have glibc malloc keep large freed buffers instead of returning them to the OS and
    page-faulting them back on every step, which makes the per-step temporaries ~25% cheaper.
    Returns whether it could (not glibc: nothing changes)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    return all(
        (mallopt(m_mmap_threshold, 32 << 20), mallopt(m_trim_threshold, 2**31 - 1), mallopt(m_top_pad, 512 << 20))
    )


def _compiled(query, kv_cache, meta, kv_scales=None) -> bool:
    """Whether this call goes through the compiled kernel: where it could be built."""
    if native.unavailable_reason() is not None:
        return False
    if kv_scales is not None:
        if kv_cache.dtype not in native.QUANTIZED_SUFFIX or not kv_cache[0, 0].is_contiguous():
            return False
    elif not (kv_cache.dtype in native.ATTENTION_SUFFIX and kv_cache.is_contiguous()):
        return False
    if meta.max_context_len > meta.block_tables.shape[1] * kv_cache.shape[2]:
        raise ValueError("attention: a context is longer than its block table covers")
    return True


def compute_dtype(query: torch.Tensor, kv_cache: torch.Tensor, kv_scales) -> torch.dtype:
    """The dtype attention rounds in: the cache's, or for an 8-bit cache the query's."""
    return query.dtype if kv_scales is not None else kv_cache.dtype


def _scale_pair(kv_scales) -> tuple:
    """The compiled kernel's k_scales, v_scales arguments."""
    return (None, None) if kv_scales is None else (kv_scales[0], kv_scales[1])


def outside_window(k_pos: torch.Tensor, q_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[len(q_pos), len(k_pos)]: True where a query may not attend a key (in the future, or,
    with a window, more than window - 1 positions back)."""
    hidden = k_pos[None, :] > q_pos[:, None]
    if window:
        hidden |= k_pos[None, :] <= q_pos[:, None] - window
    return hidden


class CpuAttentionOps(AttentionOps):
    name = "cpu"
    supports_sliding_window = True
    supports_soft_cap = True
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")
    # each row's reductions run in an order fixed by its own length alone (the kernels split
    # work across rows, never within one; experts run on the dense kernels); the conformance
    # suite's invariance rows check it
    batch_invariant = True
    # its step replay adds each row's adapter product (backends/lora.py asks; other backends'
    # replays would be captured without them, so their LoRA steps run eagerly)
    replays_lora = True
    lora_b_transposed = True  # the compiled expand reads a rank's outputs in a row

    def prepare_process(self) -> None:
        keep_freed_memory()

    def batch_invariant_for(self, quantized: bool) -> bool:
        # a quantized layer's small-batch kernel sums in another order than its large-batch one
        return self.batch_invariant and (not quantized or self.batch_invariant_mode)

    def quantized_linear(self, layer):
        return cpu_quantized_linear(layer, one_kernel=self.batch_invariant_mode)

    def prepare_model(self, model) -> None:
        for module in model.modules():
            if isinstance(module, ExpertsMLP):  # experts onto the same kernels as dense layers
                module.as_linear_layers()
        if native.unavailable_reason() is not None:
            pack_linear_layers(model)
        elif model.config.dtype == torch.float32:
            if panel_float32_linear():
                use_panel_linear(model)
            else:
                pack_linear_layers(model)
            use_fused_kernels(model)
        else:
            compute_in_float32(model)

    def capture_graphs(self, model, kv_caches, block_size, max_batch, max_model_len):
        # the replay calls this class's kernels itself: a subclass with its own decode ops
        # (a port built on this backend, a planted bug) keeps them, in eager steps
        if any(getattr(type(self), op) is not getattr(CpuAttentionOps, op) for op in REPLAYED_OPS):
            return None
        return capture_step_replay(model, kv_caches, block_size, max_batch, max_model_len)

    def argmax(self, scores):
        if (
            scores.dtype == torch.float32
            and scores.dim() == 2
            and scores.numel()
            and native.unavailable_reason() is None
        ):
            return native.argmax_rows(scores)
        return super().argmax(scores)

    def add_lora(self, out, x, lora_a, lora_b, slots, scales):
        # per row (BGMV) where rows are few, as in decode steps; a long prefill's rows share an
        # adapter, and torch's GEMMs per adapter (the default) read each one once
        compiled = native.unavailable_reason() is None
        if compiled and x.shape[0] <= LORA_ROWS_PER_ROW_KERNEL and out.dtype == x.dtype == torch.float32:
            return native.add_lora(out, x, lora_a, lora_b, slots, scales)
        return super().add_lora(out, x, lora_a, lora_b, slots, scales)

    def apply_token_bitmask(self, logits, bitmask):
        compiled = native.unavailable_reason() is None
        if compiled and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1:
            return native.apply_token_bitmask(logits, bitmask)
        return super().apply_token_bitmask(logits, bitmask)

    def write_kv(self, key, value, kv_cache, slot_mapping, *, kv_scales=None):
        if kv_scales is not None:
            if native.unavailable_reason() is None:
                native.write_kv_quantized(key, value, kv_cache, kv_scales, slot_mapping)
            else:
                write_quantized(key, value, kv_cache, kv_scales, slot_mapping)
            return
        key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
        if native.unavailable_reason() is None and native.fits_write_kv(key, value, kv_cache):
            # index_copy_ takes several times as long for the few hundred rows of a decode step
            native.write_kv(key, value, kv_cache, slot_mapping)
            return
        num_kv_heads, head_size = key.shape[1], key.shape[2]
        kv_cache[0].view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, key)
        kv_cache[1].view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, value)

    def decode_attention(
        self, query, kv_cache, meta: DecodeMetadata, scale, *, window=None, soft_cap=None, kv_scales=None
    ):
        """The torch path sorts requests by context length and attends in a few groups, so
        that short contexts are not padded to the longest one in the batch."""
        if _compiled(query, kv_cache, meta, kv_scales):
            rows = torch.arange(query.shape[0], dtype=torch.int32)
            return native.paged_attention(
                query,
                kv_cache[0],
                kv_cache[1],
                meta.block_tables,
                rows,
                meta.context_lens,
                scale,
                bfloat16_dot_products(),
                window,
                soft_cap,
                *_scale_pair(kv_scales),
            )
        num_seqs = query.shape[0]
        ctx = meta.context_lens
        limits = (scale, window, soft_cap, kv_scales)
        if num_seqs <= DECODE_GROUP_MIN:
            return self._decode_group(query, kv_cache, meta.block_tables, ctx, meta.max_context_len, *limits)
        order = torch.argsort(ctx)
        out = torch.empty_like(query)
        for rows in order.tensor_split(min(DECODE_GROUPS, num_seqs // DECODE_GROUP_MIN)):
            group_ctx = ctx.index_select(0, rows)
            out[rows] = self._decode_group(
                query.index_select(0, rows),
                kv_cache,
                meta.block_tables.index_select(0, rows),
                group_ctx,
                int(group_ctx.max()),
                *limits,
            )
        return out

    def _decode_group(
        self, query, kv_cache, block_tables, context_lens, max_context_len, scale, window, soft_cap, kv_scales
    ):
        num_seqs, num_heads, head_size = query.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        group = num_heads // num_kv_heads
        max_blocks = cdiv(max_context_len, block_size)
        blocks = block_tables[:, :max_blocks].reshape(-1).long()
        dtype = compute_dtype(query, kv_cache, kv_scales)
        q = query.view(num_seqs, num_kv_heads, group, head_size).to(dtype).float()
        positions = torch.arange(max_blocks * block_size, device=query.device)
        hidden = outside_window(positions, context_lens - 1, window)[:, None, :]  # [D, 1, S]
        keys = gather_heads(kv_cache, 0, blocks, num_seqs, kv_scales)  # [KVH, D, S, Dh]
        values = gather_heads(kv_cache, 1, blocks, num_seqs, kv_scales)
        out = attend(q.transpose(0, 1), keys, values, hidden, scale, dtype, soft_cap)  # [KVH, D, G, Dh]
        return out.transpose(0, 1).reshape(num_seqs, num_heads, head_size).to(query.dtype)

    def prefill_attention(
        self, query, kv_cache, meta: PrefillMetadata, scale, *, window=None, soft_cap=None, kv_scales=None
    ):
        if _compiled(query, kv_cache, meta, kv_scales):
            # one row per new token: its request's table, and the context up to its own position
            request, position = prefill_token_rows(meta, query.shape[0], query.device)
            return native.paged_attention(
                query,
                kv_cache[0],
                kv_cache[1],
                meta.block_tables,
                request,
                position + 1,
                scale,
                bfloat16_dot_products(),
                window,
                soft_cap,
                *_scale_pair(kv_scales),
            )
        _, num_heads, head_size = query.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        group = num_heads // num_kv_heads
        dtype = compute_dtype(query, kv_cache, kv_scales)
        out = torch.empty_like(query)
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens, meta.context_lens_list)):
            blocks = meta.block_tables[i, : cdiv(ctx_len, block_size)].long()
            # [KVH, G * q_len, Dh]: the G query heads that share a KV head, stacked
            q = query[start : start + q_len].to(dtype).float()
            q = q.view(q_len, num_kv_heads, group, head_size)
            q = q.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_size)
            # query j sits at position ctx_len - q_len + j and sees keys up to that position
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
            k_pos = torch.arange(ctx_len, device=query.device)
            hidden = outside_window(k_pos, q_pos, window).repeat(group, 1)
            keys = gather_heads(kv_cache, 0, blocks, 1, kv_scales)[:, 0, :ctx_len]  # [KVH, ctx, Dh]
            values = gather_heads(kv_cache, 1, blocks, 1, kv_scales)[:, 0, :ctx_len]
            o = attend(q, keys, values, hidden, scale, dtype, soft_cap)
            o = o.view(num_kv_heads, group, q_len, head_size).permute(2, 0, 1, 3)
            out[start : start + q_len] = o.reshape(q_len, num_heads, head_size).to(query.dtype)
            start += q_len
        return out
