"""The frontend's handle on the engine: starts the engine-core process (which starts the
workers), talks to it over ZeroMQ, and shuts everything down without leaving processes,
socket files or shared-memory segments behind — also when the engine died first."""

from __future__ import annotations

import subprocess
import sys
import time

import msgspec
import zmq

from pagedllm.core.config import EngineConfig
from pagedllm.core.process import shm
from pagedllm.core.process.ipc import Channel, free_tcp_endpoint, ipc_endpoint, make_ipc_dir, remove_ipc_dir
from pagedllm.core.protocol import (
    AbortRequests,
    AddRequests,
    CoreMessage,
    EngineDead,
    EngineReady,
    ResetPrefixCache,
    Shutdown,
)
from pagedllm.core.request import EngineRequest

from .interrupt import raise_if_interrupted

POLL_MS = 100


class EngineDeadError(RuntimeError):
    """The engine core or a worker died; the message says why."""


class EngineClient:
    def __init__(self, config: EngineConfig, transport: str = "ipc"):
        """transport: "ipc" (socket files in a private folder, the default) or "tcp" (loopback ports)."""
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport: must be 'ipc' or 'tcp', got {transport!r}")
        self.config = config
        self.ipc_dir = make_ipc_dir()
        names = ("input", "output", "workers")
        self.endpoints = {
            n: ipc_endpoint(self.ipc_dir, n) if transport == "ipc" else free_tcp_endpoint() for n in names
        }
        self.ctx = zmq.Context()
        self.to_core = Channel(self.ctx, zmq.PUSH, self.endpoints["input"], bind=False)
        self.from_core = Channel(self.ctx, zmq.PULL, self.endpoints["output"], bind=False, message_type=CoreMessage)
        # A session of its own: a Ctrl-C in the terminal reaches only the frontend, which then
        # shuts the engine down in order.
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagedllm.core.process.engine_main",
                "--config",
                msgspec.json.encode(config).decode(),
                "--input",
                self.endpoints["input"],
                "--output",
                self.endpoints["output"],
                "--workers",
                self.endpoints["workers"],
            ],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.ready: EngineReady | None = None
        self.dead_reason: str | None = None
        self.closed = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout_s: float = 600) -> EngineReady:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.recv(POLL_MS)
            if isinstance(msg, EngineReady):
                self.ready = msg
                return msg
        raise EngineDeadError(f"engine did not start within {timeout_s:.0f} s")

    def add_requests(self, requests: list[EngineRequest]) -> None:
        """Submit requests in one message: the core admits them in the same step."""
        if requests:
            self._check_alive()
            self.to_core.send(AddRequests(requests))

    def reset_prefix_cache(self) -> None:
        """Ask the core to forget its prefix cache (done where no request holds a block)."""
        if self.dead_reason is None and not self.closed:
            self.to_core.send(ResetPrefixCache())

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None and not self.closed:
            self.to_core.send(AbortRequests(list(request_ids)))

    def recv(self, timeout_ms: int = POLL_MS):
        """The next message from the core, or None after timeout_ms. Raises EngineDeadError."""
        raise_if_interrupted()
        self._check_alive()
        if not self.from_core.poll(timeout_ms):
            if self.proc.poll() is not None and not self.from_core.poll(0):
                self._died(f"engine core exited with code {self.proc.returncode}")
            return None
        msg = self.from_core.recv()
        if isinstance(msg, EngineDead):
            self._died(msg.reason)
        return msg

    def _check_alive(self) -> None:
        if self.closed:
            raise EngineDeadError("the engine has been shut down")
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def _died(self, reason: str) -> None:
        self.dead_reason = f"engine died: {reason}"
        raise EngineDeadError(self.dead_reason)

    def shutdown(self, timeout_s: float = 10) -> None:
        if self.closed:
            return
        self.closed = True
        if self.proc.poll() is None:
            try:
                self.to_core.send(Shutdown())
            except zmq.ZMQError:
                pass
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        for name in shm.segments_of(self.proc.pid):  # the core died before it could clean up
            shm.unlink_segment(name)
        self.to_core.close()
        self.from_core.close()
        self.ctx.term()
        remove_ipc_dir(self.ipc_dir)
