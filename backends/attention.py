"""The operations a backend implements, and the metadata a step hands them.

A step's tokens are one flattened batch without padding, ordered decodes first (requests
computing one token), then prefills (a whole prompt, a chunk of one, or several tokens after a
prefix-cache hit). Each layer writes the step's new K/V into the slots the core chose, then
attends; so every token of the step — including another request's, when a prefix-cache hit
shares blocks computed in this same step — is in the cache before attention reads it.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_size] (0 = K, 1 = V).
Slot s is block s // block_size, offset s % block_size. An 8-bit cache (contract v5) holds codes
of its format, with `kv_scales` [2, num_blocks, block_size, num_kv_heads] float32 beside them
(value = code * scale); kv_cache.py has the layout and the reference quantization.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from .platform import Platform


@dataclass
class DecodeMetadata:
    block_tables: torch.Tensor  # [D, max_blocks] int32, padded with 0 (the null block)
    context_lens: torch.Tensor  # [D] int32: tokens to attend to, the new one included
    max_context_len: int


@dataclass
class PrefillMetadata:
    block_tables: torch.Tensor  # [P, max_blocks] int32
    query_start_loc: torch.Tensor  # [P + 1] int32, offsets into the prefill part of the batch
    context_lens: torch.Tensor  # [P] int32: cached prefix + new tokens
    query_lens: list[int]  # the same, as Python ints, for host-side loops
    context_lens_list: list[int]
    max_query_len: int
    max_context_len: int


def prefill_token_rows(meta: PrefillMetadata, num_tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the prefill part's num_tokens query tokens: the index of its request (a row
    of meta.block_tables) and its position in that request's sequence, int64; it attends to
    positions 0..position. For kernels that handle one query token per row."""
    q_lens = torch.tensor(meta.query_lens, dtype=torch.int64, device=device)
    request = torch.repeat_interleave(torch.arange(len(meta.query_lens), device=device), q_lens)
    starts = meta.query_start_loc.long()[request]
    prefix = (meta.context_lens.long() - q_lens)[request]
    return request, prefix + torch.arange(num_tokens, device=device) - starts


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    num_decode_tokens: int
    num_prefill_tokens: int
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None


# the optional attention features a backend declares (supports_<feature>) -> the keyword its
# attention kernels take for it
ATTENTION_FEATURES = {"sliding_window": "window", "soft_cap": "soft_cap"}


def list_sizes(sizes: tuple[int, ...]) -> str:
    """'64, 128' — or '8, 16, ..., 256' for a long evenly spaced run."""
    steps = {b - a for a, b in itertools.pairwise(sizes)}
    if len(sizes) > 4 and len(steps) == 1:
        return f"{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}"
    return ", ".join(map(str, sizes))


