"""One planned step, run: propose, forward, choose.

The worker process (worker.py) is the shell around this: it joins the core and the group,
loads the model, maps the pool, applies each plan's differences to its request state and moves
blocks (swaps, copies); then it hands the step's chunks to its executor, which runs three
hooks in order:

- `propose`: tokens to compute beyond each chunk's last known one (none here);
- `forward`: the model over the chunks, the logits of each chunk's last token and of every
  row of the chunks a choice needs (one pass over the LM head), and the hidden states of the
  rows that predict prompt tokens (prompt logprobs);
- `choose`: what the step decides from them: the sampled token of each chunk that samples
  (rank 0 samples, with the step's structured-output masks, and tells the other ranks).

A feature that changes how a step runs overrides hooks in a module of its own (speculation.py
overrides propose and choose) and is chosen once, where the worker is configured
(`executor_for`); the shell knows none of them.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from pagedllm.core.config import EngineConfig
from pagedllm.core.outputs import SchedulerOutput
from pagedllm.core.protocol import KVSpec, PromptLogprobs, StepResult, TokenLogprobs
from pagedllm.core.worker_state import ScheduledChunk, WorkerState

from .pooling import Pooling, pooled_rows
from .runner import ModelRunner, SeqInput
from .sampler import Logprobs, Sampler, SamplingRow

PROMPT_LOGPROB_ROWS = 256  # prompt positions whose logits are made at once


class StepExecutor:
    """The plain step: nothing proposed; every chunk that reaches its last known token samples."""

    # a greedy decode run may go whole through the replay's greedy_step, none of the hooks
    # called but seq_inputs: an executor whose hooks change a step otherwise says False
    greedy_runs_whole = True

    def __init__(self, config: EngineConfig, model, ops, tp, threads, state: WorkerState):
        self.config, self.model, self.ops, self.tp, self.threads, self.state = config, model, ops, tp, threads, state
        self.sampler = Sampler(config.seed, argmax=ops.argmax, apply_bitmask=ops.apply_token_bitmask)
        self.runner: ModelRunner | None = None  # with the pool (attach)
        self.pooling = Pooling()

    # --- set-up: the worker calls these once ----------------------------------------------
    def describe_kv(self, kv_spec: KVSpec) -> None:
        """Add to the KV spec the worker reports what this executor keeps in the pool besides
        the target's KV (nothing here)."""

    def attach(self, runner: ModelRunner, make_runner) -> None:
        """The target's runner over its pool; `make_runner(model, offset_bytes)` makes one for
        another model over the pool's region past `offset_bytes` (where describe_kv asked for it)."""
        self.runner = runner

    def runners(self) -> tuple[ModelRunner, ...]:
        """Every runner whose steps replay (graphs are captured for each)."""
        return (self.runner,)

    # --- a step ---------------------------------------------------------------------------
    def forget(self, plan: SchedulerOutput) -> None:
        """Called with every plan before its chunks run: what ended, and block tables replaced."""
        self.pooling.forget(plan)

    @torch.inference_mode()  # the prompt-logprob rows too: a port's weights may still ask for gradients
    def run(self, plan: SchedulerOutput, chunks: list[ScheduledChunk], masks=None) -> StepResult | None:
        """The step's result on rank 0 (None on the other ranks). `masks`: the structured-output
        masks' future (step_masks.py), for a step with constrained requests."""
        t0 = time.perf_counter()
        if self.threads:
            self.threads.begin(sum(c.num_tokens for c in chunks))
        proposals = self.propose(plan, chunks)
        wanted, pooled = prompt_positions(chunks), pooled_rows(chunks)
        every = {i: chunks[i].num_tokens for i in proposals}
        logits, every_row, prompt_hidden = self.forward(chunks, every, {**wanted, **pooled})
        result = StepResult(step_id=plan.step_id, sampled_token_ids=np.full(len(chunks), -1, dtype=np.int64))
        if wanted:
            result.prompt_logprobs = self._prompt_logprobs(chunks, {i: prompt_hidden[i] for i in wanted})
        if pooled:
            result.pooled = self.pooling.add(chunks, {i: prompt_hidden[i] for i in pooled})
        self.choose(chunks, logits, every_row, proposals, masks, result)
        if self.threads:
            self.threads.end()
        result.forward_seconds = time.perf_counter() - t0
        return result if self.tp.is_first else None

    def greedy_run(self, plan: SchedulerOutput, steps: int):
        """A decode run's `steps` later steps (StepResults, one a step, made as they are asked
        for) where the replay takes each whole in one compiled call (its greedy_step: the same
        bits as forward and choose), or None where it does not: a hook changes the step, more
        than one rank, or some request that samples, asks for logprobs, biases or penalizes
        tokens, or may not end yet (min_tokens)."""
        replay = self.runner.replay
        if not self.greedy_runs_whole or self.tp.size != 1 or not hasattr(replay, "greedy_fits"):
            return None
        states = [self.state.requests[rid] for rid in plan.num_scheduled_tokens]
        if not replay.greedy_fits(len(states)) or not all(map(plain_greedy, states)):
            return None
        return self._greedy_steps(plan, steps)

    def _greedy_steps(self, plan: SchedulerOutput, steps: int):
        replay = self.runner.replay
        for step in range(steps):
            t0 = time.perf_counter()
            chunks = self.state.apply(plan.next_in_run())
            seqs = self.seq_inputs(chunks) if step == 0 else None
            sampled = replay.greedy_step(seqs, torch.get_num_threads()).copy()  # its buffer is the next step's
            for chunk, token in zip(chunks, sampled.tolist()):
                self.state.add_sampled(chunk.state, token)
            yield StepResult(step_id=plan.step_id, sampled_token_ids=sampled, forward_seconds=time.perf_counter() - t0)

    def propose(self, plan: SchedulerOutput, chunks: list[ScheduledChunk]) -> dict[int, list[int]]:
        """{chunk index: the tokens proposed after its last known one}, in the worker's copy of
        the chunk's tokens by the time this returns."""
        return {}

    def forward(self, chunks: list[ScheduledChunk], every: dict[int, int], wanted: dict[int, int]):
        """(logits of each chunk's last token; {chunk index: logits of each of its rows} for the
        chunks in `every`; {chunk index: hidden states of its first `wanted[i]` rows}). Logits
        are rank 0's (None on the others); the LM head reads all its weights once for both."""
        seqs = self.seq_inputs(chunks)
        if not every and not wanted:
            return self.runner.execute(seqs), {}, {}
        last, hidden = self.runner.hidden_states(seqs, {**wanted, **every})
        rows = [hidden[i] for i in every]
        logits = self.model.compute_logits(torch.cat([last, *rows]))
        every_row = {}
        if logits is not None and rows:
            n = len(last)
            every_row = dict(zip(every, torch.split(logits[n:], [len(r) for r in rows])))
            logits = logits[:n]
        return logits, every_row, {i: hidden[i] for i in wanted}

    def seq_inputs(self, chunks: list[ScheduledChunk]) -> list[SeqInput]:
        """The runner's view of the step's chunks (an adapter executor adds their adapters)."""
        return [SeqInput(c.token_ids, c.start, c.state.block_ids) for c in chunks]

    def choose(self, chunks, logits, every_row, proposals, masks, result: StepResult) -> None:
        """Sample each chunk that reaches its last known token (beyond what a hook took)."""
        rows = [i for i, c in enumerate(chunks) if c.state.samples and i not in proposals]
        if not rows:
            return
        batch = [chunks[i] for i in rows]
        tokens = None
        if self.tp.is_first:
            tokens, result.logprobs = self._sample(logits, rows, batch, len(chunks), masks.result() if masks else {})
        tokens = self.from_first_rank_tokens(tokens, len(rows))
        for i, chunk, token in zip(rows, batch, tokens):
            self.state.add_sampled(chunk.state, token)
            result.sampled_token_ids[i] = token

    def _sample(self, logits, rows: list[int], batch: list[ScheduledChunk], num_chunks: int, masks: dict):
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

    # --- tensor parallelism: what rank 0 decided, on every rank ---------------------------
    def from_first_rank_tokens(self, tokens: list[int] | None, count: int) -> list[int]:
        """`count` token ids rank 0 has (None on the other ranks), on every rank."""
        if self.tp.size == 1:
            return tokens
        shared = torch.tensor(tokens if tokens is not None else [0] * count, dtype=torch.int64)
        return self.tp.broadcast_from_first(shared.to(self.ops.device)).tolist()

    def from_first_rank_rows(self, rows: list[list[int]] | None, count: int, width: int) -> list[list[int]]:
        """Rows of token ids that rank 0 has (`rows`; None on the other ranks), on every rank:
        `count` rows of at most `width` ids."""
        if self.tp.size == 1:
            return rows
        table = torch.full((count, width), -1, dtype=torch.int64)
        for r, row in enumerate(rows or ()):
            table[r, : len(row)] = torch.tensor(row)
        table = self.tp.broadcast_from_first(table.to(self.ops.device)).cpu()
        return [[t for t in row if t >= 0] for row in table.tolist()]


def executor_for(config: EngineConfig, *args) -> StepExecutor:
    """The executor the engine's configuration asks for: the plain step, or a feature's."""
    if config.speculative_config is not None:
        from .speculation import speculative_executor

        return speculative_executor(config, *args)
    if config.enable_lora:  # (not with speculation: the engine's configuration refuses both)
        from .lora import AdapterExecutor

        return AdapterExecutor(config, *args)
    return StepExecutor(config, *args)


def plain_greedy(state) -> bool:
    """Whether the request's next token is the argmax of its logits alone."""
    p = state.params
    if p.temperature != 0.0 or p.logprobs is not None or p.logit_bias or p.beam_width:
        return False
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.structured_outputs:
        return False
    return len(state.token_ids) - state.num_prompt_tokens >= p.min_tokens


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
