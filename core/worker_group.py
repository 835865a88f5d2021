"""The engine core's side of its backend workers: one process per tensor-parallel rank.

One ROUTER socket reaches every rank; each worker connects a DEALER named after its rank,
says `WorkerJoin`, and is sent its `Configure`. The core starts the ranks of its own host; those
of other hosts are started there by `pagedllm worker` and join the same way. A step is
encoded once and the same frames go to every rank; rank 0 answers it; any rank may report a
failure. Never imports torch.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time

import zmq

from .config import EngineConfig
from .errors import EngineFailure
from .ipc import free_tcp_port
from .protocol import Configure, Decoder, Encoder, FromWorker, Heartbeat, Shutdown, WorkerFailed, WorkerJoin

POLL_MS = 100
HEARTBEAT_S = 2.0  # the core says it is alive at least this often (workers on other hosts watch)
logger = logging.getLogger("pagedllm.core")


class WorkerFailure(EngineFailure):
    """A worker failed, died, or broke the protocol."""


def exit_cause(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def rank_identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


class WorkerGroup:
    def __init__(self, ctx: zmq.Context, endpoint: str, config: EngineConfig):
        self.config = config
        self.size = config.tensor_parallel_size
        self.local_ranks = config.ranks_of_node(0)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a rank that is gone raises
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.encoder = Encoder()
        self.decoder = Decoder(FromWorker)
        self.procs: dict[int, subprocess.Popen] = {}
        self.joined: dict[int, WorkerJoin] = {}
        self.master_port = config.master_port or free_tcp_port(config.master_addr)
        self._last_send = time.monotonic()

    # --- processes ------------------------------------------------------------------------
    def start(self) -> None:
        """Start this host's ranks; they join (and are configured) in `gather`."""
        for rank in self.local_ranks:
            self.procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "pagedllm.backends.worker", "--head", self.endpoint, "--rank", str(rank)],
                stdin=subprocess.DEVNULL,
            )

    def is_local(self, rank: int) -> bool:
        return rank in self.procs

    def check_alive(self) -> None:
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                raise WorkerFailure(f"worker {rank} (pid {proc.pid}) {exit_cause(proc.returncode)}")

    def shutdown(self) -> None:
        try:
            self.broadcast(Shutdown())
        except zmq.ZMQError:
            pass
        deadline = time.monotonic() + 5
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.sock.close(linger=0)

    # --- messages -------------------------------------------------------------------------
    def broadcast(self, message) -> None:
        """The same frames to every rank, encoded once."""
        frames = self.encoder.encode(message)
        for rank in range(self.size):
            self.sock.send_multipart([rank_identity(rank), *frames], copy=len(frames) == 1)
        self._last_send = time.monotonic()

    def send(self, rank: int, message) -> None:
        self.sock.send_multipart([rank_identity(rank), *self.encoder.encode(message)])

    def keep_alive(self) -> None:
        """A heartbeat to every rank that has joined, when the core has been quiet a while."""
        if time.monotonic() - self._last_send > HEARTBEAT_S:
            frames = self.encoder.encode(Heartbeat())
            for rank in self.joined:
                self.sock.send_multipart([rank_identity(rank), *frames])
            self._last_send = time.monotonic()

    def recv(self, timeout_ms: int = POLL_MS):
        """(rank, message) from any rank, or None after timeout_ms. A join is answered here; a
        failure, or a local worker that died, raises WorkerFailure."""
        self.check_alive()
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            return None
        identity, *frames = self.sock.recv_multipart(copy=False)
        msg = self.decoder.decode([f.buffer for f in frames])
        rank = int(identity.bytes.decode().rpartition("-")[2])
        if isinstance(msg, WorkerFailed):
            time.sleep(0.2)  # a rank that died makes the others fail: name the one that died
            self.check_alive()
            raise WorkerFailure(f"worker {msg.rank} failed: {msg.reason}")
        if isinstance(msg, WorkerJoin):
            self._configure(msg)
            return None
        return rank, msg

    def _configure(self, join: WorkerJoin) -> None:
        if not 0 <= join.rank < self.size or join.rank in self.joined:
            logger.warning("ignoring a worker that joined as rank %d (pid %d on %s)", join.rank, join.pid, join.host)
            return
        self.joined[join.rank] = join
        self.send(join.rank, Configure(self.config, self.config.master_addr, self.master_port))

    def gather(self, kind, timeout_s: float, idle=lambda: None) -> list:
        """One `kind` message from every rank, in rank order; `idle()` runs between polls."""
        got: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.size)) - set(got))
                raise WorkerFailure(f"workers {missing} sent no {kind.__name__} within {timeout_s:.0f} s")
            item = self.recv()
            if item is None:
                self.keep_alive()
                idle()
                continue
            rank, msg = item
            if not isinstance(msg, kind):
                raise WorkerFailure(f"worker {rank} sent {type(msg).__name__}, expected {kind.__name__}")
            got[rank] = msg
        return [got[r] for r in range(self.size)]

    def wait_result(self, kind, idle=lambda: None):
        """Rank 0's answer to the step in flight; watches every rank meanwhile."""
        while True:
            item = self.recv()
            if item is None:
                idle()
                continue
            rank, msg = item
            if rank == 0 and isinstance(msg, kind):
                return msg
            raise WorkerFailure(f"worker {rank} sent {type(msg).__name__} during a step")
