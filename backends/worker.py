"""The backend worker process: holds the model and the KV cache, runs the steps the core plans.

It keeps per-request state (token ids, block table, computed count: core.worker_state) and
applies each step's differences to it; the core never resends what the worker already has.
`python -m pagedllm.backends.worker --rank 0 --input ENDPOINT --output ENDPOINT --config JSON`
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import traceback

import msgspec
import numpy as np
import torch
import zmq

from pagedllm.core import shm
from pagedllm.core.config import EngineConfig
from pagedllm.core.ipc import Channel
from pagedllm.core.logs import setup_logging
from pagedllm.core.outputs import SchedulerOutput
from pagedllm.core.protocol import (
    InitCache,
    KVSpec,
    Shutdown,
    Step,
    StepResult,
    TokenLogprobs,
    ToWorker,
    WorkerFailed,
    WorkerHello,
    WorkerReady,
)
from pagedllm.core.worker_state import WorkerState

from .gpu.dtype import default_dtype
from .models.config import DTYPES
from .models.loader import load_model
from .registry import load_backend
from .runner import ModelRunner, SeqInput
from .sampler import Sampler, SamplingRow

DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
logger = logging.getLogger("pagedllm.backends")
POLL_MS = 100


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0):
        self.config = config
        self.rank = rank
        torch.manual_seed(config.seed)
        self.ops = load_backend(config.backend)
        self.ops.prepare_process()
        self.device = self.ops.device
        self.on_gpu = str(self.device).startswith("cuda")
        dtype = default_dtype(config.model, config.dtype) if self.on_gpu else config.dtype
        self.model = load_model(config.model, dtype=dtype, device=self.device)
        self.model_config = self.model.config
        self.state = WorkerState()
        self.runner: ModelRunner | None = None
        self.sampler = Sampler(config.seed)
        self._mappings = []

    def hello(self) -> WorkerHello:
        cfg = self.model_config
        kv_spec = KVSpec(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_size=cfg.head_dim,
            dtype=DTYPE_NAMES[cfg.dtype],
        )
        return WorkerHello(
            rank=self.rank,
            kv_spec=kv_spec,
            max_position_embeddings=cfg.max_position_embeddings,
            sliding_window=cfg.sliding_window,
            kv_in_shared_memory=self.ops.kv_in_shared_memory,
            num_device_blocks=self._profile_num_blocks(kv_spec.bytes_per_block_slot),
        )

    def _profile_num_blocks(self, slot_bytes: int) -> int | None:
        cfg = self.config
        if not self.on_gpu or cfg.num_kv_blocks:
            return None
        max_len = cfg.max_model_len or self.model_config.max_position_embeddings
        from .gpu.memory import profile_num_blocks

        return profile_num_blocks(
            self.model,
            self.ops,
            cfg.block_size,
            slot_bytes,
            cfg.max_num_batched_tokens or max(2048, max_len),
            max_len,
            cfg.gpu_memory_utilization,
            self.device,
        )

    def _cache_tensor(self, segment: str | None, num_blocks: int, block_size: int) -> torch.Tensor:
        cfg = self.model_config
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        if segment is None:
            return torch.zeros(shape, dtype=cfg.dtype, device=self.device)
        mapping = shm.map_segment(segment)
        self._mappings.append(mapping)
        return torch.frombuffer(mapping, dtype=cfg.dtype, count=int(np.prod(shape))).view(shape)

    def init_cache(self, msg: InitCache) -> WorkerReady:
        kv = self._cache_tensor(msg.kv_segment, msg.num_blocks, msg.block_size)
        self.swap = (
            self._cache_tensor(msg.swap_segment, msg.num_swap_blocks, msg.block_size) if msg.num_swap_blocks else None
        )
        self.runner = ModelRunner(self.model, self.ops, kv, msg.block_size, self.device)
        if self.on_gpu:
            self._prepare_gpu(kv, msg)
        return WorkerReady(rank=self.rank)

    def _prepare_gpu(self, kv: torch.Tensor, msg: InitCache) -> None:
        from .gpu.graphs import GRAPH_BATCH_SIZES, DecodeGraphs
        from .gpu.pinning import pin

        if self.swap is not None and not pin(self.swap):
            logger.warning("could not pin the swap space; swapping will be slower")
        if self.config.enforce_eager:
            return
        graphs = DecodeGraphs(
            self.model,
            self.ops,
            kv,
            msg.block_size,
            min(self.config.max_num_seqs, GRAPH_BATCH_SIZES[-1]),
            msg.max_model_len,
        )
        try:
            graphs.capture()
            self.runner.decode_graphs = graphs
        except Exception as e:  # noqa: BLE001 - eager mode still works
            logger.warning("CUDA graph capture failed, running eagerly: %s", e)

    def execute(self, plan: SchedulerOutput) -> StepResult:
        chunks = self.state.apply(plan)
        kv = self.runner.kv_caches
        self.ops.swap_blocks(kv, self.swap, plan.swap_out)
        self.ops.swap_blocks(self.swap, kv, plan.swap_in)
        self.ops.copy_blocks(kv, plan.block_copies)
        t0 = time.perf_counter()
        logits = self.runner.execute([SeqInput(c.token_ids, c.start, c.state.block_ids) for c in chunks])
        rows = [i for i, c in enumerate(chunks) if c.state.samples]
        sampled = np.full(len(chunks), -1, dtype=np.int64)
        logprobs = None
        if rows:
            batch = [chunks[i] for i in rows]
            if len(rows) < len(chunks):
                logits = logits[rows]
            out = self.sampler(
                logits,
                [
                    SamplingRow(c.state.params, c.state.token_ids, c.state.num_prompt_tokens, c.state.eos_token_ids)
                    for c in batch
                ],
            )
            for i, chunk, token in zip(rows, batch, out.token_ids):
                self.state.add_sampled(chunk.state, token)
                sampled[i] = token
            for chunk, lp in zip(batch, out.logprobs):
                if lp is not None:
                    logprobs = logprobs or {}
                    logprobs[chunk.request_id] = TokenLogprobs(
                        lp.token_logprob, lp.rank, lp.top_token_ids, lp.top_logprobs
                    )
        return StepResult(
            step_id=plan.step_id, sampled_token_ids=sampled, logprobs=logprobs, forward_seconds=time.perf_counter() - t0
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--config", required=True)
    args = ap.parse_args(argv)
    setup_logging()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend orchestrates shutdown
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = os.getppid()
    ctx = zmq.Context()
    inbox = Channel(ctx, zmq.PULL, args.input, bind=False, message_type=ToWorker)
    outbox = Channel(ctx, zmq.PUSH, args.output, bind=False)
    code = 0
    try:
        worker = Worker(msgspec.json.decode(args.config, type=EngineConfig), args.rank)
        outbox.send(worker.hello())
        while True:
            if not inbox.poll(POLL_MS):
                if os.getppid() != parent:
                    break  # the engine core is gone
                continue
            msg = inbox.recv()
            if isinstance(msg, Step):
                outbox.send(worker.execute(msg.plan))
            elif isinstance(msg, InitCache):
                outbox.send(worker.init_cache(msg))
            elif isinstance(msg, Shutdown):
                break
    except Exception as e:  # noqa: BLE001 - the core must learn why
        outbox.send(WorkerFailed(rank=args.rank, reason=f"{e}\n{traceback.format_exc()}"))
        code = 1
    finally:
        inbox.close()
        outbox.close(linger_ms=2000)
        ctx.term()
    return code


if __name__ == "__main__":
    sys.exit(main())
