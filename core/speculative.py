"""Speculative decoding in the core: what the engine speculates with, which requests may, and
the n-gram proposer (prompt lookup). Torch-free.

A speculating request's decode step computes its last token and K proposed ones in one chunk;
the worker keeps the longest prefix of the proposal that the target model itself would have
chosen, plus the target's token after it, so the output is token for token the one without
speculation. The proposal's KV past what was kept is rolled back by the scheduler.

A request whose proposals keep failing (none of a proposal's tokens confirmed) waits 2, 4, ...
up to 64 steps before it proposes again, decoding meanwhile as without speculation (async
scheduling included): a proposer that does not follow an output costs little.

Verification samples each proposed position as plain decoding would (backends/spec_verify.py):
greedy and sampled requests, penalties, min_tokens and logprobs all speculate, and a seeded
request's tokens are those it gets without speculation. Beams and constrained requests decode
one token a step beside the others.
"""

from __future__ import annotations

import msgspec
import numpy as np

from .errors import InvalidParameter
from .request import Request

METHODS = ("ngram", "draft_model")
DRAFT_PLACEHOLDER = -1  # a draft model's proposal, before the worker's draft fills it in
MAX_SPECULATIVE_TOKENS = 16
# steps a request waits at most before proposing again, after proposals with nothing confirmed
MAX_BACKOFF = 64


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `speculative_config` fields for the n-gram and draft-model methods."""

    method: str | None = None  # "draft_model" where a model is given, else "ngram"
    model: str | None = None  # the draft model's folder (draft_model)
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4  # the longest suffix matched against earlier tokens
    prompt_lookup_min: int = 1  # the shortest
    # no speculation in a step with more running requests than this (vLLM's name): a full batch
    # is bound by arithmetic, and verifying rejected tokens costs more than it saves
    disable_by_batch_size: int | None = 16

    def __post_init__(self):
        if self.method is None:
            self.method = "draft_model" if self.model else "ngram"
        if self.method not in METHODS:
            raise InvalidParameter("speculative_config.method", f"must be one of {METHODS}, got {self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise InvalidParameter("speculative_config.model", "the draft model's folder is required by draft_model")
        if self.method == "ngram" and self.model:
            raise InvalidParameter("speculative_config.model", "is a draft model's: the ngram method takes none")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidParameter(
                "speculative_config.num_speculative_tokens",
                f"must be in 1..{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}",
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidParameter(
                "speculative_config.prompt_lookup_min",
                f"must be >= 1 and <= prompt_lookup_max ({self.prompt_lookup_max}), got {self.prompt_lookup_min}",
            )


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """From a dict, a JSON string (the CLI's --speculative-config) or None."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = msgspec.json.decode(value)
        except msgspec.DecodeError as e:
            raise InvalidParameter("speculative_config", f"is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidParameter("speculative_config", f"must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(SpeculativeConfig.__struct_fields__))
    if unknown:
        raise InvalidParameter("speculative_config", f"unknown fields {unknown}")
    try:
        return SpeculativeConfig(**value)
    except TypeError as e:  # a value of the wrong type
        raise InvalidParameter("speculative_config", str(e)) from None


def may_speculate(request: Request) -> bool:
    """Every request speculates except a beam (its group chooses among the top tokens of one
    position), a constrained one (each position's mask needs the grammar advanced by the tokens
    before it, in the core) and one about to fork its n samples."""
    return not request.sampling_params.beam_width and request.matcher is None and request.forks_pending == 0


def propose_ngram(tokens: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Prompt lookup: the longest suffix of `tokens` (lookup_max down to lookup_min tokens)
    that occurred before; the up to k tokens that followed its latest such occurrence."""
    n_tokens = len(tokens)
    if n_tokens < 2:
        return []
    seq = np.asarray(tokens)
    ends = np.flatnonzero(seq[:-1] == seq[-1])  # earlier occurrences of the last token
    if not len(ends):
        return []
    # how far back each occurrence keeps matching the suffix, up to lookup_max tokens
    matched = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(lookup_max, n_tokens - 1)):
        at = ends - back
        alive &= (at >= 0) & (seq[np.maximum(at, 0)] == seq[n_tokens - 1 - back])
        if not alive.any():
            break
        matched += alive
    best = matched.max()
    if best < lookup_min:
        return []
    start = int(ends[np.flatnonzero(matched == best)[-1]]) + 1  # the latest of the longest
    return tokens[start : start + k]


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
