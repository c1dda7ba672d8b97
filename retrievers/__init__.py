"""Dense retrieval over FAISS (installed as `orthrus_rag.retrievers`)."""

from orthrus_rag.retrievers.dense import DenseRetriever
from orthrus_rag.retrievers.embedder import Embedder, EngineEmbedder, pooling_identity
from orthrus_rag.retrievers.faiss_index import INDEX_TYPES
from orthrus_rag.retrievers.live_index import DocumentError, LiveIndex

__all__ = ["DenseRetriever", "DocumentError", "Embedder", "EngineEmbedder", "INDEX_TYPES", "LiveIndex",
           "pooling_identity"]
