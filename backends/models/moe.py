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


class ExpertsMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int, act):
        super().__init__()
        num, hidden = cfg.num_experts, cfg.hidden_size
        self.top_k, self.renormalize, self.act = cfg.num_experts_per_tok, cfg.renormalize_top_k, act
        self.router = nn.Linear(hidden, num, bias=False)
        self.w13 = nn.Parameter(torch.empty(num, 2 * intermediate_size, hidden))  # gate and up, fused
        self.w2 = nn.Parameter(torch.empty(num, hidden, intermediate_size))

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
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        rows_of = order // self.top_k
        weight_of = weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        # experts in ascending order, as transformers adds them: the same sum, rounded the same
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            rows = rows_of[start : start + n]
            h = self.act(x.index_select(0, rows) @ self.w13[expert].t()) @ self.w2[expert].t()
            out.index_add_(0, rows, (h * weight_of[start : start + n, None]).to(x.dtype))
            start += n
        return out
