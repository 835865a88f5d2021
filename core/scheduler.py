"""Continuous-batching scheduler, one rule for every phase: each step gives a request tokens
so that its `num_computed_tokens` catches up with its length, within a token budget.

Order per step: running requests (decodes before unfinished prefills, so a long prompt's
chunks never stall the decodes), then swapped requests, then waiting ones. When a running
request needs blocks and none are free, the victim is the lowest-priority, latest-arriving
request not yet scheduled in this step (possibly itself), preempted by recompute or swap."""

from __future__ import annotations

import itertools
import time

import msgspec
import numpy as np

from .beam_search import BeamGroup
from .config import CacheConfig, SchedulerConfig, check_fits
from .errors import InvalidParameter
from .kv_cache_manager import KVCacheManager
from .outputs import BeamResult, EngineCoreOutput, NewRequestData, SchedulerOutput
from .request import EngineRequest, Request, RequestStatus
from .sampling_params import SamplingParams


def child_request_id(parent_id: str, index: int) -> str:
    """The id of sample `index` (1..n-1) of a request with n > 1; sample 0 keeps the parent id."""
    return f"{parent_id}#{index}"


def child_seed(seed: int, index: int) -> int:
    return hash((seed, index, "sample")) & 0x7FFF_FFFF_FFFF_FFFF
