"""Reranking in the engine: scoring requests pooled through a reranker's head, in the same steps as the rest.

A cross-encoder (a random-initialised BertForSequenceClassification on MiniLM's tokenizer) scores as its own
transformers forward does; the backbone's yes/no reading, chunked over several steps, scores as one whole
transformers forward of the same tokens does; bad input is refused before anything is queued."""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import replace

import pytest
import torch

from orthrus_rag import Engine, SamplingParams
from orthrus_rag.engine.rerankers import DEFAULT_INSTRUCTION, JUDGE_SYSTEM
from orthrus_rag.models.cross_encoder import BertCrossEncoder
from orthrus_rag.params import RerankParams
from tests.conftest import MINILM

QUERY = "Who wrote Pride and Prejudice?"
DOCS = ["Pride and Prejudice is an 1813 novel by Jane Austen.", "The Nile flows north into the Mediterranean.",
        " ".join(["Jane Austen's novels are widely read."] * 12)]


def tiny_cross_encoder(folder, num_labels: int = 1, seed: int = 0):
    """A random BertForSequenceClassification saved with MiniLM's tokenizer; returns the transformers model."""
    from transformers import BertConfig, BertForSequenceClassification

    from orthrus_rag.models.registry import resolve_model_path

    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=96, num_labels=num_labels,
                        architectures=["BertForSequenceClassification"])
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(folder)
    source = resolve_model_path(MINILM)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return model


def hf_relevance(model, tokenizer, query: str, docs: list[str], max_length: int) -> torch.Tensor:
    batch = tokenizer([query] * len(docs), docs, padding=True, truncation="longest_first", max_length=max_length,
                      return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    return torch.sigmoid(logits[:, 0]) if logits.shape[-1] == 1 else torch.softmax(logits, -1)[:, -1]


@pytest.mark.parametrize("num_labels", [1, 2])
def test_cross_encoder_model_equals_transformers(tmp_path, num_labels):
    """Packed pairs with their segments through BertCrossEncoder give the checkpoint's own padded forward."""
    from transformers import AutoTokenizer

    hf = tiny_cross_encoder(tmp_path, num_labels)
    ours = BertCrossEncoder.from_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    pairs = [tok(QUERY, d, truncation="longest_first", max_length=96) for d in DOCS]
    ids = torch.tensor([t for p in pairs for t in p["input_ids"]])
    types = torch.tensor([t for p in pairs for t in p["token_type_ids"]])
    lens = [len(p["input_ids"]) for p in pairs]
    positions = torch.cat([torch.arange(n) for n in lens])
    assert types.sum() > 0  # the documents are segment 1
    with torch.no_grad():
        hidden = ours(ids, positions, lens, types)
        starts = torch.tensor([0, *torch.tensor(lens).cumsum(0)[:-1].tolist()])
        got = ours.relevance(hidden[starts])
    want = hf_relevance(hf, tok, QUERY, DOCS, 96)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_cross_encoder_refuses_other_checkpoints(tmp_path):
    from orthrus_rag.models.registry import resolve_model_path

    with pytest.raises(ValueError, match="not a cross-encoder"):
        BertCrossEncoder.from_pretrained(resolve_model_path(MINILM))
    tiny_cross_encoder(tmp_path, num_labels=3)
    with pytest.raises(ValueError, match="3 labels"):
        BertCrossEncoder.from_pretrained(tmp_path)


@pytest.fixture(scope="module")
def cross_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cross")
    return folder, tiny_cross_encoder(folder)


@pytest.fixture(scope="module")
def reranking(smol_engine, cross_folder):
    """An engine on the shared SmolLM2 weights with two rerankers: the tiny cross-encoder and the backbone."""
    from transformers import AutoTokenizer

    folder, _ = cross_folder
    src = smol_engine
    config = replace(src.config, model=replace(src.config.model, rerankers=[str(folder), "backbone"]))
    cross = {str(folder): (BertCrossEncoder.from_pretrained(folder), AutoTokenizer.from_pretrained(str(folder)))}
    engine = Engine(config, src.runner.model, src.tokenizer, cross_encoders=cross)
    yield engine
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_cross_encoder_scores_equal_transformers_beside_generations(reranking, cross_folder):
    folder, hf = cross_folder
    reranker = reranking.reranker()
    assert reranker.name == str(folder)  # the first loaded is the default
    start = reranking.num_steps
    reranking.add_generate("Tell me about novels:", SamplingParams(max_tokens=6, temperature=0.0))
    got = reranking.score(QUERY, DOCS)
    assert not reranking.has_unfinished()  # the generation finished in the same loop
    steps = [s for s in reranking.step_stats if s.step >= start]
    assert any(s.num_encoder_tokens and (s.num_prefill_tokens or s.num_decode_tokens) for s in steps)
    want = hf_relevance(hf, reranker.tokenizer, QUERY, DOCS, reranker.max_length)
    torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=1e-4)


def test_cross_encoder_cuts_a_long_document(reranking):
    reranker = reranking.reranker()
    long_doc = " ".join(["words"] * 500)
    pair = reranker.pair(QUERY, long_doc, RerankParams())
    assert len(pair.token_ids) == reranker.max_length == 96
    assert pair.token_type_ids[0] == 0 and pair.token_type_ids[-1] == 1
    with pytest.raises(ValueError, match="takes at most 96"):
        reranker.pair(QUERY, long_doc, RerankParams(truncate=False))
    assert 0.0 <= reranking.score(QUERY, [long_doc])[0] <= 1.0


