"""Tool calling: the tools a chat request offers, the grammar that forces a call, and the calls
parsed back out of the model's text (whole, or as a stream of deltas).

Two output formats, chosen by what the model's chat template writes:
- `hermes` (Hermes, Qwen 2.5 / 3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call, text allowed around them;
- `llama3_json` (Llama 3.1 / 3.2 JSON tool calling): the whole reply is
  `{"name": ..., "parameters": {...}}`.
`tool_choice: "required"` and a named function are guaranteed by guided decoding: a Lark grammar
that admits only calls to the allowed tools with arguments that match their JSON schemas.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from tessel.engine.guided.spec import GuidedDecoding, InvalidGuidedDecoding, json_schema
from tessel.errors import TesselError

ToolFormat = Literal["hermes", "llama3_json"]
MAX_TOOLS = 128  # tools per request (OpenAI's limit)
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
# a forced call is written as chat templates write calls (jinja's tojson: Python's json.dumps spacing)
_AS_TEMPLATES_WRITE_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema of the arguments

    def template_dict(self) -> dict[str, Any]:
        """What a chat template's `tools` sees (OpenAI's shape, as HF templates expect)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """How a request's tool calls are written and parsed; `grammar` forces one (required / named)."""

    format: ToolFormat
    names: set[str]
    grammar: GuidedDecoding | None


def tool_calling(tools: list[ToolSpec], choice: str, parallel: bool, tokenizer: Any) -> ToolCalling:
    fmt = tool_format(tokenizer)
    grammar = None if choice == "auto" else forced_grammar(tools, choice, fmt, parallel)
    return ToolCalling(fmt, {tool.name for tool in tools}, grammar)


def parse_tools(value: Any) -> list[ToolSpec]:
    if not isinstance(value, list):
        raise ValueError("tools must be a list of {type: function, function: {...}} objects")
    if len(value) > MAX_TOOLS:
        raise ValueError(f"tools has {len(value)} entries; at most {MAX_TOOLS}")
    tools = [_tool(i, item) for i, item in enumerate(value)]
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise ValueError("tools must have distinct function names")
    return tools


def _tool(index: int, item: Any) -> ToolSpec:
    where = f"tools[{index}]"
    if (
        not isinstance(item, dict)
        or item.get("type") != "function"
        or not isinstance(item.get("function"), dict)
    ):
        raise ValueError(f"{where} must be {{type: 'function', function: {{name, parameters}}}}")
    if set(item) - {"type", "function"}:
        raise ValueError(f"{where} takes only type and function")
    function = item["function"]
    unknown = set(function) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise ValueError(f"{where}.function has unsupported field(s) {', '.join(sorted(map(repr, unknown)))}")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise ValueError(f"{where}.function.name is required: 1 to 64 letters, digits, _ or -")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.function.description must be a string")
    parameters = function.get("parameters", _ANY_OBJECT)
    json_schema(parameters, f"{where}.function.parameters")  # size and depth limits
    return ToolSpec(name, description, parameters)


def parse_tool_choice(value: Any) -> str:
    """ "none", "auto", "required", or the name of the one function to call."""
    if value in ("none", "auto", "required"):
        return value
    if (
        isinstance(value, dict)
        and value.get("type") == "function"
        and isinstance(value.get("function"), dict)
        and isinstance(value["function"].get("name"), str)
    ):
        return value["function"]["name"]
    raise ValueError('tool_choice must be "none", "auto", "required" or {type: function, function: {name}}')


