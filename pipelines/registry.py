"""The methods a run can name (`pipeline=<name>`): the one list of names (checked by the CLI's `validate` before
anything loads) and the one place a name becomes a method. `standard_rag` is Iter-RetGen with one iteration and
`no_retrieval` is it without a retriever."""

from __future__ import annotations

from typing import Any

PIPELINES = ("iter_retgen", "standard_rag", "no_retrieval", "ircot", "flare", "self_ask", "search_r1")


def make_method(name: str, client: Any, retriever: Any, **options: Any) -> Any:  # -> Method
    """The method `name` over `client` and `retriever`; `options`: the shared settings (k, sampling_params,
    chat_template, max_concurrency, question_timeout_s, answer_format, prompt_style; reranker, a `Reranking`) and the
    method's own (iterations; max_steps, max_passages, step_tokens; threshold; max_follow_ups; max_searches, tags,
    constrain_format, continuation). An option the method does not take is a TypeError naming it."""
    from orthrus_rag.pipelines.flare import FLARE
    from orthrus_rag.pipelines.ircot import IRCoT
    from orthrus_rag.pipelines.iter_retgen import IterRetGen
    from orthrus_rag.pipelines.search_r1 import SearchR1
    from orthrus_rag.pipelines.self_ask import SelfAsk

    if name not in PIPELINES:
        raise ValueError(f"unknown pipeline {name!r}; expected one of {', '.join(PIPELINES)}")
    if name == "standard_rag":
        options["iterations"] = 1
    if name == "no_retrieval":
        retriever = None
    kind = {"iter_retgen": IterRetGen, "standard_rag": IterRetGen, "no_retrieval": IterRetGen, "ircot": IRCoT,
            "flare": FLARE, "self_ask": SelfAsk, "search_r1": SearchR1}[name]
    reranker = options.pop("reranker", None)
    method = kind(client, retriever, **options)
    method.reranker = reranker  # NOTE: every method retrieves through Method.retrieve, where the stage sits
    return method
