"""The split baselines: the same engine run as two worker processes (DESIGN.md, "Scheduler").

- `DedicatedDeployment`: a generation engine and an embedding engine, the CPU threads split between them, a
  router by request kind.
- `DisaggPDDeployment`: a prefill worker (prompts, chunked, and embeddings) hands each generation over with its
  KV cache, once its first token is sampled, to a decode worker that keeps decoding from that KV.

Workers are spawned processes (torch and fork do not mix). Every wait is bounded: a worker that fails, exits or
stays silent for `stall_timeout_s` turns into a `WorkerError` in the caller, and the deployment shuts down.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import queue
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, ClassVar

from orthrus_rag.config import EngineConfig
from orthrus_rag.engine.deploy.spec import Inputs, WorkerError, WorkItem, dumps, loads
from orthrus_rag.engine.deploy.worker import worker_main
from orthrus_rag.outputs import EmbeddingOutput, GenerationOutput
from orthrus_rag.params import PoolingParams, SamplingParams

logger = logging.getLogger(__name__)
POLL_S = 0.2  # how often a waiting caller checks that its workers are alive


class _ProcessDeployment:
    """Parent side of a two-worker deployment: spawned workers, one inbox each, one shared results queue."""

    ROLES: ClassVar[tuple[str, str]]
    ROUTE: ClassVar[dict[str, str]]  # request kind -> role of the worker that receives it
    HANDOFF: ClassVar[dict[str, str]] = {}  # role -> role it hands generations to

    def __init__(self, config: EngineConfig, threads: Sequence[int] = (1, 1),
                 startup_timeout_s: float = 300.0, stall_timeout_s: float = 300.0) -> None:
        threads = tuple(threads)
        if len(threads) != len(self.ROLES) or any(not isinstance(t, int) or t < 1 for t in threads):
            raise ValueError(f"threads must be {len(self.ROLES)} positive ints ({', '.join(self.ROLES)}), "
                             f"got {threads}")
        self.stall_timeout_s = stall_timeout_s
        self._closed = False
        self._batch_ids = itertools.count()
        self._request_ids = itertools.count()
        self._unconfirmed: dict[int, str] = {}  # batch -> request id of a `submit` not yet accepted or rejected
        self._rejections: list[WorkerError] = []
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._inboxes = {role: ctx.Queue() for role in self.ROLES}
        self._procs: dict[str, Any] = {}
        try:
            for role, num_threads in zip(self.ROLES, threads):
                target = self._inboxes[self.HANDOFF[role]] if role in self.HANDOFF else None
                proc = ctx.Process(target=worker_main, name=f"orthrus-{role}", daemon=True,
                                   args=(config, role, num_threads, self._inboxes[role], self._results, target))
                proc.start()
                self._procs[role] = proc
            ready: set[str] = set()
            while len(ready) < len(self.ROLES):
                tag, role, _, _ = self._receive(startup_timeout_s)
                if tag == "ready":
                    ready.add(role)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%s ready: %s", type(self).__name__, dict(zip(self.ROLES, threads)))

    # ---- the Deployment protocol ----------------------------------------------------------------------------
    def run(self, prompts: Inputs = (), sampling_params: SamplingParams | None = None, texts: Inputs = (),
            pooling_params: PoolingParams | None = None) -> tuple[list[GenerationOutput], list[EmbeddingOutput]]:
        """Like `Engine.run`: outputs in input order. Bad input raises `WorkerError` and runs nothing."""
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is shut down")
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        texts = [texts] if isinstance(texts, str) else list(texts)
        batch = next(self._batch_ids)
        parts: dict[str, list[WorkItem]] = defaultdict(list)
        for kind, inputs, params in (("generate", prompts, sampling_params), ("embed", texts, pooling_params)):
            for index, x in enumerate(inputs):
                rid = f"{kind[:3]}-{next(self._request_ids)}"
                parts[self.ROUTE[kind]].append(WorkItem(index, rid, kind, x, params))
        # NOTE: pickle everything before sending anything: an unpicklable parameter must not half-submit a batch
        payloads = {role: dumps(("submit", batch, items)) for role, items in parts.items()}
        for role, raw in payloads.items():
            self._inboxes[role].put(raw)
        try:
            return self._collect(batch, set(payloads), len(prompts), len(texts))
        except BaseException:  # rejected input, Ctrl-C: stop what the workers accepted of this batch
            if not self._closed:
                for inbox in self._inboxes.values():
                    inbox.put(dumps(("abort", batch)))
            raise

    # ---- one request at a time, for the DeploymentClient that owns it (engine/clients/) ----------------------
    def submit(self, kind: str, request_id: str, input: str | Sequence[int],
               params: SamplingParams | PoolingParams | None) -> None:
        """Send one request to the worker its kind routes to; its output comes back from `poll`. NOTE: do not
        interleave with `run`, which skips outputs that are not its own."""
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is shut down")
        if kind not in self.ROUTE:
            raise ValueError(f"unknown request kind {kind!r}; expected one of {', '.join(self.ROUTE)}")
        batch = next(self._batch_ids)
        raw = dumps(("submit", batch, [WorkItem(0, request_id, kind, input, params)]))
        self._unconfirmed[batch] = request_id
        self._inboxes[self.ROUTE[kind]].put(raw)

    def poll(self, timeout_s: float) -> list[GenerationOutput | EmbeddingOutput]:
        """Finished outputs of submitted requests: waits up to `timeout_s` for the first, then takes what else is
        queued. A rejected request raises `WorkerError` naming it in `request_ids` (the deployment stays up); a
        failed or dead worker raises one with no ids, after shutting down."""
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is shut down")
        if self._rejections:
            raise self._rejections.pop(0)
        deadline = time.monotonic() + timeout_s
        outputs: list[GenerationOutput | EmbeddingOutput] = []
        while True:
            msg = self._try_receive(max(0.0, deadline - time.monotonic()) if not outputs else 0.0)
            if msg is None:
                if outputs or time.monotonic() >= deadline:
                    return outputs
                continue
            tag, role, batch, payload = msg
            if tag in ("accepted", "rejected"):
                rid = self._unconfirmed.pop(batch, None)
                if tag == "rejected":
                    error = WorkerError(f"the {role} worker rejected request {rid}: {payload}",
                                        request_ids=(rid,) if rid is not None else ())
                    if not outputs:
                        raise error
                    self._rejections.append(error)  # NOTE: hand over the outputs first; the next poll raises
                    return outputs
            elif tag == "outputs":
                outputs.extend(out for _, out in payload)

    def _try_receive(self, timeout_s: float) -> tuple | None:
        """The next worker message within `timeout_s` (at most POLL_S), or None; fails like `_receive`."""
        try:
            raw = self._results.get(timeout=min(timeout_s, POLL_S)) if timeout_s > 0 else self._results.get_nowait()
            return self._check(loads(raw))
        except queue.Empty:
            pass
        dead = [(role, p.exitcode) for role, p in self._procs.items() if not p.is_alive()]
        if dead:
            return self._receive(1.0)  # NOTE: the worker's own reason first, else a WorkerError for the exit
        return None

    def _collect(self, batch: int, unconfirmed: set[str], num_prompts: int, num_texts: int,
                 ) -> tuple[list[GenerationOutput], list[EmbeddingOutput]]:
        generations: list[Any] = [None] * num_prompts
        embeddings: list[Any] = [None] * num_texts
        missing = num_prompts + num_texts
        while unconfirmed or missing:
            tag, role, msg_batch, payload = self._receive(self.stall_timeout_s)
            if msg_batch != batch:
                continue  # late outputs of an earlier, rejected batch
            if tag == "accepted":
                unconfirmed.discard(role)
            elif tag == "rejected":
                raise WorkerError(f"the {role} worker rejected the input: {payload}")
            elif tag == "outputs":
                for index, out in payload:
                    (embeddings if isinstance(out, EmbeddingOutput) else generations)[index] = out
                    missing -= 1
        return generations, embeddings

    def _receive(self, timeout_s: float) -> tuple:
        """The next worker message; raises WorkerError (after shutting down) on a worker failure, a dead worker or
        `timeout_s` of silence."""
        deadline = time.monotonic() + timeout_s
        while True:
            wait_s = max(0.0, min(POLL_S, deadline - time.monotonic()))
            try:
                return self._check(loads(self._results.get(timeout=wait_s)))
            except queue.Empty:
                pass
            dead = [(role, p.exitcode) for role, p in self._procs.items() if not p.is_alive()]
            if dead:
                try:  # NOTE: a worker that failed has sent why before exiting; prefer that to a bare exit code
                    return self._check(loads(self._results.get(timeout=1.0)))
                except queue.Empty:
                    self._fail(f"the {dead[0][0]} worker exited unexpectedly (exit code {dead[0][1]})")
            if time.monotonic() >= deadline:
                self._fail(f"no message from the workers for {timeout_s:.0f} s")

    def _check(self, msg: tuple) -> tuple:
        if msg[0] == "fatal":
            self._fail(f"the {msg[1]} worker failed", msg[3])
        return msg

    def _fail(self, message: str, remote_traceback: str | None = None) -> None:
        self.shutdown()
        raise WorkerError(message, remote_traceback)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop and join the workers (terminating any that do not stop within `timeout_s`). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for inbox in self._inboxes.values():
            inbox.put(dumps(("stop",)))
        deadline = time.monotonic() + timeout_s
        for proc in self._procs.values():
            while proc.is_alive() and time.monotonic() < deadline:
                self._drain_results()  # a worker exits only once its queued messages are read
                proc.join(0.05)
        for role, proc in self._procs.items():
            if proc.is_alive():
                logger.warning("the %s worker did not stop within %.0f s; terminating it", role, timeout_s)
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for q in (*self._inboxes.values(), self._results):
            q.cancel_join_thread()
            q.close()

    def _drain_results(self) -> None:
        try:
            while True:
                self._results.get_nowait()
        except queue.Empty:
            pass

    def __enter__(self) -> "_ProcessDeployment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class DedicatedDeployment(_ProcessDeployment):
    """Two engines in two processes, one per request kind; `threads` = (generation, embedding)."""

    ROLES = ("generate", "embed")
    # NOTE: scored pairs go with the embeddings: a pooling process beside the generation process
    ROUTE = {"generate": "generate", "embed": "embed", "score": "embed"}


class DisaggPDDeployment(_ProcessDeployment):
    """A prefill worker (prompts and embeddings) and a decode worker fed with KV handoffs;
    `threads` = (prefill, decode)."""

    ROLES = ("prefill", "decode")
    ROUTE = {"generate": "prefill", "embed": "prefill", "score": "prefill"}
    HANDOFF = {"prefill": "decode"}


DEPLOYMENTS: dict[str, type[_ProcessDeployment]] = {"dedicated": DedicatedDeployment, "disagg-pd": DisaggPDDeployment}
