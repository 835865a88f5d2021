"""How many host threads a step computes with, chosen by measurement as the worker runs.

One thread per core is right for a large batch on an idle machine. It is wrong for a small
step, where OpenMP's fork and barrier at every op cost more than the op, and it is badly
wrong when another process holds a core: each parallel region then waits for the thread the
kernel has descheduled (one request's decode on the demo model ran 7x slower beside one busy
process with two threads; 1.4x slower with one). Neither the work size nor the machine's load
is known in advance, so the governor times steps: per size of step (tokens, in powers of two)
it keeps the last few seconds-per-token of each thread count it may use, runs the fastest,
and re-measures the others now and then, and at once when the one it runs gets much slower or
faster (the machine's load changed).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

SAMPLES = 3  # recent steps per (size, threads) whose median counts
FIRST_INTERVAL = 32  # steps of a size between re-measurements, doubled while the choice holds
LAST_INTERVAL = 256
DRIFT = 1.5  # the running choice this much slower or faster than when chosen: re-measure now


def thread_choices(most: int) -> list[int]:
    """1, 2, 4, ... up to `most`, and `most` itself."""
    choices, n = [], 1
    while n < most:
        choices.append(n)
        n *= 2
    return choices + [most]


@dataclass
class _Size:
    """What the governor knows of steps of one size."""

    samples: dict[int, deque] = field(default_factory=dict)  # threads -> recent seconds per token
    choice: int = 0
    settled: float = 0.0  # the choice's median when it was chosen
    steps: int = 0
    next_check: int = 0
    interval: int = FIRST_INTERVAL
    trials: list[int] = field(default_factory=list)  # thread counts still to measure in this check

    def median(self, threads: int) -> float:
        return statistics.median(self.samples[threads])

    def drifted(self) -> bool:
        now = self.median(self.choice)
        return now > DRIFT * self.settled or now * DRIFT < self.settled


class ThreadGovernor:
    """`begin(num_tokens)` before a step's computation and `end()` after it; between the two,
    torch computes with the thread count chosen for that size of step."""

    def __init__(self, most: int, set_threads, clock=time.perf_counter):
        self.choices = thread_choices(max(1, most))
        self.set_threads = set_threads
        self.clock = clock
        self.current = self.choices[-1]
        self.sizes: dict[int, _Size] = {}
        self._running: tuple[_Size, int, float, int] | None = None

    def begin(self, num_tokens: int) -> int:
        """Choose and set the threads for a step of `num_tokens`; returns the count."""
        size = self.sizes.setdefault(max(1, num_tokens).bit_length(), _Size())
        size.steps += 1
        threads = self._pick(size)
        if threads != self.current:
            self.set_threads(threads)
            self.current = threads
        self._running = (size, threads, self.clock(), max(1, num_tokens))
        return threads

    def end(self) -> None:
        size, threads, start, tokens = self._running
        self._running = None
        took = (self.clock() - start) / tokens
        size.samples.setdefault(threads, deque(maxlen=SAMPLES)).append(took)
        if not size.trials or size.trials[0] != threads:
            return
        # a re-measured count that is clearly slower than the choice is dropped after one step
        # (on a shared machine a step on too many threads can take 10x as long)
        clearly_slower = size.choice and threads != size.choice and took > DRIFT * size.median(size.choice)
        if clearly_slower or len(size.samples[threads]) >= SAMPLES:
            size.trials.pop(0)
            if not size.trials:
                self._decide(size)

    def _pick(self, size: _Size) -> int:
        if not size.trials:
            if not size.choice:  # a size not seen before: measure every count
                size.trials = list(self.choices)
            elif size.steps >= size.next_check or size.drifted():
                size.trials = [n for n in self.choices if n != size.choice]
                for n in size.trials:  # measured afresh: old samples are of another load
                    size.samples[n].clear()
        return size.trials[0] if size.trials else size.choice

    def _decide(self, size: _Size) -> None:
        best = min(self.choices, key=size.median)
        size.interval = min(2 * size.interval, LAST_INTERVAL) if best == size.choice else FIRST_INTERVAL
        size.choice = best
        size.settled = size.median(best)
        size.next_check = size.steps + size.interval
