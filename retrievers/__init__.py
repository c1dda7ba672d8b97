"""Dense retrieval over FAISS (installed as `orthrus_rag.retrievers`)."""

from orthrus_rag.retrievers.dense import DenseRetriever
from orthrus_rag.retrievers.embedder import Embedder, EngineEmbedder, pooling_identity
from orthrus_rag.retrievers.faiss_index import INDEX_TYPES

__all__ = ["DenseRetriever", "Embedder", "EngineEmbedder", "INDEX_TYPES", "pooling_identity"]
