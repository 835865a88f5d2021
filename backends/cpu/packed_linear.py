"""float32 linear layers through oneDNN with pre-packed weights.

torch's default float32 GEMM on this project's CPUs is slow for the skinny shapes of
decoding: a 32x256 by 256x32000 LM head takes ~8.4 ms through F.linear and ~2.9 ms with a
oneDNN-packed weight (benchmarks/bench_decode_step.py shows the effect end to end). The
packed op is private to torch, so it is used only after a check that it exists and agrees
with F.linear; otherwise the model keeps plain nn.Linear.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from .native import bfloat16_dot_products as native_dot_products
from .native import cpu_flags, unavailable_reason


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 32)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# oneDNN builds a primitive for each row count it has not seen (~0.4 ms on a Zen 4, more than
# the GEMM of a decode step), and its cache holds 1,024: a run whose batch shrinks by a request
# a step built one for every layer at every step. Up to 256 rows (decode steps, LM heads) the
# count is padded to a multiple of 8, at most 32 counts a layer; larger ones (prefill chunks)
# go as they are.
PADDED_ROWS_UP_TO, ROW_MULTIPLE = 256, 8


def padded_rows(rows: int) -> int:
    """The row count a GEMM of `rows` rows runs at (see ROW_MULTIPLE)."""
    return rows if rows > PADDED_ROWS_UP_TO else -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE


def linear_rows(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """packed_linear of 2-D `rows` cast to `dtype`, padded with zero rows to padded_rows and the
    padding's output cut off (a row's result does not depend on the others). `packed` may be a
    plain [N, K] weight too (the op takes one as fast when it sees it once: quantized layers
    decode theirs on every call)."""
    count, width = rows.shape
    padded = padded_rows(count)
    if padded == count:
        return packed_linear(rows.to(dtype).contiguous(), packed, bias)
    x = torch.zeros(padded, width, dtype=dtype)
    x[:count] = rows
    return packed_linear(x, packed, bias)[:count]


@functools.cache
def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN packs `dtype` weights on this CPU (bfloat16 needs AVX-512 or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w, b, x = (torch.randn(24, 16), torch.randn(24), torch.randn(5, 16))
        w, b, x = w.to(dtype), b.to(dtype), x.to(dtype)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        got = packed_linear(x, pack_weight(w), b).float()
        return torch.allclose(got, F.linear(x, w, b).float(), atol=tol, rtol=tol)
    except (RuntimeError, AttributeError):
        return False


BF16_MATMUL_ENV = "PAGEDLLM_CPU_BF16_MATMUL"


def bfloat16_arithmetic_allowed() -> bool:
    """False under PAGEDLLM_CPU_BF16_MATMUL=0: bfloat16 models then compute in float32 on their
    bfloat16 weights and KV blocks, in linear layers and in attention alike."""
    return os.environ.get(BF16_MATMUL_ENV, "1") != "0"


@functools.cache
def native_bfloat16_matmul() -> bool:
    """Whether bfloat16 linear layers go to oneDNN's bfloat16 GEMM: where this CPU multiplies
    bfloat16 in hardware (AVX-512 BF16 or AMX) and oneDNN packs bfloat16 weights for it, unless
    PAGEDLLM_CPU_BF16_MATMUL=0. There it runs ~2x oneDNN's float32 GEMM and ~3.5x the widening
    kernel of panel_linear.cpp (docs/bench/README.md), at the price of rounding each layer's
    input and output to bfloat16, as transformers does; elsewhere oneDNN emulates bfloat16
    arithmetic and the widening kernel (float32 arithmetic on bfloat16 weights) wins."""
    if not bfloat16_arithmetic_allowed():
        return False
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"}) and packing_available(torch.bfloat16)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_weight(linear.weight)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = linear_rows(x.reshape(-1, self.in_features), self.packed, self.bias, x.dtype)
        return rows.view(*x.shape[:-1], self.out_features)


PACKED_DTYPES = (torch.float32, torch.bfloat16)


def plain_linears(model: nn.Module, dtypes) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) of every plain nn.Linear in `model` with weights of `dtypes`
    (quantized layers are other classes)."""
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype in dtypes
    ]


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every float32/bfloat16 CPU nn.Linear in `model` by a PackedLinear; returns how many."""
    targets = [
        (parent, name, child)
        for parent, name, child in plain_linears(model, PACKED_DTYPES)
        if child.weight.is_cpu and packing_available(child.weight.dtype)
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)


@functools.cache
def bfloat16_dot_products() -> bool:
    """Whether the kernel attends over bfloat16 blocks with AVX-512 BF16's dot products, the
    query and the probabilities rounded to bfloat16 first as transformers' bfloat16 attention
    rounds them (1.4-1.6x faster on K/V in cache, docs/bench/README.md): where it was built for
    them, unless PAGEDLLM_CPU_BF16_MATMUL=0, which keeps float32 arithmetic throughout."""
    if not bfloat16_arithmetic_allowed() or unavailable_reason() is not None:
        return False
    return native_dot_products()
