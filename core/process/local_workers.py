"""The engine core's handle on this host's worker processes: they are forked by one launcher
process (backends/launcher.py), which has torch imported already, so a worker that dies is
replaced in the time it takes to load the model. Torch-free: the launcher does the forking.
The launcher is the core's own child, or one forked for it by a launcher server
(backends/launcher_server.py) when $PAGEDLLM_LAUNCHER_SERVER names one that will serve it."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

from ..errors import EngineFailure

LAUNCHER_SERVER_ENV = "PAGEDLLM_LAUNCHER_SERVER"
# what may differ between a core and the launcher server: set by pytest and by shells (the last two:
# the terminal's size), read by neither pagedllm nor torch
VOLATILE_ENV = ("PYTEST_CURRENT_TEST", "_", "SHLVL", "OLDPWD", "COLUMNS", "LINES")
HANDSHAKE_S = 10.0

log = logging.getLogger("pagedllm.core")


class LauncherGone(EngineFailure):
    pass


def process_context() -> dict:
    """What a launcher's import and its workers depend on besides the code: this process's
    environment, working directory, interpreter and CPU affinity (a launcher server serves a
    core whose context is its own)."""
    return {
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "executable": sys.executable,
        "cpus": sorted(os.sched_getaffinity(0)),
    }


def launched_line(pid: int) -> bytes:
    """A served launcher's first line to its core."""
    return f"launched {pid}\n".encode()


class OwnLauncher:
    """A launcher process that is this core's child."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.backends.launcher"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.pid = self.proc.pid

    def send(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def receive(self) -> bytes | None:
        """What the launcher wrote (b"" once it closed its end), None if nothing yet."""
        try:
            return os.read(self.proc.stdout.fileno(), 4096)
        except BlockingIOError:
            return None

    def ended(self) -> str | None:
        return None if self.proc.poll() is None else f"exited with code {self.proc.returncode}"

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


class ServedLauncher:
    """A launcher forked by a launcher server: the connection is its stdin and stdout, and its
    end of it closes only when it exits."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid, self.eof = sock, pid, False
        sock.setblocking(False)

    @classmethod
    def connect(cls, path: str) -> ServedLauncher | None:
        """One forked for this core, or None (no server there, or it refused: the reason is logged)."""
        request = json.dumps(process_context()).encode()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(HANDSHAKE_S)
        try:
            sock.connect(path)
            socket.send_fds(sock, [request[:1]], [2])  # the launcher and its workers log where this core does
            sock.sendall(request[1:] + b"\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
        except OSError as e:
            sock.close()
            log.info("launcher server at %s: %s; starting a launcher of this engine's own", path, e)
            return None
        kind, _, rest = reply.decode(errors="replace").strip().partition(" ")
        if kind != "launched":
            sock.close()
            log.info("launcher server at %s refused (%s); starting a launcher of this engine's own", path, rest)
            return None
        return cls(sock, int(rest))

    def send(self, data: bytes) -> None:
        self.sock.setblocking(True)
        try:
            self.sock.sendall(data)
        finally:
            self.sock.setblocking(False)

    def receive(self) -> bytes | None:
        try:
            chunk = self.sock.recv(4096)
        except BlockingIOError:
            return None
        except OSError:
            chunk = b""
        self.eof = self.eof or not chunk
        return chunk

    def ended(self) -> str | None:
        return "exited" if self.eof else None

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)  # its stdin closes: it kills what is left and exits
        except OSError:
            pass
        deadline = time.monotonic() + 5
        while not self.eof and time.monotonic() < deadline:
            if self.receive() is None:
                time.sleep(0.01)
        if not self.eof:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.sock.close()


def start_launcher() -> OwnLauncher | ServedLauncher:
    path = os.environ.get(LAUNCHER_SERVER_ENV)
    return (ServedLauncher.connect(path) if path else None) or OwnLauncher()


class LocalWorkers:
    """The launcher starts at once (importing torch, seconds) and learns where the workers reach
    the core from `connect`, once the core has bound it."""

    def __init__(self):
        self.launcher = start_launcher()
        self.pids: dict[int, int] = {}  # rank -> pid of its current process
        self.exits: dict[int, int] = {}  # rank -> how its current process ended (Popen's returncode)
        self._buffer = b""

    def connect(self, endpoint: str) -> None:
        """Where the workers it starts from now on reach the core (said again: no harm)."""
        self._command(f"head {endpoint}")

    def start(self, rank: int) -> None:
        self.exits.pop(rank, None)
        self.pids.pop(rank, None)
        self._command(f"start {rank}")

    def kill(self, rank: int) -> None:
        self._command(f"kill {rank}")

    def _command(self, line: str) -> None:
        try:
            self.launcher.send(line.encode() + b"\n")
        except (OSError, ValueError):
            raise LauncherGone(f"the worker launcher {self.launcher.ended() or 'is gone'}") from None

    def poll(self) -> None:
        """Take the launcher's reports; LauncherGone if it died (its workers die with it)."""
        while chunk := self.launcher.receive():
            self._buffer += chunk
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            kind, rank, pid, *code = line.decode().split()
            if kind == "started":
                self.pids[int(rank)] = int(pid)
            elif kind == "exited" and self.pids.get(int(rank)) in (None, int(pid)):
                self.pids[int(rank)] = int(pid)
                self.exits[int(rank)] = int(code[0])
        ended = self.launcher.ended()
        if ended is not None:
            raise LauncherGone(f"the worker launcher {ended}")

    def wait_exited(self, ranks, timeout_s: float) -> bool:
        """Whether all of `ranks` ended within the timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            if all(r in self.exits for r in ranks):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    def close(self) -> None:
        """The launcher ends (killing what is left) when its stdin closes."""
        self.launcher.close()
