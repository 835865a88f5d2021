"""Waiting and swapped queues. Ordered by arrival (`fcfs`), or by priority then arrival
(`priority`); a preempted request therefore goes back ahead of later arrivals."""

from __future__ import annotations

import heapq
import itertools

from ..request import Request


class RequestQueue:
    def __init__(self, by_priority: bool):
        self.by_priority = by_priority
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def key(self, request: Request) -> tuple[int, float]:
        """Where `request` ranks: lower goes first."""
        return (request.priority if self.by_priority else 0, request.arrival_time)

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*self.key(request), next(self._seq), request))

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self):
        return (entry[3] for entry in sorted(self._heap))
