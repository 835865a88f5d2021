"""The backend worker process: holds the model and the KV cache, runs the steps the core plans.

It keeps per-request state (token ids, block table, computed count: core.worker_state) and
applies each step's differences to it; the core never resends what the worker already has.
Under tensor parallelism there is one worker per rank, each holding its slice of the model and
a KV pool of its own heads; rank 0 samples and answers each step.

This module is the process's shell: the link to the core, the group join, the model and the
pool; each step's chunks go to the step executor chosen for the configuration
(step_executor.py: propose, forward, choose; a feature's executor overrides the hooks it
changes), with the future of the step's token masks (step_masks.py).
`python -m pagedllm.backends.worker --head ENDPOINT --rank R` (started by the engine core, or
on another host by `pagedllm worker`): it joins the core and is sent its configuration.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import os
import signal
import socket
import sys
import time

import numpy as np
import torch
import zmq

from pagedllm.core.config import EngineConfig, default_batched_tokens
from pagedllm.core.logs import setup_logging
from pagedllm.core.outputs import SchedulerOutput
from pagedllm.core.process import shm
from pagedllm.core.process.worker_group import rank_identity
from pagedllm.core.protocol import (
    Configure,
    Decoder,
    Encoder,
    Heartbeat,
    InitCache,
    Shutdown,
    Step,
    StepResult,
    ToWorker,
    WorkerFailed,
    WorkerHello,
    WorkerJoin,
    WorkerReady,
)
from pagedllm.core.worker_state import WorkerState

from .kv_cache import allocate_pool, kv_spec_of, pool_dtype, pool_shape
from .models.config import ModelConfig
from .models.loader import load_model
from .models.parallel import SINGLE, TensorParallel
from .models.quantized import QuantizedLinear
from .registry import load_backend, unsupported
from .runner import ModelRunner
from .step_executor import executor_for
from .step_masks import step_masks

logger = logging.getLogger("pagedllm.backends")
POLL_MS = 100
CORE_SILENT_S = 30  # idle and nothing from the core (it sends heartbeats) this long: it is gone
WORKER_JOIN_TIMEOUT_S = 300


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, rendezvous: tuple[str, int] | None = None):
        """rendezvous: (address, port) of torch.distributed's store, under tensor parallelism."""
        self.config = config
        self.rank = rank
        self.ops = load_backend(config.backend)  # the kernels, and the platform the worker asks
        self.ops.batch_invariant_mode = config.batch_invariant
        self.ops.prepare_process()
        self.ops.seed(config.seed)
        self.tp = join_group(
            config.tensor_parallel_size,
            rank,
            *(rendezvous or ("", 0)),
            self.ops,
            config.tensor_parallel_size // config.nnodes,
        )
        self.device = self.ops.device
        threads = self.ops.compute_threads(config.cpu_threads)  # after set_device shared the cores
        dtype = self.ops.default_dtype(config.model, config.dtype)
        problem = unsupported(self.ops, config, ModelConfig.from_pretrained(config.model, dtype))  # before any weights
        if problem:
            raise ValueError(f"backend {config.backend} does not support {problem}")
        # rotary tables as long as the context (a config past the model's positions was refused
        # or explicitly allowed by the frontend)
        self.model = load_model(
            config.model,
            dtype=dtype,
            max_positions=config.max_model_len,
            device=self.device,
            tp=self.tp,
            quantization=config.quantization,
        )
        self.model_config = self.model.config
        # before the backend's kernels replace them (ModelRunner)
        self.quantized = any(isinstance(m, QuantizedLinear) for m in self.model.modules())
        self.state = WorkerState()
        self.executor = executor_for(config, self.model, self.ops, self.tp, threads, self.state)
        self._mappings = []

    def hello(self) -> WorkerHello:
        cfg = self.model_config
        kv_spec = kv_spec_of(self.model, self.config.kv_cache_dtype)
        self.executor.describe_kv(kv_spec)
        return WorkerHello(
            rank=self.rank,
            kv_spec=kv_spec,
            max_position_embeddings=cfg.max_position_embeddings,
            sliding_window=cfg.uniform_window,
            kv_in_shared_memory=self.ops.kv_in_shared_memory,
            num_device_blocks=self._profile_num_blocks(kv_spec.pool_bytes_per_slot),
            batch_invariant=bool(self.ops.batch_invariant_for(quantized=self.quantized)),
        )

    def _profile_num_blocks(self, slot_bytes: int) -> int | None:
        """The platform's answer to how many blocks its memory holds (None: the core sizes the
        pool from kv_cache_memory); not asked when num_kv_blocks sets it."""
        cfg = self.config
        if cfg.num_kv_blocks:
            return None
        max_len = cfg.max_model_len or self.model_config.max_position_embeddings
        return self.ops.kv_cache_blocks(
            self.model,
            cfg.block_size,
            slot_bytes,
            cfg.max_num_batched_tokens or default_batched_tokens(max_len),
            max_len,
            cfg.gpu_memory_utilization,
            self.device,
        )

    def _cache_tensor(self, segment: str | None, num_blocks: int, block_size: int, model, offset: int = 0):
        """A model's pool: in the shared-memory `segment` past `offset` bytes per block slot
        (a draft's follows the target's), or in the device's memory."""
        cfg, kv_dtype = model.config, self.config.kv_cache_dtype
        kv_heads = model.shards.num_kv_heads
        if segment is None:
            return allocate_pool(
                kv_dtype, cfg.num_layers, num_blocks, block_size, kv_heads, cfg.head_dim, cfg.dtype, self.device
            )
        shape = pool_shape(kv_dtype, cfg.num_layers, num_blocks, block_size, kv_heads, cfg.head_dim)
        mapping = shm.map_segment(segment)
        self._mappings.append(mapping)
        dtype = pool_dtype(kv_dtype, cfg.dtype)
        start = offset * block_size * num_blocks
        return torch.frombuffer(mapping, dtype=dtype, count=int(np.prod(shape)), offset=start).view(shape)

    def init_cache(self, msg: InitCache) -> WorkerReady:
        cfg, bs = self.config, msg.block_size
        self.swap = None
        if msg.num_swap_blocks:
            self.swap = self._cache_tensor(msg.swap_segment, msg.num_swap_blocks, bs, self.model)
            self.ops.pin_memory(self.swap)

        def make_runner(model, offset: int = 0) -> ModelRunner:
            kv = self._cache_tensor(msg.kv_segment, msg.num_blocks, bs, model, offset)
            return ModelRunner(model, self.ops, kv, bs, self.device, cfg.kv_cache_dtype)

        self.runner = make_runner(self.model)
        self.executor.attach(self.runner, make_runner)
        if not cfg.enforce_eager:
            for runner in self.executor.runners():
                runner.replay = self.ops.capture_graphs(
                    runner.model, runner.layer_caches, bs, cfg.max_num_seqs, msg.max_model_len
                )
        return WorkerReady(rank=self.rank)

    def execute(self, plan: SchedulerOutput, masks=None) -> StepResult | None:
        """Run a step; rank 0 answers, the other ranks answer nothing. `masks`: the future of
        the step's token masks (step_masks.py), where it has any."""
        chunks = self.state.apply(plan)
        self.executor.forget(plan)
        kv = self.runner.kv_caches
        self.ops.swap_blocks(kv, self.swap, plan.swap_out)
        self.ops.swap_blocks(self.swap, kv, plan.swap_in)
        self.ops.copy_blocks(kv, plan.block_copies)
        if not chunks:  # a step that only preempts, swaps or ends requests
            if not self.tp.is_first:
                return None
            return StepResult(step_id=plan.step_id, sampled_token_ids=np.empty(0, dtype=np.int64))
        return self.executor.run(plan, chunks, masks)

    def rest_of_run(self, plan: SchedulerOutput):
        """A decode run's steps after its first, each result as it is made: whole in compiled
        code where the executor can (greedy_run), else each as a step of its own."""
        steps = plan.num_steps - 1
        fast = self.executor.greedy_run(plan, steps) if steps else None
        if fast is not None:
            yield from fast
            return
        for _ in range(steps):
            yield self.execute(plan.next_in_run())


