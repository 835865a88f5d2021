"""Speculative decoding in the core: the one owner of its state. Torch-free.

A speculating request's decode step computes its last token and K proposed ones in one chunk;
the worker keeps the longest prefix of the proposal that the target model itself would have
chosen, plus the target's token after it, so the output is token for token the one without
speculation. The proposal's KV past what was kept is rolled back by the scheduler.

A request whose proposals keep failing (none of a proposal's tokens confirmed) waits 2, 4, ...
up to 64 steps before it proposes again, decoding meanwhile as without speculation (async
scheduling included): a proposer that does not follow an output costs little.

Verification samples each proposed position as plain decoding would (backends/speculation/):
greedy and sampled requests, penalties, min_tokens and logprobs all speculate, and a seeded
request's tokens are those it gets without speculation. Beams and constrained requests decode
one token a step beside the others.

The scheduler calls `Speculation` at named points: `propose` as a step begins, `extra_tokens`
as it schedules a decode, `attach` when the plan is built, `accept` (or `decoded`) as it
applies a step's results, `blocks_planning_ahead` before async scheduling plans a step ahead.
The method (config.SpeculativeConfig) chooses the proposer here, in PROPOSERS, and nowhere
else in the core.
"""

from __future__ import annotations

import numpy as np

from ..config import SpeculativeConfig
from ..outputs import SchedulerOutput, SpecStats
from ..request import Request

# steps a request waits at most before proposing again, after proposals with nothing confirmed
MAX_BACKOFF = 64


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


class NgramProposer:
    """Prompt lookup over the request's own tokens (propose_ngram)."""

    def __init__(self, config: SpeculativeConfig):
        self.lookup_min, self.lookup_max = config.prompt_lookup_min, config.prompt_lookup_max

    def __call__(self, request: Request, k: int) -> tuple[int, list[int]]:
        proposal = propose_ngram(request.all_token_ids, k, self.lookup_min, self.lookup_max)
        return len(proposal), proposal


class DraftModelSlots:
    """The worker's draft model proposes: the core schedules k slots and sends no tokens."""

    def __init__(self, config: SpeculativeConfig):
        pass

    def __call__(self, request: Request, k: int) -> tuple[int, list[int]]:
        return k, []


PROPOSERS = {"ngram": NgramProposer, "draft_model": DraftModelSlots}


class Speculation:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = PROPOSERS[config.method](config)
        # proposed, accepted; accepted at each position of a proposal
        self.stats = SpecStats([0] * config.num_speculative_tokens)
        # this step's proposals by request id: (tokens proposed, their ids; none where the worker's draft makes them)
        self._drafts: dict[str, tuple[int, list[int]]] = {}

    def on(self, num_running: int) -> bool:
        """Whether a step with this many running requests speculates (none above the batch size
        where it stops paying)."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def propose(self, decodes: list[tuple[Request, int]], num_running: int) -> None:
        """As a step begins: proposals for the decodes that may speculate, within their length limits."""
        self._drafts = drafts = {}
        if not self.on(num_running):
            return
        for request, _ in decodes:
            if request.spec_backoff or not may_speculate(request):
                continue
            room = min(
                request.max_tokens - (request.num_tokens - request.num_prompt_tokens),
                self.max_model_len - request.num_tokens,
            )
            k = min(self.config.num_speculative_tokens, room - 1)  # the model's own token comes after them
            if k > 0:
                count, tokens = self.proposer(request, k)
                if count:
                    drafts[request.request_id] = (count, tokens)

    def extra_tokens(self, request: Request) -> int:
        """The tokens a decode computes this step beyond its last known one."""
        draft = self._drafts.get(request.request_id) if self._drafts else None
        return draft[0] if draft else 0

    def attach(self, plan: SchedulerOutput) -> None:
        """The plan carries the proposals of the requests it computes more than one token of
        (cut to what the budget let in)."""
        if not self._drafts:
            return
        scheduled = plan.num_scheduled_tokens
        plan.draft_token_ids = {
            rid: tokens[: scheduled[rid] - 1] for rid, (_, tokens) in self._drafts.items() if scheduled.get(rid, 0) > 1
        }

    def blocks_planning_ahead(self, running: list[Request]) -> bool:
        """A request that may propose in its next step needs the token sampled in the step in
        flight: no step is planned ahead of the results then."""
        return self.on(len(running)) and any(r.spec_backoff <= 1 and may_speculate(r) for r in running)

    def accept(self, request: Request, plan: SchedulerOutput, tokens: list[int]) -> int:
        """A speculating request's verification: the first len(tokens) - 1 proposed tokens were
        confirmed, then the model's own. Records it (and backs off a request whose proposal had
        nothing confirmed); returns how many proposed tokens were not kept."""
        rid = request.request_id
        proposal = plan.draft_token_ids[rid]
        proposed = plan.num_scheduled_tokens[rid] - 1
        accepted = len(tokens) - 1
        if accepted > proposed or tokens[: min(accepted, len(proposal))] != proposal[:accepted]:
            raise RuntimeError(f"the worker confirmed {tokens[:accepted]} of the proposal {proposal}")
        self.stats.record(proposed, accepted)
        if accepted:
            request.spec_misses = 0
        else:  # the proposer does not follow this output: wait 2, 4, ... 64 steps before the next
            request.spec_misses += 1
            request.spec_backoff = min(2**request.spec_misses, MAX_BACKOFF)
        return proposed - accepted

    @staticmethod
    def decoded(request: Request) -> None:
        """A request decoded one token without a proposal: one step less to wait."""
        if request.spec_backoff:
            request.spec_backoff -= 1
