"""The shipped SmolLM2 embedding adapter is a loadable PEFT LoRA for SmolLM2's shapes, with its pooling card."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import orthrus_rag
from orthrus_rag.layers.lora import load_peft_adapter
from orthrus_rag.params import PoolingParams

ADAPTER = Path(orthrus_rag.__file__).parent / "adapters" / "smollm2_embed"


def test_adapter_folder_loads_with_its_card() -> None:
    adapter = load_peft_adapter(ADAPTER)
    assert adapter.rank == 8 and adapter.scaling == 2.0
    assert len(adapter.weights) == 30 * 7  # 30 layers x q/k/v/o/gate/up/down
    a, b = adapter.weights["model.layers.0.mlp.gate_proj"]
    assert a.shape == (8, 576) and b.shape == (1536, 8) and b.abs().sum() > 0  # trained: B is not zero
    card = json.loads((ADAPTER / "orthrus_embedding.json").read_text())
    assert card == {"pooling": "mean", "normalize": True, "query_instruction": "query: ",
                    "document_instruction": "passage: ", "append_eos": False}
    assert sum(f.stat().st_size for f in ADAPTER.iterdir()) <= 10 * 2**20


# ---- its prefixes, applied by the engine ----------------------------------------------------------------------
def test_the_space_fills_in_an_adapters_prefix_by_input_type() -> None:
    from orthrus_rag.params import EmbeddingSpace, PoolingParams

    space = EmbeddingSpace("m", "enc", ("a",), {"a": 1}, adapter_prefixes={"a": {"query": "q: ", "document": "d: "}})
    assert space.formatted(PoolingParams(adapter="a", input_type="query")).instruction == "q: "
    assert space.formatted(PoolingParams(adapter="a", input_type="document")).instruction == "d: "
    assert space.formatted(PoolingParams(adapter="a", input_type="query", instruction="x")).instruction == "x"
    assert space.formatted(PoolingParams(adapter="a")).instruction is None  # no input type: as given
    assert space.formatted(PoolingParams(input_type="query")).instruction is None  # the encoder: no card
    once = space.formatted(PoolingParams(adapter="a", input_type="query"))
    assert space.formatted(once) == once
    with pytest.raises(ValueError, match="unknown input_type 'passage'"):
        PoolingParams(input_type="passage")


@pytest.fixture(scope="module")
def backbone():
    """SmolLM2 with the shipped adapter, by its name (as `model=smollm2_backbone` loads it), behind a server."""
    from types import SimpleNamespace

    from orthrus_rag import Engine
    from orthrus_rag.engine.async_engine import AsyncEngine
    from orthrus_rag.entrypoints.openai import ServerThread
    from tests.conftest import SMOL, engine_overrides

    engine = Engine.from_pretrained(SMOL, embedding_adapters="smollm2_embed", **engine_overrides())
    texts = ["Who directed the film Lion's Gate?", "Lion's Gate is a 1982 film directed by Ada Moss."]
    want = {kind: [o.embedding.clone() for o in engine.embed(texts, PoolingParams(instruction=prefix))]
            for kind, prefix in (("query", "query: "), ("document", "passage: "), (None, None))}
    typed = {kind: [o.embedding.clone() for o in engine.embed(texts, PoolingParams(input_type=kind))]
             for kind in ("query", "document")}
    server = ServerThread(AsyncEngine(engine), default_max_tokens=8)  # NOTE: the engine is the server's from here
    yield SimpleNamespace(engine=engine, server=server, texts=texts, want=want, typed=typed)
    server.stop()


@pytest.mark.slow
def test_the_engine_prefixes_queries_and_documents_for_the_adapter(backbone) -> None:
    engine, want = backbone.engine, backbone.want
    assert engine.embedding_space.adapter_prefixes == {"smollm2_embed": {"query": "query: ", "document": "passage: "}}
    for kind in ("query", "document"):
        assert all(torch.equal(got, w) for got, w in zip(backbone.typed[kind], want[kind]))
    assert not torch.allclose(want["query"][0], want[None][0])  # the prefix changes the vector


@pytest.mark.slow
def test_over_http_the_server_prefixes_by_input_type(backbone) -> None:
    import openai
    from orthrus_rag.retrievers import EngineEmbedder

    from orthrus_rag.engine.clients.remote import RemoteClient
    from orthrus_rag.integrations.langchain import OrthrusEmbeddings

    texts, want = backbone.texts, backbone.want
    client = openai.OpenAI(base_url=backbone.server.url, api_key="unused", max_retries=0)
    cards = {c.id: c for c in client.models.list()}
    assert cards["smollm2_embed"].input_prefixes == {"query": "query: ", "document": "passage: "}
    # the base model's name embeds under the default adapter (there is no encoder): its card says so too
    assert cards["smollm2-135m-instruct"].input_prefixes == cards["smollm2_embed"].input_prefixes
    for kind in ("query", "document", None):
        body = {"input_type": kind} if kind else None
        out = client.embeddings.create(model="smollm2_embed", input=texts, extra_body=body)
        np.testing.assert_allclose([d.embedding for d in out.data], torch.stack(want[kind]).numpy(), atol=1e-5)
    lc = OrthrusEmbeddings(base_url=backbone.server.url, model="smollm2_embed")
    np.testing.assert_allclose(lc.embed_query(texts[0]), want["query"][0].numpy(), atol=1e-5)
    np.testing.assert_allclose(lc.embed_documents(texts[1:]), torch.stack(want["document"][1:]).numpy(), atol=1e-5)
    remote = RemoteClient(backbone.server.url)
    embedder = EngineEmbedder(remote, PoolingParams(adapter="smollm2_embed", input_type="document"),
                              PoolingParams(adapter="smollm2_embed", input_type="query"))
    assert embedder.identity["document_instruction"] == "passage: "  # what an in-process embedder records too
    assert embedder.identity["query_instruction"] == "query: "
    np.testing.assert_allclose(embedder.embed_query(texts[0]), want["query"][0].numpy(), atol=1e-5)


def test_model_smollm2_backbone_embeds_with_the_shipped_adapter(tmp_path) -> None:
    from types import SimpleNamespace

    from orthrus_rag.entrypoints.checks import validate
    from orthrus_rag.entrypoints.embedding import pooling_of
    from tests.test_app_config import _compose

    cfg = _compose("model=smollm2_backbone", f"run_dir={tmp_path}")
    validate(cfg)
    assert list(cfg.model.embedding_adapters) == ["smollm2_embed"]
    doc, query = pooling_of(cfg, SimpleNamespace(embedding_space=None))
    assert (doc.input_type, query.input_type, query.priority) == ("document", "query", -1)
