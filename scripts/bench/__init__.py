"""Benchmark harness: workloads (request generators), drivers over an EngineClient, reports."""
