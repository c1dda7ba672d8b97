"""Per-request LoRA adapters for generation: one base model, a generation adapter, an embedding adapter and the base
itself in the same steps; greedy tokens equal PEFT's merged model; the prefix cache never mixes adapters; the
server addresses adapters by name."""

from __future__ import annotations

import copy
from pathlib import Path

import openai
import pytest
import torch
from peft import LoraConfig, get_peft_model

from orthrus_rag import Engine, PoolingParams, SamplingParams
from orthrus_rag.config import ModelConfig
from orthrus_rag.layers.lora import attach_adapters, load_peft_adapter, set_lora_kernel, use_cpu_lora_kernel
from scripts.make_lora_adapter import make_adapter
from tests.conftest import SMOL, engine_overrides
from tests.test_model_parity import (ATOL, NEAR_TIE, SEQ_LEN, _assert_all_blocks_free, _build, _engine,
                                     _engine_logits, _hf_greedy, _hf_logits, _ids)

pytestmark = pytest.mark.slow  # builds engines / loads models (make test-fast skips it)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KINDS = {"gen": "both", "emb": "embed", "gen2": "generate"}


def test_adapter_config_is_checked():
    with pytest.raises(ValueError, match="adapter_kinds names 'x', which is not in adapters"):
        ModelConfig(adapters={"a": "/p"}, adapter_kinds={"x": "embed"})
    with pytest.raises(ValueError, match="unknown kind 'read'"):
        ModelConfig(adapters={"a": "/p"}, adapter_kinds={"a": "read"})
    with pytest.raises(ValueError, match="choice 'fast' for lora; expected auto, cpp, torch, per_slot, stacked"):
        ModelConfig(kernel_overrides={"lora": "fast"})
    assert ModelConfig(adapters={"a": "/p"}).adapter_kind("a") == "both"


# ---- tiny random configs of each family ------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["llama_tied", "qwen3_qk_norm", "gemma3_alternating"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp: Path = tmp_path_factory.mktemp(request.param)
    hf, ours = _build(request.param, tmp / "base")
    merged = {}
    for seed, name in ((7, "gen"), (8, "emb"), (9, "gen2")):
        torch.manual_seed(seed)
        peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                                   init_lora_weights=False))
        peft_model.save_pretrained(str(tmp / name))
        merged[name] = peft_model.merge_and_unload().eval()
    slots = attach_adapters(ours, [load_peft_adapter(tmp / n, name=n) for n in ("gen", "emb", "gen2")])
    return dict(name=request.param, hf=hf, merged=merged, ours=ours, slots=slots)


def _adapter_engine(family: dict, chunk: int, budget: int | None = None) -> Engine:
    engine = _engine(family["ours"], chunk, budget)
    engine.adapter_slots, engine.adapter_kinds = dict(family["slots"]), dict(KINDS)  # what from_config passes
    return engine


