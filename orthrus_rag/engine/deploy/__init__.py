"""The process baselines: the same engine run as two worker processes (`dedicated`, `disagg-pd`).

The seam that drives any serving system one request at a time (`ServingClient`, `make_client`) and the bridge
that pipelines await results through (`DeploymentClient`) live apart, in `orthrus_rag.engine.clients`."""

from orthrus_rag.engine.deploy.deployments import DEPLOYMENTS, DedicatedDeployment, DisaggPDDeployment
from orthrus_rag.engine.deploy.spec import Deployment, WorkerError

__all__ = ["DEPLOYMENTS", "DedicatedDeployment", "Deployment", "DisaggPDDeployment", "WorkerError"]
