"""An asyncio frontend over the engine, for servers: many requests stream at once.

    engine = AsyncEngine(model=...)
    async for out in engine.generate([1, 2, 3], SamplingParams(max_tokens=16)):
        print(out.delta_text, out.output.outputs[0].token_ids)

A reader thread receives the engine core's messages and hands each event loop the deltas of
its requests; there the output processor folds them into the requests' trackers and each
request's stream yields its updates. The event loop never blocks on a socket. A caller that
stops iterating (a client that disconnects) aborts its request, which frees its blocks in the
next step.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

from pagedllm.core.errors import rejection_error
from pagedllm.core.lora import LoRARequest
from pagedllm.core.protocol import EngineOutputs, EngineRecovered, EngineRecovering, RequestRejected
from pagedllm.core.sampling_params import SamplingParams

from .engine_args import EngineArgs, start_engine
from .engine_client import EngineDeadError
from .output_processor import OutputProcessor, StreamOutput
from .request_tracker import RequestTracker


class RequestStream:
    """One submitted request's updates, as an async iterator. Closing it before the end (or
    leaving the iteration early) aborts the request in the engine, which frees its blocks."""

    def __init__(self, engine: AsyncEngine, tracker: RequestTracker, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.tracker = tracker
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    @property
    def request_id(self) -> str:
        return self.tracker.request_id

    @property
    def timing(self):
        return self.tracker.timing

    async def __aiter__(self):
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine._forget(self)


class EngineOverloaded(RuntimeError):
    """More requests are queued than the server accepts; the client should retry later."""


class EngineShuttingDown(EngineOverloaded):
    """The server is draining before it stops: it takes no new requests."""


class AsyncEngine:
    def __init__(self, max_queue_len: int | None = None, metrics=None, **engine_args):
        """max_queue_len: requests waiting for their first token beyond which new ones are
        refused with EngineOverloaded (None: no limit). metrics: an entrypoints.metrics.EngineMetrics.
        engine_args: the fields of EngineArgs, as LLM takes them."""
        self.engine, self.inputs = start_engine(EngineArgs(**engine_args))
        self.outputs = OutputProcessor()
        self.max_queue_len = max_queue_len
        self.metrics = metrics
        if metrics is not None:
            metrics.observe_cache_config(self.engine.ready, self.engine.config.kv_cache_dtype)
        self.num_queued = 0  # submitted, no token yet
        self._streams: dict[str, RequestStream] = {}  # by request id
        self._ids = itertools.count()
        self._lock = threading.Lock()  # _streams and the output processor's routes
        self._send_lock = threading.Lock()
        self._stopping = threading.Event()
        self._accepting = True
        self.recovering: str | None = None  # why, while a failed worker is being replaced
        self.last_stats = None
        self._reader = threading.Thread(target=self._read, name="pagedllm-engine-reader", daemon=True)
        self._reader.start()

    @property
    def tokenizer(self):
        return self.inputs.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.inputs.max_model_len

    def logprobs_asked(self, params: SamplingParams) -> SamplingParams:
        """The params' logprobs within max_logprobs, a -1 made the vocabulary's size (see
        InputProcessor.logprobs_asked): for a server's checks before add_request."""
        return self.inputs.logprobs_asked(params)

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped (it died, or was shut down), or None while it serves."""
        if self.engine.dead_reason is not None:
            return self.engine.dead_reason
        return "shut down" if self.engine.closed else None

    def render_chat(
        self,
        conversation: list[dict],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> dict:
        return self.inputs.render_chat(
            conversation, chat_template, add_generation_prompt, continue_final_message, tools, template_kwargs
        )

    # --- the reader thread ----------------------------------------------------------------
    def _read(self) -> None:
        while not self._stopping.is_set():
            try:
                msg = self.engine.recv(100)
            except EngineDeadError as e:
                self._broadcast(e)
                return
            if isinstance(msg, EngineOutputs):
                self.last_stats = msg.stats
                if self.metrics is not None and msg.stats is not None:
                    self.metrics.observe_stats(msg.stats)
                self._deliver(msg.outputs)
            elif isinstance(msg, EngineRecovering):
                self.recovering = msg.reason
            elif isinstance(msg, EngineRecovered):
                self.recovering = None
            elif isinstance(msg, RequestRejected):
                error = rejection_error(msg.field, msg.message, msg.internal)
                with self._lock:
                    tracker = self.outputs.tracker(msg.request_id)  # also one of n samples: rid#i
                    stream = self._streams.get(tracker.request_id) if tracker is not None else None
                if stream is not None:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)

    def _deliver(self, deltas: list) -> None:
        """Hand each event loop the deltas of its requests: one wake-up per loop per message."""
        by_loop: dict = {}
        with self._lock:
            for delta in deltas:
                tracker = self.outputs.tracker(delta.request_id)
                stream = self._streams.get(tracker.request_id) if tracker is not None else None
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append(delta)
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(self._process, batch)

    def _process(self, deltas: list) -> None:
        """On the requests' event loop: fold the deltas in and queue each stream's updates."""
        with self._lock:
            updates, aborts = self.outputs.process(deltas)
        for tracker, update in updates:
            stream = self._streams.get(tracker.request_id)
            if stream is None:
                continue
            if update.first_token:
                self.num_queued -= 1
            stream.queue.put_nowait(update)
        self.abort(*aborts)

    def _broadcast(self, error: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)

    # --- requests -------------------------------------------------------------------------
    def prepare(self, prompt, truncation: tuple[int, str] | None = None) -> dict:
        """A prompt tokenized (and cut to `truncation`: (tokens to keep, side)), as a dict that
        add_request takes without tokenizing again."""
        (item,) = self.inputs.prompts([prompt])
        if truncation is not None:
            item = self.inputs.truncate(item, *truncation)
        return {"prompt": item[0], "prompt_token_ids": item[1]}

    def add_request(
        self,
        prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        structured_outputs_after: int | None = None,
        lora: LoRARequest | None = None,
    ) -> RequestStream:
        """Check and submit a request now (raising InvalidParameter or EngineOverloaded here, before
        any response is started); iterate the returned stream for its outputs.
        structured_outputs_after: the token from whose first sampling on the constraint applies.
        lora: the adapter it runs under (the engine needs enable_lora)."""
        if not self._accepting:
            raise EngineShuttingDown("the server is shutting down; it takes no new requests")
        params = params or SamplingParams()
        (item,) = self.inputs.prompts([prompt])
        self.inputs.check_room(item, params)
        tracker = self.inputs.tracker(item, params, request_id or f"async-{next(self._ids)}")
        tracker.structured_outputs_after = structured_outputs_after
        tracker.lora = self.inputs.adapter(lora)
        if self.max_queue_len is not None and self.num_queued >= self.max_queue_len:
            raise EngineOverloaded(
                f"{self.num_queued} requests are waiting for their first token "
                f"(limit {self.max_queue_len}); retry later"
            )
        stream = RequestStream(self, tracker, asyncio.get_running_loop())
        with self._lock:
            self.outputs.add(tracker)  # raises if the id is in use
            self._streams[tracker.request_id] = stream
        self.num_queued += 1
        tracker.timing.submitted = time.monotonic()
        try:
            with self._send_lock:
                self.engine.add_requests([self.inputs.engine_request(tracker, tracker.timing.submitted)])
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

    def _forget(self, stream: RequestStream) -> None:
        tracker = stream.tracker
        if tracker.timing.first_token is None:
            self.num_queued -= 1
        with self._lock:
            self.outputs.remove(tracker)
            self._streams.pop(tracker.request_id, None)
        if not tracker.finished:
            self.abort(*tracker.unfinished_engine_ids())
        if self.metrics is not None:
            self.metrics.observe_request(tracker.timing, tracker.output)

    @property
    def accepting(self) -> bool:
        return self._accepting

    def stop_accepting(self) -> None:
        """From now on add_request raises EngineShuttingDown; running requests go on."""
        self._accepting = False

    @property
    def num_open_requests(self) -> int:
        return len(self._streams)

    def abort_all(self) -> None:
        """Abort every running request: each stream ends with finish_reason "abort"."""
        with self._lock:
            trackers = [s.tracker for s in self._streams.values()]
        self.abort(*(rid for t in trackers for rid in t.unfinished_engine_ids()))

    def abort(self, *engine_request_ids: str) -> None:
        if engine_request_ids and self.engine.dead_reason is None and not self.engine.closed:
            with self._send_lock:
                self.engine.abort(list(engine_request_ids))

    def shutdown(self) -> None:
        self._stopping.set()
        self._reader.join(timeout=5)
        self.engine.shutdown()


__all__ = ["AsyncEngine", "EngineOverloaded", "EngineShuttingDown", "RequestStream", "StreamOutput"]
