"""Continuous-batching scheduler, one rule for every phase: each step gives a request tokens
so that its `num_computed_tokens` catches up with its length, within a token budget.

A step has five phases, in order: running requests' decodes, beam groups' decodes (all of a
group's beams in one step, or none), running requests' unfinished prefills in chunks (so a
long prompt's chunks never stall the decodes, nor take the blocks they need), swapped
requests, then waiting ones. When a running request needs blocks and none are free, the
victim is the lowest-priority, latest-arriving request not yet scheduled in this step
(possibly itself), preempted by recompute or swap; nothing new starts in a step that had to
preempt.

Under the priority policy, a waiting request that cannot start (its first chunk's blocks are
not free, or max_num_seqs run) first preempts running requests of strictly lower priority for
itself (`_preempt_for_waiting`), and then starts in the same step; swapped and waiting
requests start in one priority order."""

from __future__ import annotations

import itertools
import logging
import time

import msgspec

from ..config import CacheConfig, SchedulerConfig, check_fits
from ..errors import InvalidParameter
from ..outputs import Fragmentation, RequestOutputDelta, SchedulerOutput, SchedulerStats
from ..request import EngineRequest, Request, RequestStatus, child_request_id, child_seed, sample_request_ids
from ..sampling_params import SamplingParams
from .adapters import Adapters
from .beam_search import BeamSearches, check_beams_fit
from .kv_cache_manager import KVCacheManager, whole_prompt_pooled
from .request_queue import RequestQueue
from .speculation import Speculation
from .step_builder import StepBuilder, WorkerView
from .structured import StructuredOutputs

RUNNING = RequestStatus.RUNNING
logger = logging.getLogger("pagedllm.core")


