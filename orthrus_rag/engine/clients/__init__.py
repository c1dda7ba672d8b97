"""The client seam that the app and the benchmarks drive serving systems through: `ServingClient` (submit / poll /
shutdown) with `InProcessClient` and `make_client`, and `ClientBridge`, which awaits single results over it
(pipelines on a deployment or a peer). The process baselines themselves live in `orthrus_rag.engine.deploy`."""

from orthrus_rag.engine.clients.client import SYSTEMS, InProcessClient, ServingClient, make_client  # noqa: I001
from orthrus_rag.engine.clients.bridge import ClientBridge, ClientFailed, RequestFailed

__all__ = ["SYSTEMS", "ClientBridge", "ClientFailed", "InProcessClient", "RequestFailed", "ServingClient",
           "make_client"]
