"""Python clients of the ZMQ entrypoint, sync and asyncio. Light: no torch, no transformers.

with ZmqClient("tcp://127.0.0.1:5555") as client:
    final = client.generate("Hello", max_tokens=16, temperature=0)
    for msg in client.stream("Hello", max_tokens=16):   # Delta ..., then the Final
        print(msg)

async with AsyncZmqClient("tcp://127.0.0.1:5555") as client:
    final = await client.generate(prompt_token_ids=[1, 2, 3], max_tokens=8)

A CurveZMQ server: ZmqClient(endpoint, server_key="keys/server.key", client_key="keys/me.key_secret").
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import uuid

import msgspec
import zmq
import zmq.asyncio

from .zmq_auth import load_key_pair, load_public_key
from .zmq_protocol import Abort, Error, Final, Generate, Hello, Ready, ServerMessage


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
    def __init__(self, endpoint: str, ctx, server_key: str | None = None, client_key: str | None = None):
        """server_key: the server's public key file (NAME.key), for a CurveZMQ server;
        client_key: this client's key pair file (NAME.key_secret), authorized by the server."""
        self.ctx = ctx
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if server_key is not None:
            if client_key is None:
                raise ValueError("client_key: a CurveZMQ server needs this client's key pair too")
            self.sock.curve_serverkey = load_public_key(server_key)
            self.sock.curve_publickey, self.sock.curve_secretkey = load_key_pair(client_key)
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

    def __init__(
        self, endpoint: str, timeout_s: float = 600, server_key: str | None = None, client_key: str | None = None
    ):
        super().__init__(endpoint, zmq.Context.instance(), server_key, client_key)
        self.timeout_ms = int(timeout_s * 1000)
        self.sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)  # no server to take a message: TimeoutError
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
        self._send(self.encoder.encode(msg))
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
        """Best effort: with no server to take it (gone, or refusing our keys), it is dropped."""
        try:
            self.sock.send(self.encoder.encode(Abort(request_id)), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _send(self, *frames: bytes) -> None:
        try:
            self.sock.send_multipart(list(frames))
        except zmq.Again:
            raise TimeoutError(f"no server took the message within {self.timeout_ms / 1000:.0f} s") from None

    def wait_ready(self) -> Ready:
        """Block until the server answers (ZeroMQ holds the question until it is up)."""
        self._send(self.encoder.encode(Hello()))
        return self._next(None)

    def send_raw(self, *frames: bytes) -> None:
        """Send frames as they are (for testing a server against malformed input)."""
        self._send(*frames)

    def receive_any(self) -> ServerMessage:
        """The next message, whatever request it is about."""
        if not self.sock.poll(self.timeout_ms):
            raise TimeoutError(f"no reply within {self.timeout_ms / 1000:.0f} s")
        return self.decoder.decode(self.sock.recv())

    def _next(self, request_id: str):
        box = self._inbox[request_id]
        while not box:
            reply = self.receive_any()
            self._inbox[getattr(reply, "request_id", None)].append(reply)  # a Ready has no request id
        reply = box.popleft()
        if isinstance(reply, (Final, Error, Ready)):
            self._inbox.pop(request_id, None)
        return reply


class AsyncZmqClient(_Base):
    """asyncio client: one reader task hands each message to its request's queue."""

    def __init__(self, endpoint: str, server_key: str | None = None, client_key: str | None = None):
        super().__init__(endpoint, zmq.asyncio.Context.instance(), server_key, client_key)
        self._queues: dict[str | None, asyncio.Queue] = {}  # None: the answer to wait_ready()
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> AsyncZmqClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self, abort: bool = True) -> None:
        """abort=False drops the connection without telling the server (as a crash would)."""
        if abort:
            for rid in list(self._queues):
                if rid is not None:
                    self._abort_nowait(rid)
        if self._reader is not None:
            self._reader.cancel()
        self.sock.close(linger=0)

    async def _read(self) -> None:
        while True:
            reply = self.decoder.decode(await self.sock.recv())
            queue = self._queues.get(getattr(reply, "request_id", None))
            if queue is not None:
                queue.put_nowait(reply)

    async def wait_ready(self) -> Ready:
        """Wait until the server answers (ZeroMQ holds the question until it is up)."""
        self._start_reader()
        queue = self._queues.setdefault(None, asyncio.Queue())
        await self.sock.send(self.encoder.encode(Hello()))
        try:
            return await queue.get()
        finally:
            self._queues.pop(None, None)

    def abort(self, request_id: str) -> None:
        """Ask the server to stop a request; its stream then ends with a Final (finish_reason
        "abort"). Best effort, as in ZmqClient.abort: a send that cannot go now is dropped."""
        self._abort_nowait(request_id)

    def _abort_nowait(self, request_id: str) -> None:
        """Best effort, as in ZmqClient.abort: a send that cannot go now is dropped."""
        sent = self.sock.send(self.encoder.encode(Abort(request_id)), zmq.NOBLOCK)
        sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, not raised

    def _start_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())

    async def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        _stream: bool = True,
        **params,
    ):
        self._start_reader()
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
                self._abort_nowait(msg.request_id)

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
