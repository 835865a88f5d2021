"""The cpu backend's quantized linear layer: the compiled kernels of csrc/quantized_linear.cpp.

Up to GEMV_MAX_ROWS rows of input (decode steps of small batches, where reading the weights is
the cost) the kernel decodes each weight row once and multiplies every input row by it; past
that, the whole weight is decoded to float32 and handed to oneDNN's GEMM (the decoding is then
a small share of the multiply). Computation is float32 whatever the model dtype: inputs in
16 bits are widened and the output rounded once, as a 16-bit GEMM accumulating in float32 does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models.quantized import NF4_CODEBOOK, QuantizedLinear
from . import native
from .packed_linear import linear_rows, packing_available

GEMV_MAX_ROWS = 16  # where decoding once and oneDNN's GEMM overtake, measured here (docs/bench/README.md)


def pack_nibbles(codes: torch.Tensor, group: int) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K/2] bytes: within each group, channel j in the low nibble of
    byte j and channel j + group/2 in its high nibble."""
    n, k = codes.shape
    halves = codes.view(n, k // group, 2, group // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def float32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's GEMM where it checks out (about twice torch's default here for a weight it has
    not seen before), at the padded row counts of the dense layers (a row's result then does
    not depend on how many share the call), else F.linear."""
    if packing_available(torch.float32):
        return linear_rows(x, weight, bias, torch.float32)
    return F.linear(x, weight, bias)


class CpuQuantizedLinear(nn.Module):
    def __init__(self, layer: QuantizedLinear, gemv_max_rows: int = GEMV_MAX_ROWS):
        super().__init__()
        self.gemv_max_rows = gemv_max_rows
        w = layer.weight
        self.kind, self.in_features, self.out_features = w.kind, layer.in_features, layer.out_features
        self.group = w.group_size
        self.perm = None
        codes = w.codes
        if w.g_idx is not None:
            # act order: sort the input channels by group, so each group is contiguous, and
            # sort each input row the same way
            self.perm = torch.argsort(w.g_idx.long(), stable=True)
            if not torch.equal(w.g_idx.long()[self.perm], torch.arange(self.in_features) // self.group):
                raise ValueError("quantization: g_idx does not put group_size channels in every group")
            codes = codes[:, self.perm]
        self.register_buffer("codes", codes.contiguous() if w.kind == "int8" else pack_nibbles(codes, self.group))
        self.register_buffer("scales", w.scales.float().contiguous())
        self.register_buffer("zeros", None if w.zeros is None else w.zeros.float().contiguous())
        self.register_buffer("lut", torch.tensor(NF4_CODEBOOK) if w.kind == "nf4" else None)
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.perm is not None:
            rows = rows.index_select(1, self.perm)
        rows = rows.float().contiguous()
        args = (self.kind, self.codes, self.scales, self.zeros, self.lut)
        if rows.shape[0] <= self.gemv_max_rows:
            out = native.quantized_gemv(rows, *args, self.bias, self.in_features, self.group)
        else:
            out = float32_linear(rows, native.dequantize(*args, self.in_features, self.group), self.bias)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}, group={self.group}"


def cpu_quantized_linear(layer: QuantizedLinear, one_kernel: bool = False) -> nn.Module:
    """The compiled layer where the kernels build and the shape fits them (groups of an even
    size), else the reference layer. one_kernel (--batch-invariant): every row count takes the
    decoded weight and oneDNN's GEMM, whose result for a row does not depend on the others."""
    if native.unavailable_reason() is not None or layer.group_size % 2:
        return layer
    return CpuQuantizedLinear(layer, gemv_max_rows=0 if one_kernel else GEMV_MAX_ROWS)
