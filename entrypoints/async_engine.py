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
from dataclasses import dataclass

from pagedllm.core.errors import InvalidParameter
from pagedllm.core.protocol import EngineOutputs, RequestRejected
from pagedllm.core.request import EngineRequest
from pagedllm.core.sampling_params import SamplingParams

from .engine_client import EngineDeadError
from .llm import LLM
from .outputs import RequestOutput


@dataclass
class StreamOutput:
    output: RequestOutput  # everything so far
    index: int  # the completion this update is about
    delta_text: str  # text that completion gained (held back near possible stop strings)
    delta_token_ids: list[int]
    finished: bool  # the whole request (all n completions) is done


class AsyncEngine:
    def __init__(self, **llm_kwargs):
        self.llm = LLM(**llm_kwargs)  # starts the engine processes and loads the tokenizer
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
                for delta in msg.outputs:
                    self._deliver(delta.request_id, delta)
            elif isinstance(msg, RequestRejected):
                self._deliver(msg.request_id, InvalidParameter(msg.field, msg.message))

    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            target = self._queues.get(request_id)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _broadcast(self, item) -> None:
        with self._lock:
            targets = list(self._queues.values())
        for loop, queue in targets:
            loop.call_soon_threadsafe(queue.put_nowait, item)

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None):
        """Yields a StreamOutput whenever the request gains tokens; the last has finished=True."""
        params = params or SamplingParams()
        (text, ids), = self.llm._normalise_prompts([prompt])
        tracker = self.llm._tracker(text, ids, params, request_id or f"async-{next(self._ids)}")
        rid = tracker.request_id
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if any(eid in self._queues for eid in tracker.engine_ids):
                raise InvalidParameter("request_id", f"{rid!r} is already in use")
            for eid in tracker.engine_ids:  # sample i of n > 1 streams as rid#i
                self._queues[eid] = (asyncio.get_running_loop(), queue)
        try:
            with self._send_lock:
                self.llm.engine.add_request(EngineRequest(
                    request_id=rid, prompt_token_ids=ids, sampling_params=params,
                    eos_token_id=self.llm.eos_token_id, arrival_time=time.monotonic()))
            while not tracker.finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                index, chunk, _, abort = tracker.apply(item)
                if abort:
                    self.abort(item.request_id)
                yield StreamOutput(tracker.output, index, chunk, list(item.new_token_ids), tracker.finished)
        finally:
            with self._lock:
                for eid in tracker.engine_ids:
                    self._queues.pop(eid, None)
            if not tracker.finished:
                self.abort(*tracker.unfinished_engine_ids())

    def abort(self, *engine_request_ids: str) -> None:
        if engine_request_ids and self.llm.engine.dead_reason is None and not self.llm.engine.closed:
            with self._send_lock:
                self.llm.engine.abort(list(engine_request_ids))

    def shutdown(self) -> None:
        self._stopping.set()
        self._reader.join(timeout=5)
        self.llm.shutdown()
