"""/v1/embeddings: an encoder's server (vectors equal the Embedder's, which tests/models holds against
HF transformers), its request validation, fairness between a huge and a small request, and a decoder's
server answering 400."""

from __future__ import annotations

import base64
import json
import threading

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from bad_text import lone_surrogate_texts
from encoder_models import make_tiny_bert, oracle_embeddings
from tessel.models.embedder import Embedder
from tessel.server.embeddings import MAX_INPUTS, create_embedding_app
from tessel.server.limits import ServerLimits

pytestmark = pytest.mark.single_engine
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world!", "Attention is all you need."]


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return make_tiny_bert(tmp_path_factory.mktemp("enc") / "tiny-bert", max_seq_length=16)


@pytest.fixture(scope="module")
def client(encoder_dir):
    app = create_embedding_app(Embedder(encoder_dir, batch_size=2), limits=ServerLimits(max_prompt_chars=500))
    with TestClient(app) as client:
        yield client


def _vectors(body: dict) -> torch.Tensor:
    return torch.tensor([item["embedding"] for item in sorted(body["data"], key=lambda d: d["index"])])


def test_list_of_strings_matches_the_oracle(client, encoder_dir):
    response = client.post("/v1/embeddings", json={"input": TEXTS, "model": "tiny-bert"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == "tiny-bert"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert (_vectors(body) - oracle_embeddings(encoder_dir, TEXTS)).abs().max() < 1e-5
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > len(TEXTS)


def test_string_token_ids_and_base64_agree(client, encoder_dir):
    one = _vectors(client.post("/v1/embeddings", json={"input": TEXTS[0]}).json())
    ids = Embedder(encoder_dir).tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]
    flat = _vectors(client.post("/v1/embeddings", json={"input": ids}).json())
    nested = _vectors(client.post("/v1/embeddings", json={"input": [ids, ids]}).json())
    assert (one - flat).abs().max() < 1e-6 and (nested - one).abs().max() < 1e-6
    encoded = client.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, one[0].numpy())


@pytest.mark.parametrize(
    "body,message",
    [
        ({"input": []}, "must not be empty"),
        ({"input": ""}, "must not be empty"),
        ({"input": ["ok", 3]}, "not a mix"),
        ({"input": ["x"] * (MAX_INPUTS + 1)}, f"at most {MAX_INPUTS}"),
        ({"input": "word " * 40}, "at most 16"),
        ({"input": "a" * 501}, "at most 500"),
        ({"input": [10**9]}, "outside this model's vocabulary"),
        ({"input": "hi", "dimensions": 8}, "Matryoshka"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "temperature": 1}, "unsupported field"),
        ({"input": True}, "input must be"),
    ],
)
def test_bad_requests_get_400_naming_the_limit(client, body, message):
    response = client.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


@settings(max_examples=25, deadline=None)
@given(bad=lone_surrogate_texts(), position=st.integers(0, 2), items=st.integers(1, 3))
def test_a_lone_surrogate_is_a_400_naming_the_input(client, bad, position, items):
    """As /v1/completions and /v1/chat/completions answer it (issue 42): the one check of tessel.text."""
    text, refusal = bad
    inputs = [TEXTS[i % len(TEXTS)] for i in range(items)]
    inputs[position % items] = text
    body = json.dumps({"input": inputs[0] if items == 1 else inputs})  # ensure_ascii: "\\ud800" escapes
    response = client.post("/v1/embeddings", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input" and refusal in error["message"], error
    if items > 1:
        assert f"input[{position % items}] is not valid Unicode" in error["message"]


def test_unknown_model_404_and_text_routes_400(client):
    assert client.post("/v1/embeddings", json={"input": "hi", "model": "gpt"}).status_code == 404
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 400 and "encoder" in response.json()["error"]["message"]
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 16


def test_dimensions_with_matryoshka(encoder_dir):
    app = create_embedding_app(Embedder(encoder_dir, matryoshka=True))
    with TestClient(app) as client:
        full = _vectors(client.post("/v1/embeddings", json={"input": TEXTS}).json())
        short = _vectors(client.post("/v1/embeddings", json={"input": TEXTS, "dimensions": 8}).json())
        assert short.shape == (3, 8)
        assert (short - torch.nn.functional.normalize(full[:, :8], dim=1)).abs().max() < 1e-6
        assert client.post("/v1/embeddings", json={"input": "hi", "dimensions": 33}).status_code == 400


def test_a_small_request_is_not_held_behind_a_huge_one(encoder_dir, serve_in_thread, wait_until):
    import httpx

    embedder = Embedder(encoder_dir, batch_size=4)
    order: list[int] = []  # the batch sizes the model ran, in order: the small request is a batch of 1
    run_batch = embedder.run_batch

    def recording(ids):
        order.append(len(ids))
        return run_batch(ids)

    embedder.run_batch = recording
    huge = {"input": [f"{TEXTS[0]} {i}" for i in range(MAX_INPUTS)]}  # 512 batches of 4
    with serve_in_thread(create_embedding_app(embedder)) as url:
        results: dict[str, int] = {}

        def send_huge() -> None:
            results["huge"] = httpx.post(f"{url}/v1/embeddings", json=huge, timeout=120).status_code

        worker = threading.Thread(target=send_huge)
        worker.start()
        wait_until(lambda: len(order) >= 2, "the huge request to start")
        small = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS[1]}, timeout=120)
        assert small.status_code == 200
        worker.join(120)
    assert results["huge"] == 200
    assert order.index(1) < len(order) - 1  # the small request ran between the huge one's batches


def test_a_decoder_server_refuses_embeddings(tiny_model):
    from tessel.engine.llm_engine import LLMEngine
    from tessel.server.app import create_app

    with TestClient(create_app(LLMEngine(str(tiny_model), max_num_seqs=2))) as client:
        response = client.post("/v1/embeddings", json={"input": "hi"})
    assert response.status_code == 400
    assert "needs an encoder" in response.json()["error"]["message"]


def test_the_openai_client_gets_the_vectors(encoder_dir, serve_in_thread):
    openai = pytest.importorskip("openai")
    embedder = Embedder(encoder_dir)
    with serve_in_thread(create_embedding_app(embedder)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        response = client.embeddings.create(model="tiny-bert", input=TEXTS)  # base64 on the wire
    vectors = torch.tensor([item.embedding for item in response.data])
    assert (vectors - embedder.embed(TEXTS)).abs().max() == 0
    assert response.usage.prompt_tokens > 0
