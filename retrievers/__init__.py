"""Dense retrieval over FAISS (installed as `orthrus_rag.retrievers`)."""
