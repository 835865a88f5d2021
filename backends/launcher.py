"""The worker launcher: one process per engine host that imports torch and the backends once,
then forks a worker process per rank whenever the engine core asks — at start, and again when a
worker dies, so that a replacement only has to load the model (importing torch takes most of
the 2–3 s a fresh process would need here).

Commands come on stdin, one per line: `head ENDPOINT` (where workers reach the core; the core
may start the launcher before it knows), `start RANK`, `kill RANK`; reports go to stdout:
`started RANK PID`, `exited RANK PID CODE` (CODE < 0: killed by that signal). The launcher
ends, taking its workers with it, when its stdin closes (the core is gone).

`python -m pagedllm.backends.launcher` (started by the engine core).
"""

from __future__ import annotations

import os
import select
import signal
import sys

from .heap import keep_freed_memory

POLL_S = 0.05
SPIN_ROUNDS = 10_000


def openmp_wait_defaults(env) -> dict[str, str]:
    """OpenMP settings for the workers, unless the user chose a wait policy. libgomp's idle
    threads spin 300,000 rounds before they sleep; a worker's helper threads then spin while
    its main thread runs Python between ops and between steps, on cores the engine core and the
    frontend need (on the 2-core CI machine that doubled the engine's overhead per step at 256
    running requests; throughput was the same within noise)."""
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return {}
    return {"GOMP_SPINCOUNT": str(SPIN_ROUNDS)}


os.environ.update(openmp_wait_defaults(os.environ))  # before torch loads libgomp, which reads it once
keep_freed_memory(os.environ)  # forked workers inherit the heap's settings
from . import worker  # noqa: E402 - imports torch and the backends: every fork has them ready
from .cpu import CpuAttentionOps  # noqa: E402, F401 - the default backend's modules too (~60 ms a worker)


def _fork_worker(head: str, rank: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    # the child: a worker, with neither of the launcher's pipes to the core
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    code = 1
    try:
        code = worker.main(["--head", head, "--rank", str(rank)])
    finally:
        worker.exit_now(code)
    return 0  # not reached


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def serve() -> None:
    head = None
    ranks: dict[int, int] = {}  # pid -> rank
    out = sys.stdout

    def report(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    buffer = b""
    while True:
        while ranks:  # reap
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            report(f"exited {ranks.pop(pid)} {pid} {_returncode(status)}")
        readable, _, _ = select.select([0], [], [], POLL_S)
        if not readable:
            continue
        chunk = os.read(0, 4096)
        if not chunk:  # the core is gone
            break
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            command, _, arg = line.decode().partition(" ")
            if command == "head":
                head = arg
                continue
            rank = int(arg)
            if command == "start":
                pid = _fork_worker(head, rank)
                ranks[pid] = rank
                report(f"started {rank} {pid}")
            elif command == "kill":
                for pid, r in ranks.items():
                    if r == rank:
                        os.kill(pid, signal.SIGKILL)
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend orchestrates shutdown
    serve()
    return 0


if __name__ == "__main__":
    worker.exit_now(main())