def tool_format(tokenizer: Any) -> ToolFormat:
    """How this model writes tool calls, read from its chat template; refused if it takes no tools."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tools" not in template:
        raise TesselError(
            "this model's chat template does not render tools, so it cannot be asked to call them; "
            "serve a model whose template supports tools (Qwen 2.5, Hermes, Llama 3.1)"
        )
    return "hermes" if HERMES_OPEN in template else "llama3_json"


def forced_grammar(tools: list[ToolSpec], choice: str, fmt: ToolFormat, parallel: bool) -> GuidedDecoding:
    """A grammar admitting only calls to `choice` ("required": any of `tools`) with valid arguments."""
    chosen = tools if choice == "required" else [tool for tool in tools if tool.name == choice]
    arguments = "arguments" if fmt == "hermes" else "parameters"
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, arguments: tool.parameters},
            "required": ["name", arguments],
            "additionalProperties": False,
        }
        for tool in chosen
    ]
    schema = json.dumps({"anyOf": calls, "x-guidance": _AS_TEMPLATES_WRITE_JSON})
    if fmt == "llama3_json":
        return GuidedDecoding("lark", f"start: %json {schema}")
    repeat = ' ("\\n" call)*' if parallel and choice == "required" else ""
    call = f'call: "{HERMES_OPEN}\\n" %json {schema} "\\n{HERMES_CLOSE}"'
    return GuidedDecoding("lark", f"start: call{repeat}\n{call}")


def check_tool_request(tools: list[ToolSpec], choice: str) -> None:
    if choice in ("none", "auto"):
        return
    if not tools:
        raise InvalidGuidedDecoding(f"tool_choice {choice!r} needs tools")
    if choice != "required" and choice not in {tool.name for tool in tools}:
        raise InvalidGuidedDecoding(
            f"tool_choice names function {choice[:64]!r}, which is not among the tools"
        )


def parse_tool_calls(text: str, fmt: ToolFormat, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(the text left as content, or None; the calls to known tools) from a finished reply."""
    if fmt == "llama3_json":
        call = _call(text.strip(), names)
        return (None, [call]) if call is not None else (text, [])
    calls, content = [], text
    for match in _HERMES_BLOCK.finditer(text):
        call = _call(match.group(1), names)
        if call is not None:
            calls.append(call)
            content = content.replace(match.group(0), "", 1)
    if not calls:
        return text, []
    return (content.strip() or None), calls


def _call(text: str, names: set[str]) -> ToolCall | None:
    try:
        body = json.loads(text)
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("name") not in names:
        return None
    arguments = body.get("arguments", body.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        return ToolCall(_call_id(), body["name"], arguments)
    return ToolCall(_call_id(), body["name"], json.dumps(arguments, ensure_ascii=False))


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """Splits a streamed reply into content deltas and whole tool calls as they complete.

    Text that may still be the start of a call (a prefix of `<tool_call>`; with `llama3_json`, a reply
    that begins with `{`) is held back until it is sure either way; each call is sent whole (name and
    all its arguments in one delta), as vLLM's parsers do once a call is complete.
    """

    def __init__(self, fmt: ToolFormat, names: set[str]) -> None:
        self._fmt, self._names = fmt, names
        self._held = ""
        self._started = False  # llama3_json: the reply's first character has been seen
        self._json_reply = False
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """The content that is now sure not to be a call, and the calls completed by `delta`."""
        self._held += delta
        if self._fmt == "llama3_json":
            return self._feed_json()
        content, calls = "", []
        while True:
            start = self._held.find(HERMES_OPEN)
            if start < 0:
                keep = _partial_prefix(self._held, HERMES_OPEN)
                content += self._held[: len(self._held) - keep]
                self._held = self._held[len(self._held) - keep :]
                break
            content += self._held[:start]
            self._held = self._held[start:]
            end = self._held.find(HERMES_CLOSE)
            if end < 0:
                break
            block, self._held = self._held[: end + len(HERMES_CLOSE)], self._held[end + len(HERMES_CLOSE) :]
            _, found = parse_tool_calls(block, "hermes", self._names)
            if found:
                calls.extend(found)
            else:
                content += block
        self.calls.extend(calls)
        return content, calls

    def _feed_json(self) -> tuple[str, list[ToolCall]]:
        if not self._started and self._held.strip():
            self._started = True
            self._json_reply = self._held.lstrip().startswith("{")
        if not self._started or self._json_reply:
            return "", []
        content, self._held = self._held, ""
        return content, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the reply: the held text as content, or the call it was."""
        held, self._held = self._held, ""
        if self._fmt == "llama3_json" and self._json_reply:
            content, calls = parse_tool_calls(held, "llama3_json", self._names)
            self.calls.extend(calls)
            return content or "", calls
        return held, []


def _partial_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag` (0: none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