def join_group(
    size: int, rank: int, master_addr: str, master_port: int, platform, ranks_per_host: int = 1
) -> TensorParallel:
    """This rank's place among the tensor-parallel ranks: torch.distributed's standard TCP
    rendezvous on the head node, over the platform's distributed backend (gloo on CPUs, NCCL
    on GPUs), on the device the platform makes current for the rank."""
    if size == 1:
        return SINGLE
    platform.set_device(rank, ranks_per_host)
    torch.distributed.init_process_group(
        platform.distributed_backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=WORKER_JOIN_TIMEOUT_S),
    )
    return TensorParallel(rank, size)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", required=True, help="the engine core's worker endpoint")
    ap.add_argument("--rank", type=int, required=True)
    args = ap.parse_args(argv)
    setup_logging()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend orchestrates shutdown
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = os.getppid()
    ctx = zmq.Context()
    link = CoreLink(ctx, args.head, args.rank)
    code = 0
    try:
        link.send(WorkerJoin(rank=args.rank, host=socket.gethostname(), pid=os.getpid()))
        configure = link.expect(Configure, parent)
        link.generation = configure.generation
        worker = Worker(configure.config, args.rank, (configure.master_addr, configure.master_port))
        link.send(worker.hello())
        serve(worker, link, parent)
    except CoreGone:
        pass
    except Exception as e:  # the core must learn why
        # the traceback is logged here; the core (and through it, clients) get the one line
        logger.exception("worker %d failed", args.rank)
        link.send(WorkerFailed(rank=args.rank, reason=f"{type(e).__name__}: {e}"))
        code = 1
    finally:
        link.close()
        ctx.term()
    return code


