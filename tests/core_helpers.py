"""Shared by the core tests: building schedulers and a fake worker that checks every plan."""

from __future__ import annotations

import random
import zlib

import numpy as np

from pagedllm.core import CacheConfig, EngineRequest, SamplingParams, Scheduler, SchedulerConfig
from pagedllm.core.outputs import SchedulerOutput
from pagedllm.core.protocol import TokenLogprobs
from pagedllm.core.worker_state import WorkerState, slot_mapping


def make_scheduler(
    block_size=4,
    num_blocks=64,
    budget=64,
    max_num_seqs=16,
    max_model_len=64,
    policy="fcfs",
    preemption_mode="recompute",
    num_swap_blocks=0,
    enable_prefix_caching=True,
    block_placement="lru",
    priority_preemption=True,
    sliding_window=None,
    max_loras=None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            policy=policy,
            preemption_mode=preemption_mode,
            priority_preemption=priority_preemption,
            enable_lora=max_loras is not None,
            max_loras=max_loras or 1,
        ),
        CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            num_swap_blocks=num_swap_blocks,
            enable_prefix_caching=enable_prefix_caching,
            block_placement=block_placement,
            sliding_window=sliding_window,
        ),
    )


def add(sched: Scheduler, rid: str, prompt, max_tokens=8, eos_token_id=None, **params):
    params.setdefault("ignore_eos", eos_token_id is None)
    return sched.add_request(
        EngineRequest(
            request_id=rid,
            prompt_token_ids=list(prompt),
            eos_token_ids=[] if eos_token_id is None else [eos_token_id],
            sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        )
    )


def fake_token(rid: str, position: int, vocab: int = 50) -> int:
    """A 'sampled' token that depends only on the request and position, like greedy decoding."""
    return zlib.crc32(f"{rid}:{position}".encode()) % vocab + 1


def fake_top_tokens(tokens: list[int], k: int, vocab: int) -> TokenLogprobs:
    """k distinct 'most likely' next tokens with descending log-probabilities, a function of
    the sequence so far (so equal beams agree)."""
    rng = random.Random(zlib.crc32(repr(tokens).encode()))
    ids = rng.sample(range(1, vocab + 1), min(k, vocab))
    lps = sorted((-rng.random() * 3 for _ in ids), reverse=True)
    return TokenLogprobs(lps[0], 1, ids, lps)


