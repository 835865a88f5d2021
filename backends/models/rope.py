"""Rotary position embeddings (Hugging Face's rotate-half convention)."""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def inverse_frequencies(head_dim: int, rope: dict) -> torch.Tensor:
    rope_type = rope["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    base = rope["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / rope["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, rope)
    elif rope_type == "longrope":
        factors = rope["long_factor"] if rope.get("use_long") else rope["short_factor"]
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return inv_freq


def longrope_scale(rope: dict) -> float:
    """LongRoPE's attention factor, which scales cos and sin (Phi-3)."""
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or rope["max_position_embeddings"] / original
    if rope.get("attention_factor") is not None:
        return rope["attention_factor"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_scaling(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the band
    between low_freq_factor and high_freq_factor interpolated."""
    factor = rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    def __init__(self, head_dim: int, rope: dict, max_positions: int):
        positions = torch.arange(max_positions, dtype=torch.float32)
        scale = longrope_scale(rope) if rope["rope_type"] == "longrope" else 1.0
        freqs = torch.outer(positions, inverse_frequencies(head_dim, rope))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos() * scale  # [max_positions, head_dim], float32 like transformers
        self.sin = emb.sin() * scale

    def to(self, device) -> RotaryEmbedding:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D] each, cast to the model dtype as transformers does: once per step, shared
        by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin from cos_sin()."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
