"""Dataset loaders (installed as `orthrus_rag.data`, never as a bare top-level `data`)."""
