"""Tensor parallelism: which slice of the model each rank holds, and the collectives between
ranks (torch.distributed: gloo on CPUs, NCCL on GPUs).

Attention heads split across ranks; KV heads split when they divide, and are replicated when
there are fewer KV heads than ranks (each rank keeps the one its query heads read). The MLP's
intermediate dimension splits. QKV and gate/up are column-parallel, the output and down
projections row-parallel (one all-reduce after attention, one after the MLP). The embedding
and the LM head are vocabulary-parallel; the vocabulary is padded to a multiple of the rank
count and the padding never reaches the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.core.model_folder import check_tensor_parallel
from pagedllm.core.utils import cdiv

from .config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among the ranks. size 1: no process group, every collective a no-op."""

    rank: int = 0
    size: int = 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.size > 1:
            ops = torch.distributed.ReduceOp
            torch.distributed.all_reduce(x, op=ops.MAX if op == "max" else ops.SUM)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the ranks' tensors concatenated along the last dimension; others: None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        torch.distributed.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.is_first else None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.broadcast(x, src=0)
        return x


SINGLE = TensorParallel()  # one rank: the whole model


@dataclass(frozen=True)
class Shards:
    """What one rank holds of a model: counts and where its slices start."""

    num_heads: int
    head_start: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    intermediate_start: int
    expert_intermediate_size: int  # each expert's slice (mixture of experts: models/moe.py)
    expert_intermediate_start: int
    vocab_rows: int  # rows of the embedding and the LM head on this rank
    vocab_start: int
    vocab_size: int  # the model's, without padding

    @classmethod
    def of(cls, cfg: ModelConfig, tp: TensorParallel) -> Shards:
        check_tensor_parallel(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, tp.size)
        heads = cfg.num_heads // tp.size
        if cfg.num_kv_heads % tp.size == 0:
            kv_heads = cfg.num_kv_heads // tp.size
            kv_start = tp.rank * kv_heads
        else:  # fewer KV heads than ranks: each is replicated on tp.size / num_kv_heads ranks
            kv_heads, kv_start = 1, tp.rank // (tp.size // cfg.num_kv_heads)
        inter = cfg.intermediate_size // tp.size
        if cfg.expert_intermediate_size % tp.size:
            raise ValueError(
                f"tensor_parallel_size: {tp.size} does not divide the experts' intermediate size "
                f"{cfg.expert_intermediate_size}"
            )
        expert = cfg.expert_intermediate_size // tp.size
        rows = cdiv(cfg.vocab_size, tp.size)
        return cls(
            heads,
            tp.rank * heads,
            kv_heads,
            kv_start,
            inter,
            tp.rank * inter,
            expert,
            tp.rank * expert,
            rows,
            tp.rank * rows,
            cfg.vocab_size,
        )


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the embedding; the other ranks supply the others."""

    def __init__(self, rows: int, hidden: int, start: int, tp: TensorParallel):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.start, self.tp = start, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside[:, None], 0))
