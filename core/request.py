"""Request types: what the frontend sends (`EngineRequest`) and what the core tracks (`Request`)."""

from __future__ import annotations

import enum
import time

import msgspec

from .lora import LoRARequest
from .sampling_params import SamplingParams
from .utils import derive_seed


class EngineRequest(msgspec.Struct, kw_only=True):
    """A new request as it travels from the frontend to the engine core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = []  # any of them ends the request (models may list several)
    arrival_time: float = 0.0
    # the frontend wants this request's tokens once, when it finishes (offline generation with
    # no stop strings to watch): one hand-off to the frontend per request, not one per step
    final_only: bool = False
    # structured outputs apply from the first sampling of this token on (a reasoning model's
    # `</think>`: the grammar constrains the answer, not the thinking); None: from the start
    structured_outputs_after: int | None = None
    lora: LoRARequest | None = None  # the adapter the request runs under (None: the base model)


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again after a recompute preemption
    SWAPPED = 3  # KV lives in the swap space
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


SAMPLE_SEPARATOR = "#"  # between a request's id and a sample's index, in the ids of its samples


def child_request_id(parent_id: str, index: int) -> str:
    """The id of sample `index` (1..n-1) of a request with n > 1; sample 0 keeps the parent id."""
    return f"{parent_id}{SAMPLE_SEPARATOR}{index}"


def sample_request_ids(parent_id: str, n: int) -> list[str]:
    """The engine ids of a request's first n samples: its own, then its children's."""
    return [parent_id] + [child_request_id(parent_id, i) for i in range(1, n)]


def is_sample_of(engine_id: str, parent_id: str) -> bool:
    """Whether `engine_id` is the request `parent_id` or one of its samples."""
    return engine_id == parent_id or engine_id.startswith(parent_id + SAMPLE_SEPARATOR)


def child_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a seeded request with n > 1 (the same in every run)."""
    return derive_seed(seed, index)


class Request:
    """The core's mutable view of one sequence. `num_computed_tokens` catching up with
    `num_tokens` is the only thing the scheduler drives: prefill, chunked prefill, decode,
    prefix hits and recompute are all that one rule."""

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_ids",
        "arrival_time",
        "priority",
        "all_token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "status",
        "max_tokens",
        "min_tokens",
        "stop_ids",
        "block_hashes",
        "num_preemptions",
        "num_cached_tokens",
        "stop_reason",
        "forks_pending",
        "beam_group",
        "queued_seconds",
        "matcher",
        "grammar_gate",
        "spec_backoff",
        "spec_misses",
        "lora",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids=(),
        arrival_time: float | None = None,
        max_tokens: int = 16,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset() if sampling_params.ignore_eos else frozenset(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = sampling_params.priority
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.max_tokens = max_tokens
        self.min_tokens = sampling_params.min_tokens
        self.stop_ids = frozenset(sampling_params.stop_token_ids or ())
        self.block_hashes: list[int] = []  # chained hashes of this request's full blocks
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first admission; -1 until then
        self.stop_reason: int | None = None  # the stop token that ended it, if any
        # n > 1: the prompt is computed once, up to its last token, then the request forks
        # into n that share those blocks and each compute the last token and sample on
        # (a beam search's n is how many of its beams are returned: the search forks itself)
        self.forks_pending = 0 if sampling_params.beam_width else sampling_params.n - 1
        self.beam_group = None  # core.beam_search.BeamGroup of a beam-search request
        self.queued_seconds: float | None = None  # arrival to first scheduled, set on first admission
        self.matcher = None  # structured outputs: the llguidance matcher of the output so far
        self.grammar_gate: int | None = None  # the token that must come before the matcher applies
        # speculative decoding: steps left before this request proposes again, and how many of
        # its proposals in a row had no token confirmed (each doubles the wait)
        self.spec_backoff = 0
        self.spec_misses = 0
        self.lora: LoRARequest | None = None

    @classmethod
    def from_engine_request(cls, req: EngineRequest, max_tokens: int) -> Request:
        request = cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.eos_token_ids,
            req.arrival_time or None,
            max_tokens,
        )
        request.lora = req.lora
        return request

    @property
    def first_block_parent(self) -> int | None:
        """What the first block's hash chains from: nothing, or the adapter (the same tokens
        under another adapter, or none, are other KV). Ints only: the same in every process."""
        return None if self.lora is None else hash((-2, self.lora.lora_int_id))

    @property
    def fork_point(self) -> int:
        """How many tokens may be computed on the request's own: before it must fork (n > 1),
        or, for a beam, before its group decodes together."""
        if self.forks_pending:
            return self.num_prompt_tokens - 1
        if self.beam_group is not None:
            return len(self.all_token_ids) - 1
        return len(self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    def fork(self, child_id: str) -> Request:
        child = Request.__new__(Request)
        for name in Request.__slots__:
            setattr(child, name, getattr(self, name))
        child.request_id = child_id
        child.forks_pending = 0
        child.all_token_ids = list(self.all_token_ids)
        child.block_hashes = list(self.block_hashes)
        if self.matcher is not None:
            child.matcher = self.matcher.deep_copy()
        return child

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.name})"
        )
