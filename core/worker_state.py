"""The worker's per-request state, kept up to date from each step's differences alone.

The core sends a request's whole state once (`NewRequestData`), then only what changed: new
block ids, tokens it appended itself, and which requests ended or were preempted. `apply` is
the one place those differences are applied; the backend worker and the core's tests both
use it, so the stateful scheduler tests cover the real worker's bookkeeping. Torch-free.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .outputs import SchedulerOutput
from .sampling_params import SamplingParams


class ProtocolError(RuntimeError):
    """A step message contradicts what the worker holds (a bug on one side or the other)."""


class RequestState:
    __slots__ = ("token_ids", "num_prompt_tokens", "params", "block_ids", "num_computed", "eos_token_ids", "lora")

    def __init__(
        self,
        token_ids: list[int],
        num_prompt_tokens: int,
        params: SamplingParams,
        block_ids: list[int],
        num_computed: int,
        eos_token_ids: list[int],
        lora=None,
    ):
        self.lora = lora  # its LoRARequest, or None
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.params = params
        self.block_ids = block_ids
        self.num_computed = num_computed
        self.eos_token_ids = eos_token_ids

    @property
    def samples(self) -> bool:
        """Whether the tokens computed so far end with the last known one: a token is sampled
        (not by an embedding request: its prompt is pooled instead)."""
        return self.num_computed == len(self.token_ids) and self.params.pooling is None


class ScheduledChunk(NamedTuple):
    """One request's share of a step: tokens [start, start + num_tokens) of `state`."""

    request_id: str
    state: RequestState
    start: int
    num_tokens: int

    @property
    def token_ids(self) -> list[int]:
        return self.state.token_ids[self.start : self.start + self.num_tokens]


class WorkerState:
    def __init__(self):
        self.requests: dict[str, RequestState] = {}

    def apply(self, plan: SchedulerOutput) -> list[ScheduledChunk]:
        """Bring the state up to the plan and advance each scheduled request's computed count;
        returns the step's chunks in the plan's batch order."""
        requests = self.requests
        for rid in plan.finished_request_ids:
            requests.pop(rid, None)
        for rid in plan.preempted_request_ids:
            requests.pop(rid, None)
        for new in plan.new_requests:
            if new.request_id in requests:
                raise ProtocolError(f"request {new.request_id!r} sent as new while the worker holds it")
            requests[new.request_id] = RequestState(
                new.token_ids.tolist(),
                new.num_prompt_tokens,
                new.sampling_params,
                list(new.block_ids),
                new.num_computed_tokens,
                new.eos_token_ids,
                new.lora,
            )
        for rid, (start, ids) in plan.block_table_deltas.items():
            blocks = requests[rid].block_ids
            del blocks[start:]
            blocks.extend(ids)
        for rid, tokens in plan.appended_token_ids.items():
            requests[rid].token_ids.extend(tokens)
        chunks = []
        new_chunk = tuple.__new__  # a NamedTuple's own __new__ is a Python call: 60% of this loop
        for rid, n in plan.num_scheduled_tokens.items():
            state = requests[rid]
            chunks.append(new_chunk(ScheduledChunk, (rid, state, state.num_computed, n)))
            state.num_computed += n
        return chunks

    @staticmethod
    def keep_confirmed(chunk: ScheduledChunk, tokens: list[int]) -> None:
        """A speculating chunk (its last known token, then a proposal) verified: the proposal's
        first len(tokens) - 1 tokens stay, computed, and the model's next token follows them."""
        state = chunk.state
        kept = chunk.start + len(tokens)  # the last known token and the confirmed ones
        del state.token_ids[kept:]
        state.token_ids.append(tokens[-1])
        state.num_computed = kept

    @staticmethod
    def add_sampled(state: RequestState, token: int) -> None:
        """The sampled token joins the sequence, except a beam's: its group chooses in the core."""
        if not state.params.beam_width:
            state.token_ids.append(token)


def slot_mapping(tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The KV slot of each token, int64: block `tables[row, position // block_size]`, offset
    `position % block_size`."""
    return tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
