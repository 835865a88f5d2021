"""The request router of pagedllm's engine replicas on Ray Serve (Ray Serve's RequestRouter
API): a conversation's next turn goes to the replica that answered its earlier turns, where
its prefix is in the KV cache, unless the replicas' loads have drifted apart.

The router runs in the caller's process (the ingress) and cannot see the replicas' caches, so
it remembers what it sent where: a prompt's routing text (the ingress's `prefix`: the messages'
contents or the prompt) cut into CHUNK-character pieces, each piece hashed with all before it,
as vLLM hashes blocks. A replica's match is how many leading pieces of a request it has been
sent before. The pieces are characters, not tokens, so a match is an estimate of the cached
blocks; it errs only on which replica, never on an answer."""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from . import registry

logger = logging.getLogger("pagedllm.entrypoints")

CHUNK = 16  # characters per hashed piece: a few tokens, well under a KV block
TARGETED = "replica"  # a call's keyword naming the replica that must answer it (metrics, health)


def prefix_hashes(text: str) -> list[int]:
    """The chained hashes of `text`'s whole CHUNK-character pieces."""
    hashes, last = [], 0
    for start in range(0, len(text) - CHUNK + 1, CHUNK):
        last = hash((last, text[start : start + CHUNK]))
        hashes.append(last)
    return hashes


def routing_text(request) -> str:
    """The text a request is routed by: its `prefix`, or "" for calls that carry none."""
    return getattr(request, "prefix", "") or ""


class PrefixAwareRouter(RequestRouter):
    """Ranks the replicas for each request:

    - a call with the TARGETED keyword goes to that replica only (the ingress's per-replica
      /metrics, /health and /load);
    - where the in-flight counts differ by more than `imbalance` requests, the least loaded
      first (a hot conversation must not pile onto one replica);
    - else the replica with the longest remembered prefix, if it covers at least
      `min_match` of the request's text; else (a new conversation) the least loaded replica,
      the one holding the fewest remembered pieces among equals.

    `policy="round_robin"` ignores prefixes (the baseline the benchmark compares with)."""

    def initialize_state(
        self, policy: str = "prefix", imbalance: int = 8, min_match: float = 0.1, max_pieces: int = 200_000
    ):
        if policy not in ("prefix", "round_robin"):
            raise ValueError(f"routing policy: 'prefix' or 'round_robin', got {policy!r}")
        self.policy, self.imbalance, self.min_match, self.max_pieces = policy, imbalance, min_match, max_pieces
        self.pieces: dict[ReplicaID, OrderedDict[int, None]] = {}  # each replica's pieces, least recent first
        self.in_flight: dict[ReplicaID, int] = {}
        self.routed: dict[str, ReplicaID] = {}  # internal request id -> replica, until it completes
        self.turn = itertools.count()
        registry.ROUTERS[self._deployment_id.name if self._deployment_id else ""] = self

    # --- ranking ---------------------------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None and TARGETED in pending_request.kwargs:
            wanted = pending_request.kwargs[TARGETED]
            return [[r for r in candidate_replicas if r.replica_id.unique_id == wanted]]
        by_load = sorted(candidate_replicas, key=lambda r: self.in_flight.get(r.replica_id, 0))
        if self.policy == "round_robin":
            i = next(self.turn) % len(candidate_replicas)
            return [[candidate_replicas[i]]]
        loads = [self.in_flight.get(r.replica_id, 0) for r in by_load]
        if loads[-1] - loads[0] > self.imbalance:
            return [[r] for r in by_load]
        hashes = (
            prefix_hashes(routing_text(pending_request.args[0])) if pending_request and pending_request.args else []
        )
        best = max(by_load, key=lambda r: self._matched(r.replica_id, hashes))
        matched = self._matched(best.replica_id, hashes)
        if hashes and matched / len(hashes) >= self.min_match:
            first = best
        else:  # a new conversation: the least loaded replica, the least remembered of those
            first = min(
                by_load, key=lambda r: (self.in_flight.get(r.replica_id, 0), len(self.pieces.get(r.replica_id, ())))
            )
        return [[first], [r for r in by_load if r is not first]]

    def _matched(self, replica: ReplicaID, hashes: list[int]) -> int:
        held = self.pieces.get(replica)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    # --- what was sent where ---------------------------------------------------------------
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        self.routed[pending_request.metadata.internal_request_id] = replica_id
        if pending_request.args:
            held = self.pieces.setdefault(replica_id, OrderedDict())
            for h in prefix_hashes(routing_text(pending_request.args[0])):
                held[h] = None
                held.move_to_end(h)
            while len(held) > self.max_pieces:  # the engine evicts least recently used blocks too
                held.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.routed.pop(internal_request_id, None) is not None:
            self.in_flight[replica_id] = max(0, self.in_flight.get(replica_id, 0) - 1)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id for r in replicas}
        for gone in [r for r in self.pieces if r not in alive]:
            self._forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def _forget(self, replica_id: ReplicaID) -> None:
        """A replica that is gone took its cache with it (a new one starts empty)."""
        self.pieces.pop(replica_id, None)
        self.in_flight.pop(replica_id, None)
        self.routed = {k: v for k, v in self.routed.items() if v != replica_id}
