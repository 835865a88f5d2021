"""float32 linear layers through oneDNN with pre-packed weights.

torch's default float32 GEMM on this project's CPUs is slow for the skinny shapes of
decoding: a 32x256 by 256x32000 LM head takes ~8.4 ms through F.linear and ~2.9 ms with a
oneDNN-packed weight (benchmarks/bench_decode_step.py shows the effect end to end). The
packed op is private to torch, so it is used only after a check that it exists and agrees
with F.linear; otherwise the model keeps plain nn.Linear.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 32)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# the same op takes a plain [N, K] weight too, as fast for a weight it sees once (quantized
# layers decode theirs on every call) as for a packed one
plain_linear_pointwise = _packed_linear


@functools.cache
def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN packs `dtype` weights on this CPU (bfloat16 needs AVX-512 or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w, b, x = (torch.randn(24, 16), torch.randn(24), torch.randn(5, 16))
        w, b, x = w.to(dtype), b.to(dtype), x.to(dtype)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return torch.allclose(_packed_linear(x, _pack(w), b).float(), F.linear(x, w, b).float(), atol=tol, rtol=tol)
    except (RuntimeError, AttributeError):
        return False


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = _pack(linear.weight)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_linear(x.contiguous(), self.packed, self.bias)


PACKED_DTYPES = (torch.float32, torch.bfloat16)


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every float32/bfloat16 CPU nn.Linear in `model` by a PackedLinear; returns how many."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and child.weight.device.type == "cpu"
        and child.weight.dtype in PACKED_DTYPES
        and packing_available(child.weight.dtype)
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
