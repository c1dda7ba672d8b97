"""Deployments of the engine for fair baselines: the in-process `Engine`, `dedicated` and `disagg-pd`, and the
`ServingClient` seam that drives any of them one request at a time, and `ClientBridge`, which awaits single
results over that seam (pipelines on a deployment or a peer)."""

from orthrus_rag.engine.deploy.deployments import DEPLOYMENTS, DedicatedDeployment, DisaggPDDeployment
from orthrus_rag.engine.deploy.spec import Deployment, EngineSpec, WorkerError
from orthrus_rag.engine.deploy.client import SYSTEMS, InProcessClient, ServingClient, make_client  # noqa: I001
from orthrus_rag.engine.deploy.bridge import ClientBridge, ClientFailed, RequestFailed

__all__ = ["DEPLOYMENTS", "SYSTEMS", "ClientBridge", "ClientFailed", "DedicatedDeployment", "Deployment",
           "DisaggPDDeployment", "EngineSpec", "InProcessClient", "RequestFailed", "ServingClient", "WorkerError", "make_client"]
