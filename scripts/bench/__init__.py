"""Benchmark harness: workloads (request generators), drivers over a ServingClient, reports."""
