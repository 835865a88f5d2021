"""What a worker does differently on a CUDA device: bfloat16 by default, a KV pool sized by
profiling a forward pass under --gpu-memory-utilization, pinned swap space, and decode steps
replayed from CUDA graphs (batches padded to a few captured sizes; --enforce-eager turns it off).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

from .attention import AttentionMetadata, DecodeMetadata
from .runner import SeqInput, allocate_kv_caches

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def default_dtype(model_dir: str, requested: str) -> str:
    """'auto' on a GPU: the checkpoint's 16-bit dtype, and bfloat16 for a float32 checkpoint."""
    if requested not in (None, "auto"):
        return requested
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    saved = cfg.get("dtype") or cfg.get("torch_dtype")
    return saved if saved in ("bfloat16", "float16") else "bfloat16"


@torch.inference_mode()
def profile_num_blocks(model, ops, block_size: int, slot_bytes: int, num_tokens: int, max_seq_len: int,
                       memory_utilization: float, device="cuda") -> int:
    """Run one prefill of `num_tokens` (the most a step computes) and give the KV pool, at
    `slot_bytes` per token slot (KVSpec.bytes_per_block_slot), what
    the device's memory, times `memory_utilization`, leaves after weights, the activations'
    peak and memory outside torch."""
    from .runner import ModelRunner

    cfg = model.config
    seqs, left = [], num_tokens
    while left > 0:
        n = min(left, max_seq_len - 1)
        seqs.append(n)
        left -= n
    blocks_needed = sum(-(-n // block_size) for n in seqs) + 1
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    scratch = allocate_kv_caches(cfg, blocks_needed, block_size, device=device)
    runner = ModelRunner(model, ops, scratch, block_size, device)
    next_block, batch = 1, []
    for n in seqs:
        blocks = list(range(next_block, next_block + -(-n // block_size)))
        next_block += len(blocks)
        batch.append(SeqInput([1] * n, 0, blocks))
    runner.execute(batch)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - scratch.numel() * scratch.element_size()
    del runner, scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    outside_torch = total - free - torch.cuda.memory_reserved()
    budget = total * memory_utilization - peak - outside_torch
    blocks = int(budget // (slot_bytes * block_size))
    if blocks < 2:
        raise RuntimeError(f"no room for a KV cache: {memory_utilization:.0%} of {total / 2**30:.1f} GiB is "
                           f"{total * memory_utilization / 2**30:.1f} GiB, the model and a step need "
                           f"{(peak + outside_torch) / 2**30:.1f} GiB; raise --gpu-memory-utilization")
    return blocks


def pin(tensor: torch.Tensor) -> bool:
    """Page-lock a host tensor (the shared-memory swap space) so copies to and from the device
    are asynchronous DMA. Returns whether it worked."""
    if tensor.numel() == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    return int(err) == 0


class DecodeGraphs:
    """Decode-only steps replayed from CUDA graphs captured at a few batch sizes. A step of n
    decodes runs the smallest captured size >= n; the padding rows write to no slot (-1) and
    attend to one position of the null block, and their outputs are dropped."""

    def __init__(self, model, ops, kv_caches, block_size: int, max_batch: int, max_model_len: int):
        self.model, self.ops, self.kv_caches = model, ops, kv_caches
        self.sizes = [s for s in GRAPH_BATCH_SIZES if s <= max_batch] or [1]
        self.max_model_len = max_model_len
        n, dev = self.sizes[-1], kv_caches.device
        self.max_blocks = -(-max_model_len // block_size)
        self.block_size = block_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _forward(self, n: int) -> torch.Tensor:
        # max_context_len = max_model_len: the kernels' partitioning covers any context
        meta = AttentionMetadata(slot_mapping=self.slots[:n], num_decode_tokens=n, num_prefill_tokens=0,
                                 decode=DecodeMetadata(self.tables[:n], self.context_lens[:n], self.max_model_len),
                                 prefill=None)
        return self.model(self.input_ids[:n], self.positions[:n], self.kv_caches, meta, self.ops)

    @torch.inference_mode()
    def capture(self) -> None:
        for n in reversed(self.sizes):  # largest first, so the smaller ones reuse its memory pool
            self._forward(n)  # warm-up: kernel compilation and autotuning happen outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[n] = self._forward(n)
            self.pool = graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize()

    def fits(self, seqs: list[SeqInput]) -> bool:
        return (len(seqs) <= self.sizes[-1] and all(len(s.token_ids) == 1 for s in seqs)
                and all(s.start_pos < self.max_model_len for s in seqs))

    @torch.inference_mode()
    def run(self, seqs: list[SeqInput]) -> torch.Tensor:
        """Hidden states [len(seqs), hidden] of a decode-only step."""
        n = len(seqs)
        size = next(s for s in self.sizes if s >= n)
        bs = self.block_size
        ids = np.fromiter((s.token_ids[0] for s in seqs), dtype=np.int64, count=n)
        pos = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=n)
        tables = np.zeros((size, self.max_blocks), dtype=np.int32)
        for row, s in enumerate(seqs):
            blocks = s.block_ids[:self.max_blocks]
            tables[row, :len(blocks)] = blocks
        slots = np.full(size, -1, dtype=np.int64)
        slots[:n] = tables[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        ctx = np.ones(size, dtype=np.int32)
        ctx[:n] = pos + 1
        self.input_ids[:n].copy_(torch.from_numpy(ids), non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(pos), non_blocking=True)
        self.slots[:size].copy_(torch.from_numpy(slots), non_blocking=True)
        self.tables[:size].copy_(torch.from_numpy(tables), non_blocking=True)
        self.context_lens[:size].copy_(torch.from_numpy(ctx), non_blocking=True)
        graph = self.graphs.get(size)
        if graph is None:  # not captured (the CPU test of this padding): the same forward, eagerly
            return self._forward(size)[:n]
        graph.replay()
        return self.outputs[size][:n]


def warn(message: str) -> None:
    print(f"pagedllm worker: {message}", file=sys.stderr, flush=True)
