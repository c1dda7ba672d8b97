"""Deployments of the engine for fair baselines: the in-process `Engine`, `dedicated` and `disagg-pd`, and the
`ServingClient` seam that drives any of them one request at a time."""

from orthrus_rag.engine.deploy.deployments import DEPLOYMENTS, DedicatedDeployment, DisaggPDDeployment
from orthrus_rag.engine.deploy.spec import Deployment, EngineSpec, WorkerError
from orthrus_rag.engine.deploy.client import SYSTEMS, InProcessClient, ServingClient, make_client  # noqa: I001

__all__ = ["DEPLOYMENTS", "SYSTEMS", "DedicatedDeployment", "Deployment", "DisaggPDDeployment", "EngineSpec",
           "InProcessClient", "ServingClient", "WorkerError", "make_client"]