def _check_close(engine: Engine, adapter: str | None, ours: list[int], theirs: list[int], scores: list,
                 prompt: list[int]) -> None:
    """Greedy tokens equal up to a first divergence that is a near-tie on both sides (test_model_parity's rule),
    the engine's logits read under the same adapter."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        (out,) = engine.embed([prompt + ours[:i]], PoolingParams(pooling="all", normalize=False,
                                                                 adapter=adapter or ""))
        for logits, other in ((scores[i], a), (_engine_logits(engine, out)[-1], b)):
            top2 = logits.topk(2)
            assert other in top2.indices.tolist() and (top2.values[0] - logits[other]).abs() < NEAR_TIE
        return
    assert len(ours) == len(theirs)


@pytest.mark.parametrize("kernel", ["per_slot", "stacked", "cpu_kernel"])
def test_generation_adapters_equal_peft_merged_in_mixed_steps(family: dict, kernel: str) -> None:
    """Two generation adapters, the base model and an embedding adapter share steps (chunked prompts and decodes
    beside embedding chunks); each generation equals its own merged model, the embedding the embedding adapter's.
    `cpu_kernel`: `auto` on the C++ LoRA kernel, as the engine loads a CPU model."""
    if kernel == "cpu_kernel":
        assert use_cpu_lora_kernel(family["ours"]) > 0
    else:
        set_lora_kernel(family["ours"], kernel)
    try:
        prompts = [_ids(13, 40), _ids(9, 41), _ids(11, 42)]
        text = _ids(SEQ_LEN, 43)
        params = [SamplingParams(max_tokens=12, temperature=0, adapter="gen"), SamplingParams(max_tokens=12,
                  temperature=0), SamplingParams(max_tokens=12, temperature=0, adapter="gen2")]
        engine = _adapter_engine(family, 7, budget=16)
        gens, (emb,) = engine.run(prompts, params, [text], PoolingParams(pooling="all", normalize=False))
        steps = list(engine.step_stats)
        # one forward carried adapter generation rows, base generation rows and adapter embedding rows together
        assert any(s.num_adapter_generate_rows and s.num_forward_generate_rows > s.num_adapter_generate_rows
                   and s.num_adapter_embed_rows for s in steps)
        assert max(s.num_adapters for s in steps) == 3
        for (prompt, p, gen) in zip(prompts, params, gens):
            reference = family["merged"][p.adapter] if p.adapter else family["hf"]
            theirs, scores = _hf_greedy(reference, prompt, 12)
            _check_close(engine if p.adapter else _engine(family["ours"], 64), p.adapter, gen.token_ids, theirs,
                         scores, prompt)
        assert _hf_greedy(family["merged"]["gen"], prompts[0], 12)[0] != _hf_greedy(family["hf"], prompts[0], 12)[0]
        diff = (_engine_logits(engine, emb) - _hf_logits(family["merged"]["emb"], text)).abs().max().item()
        assert diff < ATOL, f"{family['name']} {kernel}: embedding under its adapter, max |logit diff| {diff:.2e}"
        _assert_all_blocks_free(engine)
    finally:
        set_lora_kernel(family["ours"], "auto")
        use_cpu_lora_kernel(family["ours"], enabled=False)


def test_kinds_are_enforced(family: dict) -> None:
    engine = _adapter_engine(family, 16)
    with pytest.raises(ValueError, match="adapter 'emb' embeds only; generation adapters: \\['gen', 'gen2'\\]"):
        engine.add_generate([3, 4, 5], SamplingParams(adapter="emb"))
    with pytest.raises(ValueError, match="unknown adapter 'nope'; generation adapters"):
        engine.add_generate([3, 4, 5], SamplingParams(adapter="nope"))
    with pytest.raises(ValueError, match="adapter 'gen2' generates only; embedding adapters: \\['emb', 'gen'\\]"):
        engine.add_embed([3, 4, 5], PoolingParams(adapter="gen2"))
    assert not engine.has_unfinished()
    # the default embedding adapter is the first embedding-only one, not a generation adapter loaded before it
    assert engine.embedding_route(PoolingParams()).adapter == "emb"


# ---- SmolLM2 ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_adapters(tmp_path_factory, hf_smol):
    tmp = tmp_path_factory.mktemp("smol_adapters")
    merged = make_adapter(hf_smol, str(tmp / "gen"), rank=8, alpha=16, targets=["q_proj", "v_proj", "up_proj"],
                          init="random", seed=3, scale=0.5)
    engine = Engine.from_pretrained(SMOL, adapters={"gen": str(tmp / "gen")}, **engine_overrides())
    return engine, merged


def test_smol_generation_adapter_equals_peft_merged(smol_adapters, smol_tokenizer, hf_smol):
    engine, merged = smol_adapters
    prompt = "The three primary colours are"
    ids = smol_tokenizer(prompt)["input_ids"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, adapter="gen")
    base_params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    (ours, base), _ = engine.run([ids, ids], [params, base_params], ["a passage to embed beside them"] * 4)
    with torch.inference_mode():
        want = merged.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16)[0, len(ids):].tolist()
        want_base = hf_smol.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16)[0, len(ids):].tolist()
    assert ours.token_ids == want
    assert base.token_ids == want_base and want != want_base


def test_prefix_cache_is_keyed_by_adapter(smol_adapters):
    """A prompt's blocks computed under the base are never read by the adapter's request (nor the reverse); the
    same adapter's second request does find its own. With the key ignored, the adapter request would start from
    the base's KV and its tokens would change."""
    engine, _ = smol_adapters
    prompt = list(range(1000, 1000 + 5 * engine.config.cache.block_size))  # five full blocks
    under = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, adapter="gen")
    base = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def hits(params):
        before = engine.block_manager.num_hit_tokens
        out = engine.generate([prompt], params)[0]
        return engine.block_manager.num_hit_tokens - before, out.token_ids

    assert hits(base)[0] == 0
    first_hits, first = hits(under)
    assert first_hits == 0  # the base's blocks are there, under another key
    again_hits, again = hits(under)
    assert again_hits > 0 and again == first  # its own blocks
    assert hits(base)[0] > 0


