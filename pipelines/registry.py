"""The methods a run can name (`pipeline=<name>`): the one list of names, checked by the CLI's `validate` before
anything loads. `standard_rag` is Iter-RetGen with one iteration and `no_retrieval` is it without a retriever."""

from __future__ import annotations

PIPELINES = ("iter_retgen", "standard_rag", "no_retrieval", "ircot")