class FakeWorker:
    """Plays a backend worker: keeps per-request state with the real worker's bookkeeping
    (core.worker_state.WorkerState), writes each token id into the KV slot the plan chose,
    performs swaps and copies, and before 'sampling' checks that every position a request
    attends to holds that request's token. A wrong block table, a missed copy-on-write or a
    bad prefix hit shows up here. With a sliding window a query reads only the last `window`
    positions, and only there may a table not name the null block 0 (the core releases the
    blocks behind the window)."""

    def __init__(self, block_size: int, num_blocks: int, num_swap_blocks: int = 0, vocab: int = 50, window=None):
        self.bs = block_size
        self.window = window
        self.kv = [None] * (num_blocks * block_size)
        self.swap = [None] * (num_swap_blocks * block_size)
        self.state = WorkerState()
        self._run: SchedulerOutput | None = None  # the plan whose first step ran last
        self.vocab = vocab
        self.logprobs: dict[str, TokenLogprobs] = {}

    def restart(self, kv_lost: bool = False) -> None:
        """A replacement worker: no request state; its KV pool kept (shared memory) or lost."""
        self.state = WorkerState()
        self._run = None
        if kv_lost:
            self.kv = [None] * len(self.kv)

    def _first_read(self, start: int) -> int:
        """The first position that the queries of a chunk starting at `start` attend to."""
        return 0 if self.window is None else max(0, start - self.window + 1)

    def _copy_block(self, src_mem, src, dst_mem, dst):
        bs = self.bs
        dst_mem[dst * bs : (dst + 1) * bs] = src_mem[src * bs : (src + 1) * bs]

    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        return slot_mapping(
            np.array([block_ids]), np.zeros(end - start, dtype=np.int64), np.arange(start, end), self.bs
        ).tolist()

    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        """One step of `plan`; given a decode run again, its next step (as the worker runs it)."""
        if plan is self._run:
            chunks = self.state.apply(plan.next_in_run())
        else:
            self._run = plan
            chunks = self.state.apply(plan)
        for dev, sw in plan.swap_out:
            self._copy_block(self.kv, dev, self.swap, sw)
        for sw, dev in plan.swap_in:
            self._copy_block(self.swap, sw, self.kv, dev)
        for src, dst in plan.block_copies:
            self._copy_block(self.kv, src, self.kv, dst)
        for chunk in chunks:
            blocks = chunk.state.block_ids
            first_read = self._first_read(chunk.start)
            assert 0 not in blocks[first_read // self.bs :], f"{chunk.request_id}: the null block 0 in its window"
            for pos, slot in zip(
                range(chunk.start, chunk.start + chunk.num_tokens),
                self._slots(blocks, chunk.start, chunk.start + chunk.num_tokens),
            ):
                self.kv[slot] = (chunk.state.token_ids[pos], pos)
        sampled = {}
        self.logprobs = {}
        for chunk in chunks:
            st = chunk.state
            first_read = self._first_read(chunk.start)  # what attention reads
            for pos, slot in enumerate(self._slots(st.block_ids, first_read, st.num_computed), start=first_read):
                assert self.kv[slot] == (st.token_ids[pos], pos), (
                    f"{chunk.request_id} pos {pos}: KV holds {self.kv[slot]}"
                )
            if st.samples:
                token = fake_token(chunk.request_id, len(st.token_ids), self.vocab)
                if st.params.logprobs:
                    self.logprobs[chunk.request_id] = fake_top_tokens(st.token_ids, st.params.logprobs, self.vocab)
                if st.params.beam_width:
                    token = self.logprobs[chunk.request_id].top_token_ids[0]
                self.state.add_sampled(st, token)
                sampled[chunk.request_id] = token
        return sampled


def next_step(sched: Scheduler, in_flight: list[SchedulerOutput], async_scheduling: bool, run_steps: int = 1):
    """The engine core's order: with nothing in flight a step is planned by `schedule()`, and
    sent only if it is not empty (`is_empty`: an empty plan never reaches the workers, so
    nothing it carried may matter); under async scheduling the one after it is planned ahead
    (`schedule_ahead`, a decode run of up to `run_steps` steps) before its results are applied,
    whenever the scheduler can — while a run is in flight, only before its last step. Returns
    (the oldest step, to run and apply now, or None when the plan was empty; the plans made
    here); `in_flight` keeps the rest, and a run until its last step is returned (meanwhile its
    num_steps counts its steps after the one returned)."""
    made = []
    if not in_flight:
        plan = sched.schedule()
        made.append(plan)
        if plan.is_empty:
            return None, made
        in_flight.append(plan)
    head = in_flight[0]
    if async_scheduling and head.num_steps == 1:
        ahead = sched.schedule_ahead(head, run_steps)
        if ahead is not None:
            made.append(ahead)
            in_flight.append(ahead)
    if head.num_steps > 1:  # a decode run: its next step
        head.num_steps -= 1
        return head, made
    return in_flight.pop(0), made


def run_to_completion(
    sched: Scheduler,
    worker: FakeWorker | None = None,
    max_steps=10_000,
    check=True,
    async_scheduling=False,
    run_steps: int = 1,
):
    """Steps until every request ended; returns ({rid: output tokens}, {rid: finish_reason}, plans).
    async_scheduling: steps planned ahead as the engine core plans them (`next_step`), in decode
    runs of up to `run_steps` steps."""
    worker = worker or FakeWorker(sched.block_size, sched.cache_config.num_blocks, sched.cache_config.num_swap_blocks)
    outputs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    plans = []
    in_flight: list[SchedulerOutput] = []
    for _ in range(max_steps):
        if not in_flight and not sched.has_unfinished_requests():
            return outputs, reasons, plans
        plan, made = next_step(sched, in_flight, async_scheduling, run_steps)
        plans.extend(made)
        if plan is None:
            continue
        sampled = worker.execute(plan)
        for out in sched.update(plan, sampled, worker.logprobs):
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                reasons[out.request_id] = out.finish_reason
        if check:
            sched.check_invariants()
    raise AssertionError(f"requests still unfinished after {max_steps} steps")
