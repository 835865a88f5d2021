"""Decode steps replayed from CUDA graphs: batches padded to a few captured sizes, contexts
up to GRAPH_MAX_CONTEXT (--enforce-eager turns it off)."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.core.utils import cdiv
from pagedllm.core.worker_state import slot_mapping

from ..attention import AttentionMetadata, DecodeMetadata
from ..runner import SeqInput

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# Graphs are captured for contexts up to this many tokens (vLLM's max_seq_len_to_capture);
# a step with a longer context runs eagerly. Sizing graphs for max_model_len instead would
# have every graphed step write and reduce partitions for a 128k context (~1 GB per layer
# at batch 256) and copy a 256 x 8k block table.
GRAPH_MAX_CONTEXT = 8192


class DecodeGraphs:
    """Decode-only steps replayed from CUDA graphs captured at a few batch sizes. A step of n
    decodes runs the smallest captured size >= n; the padding rows write to no slot (-1) and
    attend to one position of the null block, and their outputs are dropped. The block table
    is filled in a pinned host buffer and only the columns the step uses are copied (the
    kernels never read a row's entries past its own context)."""

    def __init__(self, model, ops, kv_caches, block_size: int, max_batch: int, max_model_len: int):
        self.model, self.ops, self.kv_caches = model, ops, kv_caches
        self.sizes = [s for s in GRAPH_BATCH_SIZES if s <= max_batch] or [1]
        self.max_context = min(max_model_len, GRAPH_MAX_CONTEXT)
        n, dev = self.sizes[-1], kv_caches.device
        self.max_blocks = cdiv(self.max_context, block_size)
        self.block_size = block_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        # Refilled every step: the previous step's copy out of it has finished by then (the
        # worker waits for each step's sampled tokens)
        self.host_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        self.context_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _forward(self, n: int) -> torch.Tensor:
        # max_context_len = the captured bound: the kernels' partitioning covers every context in it
        meta = AttentionMetadata(
            slot_mapping=self.slots[:n],
            num_decode_tokens=n,
            num_prefill_tokens=0,
            decode=DecodeMetadata(self.tables[:n], self.context_lens[:n], self.max_context),
            prefill=None,
        )
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
        return (
            len(seqs) <= self.sizes[-1]
            and all(len(s.token_ids) == 1 for s in seqs)
            and all(s.start_pos < self.max_context for s in seqs)
        )

    @torch.inference_mode()
    def run(self, seqs: list[SeqInput], keep: np.ndarray | None = None) -> torch.Tensor:
        """Hidden states [len(seqs), hidden] of a decode-only step (the rows `keep` indexes,
        in that order, where given: the signature every replay has, Platform.capture_graphs)."""
        n, size = len(seqs), self.stage(seqs)
        graph = self.graphs.get(size)
        if graph is None:  # not captured (the CPU test of this padding): the same forward, eagerly
            hidden = self._forward(size)[:n]
        else:
            graph.replay()
            hidden = self.outputs[size][:n]
        return hidden if keep is None else hidden[torch.from_numpy(np.asarray(keep, dtype=np.int64)).to(hidden.device)]

    def stage(self, seqs: list[SeqInput]) -> int:
        """Fill the static input buffers for this step; returns the captured size it runs at."""
        n = len(seqs)
        size = next(s for s in self.sizes if s >= n)
        bs = self.block_size
        ids = np.fromiter((s.token_ids[0] for s in seqs), dtype=np.int64, count=n)
        pos = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=n)
        cols = cdiv(int(pos.max()) + 1, bs)  # the widest row's blocks this step
        tables = self.host_tables[:size, :cols].numpy()
        tables[:] = 0  # padding rows read the null block
        for row, s in enumerate(seqs):
            blocks = s.block_ids[:cols]
            tables[row, : len(blocks)] = blocks
        slots = np.full(size, -1, dtype=np.int64)
        slots[:n] = slot_mapping(tables, np.arange(n), pos, bs)
        ctx = np.ones(size, dtype=np.int32)
        ctx[:n] = pos + 1
        self.input_ids[:n].copy_(torch.from_numpy(ids), non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(pos), non_blocking=True)
        self.slots[:size].copy_(torch.from_numpy(slots), non_blocking=True)
        self.tables[:size, :cols].copy_(self.host_tables[:size, :cols], non_blocking=True)
        self.context_lens[:size].copy_(torch.from_numpy(ctx), non_blocking=True)
        return size
