"""Beam search as transformers runs it (`generate(num_beams=W, do_sample=False)`), one step at a
time, over candidates the worker reports: each running beam's top 2W next tokens with their
log-probabilities. Scores are accumulated in float32 like transformers' tensors, so that equal
inputs give equal choices.

Per step: every (beam, token) candidate scores beam score + log p; the best 2W are kept. Those
that end (EOS, or max_tokens reached) and rank among the first W become finished hypotheses
scored sum_logprobs / generated_len ** length_penalty, of which the best W are kept; the best W
that do not end continue. The search stops when every kept candidate ended, or when all W
finished slots are filled and the best running beam's score, length-penalised as if it ended
now, cannot beat the worst finished one.

`BeamGroup` is that rule for one search; `BeamSearches` owns every search in flight and all
that beams change in scheduling (groups decode and are preempted whole, beams are forked and
dropped by their group's choice), behind the few calls the scheduler makes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidParameter
from ..outputs import BeamResult, RequestOutputDelta
from ..request import RequestStatus
from ..utils import cdiv

NEG = np.float32(-1.0e9)


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens only
    cum_logprob: float  # sum of the tokens' log-probabilities
    score: float  # cum_logprob / len ** length_penalty
    finish_reason: str = "stop"  # "stop": it ended with EOS; "length": it reached max_tokens


@dataclass
class Continuation:
    parent: int  # index of the running beam it extends
    token: int
    score: np.float32  # accumulated log-probability


@dataclass
class BeamStep:
    running: list[Continuation]  # the next running beams, best first
    done: bool


@dataclass(eq=False)  # a group is itself, whatever its fields
class BeamGroup:
    group_id: str
    width: int
    max_tokens: int
    length_penalty: float = 1.0
    eos_token_ids: frozenset = frozenset()  # empty: EOS does not end a beam
    scores: list[np.float32] = field(default_factory=list)  # of the running beams, best first
    finished: list[Hypothesis] = field(default_factory=list)  # at most `width`, best first
    generated: int = 0  # tokens each running beam has generated
    improvement_possible: bool = True
    members: list = field(default_factory=list)  # the running beams' requests, in `scores` order

    def __post_init__(self):
        if not self.scores:
            self.scores = [np.float32(0.0)]

    def step(self, candidates: list[list[tuple[int, float]]], histories: list[list[int]]) -> BeamStep:
        """candidates[b]: (token, logprob) of running beam b, its best first; histories[b]: the
        tokens beam b generated so far (for finished hypotheses)."""
        width = self.width
        flat = []
        for b, (score, cands) in enumerate(zip(self.scores, candidates)):
            for token, logprob in cands:
                flat.append((np.float32(score + np.float32(logprob)), b, token))
        # topk over the flattened (beam, vocab) scores: best first, ties to the lower index
        flat.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = flat[: 2 * width]
        gen_len = self.generated + 1
        hits = [tok in self.eos_token_ids or gen_len >= self.max_tokens for _, _, tok in top]

        ranked = sorted(range(len(top)), key=lambda i: (-(top[i][0] + (NEG if hits[i] else 0)), i))
        running = [Continuation(top[i][1], top[i][2], top[i][0]) for i in ranked[:width] if not hits[i]]

        if self.improvement_possible:
            penalty = np.float32(gen_len**self.length_penalty)
            for i in range(min(width, len(top))):
                if hits[i]:
                    score, b, tok = top[i]
                    reason = "stop" if tok in self.eos_token_ids else "length"
                    self.finished.append(
                        Hypothesis(histories[b] + [tok], float(score), float(np.float32(score / penalty)), reason)
                    )
            self.finished.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
            del self.finished[width:]

        self.generated = gen_len
        self.scores = [c.score for c in running]
        if running and len(self.finished) == width:
            best_possible = float(np.float32(running[0].score / np.float32(gen_len**self.length_penalty)))
            if best_possible <= min(h.score for h in self.finished):
                self.improvement_possible = False
        done = all(hits) or not self.improvement_possible or not running
        return BeamStep(running, done)

    def results(self) -> list[Hypothesis]:
        return list(self.finished)


class BeamSearches:
    """The beam searches in flight, and every special case they bring to scheduling. The
    scheduler calls it when a request arrives (`start`) or is aborted (`pop`), to choose what
    to preempt (`preemptible`, `preemption_unit`), with the top tokens a step reported
    (`report`, then `advance`), and for the tokens the worker must append (`take_appended`)."""

    def __init__(self):
        self.groups: dict[str, BeamGroup] = {}  # by the request id the search arrived under
        self._candidates: dict[str, dict[str, list]] = {}  # group -> member -> its top tokens
        self._reported: list[BeamGroup] = []  # groups that got candidates in the current update
        self._appended: dict[str, list[int]] = {}  # tokens chosen here, for the worker to append
        self._ids = itertools.count(1)

    def __bool__(self) -> bool:
        return bool(self.groups)

    def start(self, request, params, max_tokens: int) -> None:
        group = BeamGroup(
            request.request_id, params.beam_width, max_tokens, params.length_penalty, request.eos_token_ids
        )
        group.members = [request]
        request.beam_group = group
        self.groups[request.request_id] = group

    def pop(self, request_id: str) -> BeamGroup | None:
        """End the search that `request_id` (the search's id or any beam's) belongs to."""
        group = self.groups.pop(request_id, None)
        if group is not None:
            self._candidates.pop(group.group_id, None)
        return group

    # --- preemption -----------------------------------------------------------------------
    @staticmethod
    def preemptible(request, current, scheduled) -> bool:
        """A beam may not be preempted for another request while a sibling runs in this step
        (the group would be split); for its own group's sake it may."""
        group = request.beam_group
        return (
            group is None
            or request is current
            or group is current.beam_group
            or not any(m.request_id in scheduled for m in group.members)
        )

    def preemption_unit(self, request, scheduled) -> tuple[list, bool]:
        """(requests to preempt in place of `request`, whether only recompute will do). A beam
        group leaves whole and by recompute (its beams share blocks, which swapping them one by
        one would not keep), unless a sibling already runs this step: then the beam waits alone."""
        group = request.beam_group
        if group is None:
            return [request], False
        if any(m.request_id in scheduled for m in group.members):
            return [request], True
        self._candidates.pop(group.group_id, None)
        return [m for m in group.members if m.status == RequestStatus.RUNNING], True

    # --- one step -------------------------------------------------------------------------
    @staticmethod
    def decodes_now(group: BeamGroup, scheduled) -> bool:
        """Every beam has computed all but its newest token and none runs yet in this step."""
        return all(m.num_computed_tokens == m.num_tokens - 1 and m.request_id not in scheduled for m in group.members)

    def report(self, request, logprobs) -> None:
        """A beam's top tokens from this step; the group chooses once every beam reported."""
        group = request.beam_group
        self._candidates.setdefault(group.group_id, {})[request.request_id] = list(
            zip(logprobs.top_token_ids, logprobs.top_logprobs)
        )
        if group not in self._reported:
            self._reported.append(group)

    def advance(self, fork, finish, fail) -> list:
        """Let each group that got candidates choose its continuations: fork beams chosen more
        than once (`fork(parent_id, child_id)` -> Request), drop beams not chosen and end
        searches that are done (`finish(request, status)`). A search whose step raises is
        ended by `fail(group_id, error)` alone. Returns the outputs of ended searches."""
        outputs = []
        groups, self._reported = self._reported, []
        for group in groups:
            try:
                out = self._advance(group, fork, finish)
            except Exception as e:  # noqa: BLE001 - this search's failure is its own (fail() logs it)
                self._candidates.pop(group.group_id, None)
                fail(group.group_id, e)
                continue
            if out is not None:
                outputs.append(out)
        return outputs

    def _advance(self, group: BeamGroup, fork, finish):
        reported = self._candidates.get(group.group_id, {})
        members = group.members
        if any(m.request_id not in reported for m in members):
            return None
        del self._candidates[group.group_id]
        step = group.step([reported[m.request_id] for m in members], [m.output_token_ids for m in members])
        if step.done:
            del self.groups[group.group_id]
            for member in members:
                finish(member, RequestStatus.FINISHED_STOPPED)
            beams = [BeamResult(h.token_ids, h.cum_logprob, h.score, h.finish_reason) for h in group.results()]
            return RequestOutputDelta(group.group_id, [], "stop", None, beams=beams)
        by_parent: dict[int, list] = {}
        for cont in step.running:
            by_parent.setdefault(cont.parent, []).append(cont)
        new_members = {}
        for index, member in enumerate(members):
            conts = by_parent.get(index)
            if not conts:
                finish(member, RequestStatus.FINISHED_ABORTED)  # frees only what it alone held
                continue
            for cont in conts[1:]:
                child = fork(member.request_id, f"{group.group_id}#beam{next(self._ids)}")
                child.beam_group = group
                child.all_token_ids.append(cont.token)
                new_members[id(cont)] = child
            member.all_token_ids.append(conts[0].token)
            self._appended[member.request_id] = [conts[0].token]
            new_members[id(conts[0])] = member
        group.members = [new_members[id(c)] for c in step.running]
        return None

    def take_appended(self, known) -> dict[str, list[int]]:
        """The tokens chosen since the last step for beams the worker holds (`known`)."""
        appended = {rid: tok for rid, tok in self._appended.items() if rid in known}
        self._appended = {}
        return appended


def check_beams_fit(
    width: int, num_tokens: int, block_size: int, num_usable_blocks: int, max_num_seqs: int, max_batched_tokens: int
) -> None:
    """A group runs all its beams at once, so they must fit the sequence cap and one step's
    token budget; and after a recompute preemption the beams share nothing, so all of them must
    fit the pool alone."""
    if width > max_num_seqs:
        raise InvalidParameter(
            "beam_width", f"must be <= max_num_seqs ({max_num_seqs}): all beams of a search run together; got {width}"
        )
    if width > max_batched_tokens:
        raise InvalidParameter(
            "beam_width",
            f"must be <= max_num_batched_tokens ({max_batched_tokens}): all beams decode in one step; got {width}",
        )
    need = width * cdiv(num_tokens, block_size)
    if need > num_usable_blocks:
        raise InvalidParameter(
            "beam_width",
            f"{width} beams of {num_tokens} tokens need up to {need} KV blocks; the cache has {num_usable_blocks}",
        )
