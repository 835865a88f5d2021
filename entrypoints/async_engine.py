"""An asyncio frontend over the engine, for servers: many requests stream at once.

    engine = AsyncEngine(model=...)
    async for out in engine.generate([1, 2, 3], SamplingParams(max_tokens=16)):
        print(out.delta_text, out.output.outputs[0].token_ids)

A reader thread receives the engine core's messages and hands each request's deltas to its
asyncio queue; the event loop never blocks on a socket. A caller that stops iterating (a
client that disconnects) aborts its request, which frees its blocks in the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, field

from pagedllm.core.errors import InvalidParameter
from pagedllm.core.protocol import EngineOutputs, RequestRejected
from pagedllm.core.request import EngineRequest
from pagedllm.core.sampling_params import SamplingParams

from .engine_client import EngineDeadError
from .llm import LLM
from .outputs import RequestOutput


@dataclass
class RequestTiming:
    """When a request was submitted and when its tokens arrived (time.monotonic())."""

    submitted: float
    first_token: float | None = None
    last_token: float | None = None
    queued_seconds: float | None = None  # the engine's: arrival to first scheduled
    token_gaps: list[float] = field(default_factory=list)  # between a completion's successive tokens
    _last_by_request: dict = field(default_factory=dict)

    def record(self, delta) -> None:
        if delta.queued_seconds is not None and self.queued_seconds is None:
            self.queued_seconds = delta.queued_seconds
        if not delta.new_token_ids:
            return
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
        previous = self._last_by_request.get(delta.request_id)
        if previous is not None:
            self.token_gaps.append(now - previous)
        self._last_by_request[delta.request_id] = now
        self.last_token = now


@dataclass
class StreamOutput:
    output: RequestOutput  # everything so far
    index: int  # the completion this update is about
    delta_text: str  # text that completion gained (held back near possible stop strings)
    delta_token_ids: list[int]
    finished: bool  # the whole request (all n completions) is done
    finish_reason: str | None = None  # set when completion `index` ended with this update


class RequestStream:
    """One submitted request's outputs, as an async iterator. Closing it before the end (or
    leaving the iteration early) aborts the request in the engine, which frees its blocks."""

    def __init__(self, engine: "AsyncEngine", tracker):
        self.engine = engine
        self.tracker = tracker
        self.queue: asyncio.Queue = asyncio.Queue()
        self.timing = RequestTiming(time.monotonic())
        self.closed = False

    @property
    def request_id(self) -> str:
        return self.tracker.request_id

    async def __aiter__(self):
        tracker = self.tracker
        try:
            while not tracker.finished:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if self.timing.first_token is None and item.new_token_ids:
                    self.engine.num_queued -= 1
                self.timing.record(item)
                index, chunk, done, abort = tracker.apply(item)
                if abort:
                    self.engine.abort(item.request_id)
                yield StreamOutput(tracker.output, index, chunk, list(item.new_token_ids), tracker.finished,
                                   tracker.output.outputs[index].finish_reason if done else None)
        finally:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine._forget(self)


def _put_all(pairs) -> None:
    for queue, item in pairs:
        queue.put_nowait(item)


class EngineOverloaded(RuntimeError):
    """More requests are queued than the server accepts; the client should retry later."""


class AsyncEngine:
    def __init__(self, max_queue_len: int | None = None, metrics=None, **llm_kwargs):
        """max_queue_len: requests waiting for their first token beyond which new ones are
        refused with EngineOverloaded (None: no limit). metrics: an entrypoints.metrics.EngineMetrics."""
        self.llm = LLM(**llm_kwargs)  # starts the engine processes and loads the tokenizer
        self.max_queue_len = max_queue_len
        self.metrics = metrics
        self.num_queued = 0  # submitted, no token yet (touched on the event loop only)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._stopping = threading.Event()
        self.last_stats = None
        self._reader = threading.Thread(target=self._read, name="pagedllm-engine-reader", daemon=True)
        self._reader.start()

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    def _read(self) -> None:
        engine = self.llm.engine
        while not self._stopping.is_set():
            try:
                msg = engine.recv(100)
            except EngineDeadError as e:
                self._broadcast(e)
                return
            if isinstance(msg, EngineOutputs):
                self.last_stats = msg.stats
                if self.metrics is not None and msg.stats is not None:
                    self.metrics.observe_stats(msg.stats)
                self._deliver([(delta.request_id, delta) for delta in msg.outputs])
            elif isinstance(msg, RequestRejected):
                self._deliver([(msg.request_id, InvalidParameter(msg.field, msg.message))])

    def _deliver(self, items: list) -> None:
        """Hand each item to its request's queue: one wake-up of each event loop per message,
        not one per request."""
        by_loop: dict = {}
        with self._lock:
            for request_id, item in items:
                target = self._queues.get(request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, pairs in by_loop.items():
            loop.call_soon_threadsafe(_put_all, pairs)

    def _broadcast(self, item) -> None:
        with self._lock:
            targets = list(self._queues.values())
        for loop, queue in targets:
            loop.call_soon_threadsafe(queue.put_nowait, item)

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> "RequestStream":
        """Check and submit a request now (raising InvalidParameter or EngineOverloaded here, before
        any response is started); iterate the returned stream for its outputs."""
        params = params or SamplingParams()
        (text, ids), = self.llm._normalise_prompts([prompt])
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidParameter(
                "max_tokens", f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                              f"has {len(ids)}, so max_tokens can be at most "
                              f"{max(self.max_model_len - len(ids), 0)}, got {params.max_tokens}")
        tracker = self.llm._tracker(text, ids, params, request_id or f"async-{next(self._ids)}")
        if self.max_queue_len is not None and self.num_queued >= self.max_queue_len:
            raise EngineOverloaded(f"{self.num_queued} requests are waiting for their first token "
                                   f"(limit {self.max_queue_len}); retry later")
        stream = RequestStream(self, tracker)
        with self._lock:
            if any(eid in self._queues for eid in tracker.engine_ids):
                raise InvalidParameter("request_id", f"{tracker.request_id!r} is already in use")
            for eid in tracker.engine_ids:  # sample i of n > 1 streams as rid#i
                self._queues[eid] = (asyncio.get_running_loop(), stream.queue)
        self.num_queued += 1
        try:
            with self._send_lock:
                self.llm.engine.add_requests([EngineRequest(
                    request_id=tracker.request_id, prompt_token_ids=ids, sampling_params=params,
                    eos_token_id=self.llm.eos_token_id, arrival_time=stream.timing.submitted)])
        except BaseException:
            stream.close()
            raise
        return stream

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None):
        """Yields a StreamOutput whenever the request gains tokens; the last has finished=True."""
        stream = self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _forget(self, stream: "RequestStream") -> None:
        tracker = stream.tracker
        if stream.timing.first_token is None:
            self.num_queued -= 1
        with self._lock:
            for eid in tracker.engine_ids:
                self._queues.pop(eid, None)
        if not tracker.finished:
            self.abort(*tracker.unfinished_engine_ids())
        if self.metrics is not None:
            self.metrics.observe_request(stream.timing, tracker.output)

    def abort(self, *engine_request_ids: str) -> None:
        if engine_request_ids and self.llm.engine.dead_reason is None and not self.llm.engine.closed:
            with self._send_lock:
                self.llm.engine.abort(list(engine_request_ids))

    def shutdown(self) -> None:
        self._stopping.set()
        self._reader.join(timeout=5)
        self.llm.shutdown()