def backbone_reference(hf_smol, smol_tokenizer, query: str, doc: str) -> tuple[list[int], float]:
    """The yes/no reading done by hand: the judging chat rendered whole, one transformers forward."""
    user = f"<Instruct>: {DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {doc}"
    text = smol_tokenizer.apply_chat_template([{"role": "system", "content": JUDGE_SYSTEM},
                                               {"role": "user", "content": user}],
                                              add_generation_prompt=True, tokenize=False)
    ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    yes, no = smol_tokenizer.convert_tokens_to_ids(["yes", "no"])
    with torch.no_grad():
        logits = hf_smol(torch.tensor([ids])).logits[0, -1]
    return ids, float(torch.softmax(logits[[no, yes]].float(), -1)[1])


def test_backbone_reranker_chunked_equals_whole(reranking, hf_smol, smol_tokenizer):
    """The pairs are longer than a chunk (32 tokens): the score read after several steps equals one whole
    forward's."""
    reranker = reranking.reranker("backbone")
    got = reranking.score(QUERY, DOCS, RerankParams(reranker="backbone"))
    for doc, score in zip(DOCS, got):
        ids, want = backbone_reference(hf_smol, smol_tokenizer, QUERY, doc)
        assert reranker.pair(QUERY, doc, RerankParams()).token_ids == ids
        assert len(ids) > reranking.config.scheduler.max_chunk_tokens
        assert score == pytest.approx(want, abs=1e-4)


def test_backbone_pairs_share_cached_prefixes_and_score_the_same(reranking):
    """A query's pairs share the judging prompt and the query: later pairs start from the cached blocks (hits
    counted), and the scores equal an engine's without a prefix cache."""
    params = RerankParams(reranker="backbone")
    first = reranking.score(QUERY, DOCS, params)
    hits = reranking.block_manager.num_hit_tokens
    again = reranking.score(QUERY, DOCS, params)
    assert reranking.block_manager.num_hit_tokens > hits
    config = replace(reranking.config, cache=replace(reranking.config.cache, enable_prefix_caching=False),
                     model=replace(reranking.config.model, rerankers=["backbone"]))
    plain = Engine(config, reranking.runner.model, reranking.tokenizer)
    want = plain.score(QUERY, DOCS, params)
    assert first == pytest.approx(want, abs=1e-5) and again == pytest.approx(want, abs=1e-5)
    assert plain.block_manager.num_free_blocks == plain.block_manager.num_blocks


def test_scores_async_beside_generations(reranking):
    from orthrus_rag.engine.async_engine import AsyncEngine

    want = reranking.score(QUERY, DOCS, RerankParams(reranker="backbone"))

    async def main():
        async with AsyncEngine(reranking) as aengine:
            gen = asyncio.ensure_future(aengine.generate("Name a river:", SamplingParams(max_tokens=8)))
            scores = await aengine.score(QUERY, DOCS, RerankParams(reranker="backbone", priority=-1))
            with pytest.raises(ValueError, match="document is empty"):
                await aengine.score(QUERY, ["fine", " "], RerankParams(reranker="backbone"))
            return scores, await gen

    scores, gen = asyncio.run(main())
    assert scores == pytest.approx(want, abs=1e-5)
    assert gen.token_ids


@pytest.mark.parametrize("call, error, match", [
    (lambda e: e.score("", DOCS), ValueError, "query is empty"),
    (lambda e: e.score(QUERY, ["ok", "  "]), ValueError, "document is empty"),
    (lambda e: e.score(QUERY, "one string"), TypeError, "list of strings"),
    (lambda e: e.score(QUERY, [3]), TypeError, "document must be a string"),
    (lambda e: e.score(QUERY, DOCS, RerankParams(reranker="nope")), ValueError, "unknown reranker 'nope'"),
    (lambda e: e.score(QUERY, DOCS, RerankParams(instruction="judge")), ValueError, "takes no instruction"),
    (lambda e: e.score(" ".join(["long"] * 9000), DOCS, RerankParams(reranker="backbone")), ValueError,
     "query or instruction is too long"),
])
def test_bad_input_is_refused_and_nothing_stays_queued(reranking, call, error, match):
    with pytest.raises(error, match=match):
        call(reranking)
    assert not reranking.has_unfinished()


def test_an_engine_without_rerankers_says_so(engine):
    with pytest.raises(ValueError, match="loads no reranker"):
        engine.score(QUERY, DOCS)


def test_rerank_params_check_their_values():
    with pytest.raises(ValueError, match="instruction must not be empty"):
        RerankParams(instruction=" ")


@pytest.mark.slow
def test_backbone_reranker_under_an_adapter_reads_through_it():
    """`backbone+ADAPTER` scores under the adapter (its slot on every row of the pair): the same pairs read otherwise
    than on the bare backbone, and a name that is not loaded is refused before anything loads."""
    from orthrus_rag.config.engine import ModelConfig
    from tests.conftest import SMOL, engine_overrides

    engine = Engine.from_pretrained(SMOL, embedding_adapters="smollm2_embed",
                                    rerankers=["backbone", "backbone+smollm2_embed"], **engine_overrides())
    bare = engine.score(QUERY, DOCS, RerankParams(reranker="backbone"))
    adapted = engine.score(QUERY, DOCS, RerankParams(reranker="backbone+smollm2_embed"))
    assert engine.reranker("backbone+smollm2_embed").pair(QUERY, DOCS[0], RerankParams()).adapter_slot > 0
    assert all(0.0 <= s <= 1.0 for s in bare + adapted)
    assert max(abs(a - b) for a, b in zip(bare, adapted)) > 1e-4
    with pytest.raises(ValueError, match="names adapter 'nope', which is not loaded"):
        ModelConfig(rerankers=["backbone+nope"])
