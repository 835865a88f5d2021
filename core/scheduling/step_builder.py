"""How a step's plan is put together, and what the core knows of the worker's state.

`WorkerView` is the core's record of which requests the worker holds state for: a request goes
out in full the first time it is scheduled (and again after a preemption), then only as
differences. `StepBuilder` collects one step's decisions — which requests compute how many
tokens, their block-table changes, swaps — within the token budget, and turns them into the
`SchedulerOutput` the workers receive."""

from __future__ import annotations

import numpy as np

from ..outputs import NewRequestData, SchedulerOutput
from ..request import Request


class WorkerView:
    def __init__(self):
        self.known: set[str] = set()  # requests whose state the worker holds
        self._finished: list[str] = []  # ended since the last step: the worker drops them
        self._preempted: list[str] = []  # preempted since the last step: dropped, resent later

    def forget(self, request: Request, preempted: bool) -> None:
        if request.request_id in self.known:
            self.known.discard(request.request_id)
            (self._preempted if preempted else self._finished).append(request.request_id)

    def take_dropped(self) -> tuple[list[str], list[str]]:
        """(finished, preempted) request ids since the last call."""
        dropped = self._finished, self._preempted
        self._finished, self._preempted = [], []
        return dropped


class StepBuilder:
    def __init__(self, budget: int, worker: WorkerView, kv):
        self.budget = budget  # tokens left in this step
        self.worker = worker
        self.kv = kv  # the KVCacheManager, for the block tables of requests new to the worker
        self.scheduled: dict[str, int] = {}  # request id -> tokens, in batch order
        self.requests: list[Request] = []  # the same requests
        self.new_requests: list[NewRequestData] = []
        self.deltas: dict[str, tuple[int, list[int]]] = {}
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.preempted = False  # something was preempted: nothing new starts in this step

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.scheduled

    def add(self, request: Request, num_tokens: int, delta: tuple[int, list[int]]) -> None:
        """`request` computes `num_tokens` tokens this step; `delta` is how allocate_slots changed
        its block table (the whole table goes instead when the worker lacks the request)."""
        rid = request.request_id
        self.scheduled[rid] = num_tokens
        self.requests.append(request)
        self.budget -= num_tokens
        if rid not in self.worker.known:
            self.worker.known.add(rid)
            self.new_requests.append(
                NewRequestData(
                    rid,
                    np.array(request.all_token_ids, dtype=np.int32),
                    request.num_prompt_tokens,
                    request.sampling_params,
                    self.kv.block_ids(rid),
                    request.num_computed_tokens,
                    sorted(request.eos_token_ids),
                    request.lora,
                )
            )
        elif delta[1]:
            self.deltas[rid] = delta

    def build(self, step_id: int, block_copies, appended: dict[str, list[int]], total_budget: int) -> SchedulerOutput:
        finished, preempted = self.worker.take_dropped()
        if appended and self.new_requests:
            # preempted and started again in this step (priority preemption): its tokens go whole
            new = {n.request_id for n in self.new_requests}
            appended = {rid: token for rid, token in appended.items() if rid not in new}
        return SchedulerOutput(
            step_id=step_id,
            new_requests=self.new_requests,
            num_scheduled_tokens=self.scheduled,
            block_table_deltas=self.deltas,
            block_copies=block_copies,
            swap_out=self.swap_out,
            swap_in=self.swap_in,
            finished_request_ids=finished,
            preempted_request_ids=preempted,
            appended_token_ids=appended,
            total_num_scheduled_tokens=total_budget - self.budget,
        )
