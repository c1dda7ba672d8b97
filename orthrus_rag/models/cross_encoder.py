"""A BERT-family cross-encoder (transformers' `BertForSequenceClassification`: ms-marco MiniLM cross-encoders,
bge-reranker-style BERT checkpoints): the packed encoder of `bert.py` plus its pooler (dense + tanh over the [CLS]
row) and its classifier. A (query, passage) pair goes in as one sequence, query segment 0 and passage segment 1;
its relevance is the sigmoid of the one logit (sentence-transformers' CrossEncoder default), or the softmax's last
label where there are two.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import BertConfig

from orthrus_rag.models.bert import BertEncoder

_IGNORED_PREFIXES = ("cls.",)  # the MLM / NSP heads; the pooler is this model's


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_rows))


class BertCrossEncoder(BertEncoder):
    """`forward` gives hidden states as `BertEncoder` does; `relevance` turns [CLS] rows into scores."""

    ignored_prefixes = _IGNORED_PREFIXES

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.pooler = BertPooler(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    @classmethod
    def check_config(cls, config: BertConfig, path: str | os.PathLike) -> None:
        archs = config.architectures or []
        if not any(a.endswith("ForSequenceClassification") for a in archs):
            raise ValueError(f"{path} is not a cross-encoder: its architectures are {archs or 'unset'}; a reranker "
                             "needs a *ForSequenceClassification checkpoint")
        if config.num_labels not in (1, 2):
            raise ValueError(f"{path} has {config.num_labels} labels; a reranker's classifier has 1 (a relevance "
                             "logit) or 2 (irrelevant, relevant)")

    def logits(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """[n, hidden] final [CLS] states -> [n, num_labels] logits (float32), as the checkpoint's own head."""
        return self.classifier(self.pooler(cls_rows.to(self.classifier.weight.dtype))).float()

    def relevance(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """[n, hidden] final [CLS] states -> [n] scores in [0, 1]."""
        logits = self.logits(cls_rows)
        if logits.shape[-1] == 1:
            return torch.sigmoid(logits[:, 0])
        return torch.softmax(logits, dim=-1)[:, -1]
