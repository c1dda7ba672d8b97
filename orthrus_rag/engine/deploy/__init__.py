"""Deployments of the engine for fair baselines: the in-process `Engine`, `dedicated` and `disagg-pd`."""

from orthrus_rag.engine.deploy.deployments import DEPLOYMENTS, DedicatedDeployment, DisaggPDDeployment
from orthrus_rag.engine.deploy.spec import Deployment, EngineSpec, WorkerError

__all__ = ["DEPLOYMENTS", "DedicatedDeployment", "Deployment", "DisaggPDDeployment", "EngineSpec", "WorkerError"]
