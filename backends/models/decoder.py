"""The decoder-only transformer behind Llama, Mistral, Qwen2, Qwen3 and Gemma 2/3, over paged KV.

Projections are fused (q/k/v into one matrix, gate/up into another): fewer, larger GEMMs.
The loader splits Hugging Face's separate weights into them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionMetadata, AttentionOps
from ..kv_cache import split_layer_cache
from .config import ModelConfig
from .moe import ExpertsMLP
from .parallel import SINGLE, Shards, TensorParallel, VocabParallelEmbedding
from .rope import RotaryEmbedding, rotate


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The norm of x; given the residual stream, the norm of x + residual and that sum (the
        new residual stream), so a backend can do the add and the norm in one pass."""
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's GeGLU (transformers' gelu_pytorch_tanh)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


def paged_attention(q, kv_cache, meta: AttentionMetadata, ops: AttentionOps, scale: float, options: dict):
    """The step's attention: its decodes, then its prefills, through the backend's ops."""
    nd = meta.num_decode_tokens
    if meta.prefill is None:
        return ops.decode_attention(q, kv_cache, meta.decode, scale, **options)
    if meta.decode is None:
        return ops.prefill_attention(q, kv_cache, meta.prefill, scale, **options)
    return torch.cat(
        (
            ops.decode_attention(q[:nd], kv_cache, meta.decode, scale, **options),
            ops.prefill_attention(q[nd:], kv_cache, meta.prefill, scale, **options),
        )
    )


class DecoderLayer(nn.Module):
    """One layer as one rank holds it (see parallel.py): its own heads and its slice of the
    MLP; the row-parallel projections' partial sums are all-reduced."""

    def __init__(self, cfg: ModelConfig, shards: Shards, tp: TensorParallel, index: int = 0):
        super().__init__()
        self.tp = tp
        self.window = cfg.layer_windows[index] if cfg.layer_windows else None
        self.soft_cap = cfg.attn_soft_cap
        self.rope_index = 1 if cfg.layer_ropes and cfg.layer_ropes[index] else 0  # CausalLM.ropes
        # the attention ops' optional keywords, only those this layer uses (a port without
        # them runs models that need none)
        options = (("window", self.window), ("soft_cap", self.soft_cap))
        self.attn_options = {k: v for k, v in options if v}
        self.num_heads = shards.num_heads
        self.num_kv_heads = shards.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.attn_scale or cfg.head_dim**-0.5
        q_size = shards.num_heads * cfg.head_dim
        kv_size = shards.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.act = ACTIVATIONS[cfg.hidden_act]  # a backend may swap in fused kernels for these two (prepare_model)
        if cfg.moe_layers and cfg.moe_layers[index]:
            self.experts = ExpertsMLP(cfg, shards.expert_intermediate_size, self.act)
            self.gate_up_proj = self.down_proj = None
        else:
            self.experts = None
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * shards.intermediate_size, bias=cfg.mlp_bias)
            self.down_proj = nn.Linear(shards.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.rotate = rotate

    def attention(self, x, cos_sin, kv_cache, meta: AttentionMetadata, ops: AttentionOps, keep_rows=None):
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size, _ = self.split
        v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k sit side by side in the fused projection: one rotation for both
            qk = qkv[:, : q_size + kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = self.rotate(qk, *cos_sin).split((self.num_heads, self.num_kv_heads), dim=1)
        else:
            q = self.q_norm(qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, q_size : q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = self.rotate(q, *cos_sin), self.rotate(k, *cos_sin)
        cache, kv_options = split_layer_cache(kv_cache)  # an 8-bit cache comes with its scales
        ops.write_kv(k, v, cache, meta.slot_mapping, **kv_options)
        options = {**self.attn_options, **kv_options}
        out = paged_attention(q, cache, meta, ops, self.scale, options).reshape(num_tokens, -1)
        return self.tp.all_reduce(self.o_proj(out if keep_rows is None else out[keep_rows]))

    def forward(self, x, residual, cos_sin, kv_cache, meta, ops, keep_rows=None):
        """x: the previous layer's output, residual: the residual stream before it (None at the
        first layer, where x is the embedding). Returns this layer's output and the residual
        stream before it: the caller adds the two (the next layer's norm does, fused). With
        keep_rows, every token's K/V is still written, but the output and the residual stream
        are those rows' alone."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.attention(h, cos_sin, kv_cache, meta, ops, keep_rows)
        h, residual = self.post_attention_layernorm(h, residual if keep_rows is None else residual[keep_rows])
        return self.mlp(h), residual

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """The gated MLP, or the routed experts; partial sums all-reduced across ranks."""
        if self.experts is not None:
            return self.tp.all_reduce(self.experts(h))
        return self.tp.all_reduce(self.down_proj(self.act(self.gate_up_proj(h))))


class SandwichDecoderLayer(DecoderLayer):
    """Gemma's layer: the attention's and the MLP's outputs are normed before each joins the
    residual stream, the MLP's input by a norm of its own."""

    def __init__(self, cfg: ModelConfig, shards: Shards, tp: TensorParallel, index: int = 0):
        super().__init__(cfg, shards, tp, index)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos_sin, kv_cache, meta, ops, keep_rows=None):
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.attention(h, cos_sin, kv_cache, meta, ops, keep_rows)
        residual = (residual if keep_rows is None else residual[keep_rows]) + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(residual))
        return self.post_feedforward_layernorm(h), residual


class CausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int | None = None,
        tp: TensorParallel = SINGLE,
        rope: RotaryEmbedding | None = None,
        local_rope: RotaryEmbedding | None = None,
    ):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.shards = shards = Shards.of(cfg, tp)
        self.embed_tokens = VocabParallelEmbedding(shards.vocab_rows, cfg.hidden_size, shards.vocab_start, tp)
        layer = SandwichDecoderLayer if cfg.sandwich_norms else DecoderLayer
        self.layers = nn.ModuleList(layer(cfg, shards, tp, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, shards.vocab_rows, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        positions = max_positions or cfg.max_position_embeddings
        self.rope = rope or RotaryEmbedding(cfg.head_dim, cfg.rope, positions)
        # the layers' other rotary parameters (Gemma 3's local layers): one set, at index 1
        if cfg.local_rope is not None and local_rope is None:
            local_rope = RotaryEmbedding(cfg.head_dim, cfg.local_rope, positions)
        self.local_rope = local_rope

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
        ops: AttentionOps,
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; kv_caches: [L, 2, N, bs, KVH, D], or a
        kv_cache.QuantizedKV per layer for an 8-bit cache.
        keep_rows: only those rows' hidden states, in that order. The last layer then runs its
        output projection and MLP on those rows alone (the rows a step takes logits from: one
        per request, where a prefill has hundreds): the other rows' K/V, all that later steps
        read of them, are written by then."""
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale:  # in the embedding's dtype, as transformers scales it
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        ropes = [self.rope.cos_sin(positions, x.dtype)]
        if self.local_rope is not None:
            ropes.append(self.local_rope.cos_sin(positions, x.dtype))
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            cos_sin = ropes[layer.rope_index]
            x, residual = layer(x, residual, cos_sin, kv_caches[i], meta, ops, keep_rows if i == last else None)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits over the vocabulary (its padding cut off) on rank 0; None on the others."""
        logits = self.tp.gather_to_first(self.lm_head(hidden).float())
        if logits is None:
            return None
        if logits.shape[-1] != self.config.vocab_size:
            logits = logits[..., : self.config.vocab_size]
        return soft_cap(logits, self.config.final_soft_cap) if self.config.final_soft_cap else logits
