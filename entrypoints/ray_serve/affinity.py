"""Which replica should answer a request: the policy of the prefix-aware router, apart from
Ray (entrypoints/ray_serve/router.py adapts it to Ray Serve's RequestRouter API).

The router runs in the caller's process and cannot see the replicas' caches, so it remembers
what it sent where: a request's routing text (the messages' contents, or the prompt) cut into
CHUNK-character pieces, each hashed with all before it, as vLLM chains its block hashes. A
replica's match is how many leading pieces of a request it has been sent before. Pieces are
characters, not tokens, so a match estimates the cached blocks; a wrong estimate costs a
prefix recomputed, never a different answer."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable

CHUNK = 16  # characters per hashed piece: a few tokens, well under a KV block


def prefix_hashes(text: str) -> list[int]:
    """The chained hashes of `text`'s whole CHUNK-character pieces."""
    hashes, last = [], 0
    for start in range(0, len(text) - CHUNK + 1, CHUNK):
        last = hash((last, text[start : start + CHUNK]))
        hashes.append(last)
    return hashes


class PrefixAffinity:
    """Ranks replicas for a request:

    - where the in-flight counts differ by more than `imbalance` requests, least loaded first
      (a busy conversation must not pile onto one replica; an engine batches a few dozen
      requests at little cost each, so the default leaves room before giving up a cache hit);
    - else the replica with the longest remembered prefix, if it covers at least `min_match`
      of the request's pieces;
    - else (a new conversation) the least loaded replica, in turn among equals.

    policy "round_robin" ignores prefixes and loads (the benchmark's baseline)."""

    def __init__(self, policy: str = "prefix", imbalance: int = 32, min_match: float = 0.1, max_pieces: int = 200_000):
        if policy not in ("prefix", "round_robin"):
            raise ValueError(f"routing policy: 'prefix' or 'round_robin', got {policy!r}")
        self.policy, self.imbalance, self.min_match, self.max_pieces = policy, imbalance, min_match, max_pieces
        self.pieces: dict[Hashable, OrderedDict[int, None]] = {}  # each replica's, least recently sent first
        self.in_flight: dict[Hashable, int] = {}
        self.turn = itertools.count()

    def rank(self, replicas: list, text: str) -> list:
        """`replicas` (any hashable ids), best first."""
        if self.policy == "round_robin":
            first = replicas[next(self.turn) % len(replicas)]
            return [first, *(r for r in replicas if r != first)]
        load = lambda r: self.in_flight.get(r, 0)
        by_load = sorted(replicas, key=load)
        if load(by_load[-1]) - load(by_load[0]) > self.imbalance:
            return by_load
        hashes = prefix_hashes(text)
        best = max(by_load, key=lambda r: self._matched(r, hashes))
        matched = self._matched(best, hashes)
        if matched == 0 or matched < self.min_match * len(hashes):  # a new conversation
            idle = [r for r in replicas if load(r) == load(by_load[0])]
            best = idle[next(self.turn) % len(idle)]  # turns among the least loaded
        return [best, *(r for r in by_load if r != best)]

    def _matched(self, replica, hashes: list[int]) -> int:
        held = self.pieces.get(replica)
        n = 0
        while held and n < len(hashes) and hashes[n] in held:
            n += 1
        return n

    def sent(self, replica) -> None:
        self.in_flight[replica] = self.in_flight.get(replica, 0) + 1

    def remember(self, replica, text: str) -> None:
        """`replica` took a request with this routing text: it will hold its prefix."""
        held = self.pieces.setdefault(replica, OrderedDict())
        for h in prefix_hashes(text):
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_pieces:  # the engine evicts its least recently used blocks too
            held.popitem(last=False)

    def done(self, replica) -> None:
        if replica in self.in_flight:
            self.in_flight[replica] = max(0, self.in_flight[replica] - 1)

    def forget(self, replica) -> None:
        """A replica that is gone took its cache with it (a new one starts empty)."""
        self.pieces.pop(replica, None)
        self.in_flight.pop(replica, None)
