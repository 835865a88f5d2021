"""How often the engine may replace its workers: at most `max_restarts` within a sliding
window (10 minutes), so a worker that keeps dying ends the engine with its cause instead of
restarting forever."""

from __future__ import annotations

import time

RESTART_WINDOW_S = 600.0


class RestartBudget:
    def __init__(self, max_restarts: int, window_s: float = RESTART_WINDOW_S):
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.total = 0
        self._recent: list[float] = []

    def take(self) -> bool:
        """Whether another restart is allowed now (counting it if so)."""
        now = time.monotonic()
        self._recent = [t for t in self._recent if now - t < self.window_s]
        if len(self._recent) >= self.max_restarts:
            return False
        self._recent.append(now)
        self.total += 1
        return True

    def describe(self) -> str:
        return f"{len(self._recent)} of {self.max_restarts} restarts used in the last {self.window_s / 60:.0f} minutes"
