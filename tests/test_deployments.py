"""The split baselines (dedicated, disagg-pd) serve exactly what one engine serves (structured outputs too: the
constraint travels to the workers in the sampling parameters, and disagg-pd's decode worker rebuilds the matcher from
the handed-off tokens), hand KV over without recompute, surface worker failures as errors and leave no process
behind."""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import replace

import pytest
import torch

from orthrus_rag import Engine, SamplingParams
from orthrus_rag.engine.deploy import DedicatedDeployment, DisaggPDDeployment, WorkerError
from orthrus_rag.engine.handoff import HandoffOutput
from orthrus_rag.config.build import engine_config
from orthrus_rag.params import StructuredOutputsParams
from tests.conftest import SMOL, engine_overrides
from tests.test_structured_outputs import City, Portrait, _chat  # the schemas, one owner

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "Hi",
    "The capital of France is",
    "List three fruits:",
    "Question: what is the boiling point of water at sea level in degrees Celsius?\nAnswer:",
    " ".join(["The history of the printing press begins in the fifteenth century."] * 4),
    "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n",
]
TEXTS = [f"Passage {i}: " + "a note on rivers and mountains " * (1 + i) for i in range(10)]  # up to ~70 tokens


def engine_on_same_model(engine: Engine, num_blocks: int) -> Engine:
    """A second engine sharing `engine`'s model object, with a cache of its own."""
    cfg = replace(engine.config, cache=replace(engine.config.cache, num_blocks=num_blocks))
    return Engine(cfg, engine.runner.model, engine.tokenizer)


def all_free(engine: Engine) -> bool:
    return not engine.has_unfinished() and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def prefill_then_decode(a: Engine, b: Engine, prompts: list, params: SamplingParams) -> tuple[list, list]:
    """Prefill on `a` with handoff, continue on `b`; returns (handoffs, outputs) in prompt order."""
    ids = [a.add_generate(p, params, handoff=True) for p in prompts]
    done = a.run_until_done()
    handoffs = [done[i] for i in ids]
    for rid in [b.add_prefilled(h) for h in handoffs]:
        assert rid in b.scheduler.requests
    outs = b.run_until_done()
    return handoffs, [outs[i] for i in ids]


def test_handoff_continues_decoding_without_recompute(engine):
    prompts = PROMPTS[1:5]  # the last is chunked over several prefill steps
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = engine.generate(prompts, params)
    b = engine_on_same_model(engine, 64)
    handoffs, outs = prefill_then_decode(engine, b, prompts, params)
    layers = len(engine.runner.kv_caches)
    kv_heads, head_dim = engine.runner.kv_caches[0][0].shape[1:]
    for h, out, ref in zip(handoffs, outs, want):
        assert isinstance(h, HandoffOutput) and len(h.output_token_ids) == 1
        assert h.kv[0].shape == h.kv[1].shape == (layers, len(h.prompt_token_ids), kv_heads, head_dim)
        assert out.token_ids == ref.token_ids and out.text == ref.text and out.finish_reason == "length"
    # no recompute: every step on b decodes only
    assert all(s.num_prefill_tokens == 0 for s in b.step_stats)
    assert all_free(b)