class AttentionOps(Platform):
    """One backend: its kernels here, its device face inherited from Platform (host-memory
    defaults). Every member has a working default but the three kernels, so a port overrides
    only what differs. Every op works on one layer's cache unless it says otherwise. See
    docs/porting.md."""

    name = "abstract"
    # what the ops accept: the conformance suite tests these (and prints them), and the worker
    # refuses a model or configuration outside them at start-up. None: any block size the
    # engine accepts (powers of two to 128), any head size, any context length.
    supported_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    supported_block_sizes: tuple[int, ...] | None = None
    supported_head_sizes: tuple[int, ...] | None = None
    max_context_len: int | None = None
    # optional attention features (contract v4): the attention kernels take `window` (sliding-
    # window attention: a query sees only the last `window` positions, its own included) and
    # `soft_cap` (scores become soft_cap * tanh(score / soft_cap) before the softmax, Gemma 2)
    # as keyword arguments. A model whose layers need one is refused on a backend that does
    # not declare it; the conformance suite tests what is declared.
    supports_sliding_window: bool = False
    supports_soft_cap: bool = False
    # KV cache dtypes (contract v5): "auto" is the model's dtype; the 8-bit ones (fp8_e4m3,
    # fp8_e5m2, int8; kv_cache.py) reach write_kv and both attention kernels as a cache of codes
    # with the keyword `kv_scales`. Another is refused at start-up.
    supported_kv_cache_dtypes: tuple[str, ...] = ("auto",)
    # batch invariance (contract v6): True promises that a request's tokens and logprobs are the
    # same bits whatever runs beside it (batch size and order, prefill chunking, prefix hits,
    # forks, preemption, speculative verification, threads). The conformance suite's invariance
    # rows must then all pass bit for bit; without it they are shown as information.
    batch_invariant: bool = False
    # --batch-invariant (v6): set by the worker before it asks for quantized layers and prepares
    # the model. A backend whose fast paths are not invariant everywhere takes its invariant
    # ones where it is set, and says where the promise holds in batch_invariant_for.
    batch_invariant_mode: bool = False
    # add_lora's lora_b (v7): with True, the worker keeps each B as [S, r, out] storage and
    # passes its transposed view (shape [S, out, r], stride(1) == 1), for an expand that reads
    # a rank's outputs contiguously; with False, contiguous [S, out, r]
    lora_b_transposed: bool = False

    def batch_invariant_for(self, quantized: bool) -> bool:
        """Whether `batch_invariant` holds for a model with quantized layers (`quantized`) or
        without, under batch_invariant_mode; the engine reports this answer."""
        return self.batch_invariant

    def unsupported_kv_cache_dtype(self, kv_cache_dtype: str, head_size: int) -> str | None:
        """Why these ops cannot hold a cache of `kv_cache_dtype`, or None. Like the attention
        features, an 8-bit dtype counts only where the three kernels take `kv_scales`."""
        if kv_cache_dtype == "auto":
            return None
        kernels = (self.write_kv, self.decode_attention, self.prefill_attention)
        takes_scales = all("kv_scales" in inspect.signature(k).parameters for k in kernels)
        if kv_cache_dtype not in self.supported_kv_cache_dtypes or not takes_scales:
            declared = ", ".join(self.supported_kv_cache_dtypes if takes_scales else ("auto",))
            return f"kv_cache_dtype {kv_cache_dtype} (supported: {declared})"
        if head_size % 4:
            return f"kv_cache_dtype {kv_cache_dtype} at head size {head_size} (8-bit caches need a multiple of 4)"
        return None

    def unsupported_features(self, needs: set[str]) -> str | None:
        """Which of the attention features a model `needs` ("sliding_window", "soft_cap")
        these ops do not declare, or None. A declaration counts only where the kernels take
        the keyword (a subclass that overrides a kernel without it does not inherit it)."""
        missing = [
            f"{feature.replace('_', '-')} attention (AttentionOps.supports_{feature})"
            for feature in ATTENTION_FEATURES
            if feature in needs and not self.supports(feature)
        ]
        return " and ".join(missing) or None

    def supports(self, feature: str) -> bool:
        """Whether these ops declare an attention feature (ATTENTION_FEATURES) and both kernels
        take its keyword."""
        if not getattr(self, f"supports_{feature}"):
            return False
        keyword = ATTENTION_FEATURES[feature]
        kernels = (self.decode_attention, self.prefill_attention)
        return all(keyword in inspect.signature(k).parameters for k in kernels)

    def unsupported(self, dtype: torch.dtype, head_size: int, block_size: int, max_model_len: int | None) -> str | None:
        """What of a configuration these ops do not declare support for, or None."""

        def name(d: torch.dtype) -> str:
            return str(d).removeprefix("torch.")

        if dtype not in self.supported_dtypes:
            return f"dtype {name(dtype)} (supported: {', '.join(map(name, self.supported_dtypes))})"
        if self.supported_head_sizes is not None and head_size not in self.supported_head_sizes:
            return f"head size {head_size} (supported: {list_sizes(self.supported_head_sizes)})"
        if self.supported_block_sizes is not None and block_size not in self.supported_block_sizes:
            return f"block_size {block_size} (supported: {list_sizes(self.supported_block_sizes)})"
        if self.max_context_len is not None and max_model_len is not None and max_model_len > self.max_context_len:
            return f"max_model_len {max_model_len} (contexts up to {self.max_context_len})"
        return None

    def prepare_model(self, model) -> None:
        """A chance to adapt the loaded model to this backend (e.g. pack weights)."""

    def quantized_linear(self, layer: nn.Module) -> nn.Module:
        """This backend's layer for a quantized projection (a models.quantized.QuantizedLinear,
        whose weight format is documented there), or the layer itself, whose forward
        dequantizes the whole weight on every call: correct anywhere, and slow. Called for
        each quantized projection before prepare_model."""
        return layer

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Structured outputs: in place, -inf for every token a row's grammar does not allow.
        logits [rows, vocab] (float32); bitmask [rows, ceil(vocab / 32)] int32 on the same
        device, bit t % 32 of word t // 32 set when token t is allowed. A backend may fuse this
        into its sampler; the default is torch's."""
        apply_token_bitmask(logits, bitmask)

    def argmax(self, scores: torch.Tensor) -> torch.Tensor:
        """Each row's index of its largest value, as torch.argmax(dim=-1) answers (greedy
        decoding over the logits [rows, vocab]; a backend may have a faster kernel)."""
        return scores.argmax(dim=-1)

    def add_lora(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        slots: torch.Tensor,
        scales: torch.Tensor,
    ) -> None:
        """Multi-LoRA (contract v7), in place: out[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T *
        scales[s] for every row t whose adapter slot s = slots[t] is >= 0 (-1: the base model
        alone). x [T, in] and out [T, out] in the model's dtype; lora_a [S, r, in] and lora_b
        [S, out, r] (PEFT's lora_A and lora_B weights, each adapter's rank zero-padded to r; B a
        transposed view where the backend declares lora_b_transposed), in the model's dtype;
        float32 scales [S]; int32 slots [T]; all on the device. One step mixes rows of several
        adapters and of none. The default shrinks and expands each slot's rows together
        (Punica's SGMV) with torch, in float32."""
        add_lora(out, x, lora_a, lora_b, slots, scales)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """key/value: [T, KVH, D]. Stores token t at slot slot_mapping[t]. With kv_scales (an
        8-bit cache; supported_kv_cache_dtypes): each (token, head) row quantized as
        kv_cache.quantize does, its scale into kv_scales."""
        raise NotImplementedError

    def decode_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: DecodeMetadata,
        scale: float,
        *,
        window: int | None = None,
        soft_cap: float | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query: [D, H, Dh], one token per request; returns [D, H, Dh]. window / soft_cap:
        see supports_sliding_window / supports_soft_cap; passed only when a layer has them.
        kv_scales: the cache holds 8-bit codes (write_kv); K/V are code * scale, and the
        result has the query's dtype."""
        raise NotImplementedError

    def prefill_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: PrefillMetadata,
        scale: float,
        *,
        window: int | None = None,
        soft_cap: float | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query: [Tp, H, Dh]; query i of request r sits at position context_len - query_len + i
        and attends causally to every cached position up to its own (with a window, only to
        the last `window` of them). Returns [Tp, H, Dh]."""
        raise NotImplementedError

    def copy_blocks(self, kv_caches: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write across all layers: kv_caches [L, 2, N, ...] (an 8-bit pool: [L, 2, N,
        block bytes], its scales inside each block); block src -> dst."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=kv_caches.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=kv_caches.device)
        kv_caches[:, :, dst] = kv_caches[:, :, src]

    def swap_blocks(self, src_caches: torch.Tensor, dst_caches: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """Move blocks between the device pool and the host swap space (either direction)."""
        if not pairs:
            return
        if src_caches.device != dst_caches.device:
            copy_block_runs(src_caches, dst_caches, pairs)
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=src_caches.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=dst_caches.device)
        dst_caches[:, :, dst] = src_caches[:, :, src]


def add_lora(
    out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor, scales
) -> None:
    """The reference of AttentionOps.add_lora."""
    for slot in slots.unique().tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        shrunk = x[rows].float() @ lora_a[slot].float().T
        delta = (shrunk @ lora_b[slot].float().T) * scales[slot].float()
        out[rows] = (out[rows].float() + delta).to(out.dtype)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The reference of AttentionOps.apply_token_bitmask."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))


def block_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst, count) runs of blocks consecutive on both sides, in the pairs' order."""
    runs: list[tuple[int, int, int]] = []
    for s, d in pairs:
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_block_runs(src_caches: torch.Tensor, dst_caches: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Blocks between a device pool and host memory, [L, 2, N, ...] on both sides: each run of
    consecutive blocks of one layer's K or V is one contiguous copy straight into its slots —
    asynchronous when the host side is pinned — where gathering the blocks first would land in
    a fresh pageable tensor and copy synchronously. Stream order keeps later kernels and copies
    behind these; the step's sampled tokens, read back at its end, wait for them."""
    for s, d, n in block_runs(pairs):
        for layer in range(src_caches.shape[0]):
            for kv in (0, 1):
                dst_caches[layer, kv, d : d + n].copy_(src_caches[layer, kv, s : s + n], non_blocking=True)


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """`t` itself if its last dimension is dense, else a contiguous copy (for kernels that index
    rows by stride but read each row as one run)."""
    return t if t.stride(-1) == 1 else t.contiguous()
