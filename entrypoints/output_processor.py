"""The engine's token deltas in, per-request outputs out: each delta is folded into its
request's tracker (detokenized text, stop strings, logprobs) and timed. Shared by `LLM` and
`AsyncEngine`; one processor serves every request of one frontend."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedllm.core.errors import InvalidParameter
from pagedllm.core.outputs import RequestOutputDelta

from .outputs import RequestOutput
from .request_tracker import RequestTracker


@dataclass
class StreamOutput:
    output: RequestOutput  # everything so far
    index: int  # the completion this update is about
    delta_text: str  # text that completion gained (held back near possible stop strings)
    delta_token_ids: list[int]  # the tokens the completion gained (none past a stop string)
    finished: bool  # the whole request (all n completions) is done
    finish_reason: str | None = None  # set when completion `index` ended with this update
    first_token: bool = False  # this update brought the request's first token
    # the logprob entries of delta_token_ids (a copy: `output` goes on growing while this waits)
    delta_logprobs: list[dict] | None = None
    num_tokens: int = 0  # the completion's tokens with this update (`output` may be further on)


class OutputProcessor:
    def __init__(self):
        self._trackers: dict[str, RequestTracker] = {}  # by engine request id (sample i of n: rid#i)

    def __len__(self) -> int:
        return len(self._trackers)

    def add(self, tracker: RequestTracker) -> None:
        if any(eid in self._trackers for eid in tracker.engine_ids):
            raise InvalidParameter("request_id", f"{tracker.request_id!r} is already in use")
        for eid in tracker.engine_ids:
            self._trackers[eid] = tracker

    def tracker(self, engine_request_id: str) -> RequestTracker | None:
        return self._trackers.get(engine_request_id)

    def remove(self, tracker: RequestTracker) -> None:
        for eid in tracker.engine_ids:
            self._trackers.pop(eid, None)

    def process(self, deltas: list[RequestOutputDelta]) -> tuple[list[tuple[RequestTracker, StreamOutput]], list[str]]:
        """Fold the deltas in: ([(tracker, update)], engine ids to abort because a stop string
        ended them before the engine knew). Deltas of unknown or finished requests are dropped."""
        now = time.monotonic()
        updates, aborts = [], []
        for delta in deltas:
            tracker = self._trackers.get(delta.request_id)
            if tracker is None or tracker.finished:
                continue
            had_token = tracker.timing.first_token is not None
            tracker.timing.record(delta, now)
            index, chunk, done, abort, gained = tracker.apply(delta)
            if abort:
                aborts.append(delta.request_id)
            comp = tracker.output.outputs[index]
            new = list(delta.new_token_ids[:gained])
            update = StreamOutput(
                tracker.output,
                index,
                chunk,
                new,
                tracker.finished,
                comp.finish_reason if done else None,
                first_token=not had_token and tracker.timing.first_token is not None,
                delta_logprobs=comp.logprobs[-len(new) :] if comp.logprobs is not None and new else None,
                num_tokens=len(comp.token_ids),
            )
            updates.append((tracker, update))
        return updates, aborts

    def fold(self, deltas: list[RequestOutputDelta]) -> tuple[list[RequestTracker], list[str]]:
        """`process` for a caller that waits for whole requests (`LLM.generate`): no stream
        updates, no timing. Returns (trackers that finished, engine ids to abort)."""
        finished, aborts = [], []
        trackers = self._trackers
        for delta in deltas:
            tracker = trackers.get(delta.request_id)
            if tracker is None or tracker.output.finished:
                continue
            if tracker.apply(delta)[3]:
                aborts.append(delta.request_id)
            if tracker.output.finished:
                finished.append(tracker)
        return finished, aborts
