"""`LeastWorkRouter`: Ray Serve sends each request to the replica with the least outstanding work, counted in
tokens (prompt and embedding tokens not yet run, generation budget left), not in requests: one 2,000-token prompt
is more work than ten short embeddings.

Replicas report their work every `request_routing_stats_period_s` (`EngineReplica.record_routing_stats`); between
two reports the router adds its own estimate of each request it sends there, so a burst does not all land on the
replica that looked idle at the last report."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

CHARS_PER_TOKEN = 4  # a text's token estimate (the router has no tokenizer)


def estimate_tokens(args: Sequence[Any]) -> int:
    """Tokens a call will cost: its input's, plus a generation's max_tokens."""
    if not args:
        return 1
    first = args[0]
    inputs = first if isinstance(first, list) and first and not isinstance(first[0], int) else [first]
    tokens = sum(len(x) if isinstance(x, list) else len(str(x)) // CHARS_PER_TOKEN + 1 for x in inputs)
    params = args[1] if len(args) > 1 else None
    return tokens + int(getattr(params, "max_tokens", 0) or 0)


class LeastWorkRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self._added: dict[ReplicaID, tuple[int | None, int]] = {}  # replica -> (its last report's id, tokens since)

    def _work(self, replica: RunningReplica) -> int:
        stats = replica.routing_stats or {}
        seen, added = self._added.get(replica.replica_id, (None, 0))
        if seen != id(replica.routing_stats):  # a new report (or the first): it counts what was sent before it
            added = 0
            self._added[replica.replica_id] = (id(replica.routing_stats), 0)
        return int(stats.get("outstanding_tokens", 0)) + added

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        # NOTE: every replica, ranked: the least loaded first, the others as fallbacks when it is full. The first
        # is charged the request's estimate now (Ray does not report which one took a request to a router
        # outside its strict-queue mode); its next report replaces the estimate with the replica's own count
        ranked = sorted(candidate_replicas, key=self._work)
        if ranked and pending_request is not None:
            first = ranked[0].replica_id
            seen, added = self._added[first]
            self._added[first] = (seen, added + estimate_tokens(pending_request.args))
        return [[r] for r in ranked]
