"""Frontend-side state of one request: its n completions, their detokenizers, stop strings and
logprobs, built up from the engine's token deltas."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedllm.core.outputs import PromptLogprobs, RequestOutputDelta, TokenLogprobs
from pagedllm.core.request import sample_request_ids
from pagedllm.core.sampling_params import SamplingParams

from .detokenizer import IncrementalDetokenizer, find_stop
from .outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class RequestTiming:
    """When a request was submitted and when its tokens arrived (time.monotonic())."""

    submitted: float = 0.0
    first_token: float | None = None
    last_token: float | None = None
    queued_seconds: float | None = None  # the engine's: arrival to first scheduled
    token_gaps: list[float] = field(default_factory=list)  # between a completion's successive tokens
    _last_by_completion: dict = field(default_factory=dict)

    def record(self, delta: RequestOutputDelta, now: float | None = None) -> None:
        if delta.queued_seconds is not None and self.queued_seconds is None:
            self.queued_seconds = delta.queued_seconds
        if not delta.new_token_ids:
            return
        now = time.monotonic() if now is None else now
        if self.first_token is None:
            self.first_token = now
        previous = self._last_by_completion.get(delta.request_id)
        if previous is not None:
            self.token_gaps.append(now - previous)
        self._last_by_completion[delta.request_id] = now
        self.last_token = now


class RequestTracker:
    def __init__(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, tokenizer
    ):
        self.request_id = request_id
        self.params = params
        self.tokenizer = tokenizer
        self.output = RequestOutput(
            request_id,
            prompt,
            prompt_token_ids,
            [
                CompletionOutput(
                    index=i,
                    text="",
                    token_ids=[],
                    cumulative_logprob=0.0 if params.logprobs is not None else None,
                    logprobs=[] if params.logprobs is not None else None,
                )
                for i in range(params.n)
            ],
        )
        if params.prompt_logprobs is not None:
            self.output.prompt_logprobs = [None]
        # a beam search is one engine request, whose n best beams are the completions
        num_engine_requests = 1 if params.beam_width else params.n
        self.engine_ids = sample_request_ids(request_id, num_engine_requests)
        self._index = {rid: i for i, rid in enumerate(self.engine_ids)}
        self._detok = [
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
            if tokenizer is not None
            else None
            for _ in range(params.n)
        ]
        self._stops = list(params.stop or ())
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._sent = [0] * params.n  # characters of each completion already handed out as deltas
        self.beams = None  # a finished beam search: core.outputs.BeamResult list, best first
        self.timing = RequestTiming()
        self.structured_outputs_after: int | None = None  # see EngineRequest
        self.lora = None  # its checked LoRARequest (EngineRequest.lora)

    def _decode_one(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    @property
    def finished(self) -> bool:
        return self.output.finished

    def unfinished_engine_ids(self) -> list[str]:
        return [rid for rid, c in zip(self.engine_ids, self.output.outputs) if c.finish_reason is None]

    def apply(self, delta: RequestOutputDelta) -> tuple[int, str, bool, bool, int]:
        """Fold one engine delta in. Returns (completion index, text safe to stream now,
        whether this completion just finished, whether the engine must abort it: a stop
        string ended it before the engine knew, how many of the delta's tokens the completion
        took: all, or those up to a stop string's)."""
        i = self._index[delta.request_id]
        comp = self.output.outputs[i]
        if delta.embedding is not None:
            self.output.embedding = delta.embedding
        if delta.prompt_logprobs is not None and self.output.prompt_logprobs is not None:
            self._add_prompt_logprobs(delta.prompt_logprobs)
        if delta.beams is not None or (self.params.beam_width and delta.finish_reason is not None):
            self._apply_beams(delta)
            return i, "", True, False, len(delta.new_token_ids)
        if comp.finish_reason is not None:
            return i, "", False, False, 0  # e.g. the abort that follows a stop string
        if not delta.new_token_ids and delta.finish_reason is None:
            return i, "", False, False, 0  # prompt logprobs of a prefill chunk
        if delta.num_cached_tokens > self.output.num_cached_tokens:
            self.output.num_cached_tokens = delta.num_cached_tokens
        detok = self._detok[i]
        before = len(comp.token_ids)
        if detok is None:  # no tokenizer: token ids only
            self._extend(comp, delta, 0, len(delta.new_token_ids))
            if delta.finish_reason is None:
                return i, "", False, False, len(delta.new_token_ids)
            comp.finish_reason, comp.stop_reason = delta.finish_reason, delta.stop_reason
            self.output.finished = all(c.finish_reason is not None for c in self.output.outputs)
            return i, "", True, False, len(delta.new_token_ids)
        hit = self._add_text(comp, detok, delta)
        abort = False
        if hit is not None:
            comp.text = detok.text[: hit[0]]
            comp.finish_reason, comp.stop_reason = "stop", hit[1]
            abort = delta.finish_reason is None
        else:
            comp.text = detok.text
            if delta.finish_reason is not None:
                comp.finish_reason, comp.stop_reason = delta.finish_reason, delta.stop_reason
        done = comp.finish_reason is not None
        end = len(comp.text) if done else max(self._sent[i], len(comp.text) - self._holdback)
        chunk = comp.text[self._sent[i] : end]
        self._sent[i] = end
        if all(c.finish_reason is not None for c in self.output.outputs):
            self.output.finished = True
        return i, chunk, done, abort, len(comp.token_ids) - before

    def _add_text(self, comp: CompletionOutput, detok: IncrementalDetokenizer, delta: RequestOutputDelta):
        """The delta's tokens join the completion and its text, and the first stop string they
        complete (past min_tokens), if any, is returned as find_stop gives it. Where stop strings
        are asked for, a delta of several tokens (a verified speculative run, jump-forward's
        forced tokens) goes token by token, as single tokens would come without them: min_tokens
        counts to the token, and the tokens after the one that completes a stop string are
        dropped, with their logprobs."""
        tokens = delta.new_token_ids
        pieces = [(j, j + 1) for j in range(len(tokens))] if self._stops and len(tokens) > 1 else [(0, len(tokens))]
        for start, end in pieces:
            self._extend(comp, delta, start, end)
            new_text = detok.add(self._text_ids(delta, start, end))
            if end == len(tokens) and delta.finish_reason is not None:
                new_text += detok.flush()
            # no stop string may end the text before min_tokens (vLLM's rule, as for stop tokens)
            if len(comp.token_ids) >= self.params.min_tokens:
                hit = find_stop(detok.text, len(new_text), self._stops)
                if hit is not None:
                    return hit
        return None

    def _text_ids(self, delta: RequestOutputDelta, start: int, end: int) -> list[int]:
        """The tokens whose text joins the output: with special tokens kept in the text, not the
        EOS or stop token that ended it (its text is no part of the answer, as vLLM's)."""
        tokens = delta.new_token_ids[start:end]
        if (
            not self.params.skip_special_tokens
            and end == len(delta.new_token_ids)
            and delta.finish_reason == "stop"
            and tokens
            and tokens[-1] in self.tokenizer.all_special_ids
        ):
            return tokens[:-1]
        return tokens

    def _extend(self, comp: CompletionOutput, delta: RequestOutputDelta, start: int, end: int) -> None:
        """Tokens start:end of the delta, and their logprobs, join the completion."""
        tokens = delta.new_token_ids[start:end]
        comp.token_ids.extend(tokens)
        if delta.logprobs and comp.logprobs is not None:
            for token, lp in zip(tokens, delta.logprobs[start:end]):
                comp.logprobs.append(self._entry(token, lp))
                comp.cumulative_logprob += lp.token_logprob

    def _apply_beams(self, delta: RequestOutputDelta) -> None:
        """A beam search ended: its n best beams are the completions (fewer if it kept fewer)."""
        self.beams = delta.beams or []
        outputs = self.output.outputs
        if self.beams:
            del outputs[len(self.beams) :]
        for comp, beam in zip(outputs, self.beams):
            comp.token_ids = list(beam.token_ids)
            comp.cumulative_logprob = beam.cum_logprob
            comp.finish_reason = beam.finish_reason if delta.finish_reason != "abort" else "abort"
            if self.tokenizer is not None:
                comp.text = self.tokenizer.decode(comp.token_ids, skip_special_tokens=self.params.skip_special_tokens)
        for comp in outputs[len(self.beams) :]:  # aborted before it ended
            comp.finish_reason = delta.finish_reason
        self.output.finished = True

    def _add_prompt_logprobs(self, lps: PromptLogprobs) -> None:
        """Entries for prompt positions not yet known (a recomputed prompt repeats them)."""
        known = self.output.prompt_logprobs
        prompt = self.output.prompt_token_ids
        for position, lp in enumerate(lps.entries, start=lps.start):
            if position == len(known):
                known.append(self._entry(prompt[position], lp))

    def _entry(self, token: int, lp: TokenLogprobs) -> dict:
        """A token's Logprob and those of the most likely tokens in its place, by token id."""
        entry = {
            t: Logprob(v, rank + 1, self._decode_one(t))
            for rank, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs))
        }
        entry[token] = Logprob(lp.token_logprob, lp.rank, self._decode_one(token))
        return entry
