"""The process baselines: the same engine run as two worker processes (`dedicated`, `disagg-pd`).

Callers reach them through `DeploymentClient` (orthrus_rag.engine.clients), the `EngineClient` that owns a
deployment and drives its `submit` / `poll`."""

from orthrus_rag.engine.deploy.deployments import DEPLOYMENTS, DedicatedDeployment, DisaggPDDeployment
from orthrus_rag.engine.deploy.spec import WorkerError

__all__ = ["DEPLOYMENTS", "DedicatedDeployment", "DisaggPDDeployment", "WorkerError"]
