"""What each engine replica reports beyond a request's answer: its Prometheus text (the engine's step, KV and
request metrics), published every `PUBLISH_S` into one named Ray actor, the board, that the ingress reads for
/metrics (every replica's figures, labelled `replica`) and /health (replicas up against expected). A replica that
died stops publishing; after `STALE_S` it no longer counts as up."""

from __future__ import annotations

import threading
import time
from typing import Any

BOARD = "orthrus-replica-board"
PUBLISH_S = 1.0
STALE_S = 5.0


class ReplicaBoard:
    """The Ray actor (named, created by the first replica that publishes). Detached: an actor dies with the
    process that created it, and that replica may be the one that dies; `remove_board` ends it with the app."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self.entries[replica] = (time.time(), text)

    def fresh(self, max_age_s: float = STALE_S) -> dict[str, str]:
        now = time.time()
        self.entries = {k: v for k, v in self.entries.items() if now - v[0] <= 10 * max_age_s}  # NOTE: bounded
        return {k: text for k, (t, text) in self.entries.items() if now - t <= max_age_s}


def board(namespace: str | None = None) -> Any:
    """The board's actor handle (created on first use)."""
    import ray

    actor = ray.remote(ReplicaBoard).options(name=BOARD, get_if_exists=True, namespace=namespace,
                                             num_cpus=0, lifetime="detached")
    return actor.remote()


def remove_board(namespace: str = "serve") -> None:
    """End the board (when the application goes): it is detached, so nothing else would."""
    import ray

    try:
        ray.kill(ray.get_actor(BOARD, namespace=namespace))
    except ValueError:  # no board: no replica ever published
        pass


def publish_forever(replica: str, render: Any, stop: threading.Event) -> threading.Thread:
    """Publish `render()` (bytes or str) every PUBLISH_S from a daemon thread until `stop` is set."""
    def loop() -> None:
        target = None
        while not stop.wait(PUBLISH_S):
            try:
                target = target or board()
                text = render()
                target.put.remote(replica, text.decode() if isinstance(text, bytes) else text)
            except Exception:  # noqa: BLE001 (a missed report only ages the entry)
                target = None
    thread = threading.Thread(target=loop, name="orthrus-replica-metrics", daemon=True)
    thread.start()
    return thread


def merge_exposition(own: str, replicas: dict[str, str]) -> str:
    """One Prometheus text from the ingress's own and each replica's: every family once, each replica's samples
    labelled `replica`, the ingress's unlabelled."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    merged: dict[str, Metric] = {}

    def add(text: str, label: str | None) -> None:
        for family in text_string_to_metric_families(text):
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type)
            for s in family.samples:
                labels = dict(s.labels, replica=label) if label is not None else dict(s.labels)
                out.add_sample(s.name, labels, s.value, s.timestamp)

    add(own, None)
    for replica, text in sorted(replicas.items()):
        add(text, replica)

    class _Merged:
        def collect(self) -> Any:
            return list(merged.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())  # type: ignore[arg-type]
    return generate_latest(registry).decode()
