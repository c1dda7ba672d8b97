"""RAG pipelines: Iter-RetGen, standard RAG, no retrieval (installed as `orthrus_rag.pipelines`)."""
