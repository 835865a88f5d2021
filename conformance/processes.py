"""An engine's local worker processes, as the checks that kill one find them."""

from __future__ import annotations


def children_of(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def worker_pids(llm) -> list[int]:
    """The workers of an LLM's engine: the children of its worker launcher (the core's child,
    or a launcher server's)."""
    launcher = llm.engine.ready.launcher_pid or next(iter(children_of(llm.engine.pid)), None)
    return [] if launcher is None else children_of(launcher)
