"""Structured outputs, tool-call refusals and /tokenize over a live server, once per engine kind
(conftest: one process; a 2-stage pipeline, whose last stage applies the mask; the replicas router).

The model is tiny and random: only the grammar makes its outputs valid. Oracles: `jsonschema`
validates each output; the `openai` client's own `parse()` builds the pydantic object; transformers'
tokenizer and chat template give /tokenize's ids.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pydantic = pytest.importorskip("pydantic")

MAX_TOKENS = 120
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person."}]


class Point(pydantic.BaseModel):
    x: int = pydantic.Field(ge=-5, le=5)
    y: int = pydantic.Field(ge=-5, le=5)
    label: str = pydantic.Field(max_length=6)


@pytest.fixture(scope="module")
def engine(make_engine: Any) -> Any:
    with make_engine(max_num_seqs=4, max_model_len=512, kv_cache_gib=0.01) as engine:
        yield engine


@pytest.fixture(scope="module")
def served(engine: Any, serve_engine: Any) -> Any:
    with serve_engine(engine, max_pending=8) as served:
        yield served


@pytest.fixture(scope="module")
def client(served: Any) -> Any:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0, timeout=60.0)


@pytest.fixture(scope="module")
def model(tiny_model: Any) -> str:
    return tiny_model.name


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_chat_json_schema_streamed_and_not(client: Any, served: Any, model: str) -> None:
    kw = dict(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, response_format=_schema_format(PERSON))
    for seed in range(3):
        reply = client.chat.completions.create(**kw, temperature=1.0, seed=seed).choices[0]
        assert reply.finish_reason == "stop"
        jsonschema.validate(json.loads(reply.message.content), PERSON)
    whole = client.chat.completions.create(**kw, temperature=0.0).choices[0].message.content
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(**kw, temperature=0.0, stream=True)
        if chunk.choices
    )
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), PERSON)
    served.wait_idle()


def test_parse_with_a_pydantic_model(client: Any, model: str) -> None:
    completion = client.chat.completions.parse(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, response_format=Point, temperature=1.0, seed=7
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Point)
    jsonschema.validate(parsed.model_dump(), Point.model_json_schema())


def test_completions_guided_extensions(client: Any, model: str) -> None:
    kw = dict(model=model, prompt="The answer is", max_tokens=MAX_TOKENS, temperature=1.0, seed=3)
    text = client.completions.create(**kw, extra_body={"guided_json": PERSON}).choices[0].text
    jsonschema.validate(json.loads(text), PERSON)
    text = (
        client.completions.create(**kw, extra_body={"guided_regex": r"[A-Z][a-z]{2,5} [0-9]{2}"})
        .choices[0]
        .text
    )
    assert re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", text), text
    text = client.completions.create(**kw, extra_body={"guided_choice": ["left", "right"]}).choices[0].text
    assert text in ("left", "right")
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(**kw, stream=True, extra_body={"guided_json": PERSON})
        if c.choices
    )
    jsonschema.validate(json.loads(streamed), PERSON)


def test_n_choices_each_follow_the_schema(client: Any, model: str) -> None:
    reply = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        n=3,
        seed=11,
        response_format=_schema_format(PERSON),
    )
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def _deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.single_engine
@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"response_format": _schema_format({"type": "nonsense"})}, "nonsense"),
        ({"response_format": _schema_format(_deep(40))}, "max_schema_depth"),
        ({"response_format": _schema_format({"description": "x" * 70_000})}, "max_schema_chars"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        ({"response_format": {"type": "yaml"}}, "yaml"),
        ({"guided_regex": "[0-9]+", "guided_choice": ["a"]}, "guided_regex and guided_choice"),
        ({"guided_grammar": "start: (("}, "guide decoding"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "name is required"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "not among the tools",
        ),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "chat template"),  # no tools in it
    ],
)
def test_bad_guides_and_tools_are_400(served: Any, fields: dict[str, Any], named: str) -> None:
    body = {"messages": MESSAGES, "max_tokens": 4, **fields}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60.0)
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"]


@pytest.mark.single_engine
def test_a_dead_end_grammar_finishes_with_its_reason(served: Any) -> None:
    body = {"prompt": "hi", "max_tokens": 50, "guided_grammar": 'start: "ab" A\nA: /[a-z]/ & /[0-9]/'}
    response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60.0)
    choice = response.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("ab", "grammar_dead_end")
    served.wait_idle()


@pytest.mark.in_process_engine
def test_tokenize_and_detokenize(served: Any, engine: Any) -> None:
    tokenizer = engine.tokenizer
    prompt = "Hello world! How are you"
    answer = httpx.post(f"{served.url}/tokenize", json={"prompt": prompt}).json()
    assert answer["tokens"] == tokenizer(prompt)["input_ids"] and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == 512
    chat = httpx.post(f"{served.url}/tokenize", json={"messages": MESSAGES}).json()
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert chat["tokens"] == list(expected)
    back = httpx.post(f"{served.url}/detokenize", json={"tokens": answer["tokens"]}).json()
    assert back["prompt"] == tokenizer.decode(answer["tokens"])
    bad = httpx.post(f"{served.url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
