"""What the scheduler hands the workers each step, and what the core hands the frontend."""

from __future__ import annotations

import msgspec
import numpy as np

from .lora import LoRARequest
from .sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True):
    """A request the worker has no state for: first scheduled, resumed after preemption,
    or forked. `token_ids` are all its known tokens (prompt and output so far)."""

    request_id: str
    token_ids: np.ndarray  # int32; travels as its own frame (see protocol.py)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: list[int] = []
    lora: LoRARequest | None = None


class SchedulerOutput(msgspec.Struct, kw_only=True):
    """One step's plan, as differences against what the worker already holds."""

    step_id: int
    new_requests: list[NewRequestData]
    # every request that runs this step, in batch order: how many tokens it computes
    num_scheduled_tokens: dict[str, int]
    # requests the worker knows whose block table changed: (first changed index, ids from there)
    block_table_deltas: dict[str, tuple[int, list[int]]]
    block_copies: list[tuple[int, int]]  # copy-on-write (src, dst), done before the forward pass
    swap_out: list[tuple[int, int]]  # (device block, swap block), done first
    swap_in: list[tuple[int, int]]  # (swap block, device block), done after swap_out
    finished_request_ids: list[str]  # ended since the last step: drop their state
    # tokens the core appended itself (a beam's continuation, a grammar's forced tokens), to add
    # before computing
    appended_token_ids: dict[str, list[int]]
    preempted_request_ids: list[str]  # drop their state; they come back as new requests
    total_num_scheduled_tokens: int
    # structured outputs: the requests that sample under a constraint in this step; their token
    # bitmasks follow in a StepMasks message (core/protocol.py)
    structured_request_ids: list[str] = []
    # speculative decoding: proposed tokens that follow a request's last one in this step's chunk
    # (appended for this step only; the worker keeps those the model confirms); empty where the
    # worker's draft model proposes them, as many as the chunk computes past the last known token
    draft_token_ids: dict[str, list[int]] = {}
    # a decode run: the workers compute this step, then num_steps - 1 more of the same requests
    # on their own, each on the token it sampled last, into slots this plan's block tables hold
    # already; each step's result goes back as it is made (the core's copy counts those it
    # has not applied yet)
    num_steps: int = 1

    @property
    def is_empty(self) -> bool:
        """Nothing for the workers to do: no token, and nothing for them to drop, copy or append
        (a step that only preempts, swaps out or ends requests must still reach them)."""
        return not (
            self.total_num_scheduled_tokens
            or self.new_requests
            or self.finished_request_ids
            or self.preempted_request_ids
            or self.swap_out
            or self.swap_in
            or self.block_copies
            or self.appended_token_ids
        )

    def next_in_run(self) -> SchedulerOutput:
        """A decode run's next step as the workers apply it: the same requests, one token each
        (the one each sampled last), nothing else to change."""
        return SchedulerOutput(
            step_id=self.step_id,
            new_requests=[],
            num_scheduled_tokens=self.num_scheduled_tokens,
            block_table_deltas={},
            block_copies=[],
            swap_out=[],
            swap_in=[],
            finished_request_ids=[],
            appended_token_ids={},
            preempted_request_ids=[],
            total_num_scheduled_tokens=self.total_num_scheduled_tokens,
        )


class BeamResult(msgspec.Struct, array_like=True):
    token_ids: list[int]  # generated tokens
    cum_logprob: float
    score: float  # cum_logprob / len ** length_penalty
    finish_reason: str = "stop"  # "stop" (EOS) or "length" (max_tokens)


class TokenLogprobs(msgspec.Struct, array_like=True):
    token_logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Prompt tokens' logprobs from one step: entry j is of prompt token start + j, given the
    tokens before it (position 0 has none). A recomputed prompt (after a preemption) reports
    positions again; the frontend keeps the first."""

    start: int
    entries: list[TokenLogprobs]


class RequestOutputDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request gained in a step, from the scheduler through the engine core to the
    frontend (the core adds the worker's logprobs and the prefix-cache hit)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | None = None  # the stop token id that ended it
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    beams: list[BeamResult] | None = None  # a finished beam search: best first
    queued_seconds: float | None = None  # on a request's first token: arrival to first scheduled
    prompt_logprobs: PromptLogprobs | None = None
    embedding: list[float] | None = None  # an embedding request's vector, as it ends


def merge_deltas(earlier: RequestOutputDelta, later: RequestOutputDelta) -> RequestOutputDelta:
    """`earlier`, extended in place to say what it and the next delta of the same request say
    (in place: a request held for thousands of steps is not copied at each)."""
    earlier.new_token_ids.extend(later.new_token_ids)
    if later.logprobs is not None:
        if earlier.logprobs is None:
            earlier.logprobs = []
        earlier.logprobs.extend(later.logprobs)
    earlier.finish_reason, earlier.stop_reason, earlier.beams = later.finish_reason, later.stop_reason, later.beams
    earlier.num_cached_tokens = later.num_cached_tokens or earlier.num_cached_tokens
    earlier.embedding = later.embedding or earlier.embedding
    if earlier.queued_seconds is None:
        earlier.queued_seconds = later.queued_seconds
    earlier.prompt_logprobs = _merge_prompt_logprobs(earlier.prompt_logprobs, later.prompt_logprobs)
    return earlier


def _merge_prompt_logprobs(earlier: PromptLogprobs | None, later: PromptLogprobs | None) -> PromptLogprobs | None:
    """Consecutive chunks' prompt logprobs as one run; positions reported again (a recomputed
    prompt) keep their first report, as the frontend does."""
    if earlier is None or later is None:
        return earlier or later
    end = earlier.start + len(earlier.entries)
    return PromptLogprobs(earlier.start, earlier.entries + later.entries[max(0, end - later.start) :])


class Fragmentation(msgspec.Struct):
    """How well the KV pool's blocks are used and placed."""

    internal_waste: float  # of the slots in live block tables, the share holding no token
    external: float  # of the never-cached free blocks, the share in runs shorter than a median table
    mean_table_run: float  # blocks per run of consecutive ids in a live table, averaged over tables


class SchedulerStats(msgspec.Struct):
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float  # fraction of usable blocks held by requests
    prefix_cache_queries: int  # tokens looked up, since start
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int
    peak_blocks_used: int
    num_blocks: int
    # refreshed at most once a second (it walks every table), while requests run: an idle engine
    # reports the last sample; None before any request ran
    fragmentation: Fragmentation | None = None
    spec_decode: SpecStats | None = None  # speculative decoding's counts, where it is on
    num_cached_blocks: int = 0  # blocks registered in the prefix cache, held or free


class SpecStats(msgspec.Struct):
    """Counts since the engine started, as vLLM's spec_decode metrics name them."""

    num_accepted_tokens_per_pos: list[int]  # proposals whose token at position i was confirmed
    num_drafts: int = 0  # proposals verified
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # of those, confirmed

    def copy(self) -> SpecStats:
        return SpecStats(
            list(self.num_accepted_tokens_per_pos), self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        )

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.num_accepted_tokens_per_pos[i] += 1
