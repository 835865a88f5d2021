"""POSIX shared-memory segments (files under /dev/shm) owned by the engine core.

Names carry the owning engine's pid — `pagedllm-<pid>-<role>` — so that an engine starting
up can remove what a dead one left behind. Workers map segments by name; only the core
creates and unlinks them. Plain files under /dev/shm are used rather than
multiprocessing.shared_memory, whose resource tracker unlinks segments when any process
that merely attached exits (Python < 3.13).
"""

from __future__ import annotations

import mmap
import os
import re

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^pagedllm-(\d+)-[A-Za-z0-9_.-]+$")


def segment_name(role: str, pid: int | None = None) -> str:
    return f"pagedllm-{pid or os.getpid()}-{role}"


def create_segment(name: str, size: int) -> None:
    """Create a zero-filled segment. Pages are only backed by memory once touched."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, max(size, 1))
    finally:
        os.close(fd)


def map_segment(name: str) -> mmap.mmap:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def unlink_segment(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def segments_of(pid: int) -> list[str]:
    return sorted(n for n in _listdir() if (m := _NAME.match(n)) and int(m.group(1)) == pid)


def remove_stale_segments() -> list[str]:
    """Unlink segments whose engine process no longer exists."""
    removed = []
    for name in _listdir():
        m = _NAME.match(name)
        if m and not pid_alive(int(m.group(1))):
            unlink_segment(name)
            removed.append(name)
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _listdir() -> list[str]:
    try:
        return os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