class Scheduler:
    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, structured: StructuredOutputs | None = None
    ):
        """structured: the engine's structured outputs (one that compiles grammars); by default
        one that takes the matchers add_request is given."""
        check_fits(cache_config, scheduler_config)
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(
            cache_config.block_size,
            cache_config.num_blocks,
            cache_config.enable_prefix_caching,
            cache_config.num_swap_blocks,
            cache_config.block_placement,
            cache_config.sliding_window,
        )
        self.by_priority = by_priority = scheduler_config.policy == "priority"
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.waiting = RequestQueue(by_priority)
        self.swapped = RequestQueue(by_priority)
        self.worker = WorkerView()
        self.beams = BeamSearches()
        self._step_ids = itertools.count()
        self.num_preemptions = 0
        self.num_priority_preemptions = 0  # steps in which a waiting request preempted for itself
        # requests ended by an error in their own handling, since the last take_failures():
        # (request id as the frontend knows it, what to tell the client)
        self._failures: list[tuple[str, str]] = []
        self.structured = structured or StructuredOutputs(scheduler_config.jump_forward)
        self._fragmentation, self._fragmentation_at = None, -1e9
        spec = scheduler_config.speculative
        self.spec = Speculation(spec, scheduler_config.max_model_len) if spec else None
        self.adapters = Adapters(scheduler_config.max_loras) if scheduler_config.enable_lora else None

    # --- requests in and out --------------------------------------------------------------
    def add_request(self, engine_request: EngineRequest, matcher=None) -> Request:
        """`matcher`: the request's compiled constraint (core/scheduling/structured.py), when it has one."""
        rid = engine_request.request_id
        if rid in self.requests or rid in self.beams.groups:
            raise InvalidParameter("request_id", f"{rid!r} is already in use")
        prompt = engine_request.prompt_token_ids
        if not prompt:
            raise InvalidParameter("prompt", "must contain at least one token")
        params = engine_request.sampling_params
        max_len, max_seqs = self.config.max_model_len, self.config.max_num_seqs
        if params.n > max_seqs:
            raise InvalidParameter("n", f"must be <= max_num_seqs ({max_seqs}), got {params.n}")
        if len(prompt) >= max_len:
            raise InvalidParameter(
                "prompt",
                f"has {len(prompt)} tokens; max_model_len is {max_len}, "
                f"which leaves room for at most {max_len - 1} prompt tokens",
            )
        room = max_len - len(prompt)
        max_tokens = min(params.max_tokens or room, room)
        if params.beam_width:
            check_beams_fit(
                params.beam_width,
                len(prompt) + max_tokens,
                self.block_size,
                self.kv.pool.num_usable,
                max_seqs,
                self.config.max_num_batched_tokens,
            )
            params = msgspec.structs.replace(params, logprobs=2 * params.beam_width)
            engine_request = msgspec.structs.replace(engine_request, sampling_params=params)
        request = Request.from_engine_request(engine_request, max_tokens)
        self.structured.started(request, matcher, engine_request.structured_outputs_after)
        if params.beam_width:
            self.beams.start(request, params, max_tokens)
        self.requests[rid] = request
        self.waiting.add(request)
        return request

    def abort_requests(self, request_ids) -> list[RequestOutputDelta]:
        """Abort now: blocks are freed before the next step. Unknown ids are ignored (the
        request may have just finished); a beam is aborted with its whole search, and a request
        with n > 1 that has not forked yet ends its samples not yet forked too."""
        outputs = []
        for rid in request_ids:
            ended = self._end(rid)
            outputs += [RequestOutputDelta(eid, [], "abort") for eid in ended]
        return outputs

    def _end(self, rid: str) -> list[str]:
        """Abort the request `rid` names (a beam's whole search); the ids that ended, as the
        frontend knows them: the search's, or the request's and those of its unforked samples."""
        member = self.requests.get(rid)
        if member is not None and member.beam_group is not None:
            rid = member.beam_group.group_id
        group = self.beams.pop(rid)
        if group is not None:  # every beam, also one forked in the middle of a failed update
            ended = [r for r in self.requests.values() if r.beam_group is group]
        else:
            ended = [r for r in (self.requests.get(rid),) if r]
        for request in ended:
            self._remove(request, RequestStatus.FINISHED_ABORTED)
        if not ended:
            return []
        unforked = ended[0].forks_pending if group is None else 0
        return sample_request_ids(rid, unforked + 1)

    def fail_request(self, rid: str, error: BaseException) -> None:
        """An error while handling one request: that request ends (its blocks freed), the
        frontend is told through take_failures(), and every other request goes on."""
        logger.error("request %r failed in the engine core and was ended", rid, exc_info=error)
        ended = self._end(rid)
        if ended:
            message = f"the engine failed while handling this request ({type(error).__name__}); the server log has why"
            self._failures.append((ended[0], message))

    def take_failures(self) -> list[tuple[str, str]]:
        failures, self._failures = self._failures, []
        return failures

    def _remove(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of whichever queue holds it and end it."""
        if request.status == RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, status)

    def fork_request(self, parent_id: str, child_id: str, sampling_params: SamplingParams | None = None) -> Request:
        """A running request splits in two that share every block (parallel sampling, beams)."""
        if child_id in self.requests:
            raise InvalidParameter("request_id", f"{child_id!r} is already in use")
        parent = self.requests.get(parent_id)
        if parent is None or parent.status != RUNNING:
            raise ValueError(f"can only fork a running request, {parent_id!r} is not one")
        child = parent.fork(child_id)
        if sampling_params is not None:
            child.sampling_params = sampling_params
        self.kv.fork(parent, child)
        self.requests[child_id] = child
        self.running.append(child)
        return child

    def _fork_samples(self, parent: Request) -> None:
        """n > 1: the prompt (but its last token) is computed; split into n samples."""
        params = parent.sampling_params
        for i in range(1, parent.forks_pending + 1):
            child_params = (
                params if params.seed is None else msgspec.structs.replace(params, seed=child_seed(params.seed, i))
            )
            self.fork_request(parent.request_id, child_request_id(parent.request_id, i), child_params)
        parent.forks_pending = 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- sequence slots (max_num_seqs) ----------------------------------------------------
    def _seats_taken(self, running: list[Request]) -> int:
        """Sequences that `running` hold, or will once they fork: the samples of n > 1 not yet
        forked, and each started beam search's beams up to its width."""
        seats = len(running)
        groups = set()
        for r in running:
            seats += r.forks_pending
            if r.beam_group is not None:
                groups.add(r.beam_group)
        return seats + sum(g.width - len(g.members) for g in groups)

    @staticmethod
    def _seats_needed(request: Request, running_groups) -> int:
        """The sequences that starting `request` adds (see _seats_taken)."""
        group = request.beam_group
        if group is not None and group not in running_groups:
            return 1 + group.width - len(group.members)
        return 1 + request.forks_pending

    def _running_groups(self) -> set:
        return {r.beam_group for r in self.running if r.beam_group is not None} if self.beams else set()

    # --- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = StepBuilder(self.config.max_num_batched_tokens, self.worker, self.kv)
        if self.by_priority and self.config.priority_preemption:
            self._preempt_for_waiting(step)
        decodes, prefills = self._running_by_phase()
        if self.spec:
            self.spec.propose(decodes, len(self.running))
        self._schedule_running(decodes, step)
        self._schedule_beam_groups(step)  # decodes too: before prefills take the blocks they need
        self._schedule_running(prefills, step)
        if step.preempted:
            self.running = [r for r in self.running if r.status == RUNNING]
        else:
            self._schedule_swapped(step)
            self._schedule_waiting(step)
        for request, num_tokens in zip(step.requests, step.scheduled.values()):
            request.num_computed_tokens += num_tokens
        known = self.worker.known
        plan = step.build(
            next(self._step_ids),
            self.kv.take_block_copies(),
            {**self.beams.take_appended(known), **self.structured.take_forced(known)},
            self.config.max_num_batched_tokens,
        )
        plan.structured_request_ids = self.structured.sampling(step.requests)
        if self.spec:
            self.spec.attach(plan)
        return plan

    def schedule_ahead(self, in_flight: SchedulerOutput, max_steps: int = 1) -> SchedulerOutput | None:
        """The step after `in_flight`, planned before its tokens are known (async scheduling):
        each request that samples in `in_flight` computes, next, the token the worker is about
        to sample — the worker holds that token itself. Only the steady state qualifies: every
        running request decodes in `in_flight`, nothing waits that could start, and the next
        tokens' blocks are free; otherwise None, and the step is planned after the results.
        Requests that reach their length limit in `in_flight` are left out; one that stops on
        EOS or a stop token computes one token in vain, which `update` then skips.

        Up to `max_steps` steps make a decode run (`num_steps`): the workers then go on by
        themselves, each step on the tokens they sampled in the one before, while no request
        reaches its length limit, no constraint or proposal needs the core between two steps,
        and the blocks of every step are free now. A request that stops within the run computes
        its remaining steps in vain, as above; what waits meanwhile starts after the run."""
        cfg = self.config
        if self.swapped or self.beams.groups or not self.running:
            return None
        if self.structured.blocks_planning_ahead(self.running):
            return None
        if self.spec and self.spec.blocks_planning_ahead(self.running):
            return None  # a proposal continues the token sampled in the step in flight
        if self.waiting and (self.by_priority or len(self.running) < cfg.max_num_seqs):
            return None  # one could start or preempt: that needs the results first
        scheduled = in_flight.num_scheduled_tokens
        requests = []
        max_len = cfg.max_model_len
        steps = max_steps if self.spec is None else 1
        for request in self.running:
            if request.request_id not in scheduled or request.forks_pending:
                return None
            num_tokens = len(request.all_token_ids)
            if request.num_computed_tokens != num_tokens:
                return None  # a prefill chunk that samples nothing yet
            if request.sampling_params.pooling is not None:
                continue  # an embedding: the step in flight ends it
            # tokens it may still sample after the one in flight, within max_tokens and the model
            room = min(request.max_tokens - (num_tokens - request.num_prompt_tokens + 1), max_len - num_tokens - 1)
            if room > 0:
                requests.append(request)
                steps = min(steps, room)
        budget = cfg.max_num_batched_tokens
        if not requests or len(requests) > budget:
            return None
        structured = self.structured.sampling(requests)  # each samples: masks sent after the results
        if structured:
            steps = 1  # each step's masks come from the core
        deltas = self.kv.allocate_decode_slots(requests, steps)
        if deltas is None and steps > 1:
            steps = 1
            deltas = self.kv.allocate_decode_slots(requests)
        if deltas is None:
            return None
        step = StepBuilder(budget, self.worker, self.kv)
        for request, delta in zip(requests, deltas):
            step.add(request, 1, delta)
            request.num_computed_tokens += steps
        plan = step.build(next(self._step_ids), self.kv.take_block_copies(), {}, budget)
        plan.structured_request_ids = structured
        plan.num_steps = steps
        return plan

    def _running_by_phase(self) -> tuple[list, list]:
        """(decodes, unfinished prefills) of the running requests, with the tokens each has left
        before it samples; beams whose group decodes next are in neither."""
        left = [(r, r.fork_point - r.num_computed_tokens) for r in self.running]
        return [d for d in left if d[1] == 1], [p for p in left if p[1] > 1]

    def _schedule_running(self, left: list[tuple[Request, int]], step: StepBuilder) -> None:
        allocate = self.kv.allocate_slots
        spec = self.spec
        for request, num_left in left:
            if step.budget <= 0:
                break
            if request.status != RUNNING:
                continue  # preempted as a victim earlier in this loop
            if spec:  # a proposal: its last token and the proposed ones, in one chunk
                num_left += spec.extra_tokens(request)
            num_new = min(num_left, step.budget)
            delta = allocate(request, num_new)
            if delta is None:
                delta = self._preempt_until_fits(request, num_new, step)
            if delta is not None:
                step.add(request, num_new, delta)

    def _preempt_until_fits(self, request: Request, num_new: int, step: StepBuilder):
        """Preempt others until `num_new` more tokens of `request` fit; None if the request
        itself had to be preempted."""
        while True:
            self._preempt(self._pick_victim(request, step), step)
            if request.status != RUNNING:
                return None
            delta = self.kv.allocate_slots(request, num_new)
            if delta is not None:
                return delta

    def _schedule_beam_groups(self, step: StepBuilder) -> None:
        """A beam group decodes together: all of its beams in this step, or none."""
        for group in list(self.beams.groups.values()):
            if step.budget <= 0:
                break
            members = group.members
            running = [m for m in members if m.status == RUNNING]
            if len(running) < len(members):
                # half admitted (a budget or the pool let in only some beams): it waits on
                # the others while they are next to start, and otherwise goes back to wait whole
                next_up = self.waiting and self._waiting_goes_first() and self.waiting.peek().beam_group is group
                if running and not next_up and not any(m.request_id in step for m in members):
                    self._preempt(running[0], step)
                continue
            if not self.beams.decodes_now(group, step) or len(members) > step.budget:
                continue
            while self.kv.blocks_needed(members, 1) > self.kv.pool.num_free:
                victim = self._pick_victim(members[0], step)
                self._preempt(victim, step)
                if victim.beam_group is group:
                    break
            if members[0].status == RUNNING:
                for member in members:
                    step.add(member, 1, self.kv.allocate_slots(member, 1))

    def _preempt_for_waiting(self, step: StepBuilder) -> None:
        """The first waiting request, if it ranks before every swapped one and cannot start,
        preempts running requests of strictly lower priority — the lowest, then the latest
        arrival first; beam groups whole — until its first chunk (and this step's decodes) fit
        and a sequence slot is free. Only running requests are victims, so one preempted for it
        is not preempted again for it; it starts in this step unless the budget runs out first."""
        if not self.waiting or not self._waiting_goes_first():
            return
        head = self.waiting.peek()
        hits, num_hit = self.kv.get_computed_blocks(head)
        num_tokens = num_hit + min(head.fork_point - num_hit, step.budget)
        lower = [r for r in self.running if r.priority > head.priority]
        if not lower or not self._can_start(head, hits, num_tokens, lower):
            return  # not even preempting all of them would let it start: preempt none
        preempted = False
        while not self._can_start(head, hits, num_tokens):
            victims = [r for r in self.running if r.status == RUNNING and r.priority > head.priority]
            if not victims:
                break
            self._preempt(max(victims, key=lambda r: (r.priority, r.arrival_time)), step)
            self.running = [r for r in self.running if r.status == RUNNING]
            preempted = True
        if preempted:
            step.preempted = False  # preempted so that `head` starts now: let it
            self.num_priority_preemptions += 1

    def _can_start(self, request: Request, hits: list, num_tokens: int, without: list[Request] = ()) -> bool:
        """Whether `request`, with prefix hits `hits`, could start its first `num_tokens` now,
        after this step's decodes take their new blocks; `without`: as if these running
        requests were preempted. A hit that only they hold is freed and then revived: it counts
        on both sides."""
        kv = self.kv
        gone = {r.request_id for r in without}
        running = [r for r in self.running if r.request_id not in gone]
        groups = {r.beam_group for r in running if r.beam_group is not None}
        if self._seats_taken(running) + self._seats_needed(request, groups) > self.config.max_num_seqs:
            return False
        released = kv.blocks_released_by(without) if without else set()
        need = kv.blocks_to_start(hits, num_tokens, released)
        # each running request's next token (a decode's whole step; a prefill chunk grows itself)
        decodes_need = sum(kv.num_blocks_for(r.num_computed_tokens + 1) > kv.num_blocks_of(r) for r in running)
        return need + decodes_need <= kv.pool.num_free + len(released)

    def _waiting_goes_first(self) -> bool:
        """Swapped requests start before waiting ones, except under the priority policy, where
        a waiting request that ranks before every swapped one goes first."""
        if not self.swapped:
            return True
        return self.by_priority and self.waiting.key(self.waiting.peek()) < self.swapped.key(self.swapped.peek())

    def _schedule_swapped(self, step: StepBuilder) -> None:
        if not self.swapped:
            return
        groups = self._running_groups()
        seats = self._seats_taken(self.running)
        adapters = self.adapters.for_step(self.running) if self.adapters else None
        while self.swapped and step.budget > 0:
            if self.waiting and self._waiting_goes_first():
                break
            request = self.swapped.peek()
            needed = self._seats_needed(request, groups)
            if seats + needed > self.config.max_num_seqs or (adapters and not adapters.admits(request)):
                break
            num_new = min(request.fork_point - request.num_computed_tokens, step.budget)
            # what its blocks and the free ones hold past its computed tokens: a prefill chunk
            # shrinks to that (swapped out before its window released a block, it comes back
            # with all of them, and a whole chunk beside them may not fit even an empty pool)
            fits = self.kv.pool.num_free * self.kv.block_size - request.num_computed_tokens
            if num_new > fits:
                if fits < 1:
                    break
                num_new = fits
            self.swapped.pop()
            step.swap_in.extend(self.kv.swap_in(request))
            delta = self.kv.allocate_slots(request, num_new)
            request.status = RUNNING
            self.running.append(request)
            seats += needed
            if request.beam_group is not None:
                groups.add(request.beam_group)
            step.add(request, num_new, delta)

    def _schedule_waiting(self, step: StepBuilder) -> None:
        """Waiting requests, with their prefix-cache hits, while budget, sequences and blocks allow."""
        if not self.waiting:
            return
        max_seqs = self.config.max_num_seqs
        groups = self._running_groups()
        seats = self._seats_taken(self.running)
        adapters = self.adapters.for_step(self.running) if self.adapters else None
        passed_over = []  # waiting for an adapter slot: those behind may go first (as vLLM's)
        try:
            while self.waiting and self._waiting_goes_first() and step.budget > 0:
                request = self.waiting.peek()
                needed = self._seats_needed(request, groups)
                if seats + needed > max_seqs:
                    break
                if adapters and not adapters.admits(request):
                    passed_over.append(self.waiting.pop())
                    continue
                computed_blocks, num_hit = self.kv.get_computed_blocks(request)
                num_new = min(request.fork_point - num_hit, step.budget)
                delta = self.kv.allocate_slots(request, num_new, computed_blocks)
                if delta is None:
                    break
                self.waiting.pop()
                if self.kv.enable_caching:
                    self.kv.pool.record_lookup(request.num_tokens, num_hit)
                if request.num_cached_tokens < 0:  # first admission
                    request.num_cached_tokens = num_hit
                    request.queued_seconds = time.monotonic() - request.arrival_time
                request.num_computed_tokens = num_hit
                request.status = RUNNING
                self.running.append(request)
                seats += needed
                if request.beam_group is not None:
                    groups.add(request.beam_group)
                if num_new == 0:  # n > 1 and nothing to compute before forking
                    self._fork_samples(request)
                else:
                    step.add(request, num_new, delta)
        finally:
            for request in passed_over:
                self.waiting.add(request)

    # --- results --------------------------------------------------------------------------
    def update(
        self,
        plan: SchedulerOutput,
        sampled_token_ids: dict[str, int],
        logprobs: dict | None = None,
        spec_token_ids: dict[str, list[int]] | None = None,
    ) -> list[RequestOutputDelta]:
        """Apply the tokens the worker sampled. Requests in the middle of a chunked prefill
        sampled nothing; requests aborted since `schedule()` are skipped. Beams append nothing
        themselves: their group chooses from the top tokens in `logprobs`. A speculating
        request gets the proposed tokens the model confirmed and the model's next one."""
        outputs = []
        requests = self.requests
        drafts = plan.draft_token_ids
        for rid in plan.num_scheduled_tokens:
            request = requests.get(rid)
            if request is None or request.status != RUNNING:
                continue
            try:
                if drafts and rid in drafts:
                    outputs.append(self._accept(request, plan, spec_token_ids[rid]))
                elif request.num_computed_tokens < len(request.all_token_ids):
                    if request.forks_pending and request.num_computed_tokens == request.fork_point:
                        self._fork_samples(request)
                elif request.sampling_params.pooling is not None:
                    outputs.append(self._pooled(request))
                elif request.beam_group is not None:
                    self.beams.report(request, logprobs[rid])
                else:
                    if request.spec_backoff:
                        self.spec.decoded(request)
                    outputs.append(self._append_token(request, sampled_token_ids[rid]))
            except Exception as e:  # noqa: BLE001 - one request's failure is its own (fail_request logs it)
                self.fail_request(rid, e)
        if self.beams:
            outputs += self.beams.advance(self.fork_request, self._finish, self.fail_request)
        if len(self.running) != len(self.requests) - len(self.waiting) - len(self.swapped):
            self.running = [r for r in self.running if r.status == RUNNING]
        return outputs

    def _pooled(self, request: Request) -> RequestOutputDelta:
        """An embedding request's prompt is computed: it ends there (the engine adds the
        worker's vector to its output); its blocks go back, the full ones to the prefix cache."""
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        return RequestOutputDelta(
            request.request_id,
            [],
            "stop",
            queued_seconds=request.queued_seconds,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    def _accept(self, request: Request, plan: SchedulerOutput, tokens: list[int]) -> RequestOutputDelta:
        """A speculating request's step: the first len(tokens) - 1 proposed tokens were confirmed,
        then the model's own. The rest of the proposal's KV is rolled back — its slots, and the
        blocks that held only them, go back — before the confirmed tokens join (blocks they fill
        enter the prefix cache then, never with an unconfirmed token)."""
        request.num_computed_tokens -= self.spec.accept(request, plan, tokens)
        self.kv.forget_beyond(request)
        out = None
        for token in tokens:
            delta = self._append_token(request, token)
            if out is None:
                out = delta
            else:
                ids = out.new_token_ids + delta.new_token_ids
                out = msgspec.structs.replace(
                    out, new_token_ids=ids, finish_reason=delta.finish_reason, stop_reason=delta.stop_reason
                )
            if delta.finish_reason is not None:  # a stop inside the confirmed run: nothing after it
                break
        return out

    def _append_token(self, request: Request, token: int) -> RequestOutputDelta:
        """The sampled token joins the request, and after it (jump-forward) the tokens its
        grammar then forces; each is checked in turn as if sampled alone — the grammar's end,
        a stop token or EOS past min_tokens, the length — so the output is the same with
        jump-forward as without, ending at the first token that ends it."""
        tokens = request.all_token_ids
        tokens.append(token)
        if request.num_computed_tokens >= len(tokens):  # its slot was planned ahead
            self.kv.cache_planned_blocks(request)
        new_tokens = [token]
        status = self._ended_by(request, token)
        if status is None and request.matcher is not None:
            status = self.structured.jump_forward(request, new_tokens, self._ended_by, self.worker.known)
        queued = request.queued_seconds if len(tokens) - request.num_prompt_tokens == len(new_tokens) else None
        if status is None:
            return RequestOutputDelta(request.request_id, new_tokens, queued_seconds=queued)
        self._finish(request, status)
        return RequestOutputDelta(  # the engine no longer finds the request: its prefix-cache hit goes along
            request.request_id,
            new_tokens,
            status.finish_reason,
            request.stop_reason,
            queued_seconds=queued,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    def _ended_by(self, request: Request, token: int) -> RequestStatus | None:
        """How the token just appended ends the request, if it does."""
        if request.matcher is not None and self.structured.consume(request, token):
            return RequestStatus.FINISHED_STOPPED  # the output is complete: nothing may follow
        num_tokens = len(request.all_token_ids)
        num_output = num_tokens - request.num_prompt_tokens
        if num_output >= request.min_tokens and (token in request.eos_token_ids or token in request.stop_ids):
            request.stop_reason = token if token in request.stop_ids else None
            return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_tokens or num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # --- preemption -----------------------------------------------------------------------
    def _pick_victim(self, current: Request, step: StepBuilder) -> Request:
        by_priority = self.config.policy == "priority"
        preemptible = self.beams.preemptible
        candidates = [
            r
            for r in self.running
            if r.status == RUNNING and r.request_id not in step and preemptible(r, current, step)
        ]
        return max(candidates, key=lambda r: (r.priority if by_priority else 0, r.arrival_time))

    def _preempt(self, request: Request, step: StepBuilder) -> None:
        members, recompute_only = self.beams.preemption_unit(request, step)
        step.preempted = True
        for member in members:
            member.num_preemptions += 1
            self.num_preemptions += 1
            self.worker.forget(member, preempted=True)
            # a mean or first-token embedding's partial pooling goes with the worker's state of it
            if (
                self.config.preemption_mode == "swap"
                and not recompute_only
                and not whole_prompt_pooled(member.sampling_params)
            ):
                pairs = self.kv.swap_out(member)
                if pairs is not None:
                    step.swap_out.extend(pairs)
                    member.status = RequestStatus.SWAPPED
                    self.swapped.add(member)
                    continue
            self._requeue_for_recompute(member)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self.worker.forget(request, preempted=False)
        del self.requests[request.request_id]

    # --- recovery -------------------------------------------------------------------------
    def recover(self, failed: list[SchedulerOutput], kv_lost: bool) -> int:
        """The workers were replaced and hold no request state; every running request goes to
        them in full with the next step. `failed`: the steps they did not finish (two under
        async scheduling), planned again from the state before them. kv_lost: their KV pool
        went with them (device memory), so everything running is recomputed. Returns the
        computed tokens kept (not recomputed)."""
        recompute: dict[str, Request] = {}
        if failed:
            # a request started on prefix hits alone (a beam, a sample about to fork) was never
            # sent, and its hits may be blocks keyed in a failed step, never written; a block
            # copied on write in a failed step is empty, and the copy cannot be redone later:
            # its source may be freed (its holders requeued) and refilled before then
            copied = {dst for plan in failed for _, dst in plan.block_copies}
            for r in self.running:
                if r.request_id not in self.worker.known or copied.intersection(self.kv.block_ids(r.request_id)):
                    recompute[r.request_id] = r
        for plan in reversed(failed):  # the latest undone first, so each undo meets its own state
            new = {n.request_id for n in plan.new_requests}
            for rid, num_tokens in plan.num_scheduled_tokens.items():
                request = self.requests.get(rid)
                if request is None or request.status != RUNNING or rid in recompute:
                    continue
                if rid in new:  # admitted, resumed or forked in that step: it may lean on blocks never written
                    recompute[rid] = request
                else:  # a decode run: its steps not yet applied
                    request.num_computed_tokens -= num_tokens * plan.num_steps
                    self.kv.forget_beyond(request)
            swapped_out = {s for _, s in plan.swap_out}
            for r in self.swapped:
                if set(self.kv.swapped[r.request_id]) & swapped_out:
                    recompute[r.request_id] = r
        # a sliding window: the undone steps released the blocks behind their own windows, which
        # the step planned again (starting earlier) reads; released blocks do not come back
        recompute.update((r.request_id, r) for r in self.running if self.kv.window_released(r))
        if kv_lost:
            recompute.update((r.request_id, r) for r in self.running)
        # an embedding's partial pooling (a MEAN's sum, a CLS's first row) went with the workers
        recompute.update((r.request_id, r) for r in self.running if whole_prompt_pooled(r.sampling_params))
        for request in recompute.values():
            self._requeue_for_recompute(request)
        if failed and not kv_lost:
            # the requests just requeued, and any that ended with their step unfinished (aborted
            # meanwhile, or stopped with a step planned ahead), left blocks keyed for KV that may
            # never have been written: no cached free block stays
            self.kv.pool.drop_free_cached()
        self.running = [r for r in self.running if r.status == RUNNING]
        if kv_lost:
            self.kv.pool.reset_prefix_cache()
        self.worker = WorkerView()
        self.structured.reset()  # every running request goes to the new workers whole
        self.kv.pool.announce()  # KV events: the cache as it stands, to subscribers that lost track
        return sum(r.num_computed_tokens for r in self.running) + sum(r.num_computed_tokens for r in self.swapped)

    def _requeue_for_recompute(self, request: Request) -> None:
        if request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.add(request)

    # --- stats and checks -----------------------------------------------------------------
    def fragmentation(self) -> Fragmentation:
        return self.kv.fragmentation({r.request_id: r.num_tokens for r in self.running})

    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        now = time.monotonic()
        # of the live tables: sampled while requests run (an idle engine keeps the last sample)
        if self.running and now - self._fragmentation_at >= 1.0:
            self._fragmentation, self._fragmentation_at = self.fragmentation(), now
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            kv_cache_usage=pool.usage,
            prefix_cache_queries=pool.prefix_queries,
            prefix_cache_hits=pool.prefix_hits,
            num_preemptions=self.num_preemptions,
            peak_blocks_used=pool.peak_used,
            num_blocks=pool.num_blocks,
            fragmentation=self._fragmentation,
            spec_decode=self.spec.stats.copy() if self.spec else None,
            num_cached_blocks=pool.num_cached,
        )

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's reset_prefix_cache): only while no request holds a
        block; whether it was reset."""
        if self.running or self.swapped or self.kv.pool.num_used:
            return False
        self.kv.pool.reset_prefix_cache()
        return True

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        running = {r.request_id for r in self.running}
        waiting = {r.request_id for r in self.waiting}
        swapped = {r.request_id for r in self.swapped}
        assert len(running) == len(self.running), "a request is twice in running"
        assert not (running & waiting or running & swapped or waiting & swapped), "a request is in two queues"
        assert running | waiting | swapped == set(self.requests), "queues and requests disagree"
        assert set(self.kv.tables) == running, "only running requests hold device blocks"
        assert set(self.kv.swapped) == swapped, "only swapped requests hold swap blocks"
        for request in self.running:
            assert request.status == RUNNING
            assert len(self.kv.tables[request.request_id]) >= self.kv.num_blocks_for(request.num_computed_tokens), (
                f"{request} lacks blocks"
            )
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.num_computed_tokens == 0
        for gid, group in self.beams.groups.items():
            assert group.members, f"beam group {gid} has no beams"
            for member in group.members:
                assert self.requests.get(member.request_id) is member and member.beam_group is group
