"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k experts, and
each expert runs the rows routed to it as one GEMM pair — tokens grouped by expert with one
sort, gathered, computed, weighted and scattered back — instead of a loop over tokens.

Under tensor parallelism every rank holds every expert's slice of the intermediate dimension
(gate/up by rows, down by columns), as vLLM's default does: each rank's work is the same
whatever the routing (experts split whole across ranks would leave a rank idle whenever the
router favours another's), and the partial sums join in the layer's usual all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .quantized import QuantizedLinear, quantize


class ExpertsMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int, act):
        super().__init__()
        num, hidden = cfg.num_experts, cfg.hidden_size
        self.top_k, self.renormalize, self.act = cfg.num_experts_per_tok, cfg.renormalize_top_k, act
        self.router = nn.Linear(hidden, num, bias=False)
        self.w13 = nn.Parameter(torch.empty(num, 2 * intermediate_size, hidden))  # gate and up, fused
        self.w2 = nn.Parameter(torch.empty(num, hidden, intermediate_size))
        # each expert's two projections, in place of w13 and w2: quantized (--quantization), or
        # as linear layers for a backend's kernels (as_linear_layers)
        self.gate_up: nn.ModuleList | None = None
        self.down: nn.ModuleList | None = None

    def quantize(self, kind: str, tp) -> int:
        """Each expert's gate/up and down projections as QuantizedLinear layers (a backend may
        swap its kernel in for each), the full-precision stacks freed. Under tensor parallelism
        a down projection's slice is split by input channel: its int8 row scales come from the
        whole row, as the dense down projection's do. Returns how many layers."""
        experts = self.w13.shape[0]
        gate_up = (QuantizedLinear(quantize(self.w13[e].detach(), kind), None) for e in range(experts))
        self.gate_up = nn.ModuleList(gate_up)
        downs = []
        for e in range(experts):
            w = self.w2[e].detach()
            absmax = tp.all_reduce(w.float().abs().amax(1), op="max") if kind == "int8" and tp.size > 1 else None
            downs.append(QuantizedLinear(quantize(w, kind, absmax), None))
        self.down = nn.ModuleList(downs)
        self.w13 = self.w2 = None
        return 2 * experts

    def as_linear_layers(self) -> None:
        """Each expert's gate/up and down projections as nn.Linear layers (views of the stacks,
        which are then dropped), so that a backend puts its own kernels in for them as for the
        dense layers' (the `cpu` backend's: the panel kernel, whose rows never depend on how
        many others share the GEMM: a token's output is then the same whatever the routing of
        the batch around it). Quantized experts are left as they are."""
        if self.w13 is None:
            return
        self.gate_up = nn.ModuleList(_linear(w) for w in self.w13.detach())
        self.down = nn.ModuleList(_linear(w) for w in self.w2.detach())
        self.w13 = self.w2 = None

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `index`'s MLP on the rows routed to it."""
        if self.gate_up is not None:
            return self.down[index](self.act(self.gate_up[index](x)))
        w13, w2 = self.w13[index], self.w2[index]
        if w13.dtype != x.dtype:  # 16-bit weights under float32 activations (the cpu backend's)
            w13, w2 = w13.to(x.dtype), w2.to(x.dtype)
        return self.act(x @ w13.t()) @ w2.t()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights, [T, k] each: the softmax over all experts'
        scores (in float32), its k largest, renormalised to sum to one where the model says so."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.router.out_features).tolist()
        rows_of = order // self.top_k
        weight_of = weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        # experts in ascending order, as transformers adds them: the same sum, rounded the same
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            rows = rows_of[start : start + n]
            h = self.expert(expert, x.index_select(0, rows))
            out.index_add_(0, rows, (h * weight_of[start : start + n, None]).to(x.dtype))
            start += n
        return out


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer
