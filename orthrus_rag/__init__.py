"""orthrus_rag: iterative RAG on one engine that batches embedding and generation in the same forward pass."""

from orthrus_rag.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from orthrus_rag.engine.engine import Engine
from orthrus_rag.outputs import EmbeddingOutput, GenerationOutput, ScoreOutput
from orthrus_rag.params import PoolingParams, RerankParams, SamplingParams

__all__ = ["CacheConfig", "EmbeddingOutput", "Engine", "EngineConfig", "GenerationOutput", "ModelConfig",
           "PoolingParams", "RerankParams", "SamplingParams", "SchedulerConfig", "ScoreOutput"]
__version__ = "0.1.0"
