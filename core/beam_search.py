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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NEG = np.float32(-1.0e9)


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens only
    cum_logprob: float  # sum of the tokens' log-probabilities
    score: float  # cum_logprob / len ** length_penalty


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
    eos_token_id: int | None = None  # None: EOS does not end a beam
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
        top = flat[:2 * width]
        gen_len = self.generated + 1
        hits = [(self.eos_token_id is not None and tok == self.eos_token_id) or gen_len >= self.max_tokens
                for _, _, tok in top]

        ranked = sorted(range(len(top)), key=lambda i: (-(top[i][0] + (NEG if hits[i] else 0)), i))
        running = [Continuation(top[i][1], top[i][2], top[i][0]) for i in ranked[:width] if not hits[i]]

        if self.improvement_possible:
            penalty = np.float32(gen_len ** self.length_penalty)
            for i in range(min(width, len(top))):
                if hits[i]:
                    score, b, tok = top[i]
                    self.finished.append(Hypothesis(histories[b] + [tok], float(score), float(np.float32(score / penalty))))
            self.finished.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
            del self.finished[width:]

        self.generated = gen_len
        self.scores = [c.score for c in running]
        if running and len(self.finished) == width:
            best_possible = float(np.float32(running[0].score / np.float32(gen_len ** self.length_penalty)))
            if best_possible <= min(h.score for h in self.finished):
                self.improvement_possible = False
        done = all(hits) or not self.improvement_possible or not running
        return BeamStep(running, done)

    def results(self) -> list[Hypothesis]:
        return list(self.finished)