def serve(worker: Worker, link: CoreLink, parent: int) -> None:
    """Answer the core's messages until it says Shutdown or disappears."""
    while True:
        msg = link.recv(parent)
        if isinstance(msg, Step):
            plan = msg.plan
            masks = step_masks(plan, worker.tp.is_first, lambda kind: link.expect(kind, parent))
            result = worker.execute(plan, masks)
            if masks is not None:
                masks.result()  # taken even where nothing sampled, so the next step's message is its own
            if result is not None:
                link.send(result)
            for result in worker.rest_of_run(plan):  # a decode run: the next steps need no plan
                if result is not None:
                    link.send(result)
        elif isinstance(msg, InitCache):
            ready = worker.init_cache(msg)
            gc.freeze()  # the model and torch's modules: collections need not walk them each step
            link.send(ready)
        elif isinstance(msg, Shutdown):
            return
        link.last_heard = time.monotonic()  # silence counts from here: the work took its time


class CoreGone(Exception):
    pass


class CoreLink:
    """The worker's DEALER socket to the core's ROUTER, named after the rank."""

    def __init__(self, ctx: zmq.Context, endpoint: str, rank: int):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, rank_identity(rank))
        self.sock.setsockopt(zmq.LINGER, 2000)  # a last failure report gets out
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.connect(endpoint)
        self.encoder = Encoder()
        self.decoder = Decoder(ToWorker)
        self.last_heard = time.monotonic()
        self.generation = -1  # the Configure's, stamped on every message after it

    def send(self, message) -> None:
        if hasattr(message, "generation"):
            message.generation = self.generation
        frames = self.encoder.encode(message)
        self.sock.send_multipart(frames, copy=len(frames) == 1)

    def recv(self, parent: int):
        """The next message (heartbeats are taken here). CoreGone when the process that
        started this one is gone, or the core has been silent for CORE_SILENT_S."""
        while True:
            if self.sock.poll(POLL_MS, zmq.POLLIN):
                frames = self.sock.recv_multipart(copy=False)
                self.last_heard = time.monotonic()
                msg = self.decoder.decode([f.buffer for f in frames])
                if not isinstance(msg, Heartbeat):
                    return msg
            elif os.getppid() != parent or time.monotonic() - self.last_heard > CORE_SILENT_S:
                raise CoreGone()

    def expect(self, kind, parent: int):
        msg = self.recv(parent)
        if not isinstance(msg, kind):
            raise RuntimeError(f"the core sent {type(msg).__name__}, expected {kind.__name__}")
        return msg

    def close(self) -> None:
        self.sock.close()


def exit_now(code: int) -> None:
    """End the process without the interpreter's teardown of torch (most of a second here):
    sockets are closed and the KV pool is the core's shared memory, so nothing is left to do."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
