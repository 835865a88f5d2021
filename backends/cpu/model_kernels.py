"""Models onto the compiled kernels. float32: RMSNorm and silu-and-multiply fused; the linear
layers on the panel kernel (PanelLinear) where the CPU has AVX2 and FMA, else on oneDNN's
packed GEMM (packed_linear.py; panel_float32_linear says why). 16-bit:
weights and KV blocks stay in bfloat16 or float16 (their memory and their memory traffic),
the activations between the ops are float32. Linear
layers: on CPUs without 16-bit arithmetic torch's own 16-bit path widens and rounds at every op
(its bfloat16 GEMM is 5-10x slower than float32 from 16 rows on), so there each weight is
widened in registers where it is used (PanelLinear) and nothing is rounded back to 16 bits except
what the KV cache stores; where the CPU multiplies bfloat16 (AVX-512 BF16, AMX), bfloat16 layers
run oneDNN's bfloat16 GEMM instead (Bfloat16Linear), their inputs rounded to bfloat16 as
transformers rounds them.

The widening path differs from transformers' eager 16-bit computation by its missing roundings
(it is closer to the float64 answer); PAGEDLLM_CPU_KERNELS=0 keeps the transformers-identical
path.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.decoder import DecoderLayer, RMSNorm, silu_and_mul
from ..models.parallel import VocabParallelEmbedding
from . import native
from .packed_linear import PackedLinear, linear_rows, native_bfloat16_matmul, plain_linears

HALF_DTYPES = (torch.bfloat16, torch.float16)


class PanelLinear(nn.Module):
    """nn.Linear with its 16-bit or float32 weight packed for the panel kernel
    (native.pack_panel_weight: the same bytes, reordered once; a second copy only for an LM head
    tied to the embedding, which keeps its rows); float32 in, float32 out."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", native.pack_panel_weight(linear.weight))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        out = native.panel_linear(rows, self.packed, self.out_features, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.packed.dtype}"


class Bfloat16Linear(PackedLinear):
    """nn.Linear with its bfloat16 weight on oneDNN's packed bfloat16 GEMM, for CPUs that
    multiply bfloat16 in hardware (packed_linear.native_bfloat16_matmul): float32 in, rounded
    to bfloat16 for the product as transformers' bfloat16 layers are, float32 out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = linear_rows(x.reshape(-1, self.in_features), self.packed, self.bias, torch.bfloat16)
        return rows.float().view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN bfloat16"


class FusedRMSNorm(nn.Module):
    """RMSNorm as one compiled pass, the residual add included when there is one (the residual
    stream is updated in place: the model hands each one on and never reads the old one); the
    weight in float32 (a copy when the model's is 16-bit)."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight.detach().float(), norm.eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return native.rms_norm(x, self.weight, self.eps)
        return native.add_rms_norm(x, residual, self.weight, self.eps), residual


class Float32Embedding(nn.Module):
    """The 16-bit embedding, its rows handed on in float32."""

    def __init__(self, embedding: VocabParallelEmbedding):
        super().__init__()
        self.inner = embedding

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids).float()


def panel_float32_linear() -> bool:
    """Whether float32 linear layers run on the panel kernel rather than oneDNN's packed GEMM:
    wherever the kernels are built and the CPU has AVX2 with FMA, except on Intel's AVX-512
    cores. The panel kernel's tile is 256 bits wide. On Zen 3 (AVX2) it beat or matched oneDNN
    at every shape measured (benchmarks/bench_linear.py: 1.25-2.0x at one row, where oneDNN
    spends 30-70 us a call on any layer, 1.0-1.4x at 8-1,860 rows). On Zen 4, whose AVX-512 runs
    on 256-bit pipes, it still wins at 1-8 rows (1.0-1.8x) and loses 5-20% from 64 rows on, and
    whole runs were 1.3-1.5x those on oneDNN (docs/bench/README.md, 2026-12-05). Intel's server
    cores have two 512-bit FMA pipes: on an AMX Xeon oneDNN ran the demo's layers 1.6-2.1x the
    panel kernel's rate from 64 rows on (docs/bench, 2026-12-05, evening), so float32 goes to
    oneDNN there (its decode steps replayed through torch, as bfloat16 ones are)."""
    flags = native.cpu_flags()
    if native.unavailable_reason() is not None or not {"avx2", "fma"} <= flags:
        return False
    return not ("avx512f" in flags and native.cpu_vendor_family()[0] == "GenuineIntel")


def use_panel_linear(model: nn.Module) -> int:
    """Every float32 nn.Linear of `model` onto the panel kernel (PanelLinear); returns how many."""
    targets = plain_linears(model, (torch.float32,))
    for parent, name, child in targets:
        setattr(parent, name, PanelLinear(child))
    return len(targets)


def use_fused_kernels(model: nn.Module) -> None:
    """RMSNorm, the MLP's silu-and-multiply and the rotary embedding as one compiled pass each,
    instead of 5-7, 2 and 5 elementwise torch ops (a fifth of a float32 prefill step's time went
    to the first two; the rotation took 5% of a worker's time on the demo model)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, RMSNorm):
                setattr(parent, name, FusedRMSNorm(child))
        if isinstance(parent, DecoderLayer):
            parent.rotate = native.rotate
            if parent.act is silu_and_mul:  # other activations keep torch's
                parent.act = native.silu_and_mul


def compute_in_float32(model: nn.Module) -> int:
    """A 16-bit model's linear layers onto the 16-bit-weight kernel (bfloat16 ones onto oneDNN's
    bfloat16 GEMM where the CPU has bfloat16 arithmetic) and its activations into float32
    (embedding output, norms, MLP activation); returns how many layers were replaced.
    Layers that are not plain nn.Linear (quantized ones) take float32 inputs as they are."""
    targets = plain_linears(model, HALF_DTYPES)
    for parent, name, child in targets:
        on_onednn = child.weight.dtype == torch.bfloat16 and native_bfloat16_matmul()
        setattr(parent, name, Bfloat16Linear(child) if on_onednn else PanelLinear(child))
    model.embed_tokens = Float32Embedding(model.embed_tokens)
    use_fused_kernels(model)
    return len(targets)
