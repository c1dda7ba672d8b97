"""Hydra configuration groups (installed as `orthrus_rag.conf`, found from any install)."""
