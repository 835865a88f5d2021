"""ZeroMQ plumbing shared by the processes."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

import zmq

from ..protocol import Decoder, Encoder


class PeerGone(RuntimeError):
    pass


class Channel:
    """One direction of a pipe: a PUSH or PULL socket with its encoder or decoder."""

    def __init__(self, ctx: zmq.Context, kind: int, endpoint: str, bind: bool, message_type=None):
        self.socket = ctx.socket(kind)
        self.socket.setsockopt(zmq.LINGER, 0)
        if kind == zmq.PUSH:
            self.socket.setsockopt(zmq.SNDHWM, 0)
        (self.socket.bind if bind else self.socket.connect)(endpoint)
        self.encoder = Encoder()
        self.decoder = Decoder(message_type) if message_type is not None else None

    def send(self, message, peer_timeout_ms: int | None = None) -> None:
        """peer_timeout_ms: wait at most this long for a connected peer, then raise PeerGone.
        (A bound PUSH socket with no peer blocks forever, and with unlimited queues a
        connected one never blocks, so this only ever waits for a peer that left.)"""
        if peer_timeout_ms is not None and not self.socket.poll(peer_timeout_ms, zmq.POLLOUT):
            raise PeerGone(f"no peer on the other end of {self.socket.getsockopt_string(zmq.LAST_ENDPOINT)}")
        frames = self.encoder.encode(message)
        self.socket.send_multipart(frames, copy=len(frames) == 1)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.socket.poll(timeout_ms, zmq.POLLIN))

    def recv(self):
        frames = self.socket.recv_multipart(copy=False)
        return self.decoder.decode([f.buffer for f in frames])

    def close(self, linger_ms: int = 0) -> None:
        """linger_ms > 0 gives a last message (an error report) time to leave."""
        self.socket.close(linger=linger_ms)


def make_ipc_dir(pid: int | None = None) -> str:
    """A private folder for ipc:// socket files, named after the engine's pid."""
    return tempfile.mkdtemp(prefix=f"pagedllm-{pid or os.getpid()}-")


def remove_ipc_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def ipc_endpoint(folder: str, name: str) -> str:
    return f"ipc://{os.path.join(folder, name)}"


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now (whoever asked binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_tcp_endpoint(host: str = "127.0.0.1") -> str:
    """A loopback tcp:// endpoint on a port that is free now (the engine core binds it next)."""
    return f"tcp://{host}:{free_tcp_port(host)}"
