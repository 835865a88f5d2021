"""Quantized linear layers: one weight format that every backend reads (QuantizedWeight), the
layer that holds it (QuantizedLinear, whose own forward dequantizes: the reference any
backend's kernel is checked against), and the load-time quantizers. A backend swaps each
QuantizedLinear for its own kernel in `AttentionOps.quantized_linear`.

The format: codes [N, K] one per weight in input-channel order (int8: -127..127; int4 and nf4:
0..15), scales [N, G] and, for int4, zero points [N, G] in code units, where G = K / group_size;
GPTQ's act-order checkpoints add g_idx [K], the group of each input channel (otherwise the
group of channel k is k // group_size). Weight = (code - zero) * scale, or for nf4
NF4_CODEBOOK[code] * scale. Slicing rows or whole groups of columns (tensor parallelism) keeps
it valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

INT4_GROUP = 128  # GPTQ's and AWQ's usual group
NF4_BLOCK = 64  # bitsandbytes' default blocksize
# the 16 values of 4-bit NormalFloat (Dettmers et al., QLoRA, 2023), as bitsandbytes defines them
NF4_CODEBOOK = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


@dataclass
class QuantizedWeight:
    kind: str  # int8, int4 or nf4
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    g_idx: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def groups(self) -> torch.Tensor:
        """The group of each input channel, [K]."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.codes.shape[1], device=self.codes.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32, codebook: torch.Tensor | None = None) -> torch.Tensor:
        """The weight [N, K] it stands for, computed in float32 and rounded once to `dtype`
        (nf4: `codebook` is NF4_CODEBOOK already on the codes' device, if the caller has it)."""
        groups = self.groups()
        scales = self.scales.float().index_select(1, groups)
        if self.kind == "nf4":
            book = codebook if codebook is not None else torch.tensor(NF4_CODEBOOK, device=self.codes.device)
            return (book[self.codes.long()] * scales).to(dtype)
        values = self.codes.float()
        if self.zeros is not None:
            values = values - self.zeros.float().index_select(1, groups)
        return (values * scales).to(dtype)

    def to(self, device) -> QuantizedWeight:
        def move(t):
            return None if t is None else t.to(device)

        return QuantizedWeight(
            self.kind, move(self.codes), move(self.scales), move(self.zeros), self.group_size, move(self.g_idx)
        )

    def rows(self, start: int, size: int) -> QuantizedWeight:
        """Output channels [start, start + size)."""

        def cut(t):
            return None if t is None else t[start : start + size]

        return QuantizedWeight(
            self.kind, cut(self.codes), cut(self.scales), cut(self.zeros), self.group_size, self.g_idx
        )

    def columns(self, start: int, size: int) -> QuantizedWeight:
        """Input channels [start, start + size): whole groups only."""
        g = self.group_size
        if self.g_idx is not None:
            raise ValueError("quantization: an act-order (desc_act) GPTQ weight cannot be split across ranks by input")
        if start % g or size % g:
            raise ValueError(
                f"quantization: input channels {start}..{start + size} do not fall on groups of {g}; "
                "this tensor_parallel_size cannot split this quantized model"
            )

        def cut(t):
            return None if t is None else t[:, start // g : (start + size) // g]

        return QuantizedWeight(
            self.kind, self.codes[:, start : start + size], cut(self.scales), cut(self.zeros), g, None
        )

    @staticmethod
    def stack(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Parts over the same input channels, one below the other (a fused projection)."""
        first = parts[0]
        for p in parts[1:]:
            if (p.kind, p.group_size, p.shape[1]) != (first.kind, first.group_size, first.shape[1]):
                raise ValueError("quantization: the parts of a fused projection are quantized differently")
            if (p.g_idx is None) != (first.g_idx is None) or (
                p.g_idx is not None and not torch.equal(p.g_idx, first.g_idx)
            ):
                raise ValueError("quantization: the parts of a fused projection have different act orders (g_idx)")

        def cat(name):
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else torch.cat(values)

        return QuantizedWeight(first.kind, cat("codes"), cat("scales"), cat("zeros"), first.group_size, first.g_idx)


def group_size_for(in_features: int, wanted: int) -> int:
    """`wanted` where it divides the input size, else the largest of 64 and 32 that does, else
    one group per row."""
    return next((g for g in (wanted, 64, 32) if g <= wanted and in_features % g == 0), in_features)


def quantize(weight: torch.Tensor, kind: str, row_absmax: torch.Tensor | None = None) -> QuantizedWeight:
    """Round-to-nearest quantization of a [N, K] weight. int8: `row_absmax` [N], when given,
    sets the scales (a row-parallel slice takes its whole row's, so that ranks quantize as one)."""
    w = weight.detach().float()
    n, k = w.shape
    if kind == "int8":
        absmax = w.abs().amax(1) if row_absmax is None else row_absmax
        scale = absmax[:, None].clamp_min(1e-12) / 127
        codes = (w / scale).round().clamp(-127, 127).to(torch.int8)
        return QuantizedWeight("int8", codes, scale, None, k)
    if kind == "int4":
        g = group_size_for(k, INT4_GROUP)
        grouped = w.view(n, k // g, g)
        lo = grouped.amin(-1).clamp(max=0)  # zero stays exactly representable, as GPTQ's quantizer keeps it
        hi = grouped.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        zero = (-lo / scale).round().clamp(0, 15)
        codes = ((grouped / scale[..., None]).round() + zero[..., None]).clamp(0, 15)
        return QuantizedWeight("int4", codes.view(n, k).to(torch.uint8), scale, zero, g)
    if kind == "nf4":
        g = group_size_for(k, NF4_BLOCK)
        grouped = w.view(n, k // g, g)
        scale = grouped.abs().amax(-1).clamp_min(1e-12)
        book = torch.tensor(NF4_CODEBOOK)
        midpoints = (book[1:] + book[:-1]) / 2
        codes = torch.bucketize(grouped / scale[..., None], midpoints)
        return QuantizedWeight("nf4", codes.view(n, k).to(torch.uint8), scale, None, g)
    raise ValueError(f"quantization: unknown mode {kind!r}")


class QuantizedLinear(nn.Module):
    """A linear layer over a QuantizedWeight. Its forward dequantizes the whole weight each call:
    correct on any device, and the reference for the kernels backends swap in."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None):
        super().__init__()
        self.kind, self.group_size = weight.kind, weight.group_size
        self.out_features, self.in_features = weight.shape
        self.register_buffer("codes", weight.codes)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("zeros", weight.zeros)
        self.register_buffer("g_idx", weight.g_idx)
        # a buffer, so that no forward copies it to the device (not allowed in a CUDA graph capture)
        codebook = torch.tensor(NF4_CODEBOOK, device=weight.codes.device) if weight.kind == "nf4" else None
        self.register_buffer("codebook", codebook)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.kind, self.codes, self.scales, self.zeros, self.group_size, self.g_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.dequantize(x.dtype, self.codebook), self.bias)

    def extra_repr(self) -> str:
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}, group={self.group_size}"


# the projections that are quantized: every linear layer of the decoder layers; the embedding
# and the LM head keep the model dtype
QUANTIZED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_model(model: nn.Module, kind: str, row_parallel: frozenset[str] = frozenset()) -> int:
    """Replace the decoder layers' projections by QuantizedLinear layers in place, one at a time
    (the full-precision weight of each is freed as it goes). Returns how many. Under tensor
    parallelism every rank quantizes its own slice; int8's per-row scales of a `row_parallel`
    projection's slice (split by input channel) come from the whole row (an all-reduce of the
    ranks' maxima), and int4/nf4 groups are the same as one rank's wherever a rank's input slice
    is a multiple of the group."""
    count = 0
    for layer in model.layers:
        if layer.experts is not None:
            count += layer.experts.quantize(kind, model.tp)
        for name in QUANTIZED_PROJECTIONS:
            linear = getattr(layer, name)
            if linear is None:  # an experts layer's MLP
                continue
            absmax = None
            if kind == "int8" and name in row_parallel and model.tp.size > 1:
                absmax = model.tp.all_reduce(linear.weight.detach().float().abs().amax(1), op="max")
            bias = None if linear.bias is None else linear.bias.detach()
            setattr(layer, name, QuantizedLinear(quantize(linear.weight, kind, absmax), bias))
            count += 1
    return count


def use_kernels(model: nn.Module, kernel) -> None:
    """Replace each QuantizedLinear of the model by `kernel(layer)` (a backend's own layer)."""
    for layer in model.layers:
        for name in QUANTIZED_PROJECTIONS:
            child = getattr(layer, name)
            if isinstance(child, QuantizedLinear):
                setattr(layer, name, kernel(child))
        experts = layer.experts
        if experts is not None and experts.gate_up is not None:
            for layers in (experts.gate_up, experts.down):
                for i, child in enumerate(layers):
                    layers[i] = kernel(child)
