"""The OpenAI-compatible HTTP server (`orthrus-rag serve`): embeddings, completions and chat from any client meet
in the steps of one engine; Prometheus metrics at /metrics."""

from orthrus_rag.entrypoints.openai.api import build_app
from orthrus_rag.entrypoints.openai.server import ServerThread, serve
from orthrus_rag.entrypoints.openai.service import OpenAIService

__all__ = ["OpenAIService", "ServerThread", "build_app", "serve"]
