"""Hugging Face peer: transformers generation + sentence-transformers / mean-pooled embeddings, two threads.

Same interface as `VllmDedicatedPeer` (`submit` / `poll` / `shutdown`), in-process:

- generation: `gen_mode="continuous"` (default) uses transformers' built-in continuous batching
  (`model.init_continuous_batching` with a small `ContinuousBatchingConfig` sized for the CPU; requests join
  the running batch); `gen_mode="static"` runs `model.generate` over whatever is queued, left-padded, and takes
  new arrivals only once that batch has finished (HF's plain static batching);
- embeddings: all-MiniLM-L6-v2 through sentence-transformers (`embed_model="all-minilm-l6-v2"`), or SmolLM2 as
  a shared-backbone embedder (default) with a padded batched forward and masked mean pooling + L2;
- two worker threads, `threads_per_worker` torch threads each (1 + 1 on this 2-core CPU, like the vLLM split).

Completions are stamped with `time.perf_counter()` when the worker hands them over (caller-side timing).
Runs in the main venv (`make install`) or the peers venv.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

from polling import PollMixin  # noqa: E402 (a sibling module: scripts/peers/)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EMBED, GENERATE = "embed", "generate"
_STOP = object()


def _resolve(name: str) -> str:
    if os.path.isdir(name):
        return name
    from orthrus_rag.models.registry import resolve_model_path

    return str(resolve_model_path(name))


class HfPeer(PollMixin):
    """transformers generation (continuous or static batches) and embeddings, one thread each."""

    def __init__(self, gen_model: str = "smollm2-135m-instruct", embed_model: str = "smollm2-135m-instruct", *,
                 gen_mode: str = "continuous", threads_per_worker: int = 1, temperature: float = 0.0,
                 max_batch: int = 32, embed_batch: int = 32, max_embed_tokens: int = 512,
                 cb_page_size: int = 64, cb_num_blocks: int = 512, cb_max_batch_tokens: int = 256) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        if gen_mode not in ("continuous", "static"):
            raise ValueError(f"gen_mode must be 'continuous' or 'static', not {gen_mode!r}")
        self.gen_mode = gen_mode
        self.threads = threads_per_worker
        self.max_batch, self.embed_batch, self.max_embed_tokens = max_batch, embed_batch, max_embed_tokens
        self._torch = torch
        self._results: list[dict] = []
        self._cond = threading.Condition()
        self._errors: list[str] = []
        self._gen_q: queue.Queue = queue.Queue()
        self._embed_q: queue.Queue = queue.Queue()

        t0 = time.perf_counter()
        gen_path = _resolve(gen_model)
        self.tok = AutoTokenizer.from_pretrained(gen_path)
        self.tok.padding_side = "left"
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(gen_path, dtype=torch.float32,
                                                          attn_implementation="sdpa").eval()
        sampling = temperature > 0
        self.gen_config = GenerationConfig(
            max_new_tokens=16, do_sample=sampling, temperature=temperature if sampling else None,
            top_p=None, top_k=None, eos_token_id=self.tok.eos_token_id, pad_token_id=self.tok.pad_token_id)

        embed_path = _resolve(embed_model)
        self._st = None
        if os.path.isfile(os.path.join(embed_path, "modules.json")):
            from sentence_transformers import SentenceTransformer

            self._st = SentenceTransformer(embed_path, device="cpu")
        else:
            from transformers import AutoModel

            self.embed_tok = AutoTokenizer.from_pretrained(embed_path)
            self.embed_tok.padding_side = "right"
            if self.embed_tok.pad_token_id is None:
                self.embed_tok.pad_token = self.embed_tok.eos_token
            # the shared backbone: reuse the generation model's weights when it is the same checkpoint
            self.embed_model = (self.model.model if embed_path == gen_path
                                else AutoModel.from_pretrained(embed_path, dtype=torch.float32).eval())
        self.load_s = time.perf_counter() - t0

        self._cb = None
        if gen_mode == "continuous":
            from transformers.generation.configuration_utils import ContinuousBatchingConfig

            # the defaults size the KV cache from GPU memory; on the CPU give it explicit, small numbers
            cb = ContinuousBatchingConfig(page_size=cb_page_size, num_blocks=cb_num_blocks,
                                          max_batch_tokens=cb_max_batch_tokens, max_requests_per_batch=max_batch)
            self._cb = self.model.init_continuous_batching(generation_config=self.gen_config,
                                                           continuous_batching_config=cb)
        self._threads = [threading.Thread(target=self._gen_loop, name="hf-gen", daemon=True),
                         threading.Thread(target=self._embed_loop, name="hf-embed", daemon=True)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------------------------------------ public API
    def submit(self, kind: str, request_id: str, input_text: str, params_dict: dict | None = None) -> None:
        if self._errors:
            raise RuntimeError("; ".join(self._errors))
        params = dict(params_dict or {})
        if kind == GENERATE:
            self._gen_q.put((str(request_id), input_text, params))
        elif kind == EMBED:
            self._embed_q.put((str(request_id), input_text, params))
        else:
            raise ValueError(f"kind must be {EMBED!r} or {GENERATE!r}, not {kind!r}")

    def shutdown(self, timeout_s: float = 60.0) -> None:
        self._gen_q.put(_STOP)
        self._embed_q.put(_STOP)
        for t in self._threads:
            t.join(timeout_s)

    def __enter__(self) -> HfPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------------------------------------ workers
    def _deliver(self, items: list[dict]) -> None:
        now = time.perf_counter()
        with self._cond:
            for it in items:
                it["finished_at"] = now
                self._results.append(it)
            self._cond.notify_all()

    def _fail(self, where: str, exc: BaseException) -> None:
        with self._cond:
            self._errors.append(f"{where}: {type(exc).__name__}: {exc}")
            self._cond.notify_all()

    @staticmethod
    def _drain(q: queue.Queue, first, limit: int) -> tuple[list, bool]:
        items, stop = [first], False
        while len(items) < limit:
            try:
                x = q.get_nowait()
            except queue.Empty:
                break
            if x is _STOP:
                stop = True
                break
            items.append(x)
        return items, stop

    def _gen_loop(self) -> None:
        torch = self._torch
        torch.set_num_threads(self.threads)
        try:
            if self._cb is not None:
                self._gen_loop_continuous()
            else:
                self._gen_loop_static()
        except BaseException as exc:
            self._fail("generate", exc)

    def _gen_loop_continuous(self) -> None:
        # the manager runs its own generation thread; this thread feeds it and collects its results
        cb = self._cb
        cb.start()
        pending = 0
        stopping = False
        try:
            while not (stopping and pending == 0):
                while True:  # feed everything queued
                    try:
                        x = self._gen_q.get(block=pending == 0 and not stopping, timeout=None)
                    except queue.Empty:
                        break
                    if x is _STOP:
                        stopping = True
                        break
                    rid, text, params = x
                    ids = self.tok(text)["input_ids"]
                    eos = -1 if params.get("ignore_eos") else None
                    cb.add_request(ids, request_id=rid, max_new_tokens=int(params.get("max_tokens", 16)),
                                   eos_token_id=eos)
                    pending += 1
                if pending == 0:
                    continue
                res = cb.get_result(timeout=0.05)
                if res is None:
                    if not cb.is_running():
                        raise RuntimeError("continuous batching thread stopped")
                    continue
                if not res.is_finished():
                    continue
                pending -= 1
                if getattr(res, "error", None):
                    self._deliver([{"request_id": res.request_id, "kind": GENERATE, "n_tokens": 0,
                                    "error": str(res.error)}])
                    continue
                toks = list(res.generated_tokens)
                self._deliver([{"request_id": res.request_id, "kind": GENERATE, "n_tokens": len(toks),
                                "text": self.tok.decode(toks, skip_special_tokens=True)}])
        finally:
            cb.stop(block=True, timeout=30)

    def _gen_loop_static(self) -> None:
        torch = self._torch
        while True:
            first = self._gen_q.get()
            if first is _STOP:
                return
            batch, stop = self._drain(self._gen_q, first, self.max_batch)
            enc = self.tok([t for _, t, _ in batch], return_tensors="pt", padding=True)
            max_new = max(int(p.get("max_tokens", 16)) for _, _, p in batch)
            ignore_eos = any(p.get("ignore_eos") for _, _, p in batch)
            kw: dict[str, Any] = {"max_new_tokens": max_new}
            if ignore_eos:
                kw.update(eos_token_id=None, min_new_tokens=max_new)
            with torch.inference_mode():
                out = self.model.generate(**enc, generation_config=self.gen_config, **kw)
            new = out[:, enc["input_ids"].shape[1]:]
            items = []
            for (rid, _, p), row in zip(batch, new.tolist()):
                row = row[: int(p.get("max_tokens", 16))]
                if not p.get("ignore_eos") and self.tok.eos_token_id in row:
                    row = row[: row.index(self.tok.eos_token_id) + 1]
                items.append({"request_id": rid, "kind": GENERATE, "n_tokens": len(row),
                              "text": self.tok.decode(row, skip_special_tokens=True)})
            self._deliver(items)  # a static batch finishes together
            if stop:
                return

    def _embed_loop(self) -> None:
        torch = self._torch
        torch.set_num_threads(self.threads)
        try:
            while True:
                first = self._embed_q.get()
                if first is _STOP:
                    return
                batch, stop = self._drain(self._embed_q, first, self.embed_batch)
                texts = [t for _, t, _ in batch]
                with torch.inference_mode():
                    if self._st is not None:
                        vecs = self._st.encode(texts, batch_size=len(texts), convert_to_tensor=True,
                                               normalize_embeddings=True)
                        n_toks = [len(x) for x in self._st.tokenizer(texts, truncation=True)["input_ids"]]
                    else:
                        enc = self.embed_tok(texts, return_tensors="pt", padding=True, truncation=True,
                                             max_length=self.max_embed_tokens)
                        hidden = self.embed_model(**enc).last_hidden_state
                        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                        vecs = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
                        n_toks = enc["attention_mask"].sum(1).tolist()
                items = []
                for (rid, _, p), v, n in zip(batch, vecs, n_toks):
                    it = {"request_id": rid, "kind": EMBED, "n_tokens": int(n)}
                    if p.get("return_embedding"):
                        it["embedding"] = v.tolist()
                    items.append(it)
                self._deliver(items)
                if stop:
                    return
        except BaseException as exc:
            self._fail("embed", exc)
