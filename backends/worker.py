"""The backend worker process: holds the model and the KV cache, runs the steps the core plans.

It keeps per-request state (token ids, block table, computed count: core.worker_state) and
applies each step's differences to it; the core never resends what the worker already has.
Under tensor parallelism there is one worker per rank, each holding its slice of the model and
a KV pool of its own heads; rank 0 samples and answers each step.
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

from pagedllm.core import shm
from pagedllm.core.config import EngineConfig, default_batched_tokens
from pagedllm.core.logs import setup_logging
from pagedllm.core.outputs import SchedulerOutput
from pagedllm.core.protocol import (
    Configure,
    Decoder,
    Encoder,
    Heartbeat,
    InitCache,
    KVSpec,
    PromptLogprobs,
    Shutdown,
    Step,
    StepMasks,
    StepResult,
    TokenLogprobs,
    ToWorker,
    WorkerFailed,
    WorkerHello,
    WorkerJoin,
    WorkerReady,
)
from pagedllm.core.worker_group import rank_identity
from pagedllm.core.worker_state import WorkerState

from .draft_proposer import DraftProposer
from .kv_cache import allocate_pool, pool_dtype, pool_shape
from .models.config import DTYPES, ModelConfig
from .models.loader import load_model
from .models.parallel import SINGLE, TensorParallel
from .registry import load_backend
from .runner import ModelRunner, SeqInput
from .sampler import Logprobs, Sampler, SamplingRow
from .spec_verify import verify as verify_proposals

DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
logger = logging.getLogger("pagedllm.backends")
POLL_MS = 100
CORE_SILENT_S = 30  # idle and nothing from the core (it sends heartbeats) this long: it is gone
PROMPT_LOGPROB_ROWS = 256  # prompt positions whose logits are made at once
WORKER_JOIN_TIMEOUT_S = 300


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, rendezvous: tuple[str, int] | None = None):
        """rendezvous: (address, port) of torch.distributed's store, under tensor parallelism."""
        self.config = config
        self.rank = rank
        self.ops = load_backend(config.backend)  # the kernels, and the platform the worker asks
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
        self.threads = self.ops.compute_threads(config.cpu_threads)  # after set_device shared the cores
        dtype = self.ops.default_dtype(config.model, config.dtype)
        problem = self._unsupported(ModelConfig.from_pretrained(config.model, dtype))  # before any weight loads
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
        self.draft_model = self._load_draft(DTYPE_NAMES[self.model_config.dtype])  # at the target's dtype
        self.drafter: DraftProposer | None = None  # with the pool (init_cache)
        self.state = WorkerState()
        self.runner: ModelRunner | None = None
        self.sampler = Sampler(config.seed, argmax=self.ops.argmax, apply_bitmask=self.ops.apply_token_bitmask)
        self.receive_masks = None  # rank 0: () -> the StepMasks of the step it runs (set by serve)
        self._mappings = []

    def _spec_of(self, model) -> KVSpec:
        cfg = model.config
        return KVSpec(
            num_layers=cfg.num_layers,
            num_kv_heads=model.shards.num_kv_heads,
            head_size=cfg.head_dim,
            dtype=DTYPE_NAMES[cfg.dtype],
            kv_cache_dtype=self.config.kv_cache_dtype,
        )

    def hello(self) -> WorkerHello:
        cfg = self.model_config
        kv_spec = self._spec_of(self.model)
        if self.draft_model is not None:
            kv_spec.draft_bytes_per_slot = self._spec_of(self.draft_model).bytes_per_block_slot
        return WorkerHello(
            rank=self.rank,
            kv_spec=kv_spec,
            max_position_embeddings=cfg.max_position_embeddings,
            sliding_window=cfg.uniform_window,
            kv_in_shared_memory=self.ops.kv_in_shared_memory,
            num_device_blocks=self._profile_num_blocks(kv_spec.pool_bytes_per_slot),
        )

    def _unsupported(self, wanted: ModelConfig) -> str | None:
        """What of a model (the target or a draft), with this engine's block size, context and
        KV cache dtype, the backend does not support; None: all of it."""
        cfg = self.config
        problem = self.ops.unsupported(wanted.dtype, wanted.head_dim, cfg.block_size, cfg.max_model_len)
        problem = problem or self.ops.unsupported_features(wanted.attention_features())
        return problem or self.ops.unsupported_kv_cache_dtype(cfg.kv_cache_dtype, wanted.head_dim)

    def _load_draft(self, dtype: str):
        """speculative_config's draft model, checked against the target and the backend; None
        for other methods."""
        cfg, spec = self.config, self.config.speculative_config
        if spec is None or spec.method != "draft_model" or not self.tp.is_first:
            return None  # under tensor parallelism rank 0 runs the whole draft and shares its proposals
        if self.model_config.uniform_window:
            raise ValueError(
                "a draft model beside a target whose every layer has a sliding window is not supported (the core "
                "releases the blocks behind the window, which the draft would still read)"
            )
        wanted = ModelConfig.from_pretrained(spec.model, dtype)
        if wanted.vocab_size != self.model_config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({wanted.vocab_size} tokens) is not the target's "
                f"({self.model_config.vocab_size}): a draft model must share the target's tokenizer"
            )
        problem = self._unsupported(wanted)
        if problem:
            raise ValueError(f"backend {cfg.backend} does not support the draft model's {problem}")
        max_positions = cfg.max_model_len or self.model_config.max_position_embeddings
        return load_model(spec.model, dtype=dtype, max_positions=max_positions, device=self.device)

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

    def _cache_tensor(self, segment: str | None, num_blocks: int, block_size: int, model=None) -> torch.Tensor:
        """A model's pool (the target's, or with `model` a draft's, which follows the target's in
        the same segment)."""
        model = model or self.model
        cfg, kv_dtype = model.config, self.config.kv_cache_dtype
        kv_heads = model.shards.num_kv_heads
        if segment is None:
            return allocate_pool(
                kv_dtype, cfg.num_layers, num_blocks, block_size, kv_heads, cfg.head_dim, cfg.dtype, self.device
            )
        shape = pool_shape(kv_dtype, cfg.num_layers, num_blocks, block_size, kv_heads, cfg.head_dim)
        offset = 0 if model is self.model else self._spec_of(self.model).bytes_per_block_slot * block_size * num_blocks
        mapping = shm.map_segment(segment)
        self._mappings.append(mapping)
        dtype = pool_dtype(kv_dtype, cfg.dtype)
        return torch.frombuffer(mapping, dtype=dtype, count=int(np.prod(shape)), offset=offset).view(shape)

    def init_cache(self, msg: InitCache) -> WorkerReady:
        kv = self._cache_tensor(msg.kv_segment, msg.num_blocks, msg.block_size)
        self.swap = (
            self._cache_tensor(msg.swap_segment, msg.num_swap_blocks, msg.block_size) if msg.num_swap_blocks else None
        )
        self.runner = ModelRunner(self.model, self.ops, kv, msg.block_size, self.device, self.config.kv_cache_dtype)
        if self.draft_model is not None:
            draft_kv = self._cache_tensor(msg.kv_segment, msg.num_blocks, msg.block_size, self.draft_model)
            runner = ModelRunner(
                self.draft_model, self.ops, draft_kv, msg.block_size, self.device, self.config.kv_cache_dtype
            )
            self.drafter = DraftProposer(runner, self.ops.argmax)
        if self.swap is not None:
            self.ops.pin_memory(self.swap)
        if not self.config.enforce_eager:  # the draft's one-token passes replay too
            for runner in (self.runner, self.drafter.runner) if self.drafter else (self.runner,):
                runner.decode_graphs = self.ops.capture_graphs(
                    runner.model, runner.layer_caches, msg.block_size, self.config.max_num_seqs, msg.max_model_len
                )
        return WorkerReady(rank=self.rank)

    def execute(self, plan: SchedulerOutput) -> StepResult | None:
        """Run a step; rank 0 samples and answers, the other ranks learn its tokens and answer
        nothing."""
        chunks = self.state.apply(plan)
        drafter = self.drafter
        if drafter is not None:
            drafter.forget(plan, self.runner.block_size)
        kv = self.runner.kv_caches
        self.ops.swap_blocks(kv, self.swap, plan.swap_out)
        self.ops.swap_blocks(self.swap, kv, plan.swap_in)
        self.ops.copy_blocks(kv, plan.block_copies)
        if not chunks:  # a step that only preempts, swaps or ends requests
            if not self.tp.is_first:
                return None
            return StepResult(step_id=plan.step_id, sampled_token_ids=np.empty(0, dtype=np.int64))
        t0 = time.perf_counter()
        drafts = plan.draft_token_ids
        if drafts and self.config.speculative_config.method == "draft_model":  # the draft fills them in
            drafts = self._draft_proposals([c for c in chunks if c.request_id in drafts])
        seqs = [SeqInput(c.token_ids, c.start, c.state.block_ids) for c in chunks]
        wanted = prompt_positions(chunks)
        # speculating chunks: the logits of every position, to verify the proposal
        verify = {i: c.num_tokens for i, c in enumerate(chunks) if c.request_id in drafts} if drafts else {}
        if self.threads:
            self.threads.begin(sum(len(s.token_ids) for s in seqs))
        spec_tokens = spec_logprobs = None
        if wanted or verify:
            last, hidden = self.runner.hidden_states(seqs, {**wanted, **verify})
            prompt_lps = self._prompt_logprobs(chunks, {i: hidden[i] for i in wanted}) if wanted else None
            logits, verify_logits = self._logits_with_every_row(last, [hidden[i] for i in verify])
            if verify:
                spec_tokens, spec_logprobs = self._verify(chunks, verify_logits, verify, drafts)
        else:
            logits, prompt_lps = self.runner.execute(seqs), None
        if self.threads:
            self.threads.end()
        rows = [i for i, c in enumerate(chunks) if c.state.samples and i not in verify]
        sampled = np.full(len(chunks), -1, dtype=np.int64)
        logprobs = None
        if rows:
            batch = [chunks[i] for i in rows]
            tokens = logprobs = None
            if self.tp.is_first:  # rank 0 samples (and applies the structured-output masks)
                tokens, logprobs = self._sample(logits, rows, batch, len(chunks), self._step_masks(plan))
            if self.tp.size > 1:
                shared = torch.tensor(tokens if tokens is not None else [0] * len(rows), dtype=torch.int64)
                tokens = self.tp.broadcast_from_first(shared.to(self.device)).tolist()
            for i, chunk, token in zip(rows, batch, tokens):
                self.state.add_sampled(chunk.state, token)
                sampled[i] = token
        if not self.tp.is_first:
            return None
        return StepResult(
            step_id=plan.step_id,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            forward_seconds=time.perf_counter() - t0,
            prompt_logprobs=prompt_lps,
            spec_token_ids=spec_tokens,
            spec_logprobs=spec_logprobs,
        )

    def _draft_proposals(self, speculating: list) -> dict[str, list[int]]:
        """Rank 0's draft proposes; under tensor parallelism the other ranks receive its
        proposals and put them in their copy of the tokens."""
        mine = list(self.drafter.propose(speculating).values()) if self.drafter is not None else None
        proposals = self._from_first_rank(mine, len(speculating), max(c.num_tokens for c in speculating))
        if mine is None:  # rank 0's draft filled in its own copy
            for c, proposal in zip(speculating, proposals):
                c.state.token_ids[c.start + 1 : c.start + c.num_tokens] = proposal
        return {c.request_id: proposal for c, proposal in zip(speculating, proposals)}

    def _from_first_rank(self, rows: list[list[int]] | None, count: int, width: int) -> list[list[int]]:
        """Rows of token ids that rank 0 has (`rows`; None on the other ranks), on every rank:
        `count` rows of at most `width` ids."""
        if self.tp.size == 1:
            return rows
        table = torch.full((count, width), -1, dtype=torch.int64)
        for r, row in enumerate(rows or ()):
            table[r, : len(row)] = torch.tensor(row)
        table = self.tp.broadcast_from_first(table.to(self.device)).cpu()
        return [[t for t in row if t >= 0] for row in table.tolist()]

    def _logits_with_every_row(self, last: torch.Tensor, chunks_rows: list[torch.Tensor]):
        """The logits of each chunk's last token, and of every token of the speculating chunks
        (their hidden states `chunks_rows`), in one pass over the LM head: a pass reads all of
        its weights, and a small model's decode step is mostly such reading. (None, None) on
        the ranks other than the first."""
        logits = self.model.compute_logits(torch.cat([last, *chunks_rows]))
        if logits is None:
            return None, None
        n = len(last)
        return logits[:n], list(torch.split(logits[n:], [len(rows) for rows in chunks_rows]))

    def _verify(self, chunks, logits: list, verify: dict[int, int], drafts: dict[str, list[int]]):
        """Speculative decoding: rank 0 samples every position of each speculating chunk (its
        last token, then the proposal) and keeps the proposal up to the first token its draws
        disagree with, then its own draw there (backends/spec_verify.py); the other ranks
        compute the logits with it and learn the kept tokens. Returns the tokens and, where
        asked, their logprobs, by request id."""
        speculating = [chunks[i] for i in verify]
        kept = logprobs = None
        if self.tp.is_first:
            rows = [
                SamplingRow(
                    c.state.params, c.state.token_ids[: c.start + 1], c.state.num_prompt_tokens, c.state.eos_token_ids
                )
                for c in speculating
            ]
            proposals = [drafts[c.request_id] for c in speculating]
            kept = []
            for row, (tokens, lps) in enumerate(verify_proposals(self.sampler, logits, rows, proposals)):
                kept.append(tokens)
                if lps[0] is not None:
                    logprobs = logprobs or {}
                    logprobs[speculating[row].request_id] = [wire_logprobs(lp) for lp in lps]
        kept = self._from_first_rank(kept, len(speculating), max(verify.values()))
        out = {}
        for chunk, tokens in zip(speculating, kept):
            self.state.keep_confirmed(chunk, tokens)
            if self.drafter is not None:
                self.drafter.keep(chunk)
            out[chunk.request_id] = tokens
        return out, logprobs

    def _step_masks(self, plan: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Structured outputs: each constrained request's token bitmask for this step, by id —
        from the StepMasks message the core sends after the step (`receive_masks`)."""
        if not plan.structured_request_ids:
            return {}
        msg = self.receive_masks()
        if msg.step_id != plan.step_id:
            raise RuntimeError(f"masks of step {msg.step_id} came for step {plan.step_id}")
        masks = torch.from_numpy(np.array(msg.bitmask))  # a copy: the frame's buffer is read-only
        return dict(zip(plan.structured_request_ids, masks))

    def _prompt_logprobs(self, chunks, hidden: dict[int, torch.Tensor]) -> dict[str, PromptLogprobs] | None:
        """For each chunk in `hidden`, the logprob of each next prompt token given the tokens
        before it, with the top `prompt_logprobs`. Logits are made a slice of rows at a time (a
        long prompt's whole [tokens, vocab] would not fit); every rank takes part, rank 0 answers."""
        out = {}
        for i, h in hidden.items():
            chunk = chunks[i]
            state = chunk.state
            targets = torch.tensor(state.token_ids[chunk.start + 1 : chunk.start + 1 + len(h)], dtype=torch.long)
            entries = []
            for lo in range(0, len(h), PROMPT_LOGPROB_ROWS):
                logits = self.model.compute_logits(h[lo : lo + PROMPT_LOGPROB_ROWS])
                if logits is not None:
                    k = state.params.prompt_logprobs
                    entries += token_logprobs(logits.cpu(), targets[lo : lo + len(logits)], k)
            out[chunk.request_id] = PromptLogprobs(chunk.start + 1, entries)
        return out if self.tp.is_first else None

    def _sample(self, logits, rows: list[int], batch: list, num_chunks: int, masks: dict):
        if len(rows) < num_chunks:
            logits = logits[rows]
        out = self.sampler(
            logits,
            [
                SamplingRow(
                    c.state.params,
                    c.state.token_ids,
                    c.state.num_prompt_tokens,
                    c.state.eos_token_ids,
                    masks.get(c.request_id),
                )
                for c in batch
            ],
        )
        logprobs = None
        for chunk, lp in zip(batch, out.logprobs):
            if lp is not None:
                logprobs = logprobs or {}
                logprobs[chunk.request_id] = wire_logprobs(lp)
        return out.token_ids, logprobs


def prompt_positions(chunks) -> dict[int, int]:
    """{chunk index: how many of its first tokens predict a prompt token} for the chunks of
    requests that asked for prompt logprobs."""
    wanted = {}
    for i, c in enumerate(chunks):
        if c.state.params.prompt_logprobs is not None:
            n = min(c.start + c.num_tokens, c.state.num_prompt_tokens - 1) - c.start
            if n > 0:
                wanted[i] = n
    return wanted


def wire_logprobs(lp: Logprobs) -> TokenLogprobs:
    """The sampler's logprobs of a token as the core takes them."""
    return TokenLogprobs(lp.token_logprob, lp.rank, lp.top_token_ids, lp.top_logprobs)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """Per row: the log-probability and rank of its target token, and the top k."""
    lps = torch.log_softmax(logits.float(), dim=-1)
    target_lps = lps.gather(1, targets[:, None])
    ranks = ((lps > target_lps).sum(dim=1) + 1).tolist()
    top = lps.topk(k, dim=-1) if k else None
    top_ids = top.indices.tolist() if k else [[] for _ in ranks]
    top_lps = top.values.tolist() if k else [[] for _ in ranks]
    values = target_lps[:, 0].tolist()
    return [TokenLogprobs(lp, r, ids, vals) for lp, r, ids, vals in zip(values, ranks, top_ids, top_lps)]


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
    worker.receive_masks = lambda: link.expect(StepMasks, parent)
    while True:
        msg = link.recv(parent)
        if isinstance(msg, Step):
            result = worker.execute(msg.plan)
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
