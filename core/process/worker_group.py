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
import time

import zmq

from ..config import EngineConfig
from ..errors import EngineFailure
from ..protocol import Configure, Decoder, Encoder, FromWorker, Heartbeat, Shutdown, WorkerFailed, WorkerJoin
from .ipc import free_tcp_port
from .local_workers import LauncherGone, LocalWorkers

POLL_MS = 100
HEARTBEAT_S = 2.0  # the core says it is alive at least this often (workers on other hosts watch)
logger = logging.getLogger("pagedllm.core")


class WorkerFailure(EngineFailure):
    """A worker failed, died, or broke the protocol. `reported`: the worker itself said why (an
    error in its code or setup, which a restart would meet again), rather than being killed."""

    def __init__(self, message: str, reported: bool = False):
        super().__init__(message)
        self.reported = reported


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
    def __init__(self, ctx: zmq.Context, endpoint: str, config: EngineConfig, launcher: LocalWorkers | None = None):
        self.config = config
        self.size = config.tensor_parallel_size
        self.local_ranks = config.ranks_of_node(0)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a rank that is gone raises
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a replacement worker takes over its rank's name
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.encoder = Encoder()
        self.decoder = Decoder(FromWorker)
        self.local = launcher  # this host's ranks, forked by the launcher
        self.joined: dict[int, WorkerJoin] = {}
        self.master_port = config.master_port or free_tcp_port(config.master_addr)
        self._last_send = time.monotonic()
        self.generation = 0  # restarts so far: what this group's workers stamp on their messages

    # --- processes ------------------------------------------------------------------------
    def start(self) -> None:
        """Start this host's ranks; they join (and are configured) in `gather`."""
        if self.local is None:
            self.local = LocalWorkers()
        self.local.connect(self.endpoint)
        for rank in self.local_ranks:
            self.local.start(rank)

    def restart(self) -> None:
        """Stop every local rank (a torch.distributed group does not take a new member) and start
        them again; they join as at the start, with a fresh rendezvous port. A launcher that died
        is replaced too (its workers died with it)."""
        try:
            for rank in self.local_ranks:
                if rank not in self.local.exits:
                    self.local.kill(rank)
            if not self.local.wait_exited(self.local_ranks, timeout_s=10):
                raise WorkerFailure("the old workers did not end")
        except LauncherGone:
            self.local.close()
            self.local = None
        self.joined = {}
        self.generation += 1  # from now on, messages of the old workers still queued are dropped
        self.master_port = self.config.master_port or free_tcp_port(self.config.master_addr)
        self.start()

    def launcher_pid(self) -> int | None:
        return None if self.local is None else self.local.launcher.pid

    def is_local(self, rank: int) -> bool:
        return rank in self.local_ranks

    def check_alive(self, besides: int | None = None) -> None:
        if self.local is None:
            return
        try:
            self.local.poll()
        except LauncherGone as e:
            raise WorkerFailure(str(e)) from None
        for rank, code in self.local.exits.items():
            if rank != besides:
                pid = self.local.pids.get(rank)
                raise WorkerFailure(f"worker {rank} (pid {pid}) {exit_cause(code)}")

    def shutdown(self) -> None:
        try:
            self.broadcast(Shutdown())
        except (zmq.ZMQError, EngineFailure):
            pass  # a rank that is gone needs no telling
        if self.local is not None:
            try:
                self.local.wait_exited(self.local_ranks, timeout_s=5)
            except EngineFailure:
                pass
            self.local.close()  # the launcher kills what is left
        self.sock.close(linger=0)

    # --- messages -------------------------------------------------------------------------
    def broadcast(self, message) -> None:
        """The same frames to every rank, encoded once."""
        frames = self.encoder.encode(message)
        for rank in range(self.size):
            self._send_frames(rank, frames)
        self._last_send = time.monotonic()

    def _send_frames(self, rank: int, frames: list) -> None:
        try:
            self.sock.send_multipart([rank_identity(rank), *frames], copy=len(frames) == 1)
        except zmq.ZMQError as e:  # EHOSTUNREACH: the rank's connection is gone
            self.check_alive()
            raise WorkerFailure(f"worker {rank} cannot be reached: {e}") from None

    def send(self, rank: int, message) -> None:
        self._send_frames(rank, self.encoder.encode(message))

    def keep_alive(self) -> None:
        """A heartbeat to every rank that has joined, when the core has been quiet a while."""
        if time.monotonic() - self._last_send > HEARTBEAT_S:
            frames = self.encoder.encode(Heartbeat())
            for rank in self.joined:
                self._send_frames(rank, frames)
            self._last_send = time.monotonic()

    def recv(self, timeout_ms: int = POLL_MS):
        """(rank, message) from any rank, or None after timeout_ms. A join is answered here; a
        failure, or a local worker that died, raises WorkerFailure."""
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            self.check_alive()
            return None
        identity, *frames = self.sock.recv_multipart(copy=False)
        msg = self.decoder.decode([f.buffer for f in frames])
        rank = int(identity.bytes.decode().rpartition("-")[2])
        if self._stale(rank, msg):
            logger.info("dropped a %s from a replaced worker %d", type(msg).__name__, rank)
            return None
        if isinstance(msg, WorkerFailed):
            time.sleep(0.2)  # a rank that died makes the others fail: name the one that died
            self.check_alive(besides=msg.rank)
            raise WorkerFailure(f"worker {msg.rank} failed: {msg.reason}", reported=True)
        if isinstance(msg, WorkerJoin):
            self._configure(msg)
            return None
        return rank, msg

    def _stale(self, rank: int, msg) -> bool:
        """A message of a worker this group has replaced: stamped with an older generation, or
        (before its Configure) a join from a process that is not the rank's current one."""
        if isinstance(msg, WorkerJoin):
            pids = self.local.pids if self.local is not None and rank in self.local_ranks else {}
            return rank in pids and pids[rank] != msg.pid
        generation = getattr(msg, "generation", -1)
        return generation != -1 and generation != self.generation

    def _configure(self, join: WorkerJoin) -> None:
        if not 0 <= join.rank < self.size or join.rank in self.joined:
            logger.warning("ignoring a worker that joined as rank %d (pid %d on %s)", join.rank, join.pid, join.host)
            return
        self.joined[join.rank] = join
        self.send(join.rank, Configure(self.config, self.config.master_addr, self.master_port, self.generation))

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