from .request_queue import RequestQueue


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig):
        check_fits(cache_config, scheduler_config)
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(cache_config.block_size, cache_config.num_blocks,
                                 cache_config.enable_prefix_caching, cache_config.num_swap_blocks)
        by_priority = scheduler_config.policy == "priority"
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.waiting = RequestQueue(by_priority)
        self.swapped = RequestQueue(by_priority)
        self._on_worker: set[str] = set()  # requests whose state the worker holds
        self.groups: dict[str, BeamGroup] = {}  # beam searches by request id
        self._appended: dict[str, int] = {}  # beam tokens chosen here, for the worker
        self._candidates: dict[str, dict[str, list]] = {}  # beam group -> member -> top tokens
        self._beam_ids = itertools.count(1)
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
        self._step_ids = itertools.count()
        self.num_preemptions = 0

    # --- requests in and out --------------------------------------------------------------
    def add_request(self, engine_request: EngineRequest) -> Request:
        rid = engine_request.request_id
        if rid in self.requests or rid in self.groups:
            raise InvalidParameter("request_id", f"{rid!r} is already in use")
        prompt = engine_request.prompt_token_ids
        if not prompt:
            raise InvalidParameter("prompt", "must contain at least one token")
        max_len = self.config.max_model_len
        n = engine_request.sampling_params.n
        if n > self.config.max_num_seqs:
            raise InvalidParameter("n", f"must be <= max_num_seqs ({self.config.max_num_seqs}), got {n}")
        if len(prompt) >= max_len:
            raise InvalidParameter(
                "prompt", f"has {len(prompt)} tokens; max_model_len is {max_len}, "
                          f"which leaves room for at most {max_len - 1} prompt tokens")
        room = max_len - len(prompt)
        params = engine_request.sampling_params
        max_tokens = min(params.max_tokens or room, room)
        if params.beam_width:
            self._check_beam_fits(params.beam_width, len(prompt) + max_tokens)
            params = msgspec.structs.replace(params, logprobs=2 * params.beam_width)
            engine_request = msgspec.structs.replace(engine_request, sampling_params=params)
        request = Request.from_engine_request(engine_request, max_tokens)
        if params.beam_width:
            group = BeamGroup(rid, params.beam_width, max_tokens, params.length_penalty,
                              None if params.ignore_eos else engine_request.eos_token_id)
            group.members = [request]
            request.beam_group = group
            self.groups[rid] = group
        self.requests[rid] = request
        self.waiting.add(request)
        return request

    def _check_beam_fits(self, width: int, tokens: int) -> None:
        """After a recompute preemption the beams share nothing: all of them must fit alone."""
        need = width * -(-tokens // self.block_size)
        usable = self.kv.pool.num_usable
        if need > usable:
            raise InvalidParameter("beam_width", f"{width} beams of {tokens} tokens need up to {need} KV "
                                                 f"blocks; the cache has {usable}")

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        """Abort now: blocks are freed before the next step. Unknown ids are ignored (the
        request may have just finished)."""
        outputs = []
        for rid in request_ids:
            member = self.requests.get(rid)
            if member is not None and member.beam_group is not None:
                rid = member.beam_group.group_id  # a beam is aborted with its whole search
            group = self.groups.pop(rid, None)
            if group is not None:
                for member in group.members:
                    self._remove(member, RequestStatus.FINISHED_ABORTED)
                self._candidates.pop(rid, None)
                outputs.append(EngineCoreOutput(rid, [], "abort"))
                continue
            request = self.requests.get(rid)
            if request is None:
                continue
            self._remove(request, RequestStatus.FINISHED_ABORTED)
            outputs.append(EngineCoreOutput(rid, [], "abort"))
        return outputs

    def _remove(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of whichever queue holds it and end it."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, status)

    def fork_request(self, parent_id: str, child_id: str,
                     sampling_params: SamplingParams | None = None) -> Request:
        """A running request splits in two that share every block (parallel sampling, beams)."""
        if child_id in self.requests:
            raise InvalidParameter("request_id", f"{child_id!r} is already in use")
        parent = self.requests.get(parent_id)
        if parent is None or parent.status != RequestStatus.RUNNING:
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
            child_params = params if params.seed is None else \
                msgspec.structs.replace(params, seed=child_seed(params.seed, i))
            self.fork_request(parent.request_id, child_request_id(parent.request_id, i), child_params)
        parent.forks_pending = 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # --- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        kv = self.kv
        scheduled: dict[str, int] = {}
        deltas: dict[str, tuple[int, list[int]]] = {}
        new_requests: list[NewRequestData] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        preempted_now = False

        def record(request: Request, num_tokens: int, delta) -> None:
            scheduled[request.request_id] = num_tokens
            if request.request_id not in self._on_worker:
                self._on_worker.add(request.request_id)
                new_requests.append(NewRequestData(
                    request.request_id, np.array(request.all_token_ids, dtype=np.int32),
                    request.num_prompt_tokens,
                    request.sampling_params, kv.block_ids(request.request_id),
                    request.num_computed_tokens, request.eos_token_id))
            elif delta[1]:
                deltas[request.request_id] = delta
            request.num_computed_tokens += num_tokens  # scheduled requests are never preempted later

        # 1. running: decodes first, then unfinished prefills
        prefills = []
        for phase in (self.running, prefills):
            for request in phase:
                if budget <= 0:
                    break
                if request.status != RequestStatus.RUNNING:
                    continue  # preempted as a victim earlier in this loop
                remaining = request.fork_point - request.num_computed_tokens
                if remaining <= 0:
                    continue
                if phase is self.running and remaining > 1:
                    prefills.append(request)
                    continue
                num_new = min(remaining, budget)
                while True:
                    delta = kv.allocate_slots(request, num_new)
                    if delta is not None:
                        break
                    victim = self._pick_victim(request, scheduled)
                    self._preempt(victim, swap_out, scheduled)
                    preempted_now = True
                    if request.status != RequestStatus.RUNNING:
                        break
                if request.status != RequestStatus.RUNNING:
                    continue
                record(request, num_new, delta)
                budget -= num_new
        # beam groups decode together: all of a group's beams in one step, or none
        for group in list(self.groups.values()):
            if budget <= 0:
                break
            members = group.members
            if not all(m.status == RequestStatus.RUNNING for m in members):
                if any(m.status == RequestStatus.RUNNING for m in members) and \
                        not any(m.request_id in scheduled for m in members):
                    self._preempt_group(group, swap_out)  # half admitted: wait whole, never stall
                    preempted_now = True
                continue
            if (any(m.num_computed_tokens != m.num_tokens - 1 or m.request_id in scheduled for m in members)
                    or len(members) > budget):
                continue
            while kv.blocks_needed(members, 1) > kv.pool.num_free:
                victim = self._pick_victim(members[0], scheduled)
                self._preempt(victim, swap_out, scheduled)
                preempted_now = True
                if victim.beam_group is group:
                    break
            if members[0].status != RequestStatus.RUNNING:
                continue
            for member in members:
                record(member, 1, kv.allocate_slots(member, 1))
            budget -= len(members)
        if preempted_now:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]

        # 2. swapped, then 3. waiting; nothing new starts in a step that had to preempt
        max_seqs = self.config.max_num_seqs
        while (self.swapped and not preempted_now and budget > 0
               and len(self.running) < max_seqs):
            request = self.swapped.peek()
            num_new = min(request.fork_point - request.num_computed_tokens, budget)
            blocks_needed = -(-(request.num_computed_tokens + num_new) // self.block_size)
            if blocks_needed > kv.pool.num_free:
                break
            self.swapped.pop()
            swap_in.extend(kv.swap_in(request))
            delta = kv.allocate_slots(request, num_new)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            record(request, num_new, delta)
            budget -= num_new

        while (self.waiting and not self.swapped and not preempted_now and budget > 0
               and len(self.running) + 1 + self.waiting.peek().forks_pending <= max_seqs):
            request = self.waiting.peek()
            computed_blocks, num_hit = kv.get_computed_blocks(request)
            num_new = min(request.fork_point - num_hit, budget)
            delta = kv.allocate_slots(request, num_new, computed_blocks)
            if delta is None:
                break
            self.waiting.pop()
            if kv.enable_caching:
                kv.pool.record_lookup(request.num_tokens, num_hit)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                request.queued_seconds = time.monotonic() - request.arrival_time
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if num_new == 0:  # n > 1 and nothing to compute before forking
                self._fork_samples(request)
                continue
            record(request, num_new, delta)
            budget -= num_new

        finished, self._finished_ids = self._finished_ids, []
        preempted, self._preempted_ids = self._preempted_ids, []
        appended = {rid: tok for rid, tok in self._appended.items() if rid in self._on_worker}
        self._appended = {}
        return SchedulerOutput(
            step_id=next(self._step_ids), new_requests=new_requests,
            num_scheduled_tokens=scheduled, block_table_deltas=deltas,
            block_copies=kv.take_block_copies(), swap_out=swap_out, swap_in=swap_in,
            finished_request_ids=finished, preempted_request_ids=preempted, appended_token_ids=appended,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget)

    def update(self, plan: SchedulerOutput, sampled_token_ids: dict[str, int],
               logprobs: dict | None = None) -> list[EngineCoreOutput]:
        """Apply the tokens the worker sampled. Requests in the middle of a chunked prefill
        sampled nothing; requests aborted since `schedule()` are skipped. Beams append nothing
        themselves: their group chooses from the top tokens in `logprobs`."""
        outputs = []
        beam_groups = []
        any_finished = False
        max_model_len = self.config.max_model_len
        requests = self.requests
        RUNNING = RequestStatus.RUNNING
        for rid in plan.num_scheduled_tokens:
            request = requests.get(rid)
            if request is None or request.status != RUNNING:
                continue
            tokens = request.all_token_ids
            if request.num_computed_tokens < len(tokens):
                if request.forks_pending and request.num_computed_tokens == request.fork_point:
                    self._fork_samples(request)
                continue
            if request.beam_group is not None:
                group = request.beam_group
                lp = (logprobs or {})[rid]
                self._candidates.setdefault(group.group_id, {})[rid] = list(zip(lp.top_token_ids, lp.top_logprobs))
                if group not in beam_groups:
                    beam_groups.append(group)
                continue
            token = sampled_token_ids[rid]
            tokens.append(token)
            num_output = len(tokens) - request.num_prompt_tokens
            status = None
            if num_output >= request.min_tokens and (
                    token == request.eos_token_id or token in request.stop_ids):
                status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token if token in request.stop_ids else None
            elif num_output >= request.max_tokens or len(tokens) >= max_model_len:
                status = RequestStatus.FINISHED_LENGTH
            queued = request.queued_seconds if num_output == 1 else None
            if status is None:
                outputs.append(EngineCoreOutput(rid, [token], queued_seconds=queued))
            else:
                self._finish(request, status)
                any_finished = True
                outputs.append(EngineCoreOutput(rid, [token], status.finish_reason, request.stop_reason,
                                                queued_seconds=queued))
        for group in beam_groups:
            out = self._advance_beams(group)
            any_finished = True
            if out is not None:
                outputs.append(out)
        if any_finished:
            self.running = [r for r in self.running if r.status == RUNNING]
        return outputs

    def _advance_beams(self, group: BeamGroup) -> EngineCoreOutput | None:
        """All beams of the group computed a token's logits: choose the continuations, fork
        beams chosen more than once, drop beams not chosen, and end the search if done."""
        reported = self._candidates.get(group.group_id, {})
        members = group.members
        if any(m.request_id not in reported for m in members):
            return None
        del self._candidates[group.group_id]
        histories = [m.output_token_ids for m in members]
        step = group.step([reported[m.request_id] for m in members], histories)
        if step.done:
            del self.groups[group.group_id]
            for member in members:
                self._finish(member, RequestStatus.FINISHED_STOPPED)
            beams = [BeamResult(h.token_ids, h.cum_logprob, h.score) for h in group.results()]
            return EngineCoreOutput(group.group_id, [], "stop", None, beams)
        by_parent: dict[int, list] = {}
        for cont in step.running:
            by_parent.setdefault(cont.parent, []).append(cont)
        new_members = {}
        for index, member in enumerate(members):
            conts = by_parent.get(index)
            if not conts:
                self._finish(member, RequestStatus.FINISHED_ABORTED)  # frees only what it alone held
                continue
            for cont in conts[1:]:
                child = self.fork_request(member.request_id, f"{group.group_id}#beam{next(self._beam_ids)}")
                child.beam_group = group
                child.all_token_ids.append(cont.token)
                new_members[id(cont)] = child
            member.all_token_ids.append(conts[0].token)
            self._appended[member.request_id] = conts[0].token
            new_members[id(conts[0])] = member
        group.members = [new_members[id(c)] for c in step.running]
        return None

    # --- preemption -----------------------------------------------------------------------
    def _pick_victim(self, current: Request, scheduled: dict[str, int]) -> Request:
        by_priority = self.config.policy == "priority"
        candidates = [r for r in self.running
                      if r.status == RequestStatus.RUNNING and r.request_id not in scheduled
                      and (r.beam_group is None or r is current or r.beam_group is current.beam_group
                           or not any(m.request_id in scheduled for m in r.beam_group.members))]
        return max(candidates, key=lambda r: (r.priority if by_priority else 0, r.arrival_time))

    def _preempt_group(self, group: BeamGroup, swap_out) -> None:
        """A beam group leaves the running batch whole, by recompute (its beams are forks that
        share blocks; swapping them one by one would not keep that sharing)."""
        self._candidates.pop(group.group_id, None)
        for member in group.members:
            if member.status == RequestStatus.RUNNING:
                self._preempt(member, swap_out, group_member=True)

    def _preempt(self, request: Request, swap_out: list[tuple[int, int]], scheduled=(),
                 group_member: bool = False) -> None:
        group = request.beam_group
        if group is not None and not group_member:
            if not any(m.request_id in scheduled for m in group.members):
                self._preempt_group(group, swap_out)
                return
            group_member = True  # a sibling already runs this step: this beam alone waits
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._forget_on_worker(request, self._preempted_ids)
        if self.config.preemption_mode == "swap" and not group_member:
            pairs = self.kv.swap_out(request)
            if pairs is not None:
                swap_out.extend(pairs)
                request.status = RequestStatus.SWAPPED
                self.swapped.add(request)
                return
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.add(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self._forget_on_worker(request, self._finished_ids)
        del self.requests[request.request_id]

    def _forget_on_worker(self, request: Request, into: list[str]) -> None:
        if request.request_id in self._on_worker:
            self._on_worker.discard(request.request_id)
            into.append(request.request_id)

    # --- stats and checks -----------------------------------------------------------------
    def stats(self) -> dict:
        pool = self.kv.pool
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_swapped": len(self.swapped),
            "kv_cache_usage": pool.usage,
            "prefix_cache_queries": pool.prefix_queries,
            "prefix_cache_hits": pool.prefix_hits,
            "num_preemptions": self.num_preemptions,
        }

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        running = {r.request_id for r in self.running}
        waiting = {r.request_id for r in self.waiting}
        swapped = {r.request_id for r in self.swapped}
        assert len(running) == len(self.running), "a request is twice in running"
        assert not (running & waiting or running & swapped or waiting & swapped), \
            "a request is in two queues"
        assert running | waiting | swapped == set(self.requests), "queues and requests disagree"
        assert set(self.kv.tables) == running, "only running requests hold device blocks"
        assert set(self.kv.swapped) == swapped, "only swapped requests hold swap blocks"
        for request in self.running:
            assert request.status == RequestStatus.RUNNING
            need = -(-request.num_computed_tokens // self.block_size)
            assert len(self.kv.tables[request.request_id]) >= need, f"{request} lacks blocks"
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.num_computed_tokens == 0
        for gid, group in self.groups.items():
            assert group.members, f"beam group {gid} has no beams"
            for member in group.members:
                assert self.requests.get(member.request_id) is member and member.beam_group is group
