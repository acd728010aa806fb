"""A real model behind `tessel serve` (a child process) as applications use it: the `openai` client's
`chat.completions.parse` with a pydantic model, and a tool-calling round trip (call, tool result,
final answer), streamed and not.

SmolLM2's own chat template renders no tools, so it is served with a Qwen 2.5 (Hermes) template
(tests/server/data/hermes_tools.jinja) beside its weights. Oracles: `jsonschema` validates the parsed
object and every call's arguments against the tool's parameters; transformers' chat template
rendering of the same conversation gives the prompt's token count; the streamed calls equal the
non-streamed ones (greedy).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("llguidance")

from serve_process import serve_process  # noqa: E402

pytestmark = pytest.mark.slow  # a server process with a 135M model: ~30 s

TEMPLATE = Path(__file__).parent / "data" / "hermes_tools.jinja"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    },
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: float = pydantic.Field(ge=0, le=50)
    landmarks: list[str] = pydantic.Field(max_length=3)


@pytest.fixture(scope="module")
def hermes_model(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("smollm2-hermes") / "smollm2-hermes"
    model.mkdir()
    for name in MODEL_FILES:
        (model / name).symlink_to(smollm2_dir / name)
    shutil.copy(TEMPLATE, model / "chat_template.jinja")
    return model


@pytest.fixture(scope="module")
def client(hermes_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serve_process(hermes_model, log, "--max-model-len", "2048", "--max-num-seqs", "4") as served:
        yield openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0, timeout=120.0)


def test_parse_a_pydantic_model(client: Any) -> None:
    completion = client.chat.completions.parse(
        model="smollm2-hermes",
        messages=[{"role": "user", "content": "Tell me about Paris as JSON."}],
        response_format=City,
        max_tokens=200,
        temperature=0,
    )
    city = completion.choices[0].message.parsed
    assert isinstance(city, City), completion
    jsonschema.validate(city.model_dump(), City.model_json_schema())


def _check_call(call: Any) -> dict[str, Any]:
    parameters = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, parameters[call.function.name])
    return {"name": call.function.name, "arguments": arguments}


def _streamed_calls(client: Any, **kw: Any) -> tuple[list[dict[str, Any]], str | None, str]:
    calls: dict[int, dict[str, Any]] = {}
    content, reason = "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            reason = choice.finish_reason or reason
    whole = [{"name": c["name"], "arguments": json.loads(c["arguments"])} for _, c in sorted(calls.items())]
    return whole, reason, content


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_tool_round_trip(client: Any, hermes_model: Path, tool_choice: Any) -> None:
    from transformers import AutoTokenizer

    kw = dict(model="smollm2-hermes", messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, temperature=0)
    kw.update(max_tokens=120, parallel_tool_calls=False)
    first = client.chat.completions.create(**kw).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    calls = [_check_call(call) for call in first.message.tool_calls]
    assert len(calls) == 1
    if tool_choice != "required":
        assert calls[0]["name"] == "get_weather"
    streamed, reason, content = _streamed_calls(client, **kw)
    assert (streamed, reason, content) == (calls, "tool_calls", "")

    call = first.message.tool_calls[0]
    conversation = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    final = client.chat.completions.create(
        model="smollm2-hermes", messages=conversation, tools=TOOLS, max_tokens=40, temperature=0
    )
    assert final.choices[0].message.content
    tokenizer = AutoTokenizer.from_pretrained(hermes_model)
    rendered = [*conversation[:1], {**conversation[1], "tool_calls": [_template_call(call)]}, conversation[2]]
    expected = tokenizer.apply_chat_template(
        rendered, tools=TOOLS, add_generation_prompt=True, return_dict=False
    )
    assert final.usage.prompt_tokens == len(expected)


def _template_call(call: Any) -> dict[str, Any]:
    """A call as HF chat templates take it: arguments as an object."""
    return {
        "type": "function",
        "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
    }


def test_auto_parses_what_the_model_chose(client: Any) -> None:
    """With tool_choice auto nothing is forced: a call in the reply is parsed out (to a known tool),
    and the content keeps no call block."""
    reply = client.chat.completions.create(
        model="smollm2-hermes", messages=QUESTION, tools=TOOLS, max_tokens=80, temperature=0
    ).choices[0]
    names = {tool["function"]["name"] for tool in TOOLS}
    assert all(call.function.name in names for call in reply.message.tool_calls or [])
    assert reply.message.tool_calls or reply.message.content
    assert "</tool_call>" not in (reply.message.content or "")