def test_handoff_keeps_the_seeded_random_stream(engine):
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=1234)
    want = engine.generate(PROMPTS[1:3], params)
    b = engine_on_same_model(engine, 64)
    handoffs, outs = prefill_then_decode(engine, b, PROMPTS[1:3], params)
    assert all(h.generator_state is not None for h in handoffs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert all_free(b)


def test_handoff_falls_back_to_recompute_without_blocks(engine):
    ids = engine.tokenizer(" ".join(["A long passage about the sea and its many ships."] * 6))["input_ids"]
    prompts = [ids[:20], ids[5:25]]  # 20 prompt tokens + 4 generated: 2 blocks of 16 each
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = engine.generate(prompts, params)
    b = engine_on_same_model(engine, 3)  # room for one of them only
    rids = [engine.add_generate(p, params, handoff=True) for p in prompts]
    done = engine.run_until_done()
    for rid in rids:
        b.add_prefilled(done[rid])
    assert [r.req_id for r in b.scheduler.running] == rids[:1]
    assert [r.req_id for r in b.scheduler.waiting] == rids[1:]
    outs = b.run_until_done()
    assert [outs[r].token_ids for r in rids] == [o.token_ids for o in want]
    assert all_free(b)


def test_no_handoff_when_the_first_token_finishes(engine):
    rid = engine.add_generate("Hi", SamplingParams(max_tokens=1, temperature=0.0), handoff=True)
    out = engine.run_until_done()[rid]
    assert not isinstance(out, HandoffOutput) and out.finish_reason == "length" and len(out.token_ids) == 1


def test_add_prefilled_rejects_kv_of_another_shape(engine):
    rid = engine.add_generate("Hello there", GREEDY, handoff=True)
    h = engine.run_until_done()[rid]
    b = engine_on_same_model(engine, 8)
    with pytest.raises(ValueError, match="does not fit"):
        b.add_prefilled(replace(h, kv=(h.kv[0][:, :-1], h.kv[1][:, :-1])))
    assert all_free(b)


# ---- the multi-process deployments ------------------------------------------------------------------------------
SPEC = engine_config(SMOL, **engine_overrides(num_blocks=64, rerankers=["backbone"]))


@pytest.fixture(scope="module")
def dedicated():
    with DedicatedDeployment(SPEC) as dep:
        yield dep


@pytest.fixture(scope="module")
def disagg():
    with DisaggPDDeployment(SPEC) as dep:
        yield dep


def test_mixed_workload_is_identical_on_every_deployment(engine, dedicated, disagg):
    want_gen, want_emb = engine.run(PROMPTS, GREEDY, TEXTS)
    for dep in (engine, dedicated, disagg):
        assert isinstance(dep, (Engine, DedicatedDeployment, DisaggPDDeployment))
        gen, emb = dep.run(PROMPTS, GREEDY, TEXTS)
        assert [o.token_ids for o in gen] == [o.token_ids for o in want_gen], type(dep).__name__
        assert [o.text for o in gen] == [o.text for o in want_gen]
        for got, ref in zip(emb, want_emb):
            assert got.prompt_token_ids == ref.prompt_token_ids
            torch.testing.assert_close(got.embedding, ref.embedding, atol=1e-5, rtol=0)
    assert disagg.run() == ([], [])


def test_bad_input_is_rejected_and_the_deployment_keeps_serving(engine, dedicated, disagg):
    want = engine.generate(["Hi"], GREEDY)[0].token_ids
    for dep in (dedicated, disagg):
        with pytest.raises(WorkerError, match="rejected the input: ValueError: prompt is empty"):
            dep.run(["fine", ""], GREEDY, ["fine too"])
        # half a batch accepted by one worker, rejected by the other: the accepted half is aborted
        with pytest.raises(WorkerError, match="embedding input is empty"):
            dep.run(PROMPTS[:2], GREEDY, ["ok", " "])
        gen, emb = dep.run(["Hi"], GREEDY, ["still serving"])
        assert gen[0].token_ids == want and emb[0].embedding.shape == (576,)


def test_a_rejected_submit_names_its_request_and_the_others_finish(dedicated):
    dedicated.submit("generate", "bad", "", GREEDY)
    dedicated.submit("embed", "good", "fine", None)
    finished, rejected = [], []
    deadline = time.monotonic() + 120
    while not (finished and rejected) and time.monotonic() < deadline:
        try:
            finished += [o.request_id for o in dedicated.poll(0.5)]
        except WorkerError as exc:
            rejected.append(exc)
    assert finished == ["good"]
    assert [e.request_ids for e in rejected] == [("bad",)] and "prompt is empty" in str(rejected[0])


def test_scored_pairs_run_in_the_pooling_worker(engine, dedicated):
    """`dedicated` routes scoring to its embedding process (a scoring process beside the generation process): the
    scores are the in-process engine's."""
    import asyncio

    from orthrus_rag.engine.clients.deployment_client import DeploymentClient

    local = Engine(replace(engine.config, model=replace(engine.config.model, rerankers=["backbone"])),
                   engine.runner.model, engine.tokenizer)
    query, docs = "Who wrote Emma?", ["Emma is a novel by Jane Austen.", "The Nile flows north."]
    client = DeploymentClient(dedicated, reranker_names=["backbone"])
    try:
        got = asyncio.run(client.score(query, docs))
    finally:
        client.shutdown(close_client=False)
    assert got == pytest.approx(local.score(query, docs), abs=1e-5)


def test_structured_outputs_return_what_the_engine_returns(engine, dedicated, disagg):
    """A valid object, and one closed at max_tokens inside a string: the tokens of one in-process engine."""
    tok = engine.tokenizer
    prompts = [_chat(tok, "Tell me about Rome as JSON."), _chat(tok, "Describe Paris as JSON with a long summary.")]
    params = [SamplingParams(max_tokens=48, temperature=0,
                             structured_outputs=StructuredOutputsParams(json=City.model_json_schema())),
              SamplingParams(max_tokens=24, temperature=0,  # cut inside the summary, closed
                             structured_outputs=StructuredOutputsParams(json=Portrait.model_json_schema()))]
    want = [engine.generate(p, sp)[0] for p, sp in zip(prompts, params)]
    for dep in (dedicated, disagg):
        got = [dep.run([p], sp)[0][0] for p, sp in zip(prompts, params)]
        assert [o.token_ids for o in got] == [o.token_ids for o in want], type(dep).__name__
        City.model_validate_json(got[0].text)
        Portrait.model_validate_json(got[1].text)
        assert [o.finish_reason for o in got] == ["stop", "length"]


def test_dead_worker_surfaces_and_shutdown_leaves_no_process(dedicated, disagg):
    disagg._procs["decode"].kill()
    with pytest.raises(WorkerError, match="decode worker exited unexpectedly"):
        disagg.run(["Hi"], GREEDY)
    with pytest.raises(RuntimeError, match="shut down"):
        disagg.run(["Hi"], GREEDY)
    dedicated.shutdown()
    dedicated.shutdown()  # idempotent
    assert mp.active_children() == []


def test_worker_that_cannot_start_fails_the_constructor():
    with pytest.raises(WorkerError, match=r"(prefill|decode) worker failed"):
        DisaggPDDeployment(engine_config("/nonexistent/model", **engine_overrides(num_blocks=8)))
    assert mp.active_children() == []


def test_options_are_checked_in_the_caller():
    with pytest.raises(ValueError, match="threads"):
        DedicatedDeployment(SPEC, threads=(1, 0))
    with pytest.raises(ValueError, match="unknown engine option 'bogus'"):
        engine_config(SMOL, bogus=1)  # NOTE: options are checked when the config is made, before any worker
    assert mp.active_children() == []
