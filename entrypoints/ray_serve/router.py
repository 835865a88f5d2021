"""The request router of pagedllm's engine replicas on Ray Serve: PrefixAffinity's policy
(affinity.py) on Ray Serve's RequestRouter API, so that a conversation's next turn goes to the
replica that holds its prefix in the KV cache. It runs in the process that calls the replicas
(the ingress)."""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from . import registry
from .affinity import PrefixAffinity

TARGETED = "replica"  # a call's keyword naming the replica that must answer it (metrics, health)


def routing_text(pending_request: PendingRequest | None) -> str:
    """The text a request is routed by: its first argument's `prefix` (a ForwardedRequest's)."""
    if pending_request is None or not pending_request.args:
        return ""
    return getattr(pending_request.args[0], "prefix", "") or ""


class PrefixAwareRouter(RequestRouter):
    """PrefixAffinity's ranking (its keywords are the router's kwargs: policy, imbalance,
    min_match, max_pieces); a call with the TARGETED keyword goes to that replica only (the
    ingress's per-replica /metrics, /health and /load)."""

    def initialize_state(self, **policy):
        self.affinity = PrefixAffinity(**policy)
        registry.ROUTERS[self._deployment_id.name if self._deployment_id else ""] = self

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None and TARGETED in pending_request.kwargs:
            wanted = pending_request.kwargs[TARGETED]
            return [[r for r in candidate_replicas if r.replica_id.unique_id == wanted]]
        by_id = {r.replica_id: r for r in candidate_replicas}
        ranked = self.affinity.rank(list(by_id), routing_text(pending_request))
        return [[by_id[ranked[0]]], [by_id[r] for r in ranked[1:]]]

    # In flight: from the send until Ray reports the call completed, which it does once for
    # every call it sent. (A burst is ranked before any of it is sent: the counts lag there,
    # and PrefixAffinity takes turns among equally loaded replicas.)
    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.affinity.sent(replica_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.affinity.remember(replica_id, routing_text(pending_request))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.affinity.done(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id for r in replicas}
        for gone in [r for r in self.affinity.pieces if r not in alive]:
            self.affinity.forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id)