def test_server_addresses_adapters_by_name(smol_adapters):
    from orthrus_rag.engine.async_engine import AsyncEngine
    from orthrus_rag.entrypoints.openai import ServerThread

    engine, _ = smol_adapters
    prompt = "The three primary colours are"
    direct = engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0, adapter="gen"))[0]  # before serving
    server = ServerThread(AsyncEngine(engine), default_max_tokens=8)
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        cards = {m.id: m for m in client.models.list()}
        assert cards["gen"].kinds == ["generate", "embed"] and cards["gen"].parent == SMOL
        assert cards[SMOL].kinds == ["generate", "embed"] and cards[SMOL].parent is None
        ours = client.completions.create(model="gen", prompt=prompt, max_tokens=8, temperature=0)
        base = client.completions.create(model=SMOL, prompt=prompt, max_tokens=8, temperature=0)
        assert ours.choices[0].text == direct.text and ours.model == "gen"
        assert base.choices[0].text != ours.choices[0].text
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt=prompt, max_tokens=2)
    finally:
        server.stop()


def test_langchain_chat_names_the_adapter(smol_adapters):
    from orthrus_rag.integrations.langchain import ChatOrthrus, LocalOrthrus

    engine, _ = smol_adapters
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0, adapter="gen"))[0].text
    local = LocalOrthrus.of(engine)
    try:
        got = ChatOrthrus(engine=local, model="gen", max_tokens=8, temperature=0).invoke("Name a colour.")
        assert got.content == want and got.response_metadata["model_name"] == "gen"
    finally:
        local.close()


def test_a_run_names_its_generation_and_embedding_adapters(smol_adapters, tmp_path, monkeypatch):
    """`pipeline.generation_adapter` and `retriever.adapter` reach every request of an Iter-RetGen run."""
    from orthrus_rag.entrypoints import commands as app
    from tests.test_app_config import _compose

    engine, _ = smol_adapters
    path = engine.config.model.adapters["gen"]
    seen: dict[str, set] = {"generate": set(), "embed": set()}
    add_generate, add_embed = Engine.add_generate, Engine.add_embed

    def spy_generate(self, prompt, params=None, *a, **kw):
        seen["generate"].add(params.adapter if params else None)
        return add_generate(self, prompt, params, *a, **kw)

    def spy_embed(self, text, params=None, *a, **kw):
        seen["embed"].add(params.adapter if params else None)
        return add_embed(self, text, params, *a, **kw)

    monkeypatch.setattr(Engine, "add_generate", spy_generate)
    monkeypatch.setattr(Engine, "add_embed", spy_embed)
    cfg = _compose("experiment=smoke", "dataset.num_questions=2", "pipeline.max_tokens=8", "retriever.k=2",
                   f"+model.adapters.gen={path}", "pipeline.generation_adapter=gen", "retriever.adapter=gen",
                   f"run_dir={tmp_path}", "progress=false")
    summary = app.run(cfg)
    assert summary["num_failed"] == 0
    assert seen == {"generate": {"gen"}, "embed": {"gen"}}
    assert summary["config"]["generation_adapter"] == "gen" and summary["config"]["retriever_adapter"] == "gen"
