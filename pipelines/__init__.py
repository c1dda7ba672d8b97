"""RAG pipelines: Iter-RetGen, standard RAG, no retrieval (installed as `orthrus_rag.pipelines`)."""

from orthrus_rag.pipelines.evaluate import format_table, summarize, write_run
from orthrus_rag.pipelines.iter_retgen import PIPELINES, IterRetGen
from orthrus_rag.pipelines.metrics import exact_match, f1_score, normalize_answer, recall_at_k
from orthrus_rag.pipelines.records import IterationRecord, QARecord

__all__ = ["PIPELINES", "IterRetGen", "IterationRecord", "QARecord", "exact_match", "f1_score", "format_table",
           "normalize_answer", "recall_at_k", "summarize", "write_run"]
