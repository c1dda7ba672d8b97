"""A request's output constraint, from OpenAI's `response_format` or vLLM's extra fields, checked before any engine
request is made (a bad schema is a 400 naming it, never a broken stream).

Accepted, one per request:
- `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`; the schema is enforced
  whether or not `strict` is set (a constrained decoder has no weaker mode);
- vLLM's `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`, plus
  `whitespace_flexible` and `close_on_length`;
- vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

`structured_close_on_length` (top level, ours) switches `close_on_length` for whichever of them is given: an output
closed as its token budget runs out (on, the default) or cut where it ends (off).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from orthrus_rag.entrypoints.openai.errors import bad_request
from orthrus_rag.params import STRUCTURED_KINDS, StructuredOutputsParams
from orthrus_rag.structured.compiler import compiler_for

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def constraint_of(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from ((None, None): free text); a 400 naming the field
    for anything malformed."""
    given: list[tuple[str, dict[str, Any]]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        spec = _from_response_format(fmt)
        if spec is not None:
            given.append(("response_format", spec))
    if req.structured_outputs is not None:
        allowed = set(STRUCTURED_KINDS) | {"whitespace_flexible", "close_on_length"}
        unknown = sorted(set(req.structured_outputs) - allowed)
        if unknown:
            raise bad_request(f"structured_outputs: unknown field(s) {', '.join(unknown)}; expected one of "
                              f"{', '.join(sorted(allowed))}", "structured_outputs")
        given.append(("structured_outputs", dict(req.structured_outputs)))
    for field, kind in GUIDED.items():
        value = getattr(req, field, None)
        if value is not None:
            given.append((field, {kind: value}))
    if not given:
        return None, None
    if len(given) > 1:
        raise bad_request(f"give one output constraint, not {' and '.join(f for f, _ in given)}", given[1][0])
    field, fields = given[0]
    try:
        spec = StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as exc:
        raise bad_request(f"{field}: {exc}", field) from None
    close = getattr(req, "structured_close_on_length", None)
    return (spec if close is None else replace(spec, close_on_length=close)), field


def _from_response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        body = fmt.get("json_schema")
        if not isinstance(body, dict) or not isinstance(body.get("schema"), dict):
            raise bad_request("response_format json_schema needs json_schema.schema, a JSON schema object",
                              "response_format")
        return {"json": body["schema"]}
    raise bad_request(f"response_format type {kind!r} is not one of text, json_object, json_schema",
                      "response_format")


async def checked_constraint(client: Any, req: Any) -> StructuredOutputsParams | None:
    """The request's constraint, compiled in a worker thread: a 400 naming the field when the schema, regex or
    grammar is invalid. An in-process engine's own compiler does it (its requests then find it compiled); a client
    whose engine is elsewhere (a deployment, replicas, a remote server) is checked with this process's compiler
    for its tokenizer, and its engine compiles the constraint again, once."""
    spec, field = constraint_of(req)
    if spec is None:
        return None
    compiler = getattr(getattr(client, "engine", None), "grammars", None) \
        or compiler_for(client.tokenizer, len(client.tokenizer))
    try:
        await asyncio.to_thread(compiler.prepare, spec)
    except ValueError as exc:
        raise bad_request(str(exc), field) from None
    return spec

