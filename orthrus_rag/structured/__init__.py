"""Structured outputs: a grammar per constrained request, a token mask per constrained row, before sampling.

`compiler.py` turns a `StructuredOutputsParams` into a grammar and a matcher (llguidance; the one module that
imports it); `bitmask.py` applies the matchers' masks to a step's logits. Rows without a constraint pay nothing.
`budget.py` closes an output as its token budget runs out (`close_on_length`), with the closings `closing.py` finds.
"""
