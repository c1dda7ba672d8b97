"""Dataset loaders (installed as `orthrus_rag.data`, never as a bare top-level `data`)."""

from orthrus_rag.data.loaders import DATASETS, build_corpus, load_qa
from orthrus_rag.data.synthetic import make_synthetic
from orthrus_rag.data.types import Passage, QAExample

__all__ = ["DATASETS", "Passage", "QAExample", "build_corpus", "load_qa", "make_synthetic"]
