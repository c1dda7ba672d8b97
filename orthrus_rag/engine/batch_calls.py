"""The engine's synchronous batch calls: submit a list, run the loop until it is empty, get the outputs in input
order (`generate`, `embed`, `score`, and `run` for both kinds at once). Every input is checked before any is queued,
and a call that fails leaves none of its requests behind."""

from __future__ import annotations

from collections.abc import Sequence

from orthrus_rag.outputs import EmbeddingOutput, GenerationOutput
from orthrus_rag.params import PoolingParams, RerankParams, SamplingParams, pairs_of


class BatchCalls:
    """Mixed into `Engine` (engine.py): built on its `add_generate`, `add_embed`, `add_score`, `abort` and
    `run_until_done`."""

    def generate(self, prompts: str | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationOutput]:
        outs, _ = self.run(prompts=prompts, sampling_params=params)
        return outs

    def embed(self, texts: str | Sequence[str | Sequence[int]],
              params: PoolingParams | None = None) -> list[EmbeddingOutput]:
        _, outs = self.run(texts=texts, pooling_params=params)
        return outs

    def score(self, query: str, documents: Sequence[str], params: RerankParams | None = None) -> list[float]:
        """Each document's relevance to `query` (in [0, 1], documents' order), all pairs in shared steps."""
        pairs = pairs_of(query, documents)
        ids: list[str] = []
        try:
            for q, doc in pairs:
                ids.append(self.add_score(q, doc, params))
            outputs = self.run_until_done()
        except BaseException:
            for rid in ids:  # NOTE: as `run`: nothing of this call stays queued
                self.abort(rid)
            raise
        failed = [f"{i}: {outputs[i].error}" for i in ids if outputs[i].error]
        if failed:
            raise RuntimeError(f"{len(failed)} score(s) failed: {'; '.join(failed[:3])}")
        return [float(outputs[i].embedding[0]) for i in ids]

    def run(self, prompts: str | Sequence[str | Sequence[int]] = (),
            sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
            texts: str | Sequence[str | Sequence[int]] = (), pooling_params: PoolingParams | None = None,
            ) -> tuple[list[GenerationOutput], list[EmbeddingOutput]]:
        """Submit generations and embeddings together so they share engine steps; outputs in input order.
        `sampling_params`: one for every prompt, or a list with one per prompt (as vLLM's `generate`).
        Every input is validated before any is submitted."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        texts = [texts] if isinstance(texts, str) else list(texts)
        if isinstance(sampling_params, Sequence):
            per_prompt = list(sampling_params)
            if len(per_prompt) != len(prompts):
                raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts; give one, or one "
                                 "per prompt")
        else:
            per_prompt = [sampling_params] * len(prompts)
        gen_ids, emb_ids = [], []
        try:
            for p, params in zip(prompts, per_prompt):
                gen_ids.append(self.add_generate(p, params))
            for t in texts:
                emb_ids.append(self.add_embed(t, pooling_params))
        except (ValueError, TypeError):
            for rid in gen_ids + emb_ids:
                self.abort(rid)
            raise
        try:
            outputs = self.run_until_done()
        except BaseException:
            # NOTE: a failed step (or an interrupt) must not leave this call's requests queued: every later call
            # would run into them again. Abort them (blocks freed) and let the error through.
            for rid in gen_ids + emb_ids:
                self.abort(rid)
            raise
        failed = [f"{i}: {outputs[i].error}" for i in emb_ids if outputs[i].error]
        if failed:
            raise RuntimeError(f"{len(failed)} embedding(s) failed: {'; '.join(failed[:3])}")
        return [outputs[i] for i in gen_ids], [outputs[i] for i in emb_ids]
