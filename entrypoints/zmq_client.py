"""Python clients of the ZMQ entrypoint, sync and asyncio. Light: no torch, no transformers.

with ZmqClient("tcp://127.0.0.1:5555") as client:
    final = client.generate("Hello", max_tokens=16, temperature=0)
    for msg in client.stream("Hello", max_tokens=16):   # Delta ..., then the Final
        print(msg)

async with AsyncZmqClient("tcp://127.0.0.1:5555") as client:
    final = await client.generate(prompt_token_ids=[1, 2, 3], max_tokens=8)
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import uuid

import msgspec
import zmq
import zmq.asyncio

from .zmq_protocol import Abort, Error, Final, Generate, ServerMessage


class ZmqRequestError(RuntimeError):
    def __init__(self, error: Error):
        super().__init__(f"{error.code}: {error.message}")
        self.code, self.field, self.request_id = error.code, error.field, error.request_id


def _checked(reply):
    """The reply, unless it is an error: that is raised."""
    if isinstance(reply, Error):
        raise ZmqRequestError(reply)
    return reply


class _Base:
    def __init__(self, endpoint: str, ctx):
        self.ctx = ctx
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ServerMessage)
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]

    def _generate_message(self, prompt, prompt_token_ids, request_id, stream, params) -> Generate:
        return Generate(
            request_id=request_id or f"{self._prefix}-{next(self._ids)}",
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            stream=stream,
        )


class ZmqClient(_Base):
    """Blocking client. Several streams may be open at once; messages for one are kept while
    another is read."""

    def __init__(self, endpoint: str, timeout_s: float = 600):
        super().__init__(endpoint, zmq.Context.instance())
        self.timeout_ms = int(timeout_s * 1000)
        self._inbox: dict[str, collections.deque] = collections.defaultdict(collections.deque)

    def __enter__(self) -> ZmqClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close(linger=0)

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        **params,
    ) -> Final:
        final = None
        for msg in self.stream(
            prompt, prompt_token_ids=prompt_token_ids, request_id=request_id, _stream=False, **params
        ):
            final = msg
        return final

    def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        _stream: bool = True,
        **params,
    ):
        """Yields Delta messages, then the Final one. Raises ZmqRequestError on an error reply.
        Leaving the loop early aborts the request."""
        msg = self._generate_message(prompt, prompt_token_ids, request_id, _stream, params)
        self.sock.send(self.encoder.encode(msg))
        done = False
        try:
            while not done:
                reply = self._next(msg.request_id)
                done = isinstance(reply, (Final, Error))
                yield _checked(reply)
        finally:
            if not done:
                self.abort(msg.request_id)

    def abort(self, request_id: str) -> None:
        self.sock.send(self.encoder.encode(Abort(request_id)))

    def send_raw(self, *frames: bytes) -> None:
        """Send frames as they are (for testing a server against malformed input)."""
        self.sock.send_multipart(list(frames))

    def receive_any(self) -> ServerMessage:
        """The next message, whatever request it is about."""
        if not self.sock.poll(self.timeout_ms):
            raise TimeoutError(f"no reply within {self.timeout_ms / 1000:.0f} s")
        return self.decoder.decode(self.sock.recv())

    def _next(self, request_id: str):
        box = self._inbox[request_id]
        while not box:
            reply = self.receive_any()
            self._inbox[reply.request_id].append(reply)
        reply = box.popleft()
        if isinstance(reply, (Final, Error)):
            self._inbox.pop(request_id, None)
        return reply


class AsyncZmqClient(_Base):
    """asyncio client: one reader task hands each message to its request's queue."""

    def __init__(self, endpoint: str):
        super().__init__(endpoint, zmq.asyncio.Context.instance())
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> AsyncZmqClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self, abort: bool = True) -> None:
        """abort=False drops the connection without telling the server (as a crash would)."""
        if abort:
            for rid in list(self._queues):
                await self.sock.send(self.encoder.encode(Abort(rid)))
        if self._reader is not None:
            self._reader.cancel()
        self.sock.close(linger=0)

    async def _read(self) -> None:
        while True:
            reply = self.decoder.decode(await self.sock.recv())
            queue = self._queues.get(reply.request_id)
            if queue is not None:
                queue.put_nowait(reply)

    async def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        _stream: bool = True,
        **params,
    ):
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        msg = self._generate_message(prompt, prompt_token_ids, request_id, _stream, params)
        queue = self._queues[msg.request_id] = asyncio.Queue()
        done = False
        try:
            await self.sock.send(self.encoder.encode(msg))
            while not done:
                reply = await queue.get()
                done = isinstance(reply, (Final, Error))
                yield _checked(reply)
        finally:
            self._queues.pop(msg.request_id, None)
            if not done and not self.sock.closed:
                await self.sock.send(self.encoder.encode(Abort(msg.request_id)))

    async def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        **params,
    ) -> Final:
        final = None
        async for msg in self.stream(
            prompt, prompt_token_ids=prompt_token_ids, request_id=request_id, _stream=False, **params
        ):
            final = msg
        return final
