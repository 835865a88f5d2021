"""The engine core's handle on this host's worker processes: they are forked by one launcher
process (backends/launcher.py), which has torch imported already, so a worker that dies is
replaced in the time it takes to load the model. Torch-free: the launcher does the forking."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from .errors import EngineFailure


class LauncherGone(EngineFailure):
    pass


class LocalWorkers:
    """The launcher starts at once (importing torch, seconds) and learns where the workers reach
    the core from `connect`, once the core has bound it."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.backends.launcher"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        os.set_blocking(self.proc.stdout.fileno(), False)
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
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise LauncherGone(f"the worker launcher exited with code {self.proc.poll()}") from None

    def poll(self) -> None:
        """Take the launcher's reports; LauncherGone if it died (its workers die with it)."""
        while True:
            try:
                chunk = os.read(self.proc.stdout.fileno(), 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._buffer += chunk
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            kind, rank, pid, *code = line.decode().split()
            if kind == "started":
                self.pids[int(rank)] = int(pid)
            elif kind == "exited" and self.pids.get(int(rank)) in (None, int(pid)):
                self.pids[int(rank)] = int(pid)
                self.exits[int(rank)] = int(code[0])
        if self.proc.poll() is not None:
            raise LauncherGone(f"the worker launcher exited with code {self.proc.returncode}")

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
