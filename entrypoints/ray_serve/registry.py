"""The routers of this process, by deployment: the ingress reads the replicas from its router.

Its own module because Ray Serve pickles a router's module by value: a dict there would be a
copy in the process that runs the router."""

from __future__ import annotations

ROUTERS: dict[str, object] = {}


def replica_ids(deployment: str) -> list[str]:
    """The running replicas of `deployment` as this process's router knows them (empty before
    its first call)."""
    router = ROUTERS.get(deployment)
    return [] if router is None else [r.unique_id for r in list(router.curr_replicas)]
