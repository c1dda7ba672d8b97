"""RAG pipelines: Iter-RetGen, standard RAG, no retrieval, IRCoT, FLARE, Self-Ask, on one shared surface (method.py) (installed as
`orthrus_rag.pipelines`)."""

from orthrus_rag.pipelines.answers import extract_answer, is_yes_no_question, parse_answer
from orthrus_rag.pipelines.evaluate import RunScores, format_table, summarize
from orthrus_rag.pipelines.flare import FLARE
from orthrus_rag.pipelines.ircot import IRCoT
from orthrus_rag.pipelines.self_ask import SelfAsk
from orthrus_rag.pipelines.iter_retgen import IterRetGen
from orthrus_rag.pipelines.method import Method, default_concurrency
from orthrus_rag.pipelines.registry import PIPELINES
from orthrus_rag.pipelines.evaluate import (accuracy, answer_scores, exact_match, f1_score, normalize_answer,
                                           recall_at_k)
from orthrus_rag.pipelines.records import IterationRecord, QARecord

__all__ = ["FLARE", "PIPELINES", "IRCoT", "SelfAsk", "IterRetGen", "IterationRecord", "Method", "QARecord", "RunScores", "accuracy", "answer_scores",
           "default_concurrency", "exact_match", "extract_answer", "f1_score", "format_table", "is_yes_no_question",
           "normalize_answer", "parse_answer", "recall_at_k", "summarize"]
