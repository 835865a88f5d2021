"""Process-tree and /dev/shm checks for leak tests (Linux /proc)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time


def children_of(pid: int) -> list[int]:
    """All live descendants of pid."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        frontier += kids
    return found


def is_running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def segments_of(pid: int) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"pagedllm-{pid}-"))


def wait_until(predicate, timeout_s: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def workers_of(core_pid: int, launcher_pid: int | None = None) -> list[int]:
    """The worker processes of an engine core: the children of its worker launcher (the core's
    child, or a launcher server's: EngineReady.launcher_pid)."""
    if launcher_pid is not None:
        return children_of(launcher_pid)
    return [p for launcher in direct_children(core_pid) for p in children_of(launcher)]


def direct_children(pid: int) -> list[int]:
    return [p for p in children_of(pid) if parent_of(p) == pid]


def engine_processes(engine) -> list[int]:
    """The live processes of an engine (an EngineClient: llm.engine) below its core: the core's
    descendants, and its launcher and the launcher's children when a launcher server forked it."""
    found = children_of(engine.pid)
    launcher = engine.ready.launcher_pid
    if launcher not in found and is_running(launcher):
        found += [launcher, *children_of(launcher)]
    return found


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def pythonpath_with(folder) -> str:
    """$PYTHONPATH with `folder` first: what the processes a test starts import from."""
    return os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))


class Killer(threading.Thread):
    """SIGKILLs the engine core's worker `times` times, each a random while after the current
    worker appeared (so some kills land mid-step, some while a replacement starts)."""

    def __init__(
        self, core_pid: int, times: int, seed: int = 0, delay=(0.2, 0.7), youngest: bool = False, launcher_pid=None
    ):
        """youngest: kill the worker started last (under tensor parallelism, the last rank);
        launcher_pid: EngineReady's (needed when a launcher server forked the launcher)."""
        super().__init__(daemon=True)
        self.core_pid, self.times, self.rng, self.delay = core_pid, times, random.Random(seed), delay
        self.launcher_pid = launcher_pid
        self.youngest = youngest
        self.killed: list[tuple[int, float]] = []  # (pid, when)
        self.stop = threading.Event()

    def run(self) -> None:
        last = None
        while len(self.killed) < self.times and not self.stop.is_set():
            workers = sorted(p for p in workers_of(self.core_pid, self.launcher_pid) if p != last)
            if not workers:
                time.sleep(0.02)
                continue
            victim = workers[-1] if self.youngest else workers[0]
            time.sleep(self.rng.uniform(*self.delay))
            if is_running(victim):
                os.kill(victim, signal.SIGKILL)
                self.killed.append((victim, time.monotonic()))
                last = victim
