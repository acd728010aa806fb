"""Tool calls written the way a chat template writes them parse back to the calls that were rendered,
whole or streamed in any split; the grammar that forces a call accepts exactly such calls.

Oracles: HF transformers renders assistant tool calls through a Hermes / Qwen 2.5 chat template
(tests/server/data/hermes_tools.jinja); llguidance's own matcher judges the forcing grammar.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
llguidance = pytest.importorskip("llguidance")
pytest.importorskip("llguidance.hf")

from tessel.server.tools import (  # noqa: E402
    ToolCallStream,
    ToolSpec,
    forced_grammar,
    parse_tool_calls,
    parse_tools,
    tool_format,
)

HERMES_TEMPLATE = (Path(__file__).parent / "data" / "hermes_tools.jinja").read_text()
TOOLS = parse_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                    "required": ["city"],
                },
            },
        },
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
    ]
)
NAMES = {tool.name for tool in TOOLS}
CALLS = [
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}},
    {"name": "add", "arguments": {"a": 1, "b": [2, 3], "note": "x </tool_call"}},
]


@pytest.fixture(scope="module")
def tokenizer(checkpoints: Any) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoints("llama"))
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import tiny_models

    root = tmp_path_factory.mktemp("checkpoints")
    return lambda name: tiny_models.variant_checkpoint(root, name)


def _rendered_reply(tokenizer: Any, calls: list[dict[str, Any]], content: str | None) -> str:
    """The assistant turn as the template writes it, without its role header and end marker."""
    tool_calls = [{"type": "function", "function": call} for call in calls]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": content, "tool_calls": tool_calls},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[t.template_dict() for t in TOOLS], tokenize=False)
    reply = text.rsplit("<|assistant|>\n" if "<|assistant|>" in text else "<|im_start|>assistant", 1)[1]
    return reply.removesuffix("<|im_end|>\n").lstrip("\n")


def _as_dicts(calls: list[Any]) -> list[dict[str, Any]]:
    return [{"name": call.name, "arguments": json.loads(call.arguments)} for call in calls]


@pytest.mark.parametrize("content", [None, "Let me check."])
def test_template_rendered_calls_parse_back(tokenizer: Any, content: str | None) -> None:
    reply = _rendered_reply(tokenizer, CALLS, content)
    assert tool_format(tokenizer) == "hermes"
    parsed_content, calls = parse_tool_calls(reply, "hermes", NAMES)
    assert _as_dicts(calls) == CALLS
    assert parsed_content == content
    assert len({call.id for call in calls}) == len(calls)


def test_streamed_in_any_split_gives_the_same_calls(tokenizer: Any) -> None:
    reply = _rendered_reply(tokenizer, CALLS, "Let me check.")
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(reply)), 6))
        pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)], strict=True)]
        stream, content = ToolCallStream("hermes", NAMES), ""
        for piece in pieces:
            text, _ = stream.feed(piece)
            content += text
        content += stream.finish()[0]
        assert _as_dicts(stream.calls) == CALLS
        assert content.strip() == "Let me check."


def test_text_that_only_looks_like_a_call_stays_content() -> None:
    text = "Use <tool_call> tags like <tool_call>{not json}</tool_call> or <tool_"
    assert parse_tool_calls(text, "hermes", NAMES) == (text, [])
    stream = ToolCallStream("hermes", NAMES)
    streamed = "".join(stream.feed(c)[0] for c in text) + stream.finish()[0]
    assert streamed == text and stream.calls == []


def test_llama3_json_calls() -> None:
    reply = json.dumps({"name": "get_weather", "parameters": {"city": "Oslo"}})
    content, calls = parse_tool_calls(reply, "llama3_json", NAMES)
    assert content is None and _as_dicts(calls) == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert parse_tool_calls("Just text.", "llama3_json", NAMES) == ("Just text.", [])
    stream = ToolCallStream("llama3_json", NAMES)
    assert stream.feed(reply[:10]) == ("", [])
    assert stream.feed(reply[10:]) == ("", [])
    assert _as_dicts(stream.finish()[1]) == _as_dicts(calls)


def _matcher(tokenizer: Any, grammar: str) -> Any:
    llg_tokenizer = llguidance.hf.from_tokenizer(
        tokenizer, n_vocab=len(tokenizer), eos_token=tokenizer.eos_token_id
    )
    return llguidance.LLMatcher(llg_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))


def _accepts(tokenizer: Any, grammar: str, text: str) -> bool:
    matcher = _matcher(tokenizer, grammar)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_forcing_grammar_accepts_the_templates_calls(tokenizer: Any) -> None:
    reply = _rendered_reply(tokenizer, CALLS[:1], None)
    first_call = reply.strip()
    both = _rendered_reply(tokenizer, CALLS, None).strip()
    required = forced_grammar(TOOLS, "required", "hermes", parallel=True).spec
    assert _accepts(tokenizer, required, first_call)
    assert _accepts(tokenizer, required, both)
    assert not _accepts(tokenizer, forced_grammar(TOOLS, "required", "hermes", parallel=False).spec, both)
    named = forced_grammar(TOOLS, "add", "hermes", parallel=True).spec
    assert not _accepts(tokenizer, named, first_call)  # get_weather is not the named function
    bad_arguments = first_call.replace('"city": "Paris", ', "")  # the required city is missing
    assert not _accepts(tokenizer, required, bad_arguments)


def test_tool_specs_are_checked() -> None:
    with pytest.raises(ValueError, match="name is required"):
        parse_tools([{"type": "function", "function": {"parameters": {}}}])
    with pytest.raises(ValueError, match="distinct"):
        parse_tools([TOOLS[0].template_dict(), TOOLS[0].template_dict()])
    assert parse_tools([TOOLS[1].template_dict()]) == [ToolSpec("add", None, {"type": "object"})]
