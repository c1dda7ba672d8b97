"""LangChain components over the co-scheduled engine, in-process (`engine=`) or against `orthrus-rag serve`
(`base_url=`): `OrthrusEmbeddings`, `ChatOrthrus`, `OrthrusRetriever`, `OrthrusReranker` and every RAG method as a
Runnable (`RAGRunnable`; `IterRetGenRunnable`). Built on one engine they share its steps, so an LCEL chain's
retrieval, reranking and generation are batched together."""

from orthrus_rag.integrations.langchain.chat_models import ChatOrthrus
from orthrus_rag.integrations.langchain.embeddings import OrthrusEmbeddings
from orthrus_rag.integrations.langchain.iter_retgen import IterRetGenRunnable, RAGRunnable
from orthrus_rag.integrations.langchain.rerankers import OrthrusReranker
from orthrus_rag.integrations.langchain.retrievers import LangChainEmbedder, OrthrusRetriever
from orthrus_rag.integrations.langchain.transport import LocalOrthrus, OrthrusAPIError, RemoteOrthrus

__all__ = ["ChatOrthrus", "IterRetGenRunnable", "LangChainEmbedder", "LocalOrthrus", "OrthrusAPIError",
           "OrthrusEmbeddings", "OrthrusReranker", "OrthrusRetriever", "RAGRunnable", "RemoteOrthrus"]
