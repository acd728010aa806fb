"""Request and response bodies of the OpenAI-compatible API (the shapes OpenAI documents).

Requests are strict pydantic models: every sampling field goes through the engine's one
validation (`tessel.engine.sampling_params.check_*`), so the HTTP API refuses exactly what
`SamplingParams` refuses; flags are strict booleans (`"stream": "yes"` is a 400); text must be
valid Unicode (no lone surrogates). Fields tessel does not implement (`tools`, `functions`,
`response_format`, `logit_bias`, penalties, ...) and unknown fields are refused with a 400 naming
them, unless sent at their no-op value (null, `presence_penalty: 0`, `tools: []`, ...), which
clients often do. `suffix` is refused too; `n` is 1 to `MAX_CHOICES`. `best_of` (OpenAI: generate
best_of candidates, return the n most likely) is not implemented: it is accepted only equal to `n`
(where it changes nothing), else refused naming it, `{"n": 2, "best_of": 1}` included. Completions take
`logprobs: k` and `echo`; chat takes `logprobs: true` with `top_logprobs: k` (k up to
`MAX_LOGPROBS`). `top_k` and `ignore_eos` are extensions that vLLM also accepts.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
    model_serializer,
    model_validator,
)

from tessel.engine.guided import spec as guided_spec
from tessel.engine.guided.spec import GuidedDecoding, InvalidGuidedDecoding
from tessel.engine.sampling_params import (
    InvalidSamplingParams,
    check_int,
    check_logprobs,
    check_max_tokens,
    check_seed,
    check_stop,
    check_temperature,
    check_top_k,
    check_top_p,
)
from tessel.server.tools import ToolSpec, check_tool_request, parse_tool_choice, parse_tools
from tessel.text import check_text

# OpenAI's documented default for /v1/completions; chat completions default to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_CHOICES = 16  # n: choices per request (each one is a sequence in the engine)
# Fields OpenAI's API has and tessel does not implement: accepted only at these no-op values (or null).
NO_OP_VALUES: dict[str, list[Any]] = {
    "presence_penalty": [0],
    "frequency_penalty": [0],
    "repetition_penalty": [1],
    "logit_bias": [{}],
    "functions": [[]],
    "function_call": ["none"],
    "store": [False],
}
_TOOL_FIELDS = {"functions", "function_call"}
_SHOWN_NAME_CHARS = 40


def _optional_text(name: str):
    return lambda value: None if value is None else check_text(value, name)


def _choices(value: Any) -> int:
    n = check_int(value, "n")
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidSamplingParams(f"n must be in [1, {MAX_CHOICES}], got {n if abs(n) < 10**6 else '...'}")
    return n


Temperature = Annotated[float, BeforeValidator(check_temperature)]
TopP = Annotated[float, BeforeValidator(check_top_p)]
TopK = Annotated[int, BeforeValidator(check_top_k)]
MaxTokens = Annotated[int | None, BeforeValidator(check_max_tokens)]
Seed = Annotated[int | None, BeforeValidator(check_seed)]
Stop = Annotated[list[str], BeforeValidator(check_stop)]
ModelName = Annotated[str | None, BeforeValidator(_optional_text("model"))]


def _shown(name: str) -> str:
    return repr(name[:_SHOWN_NAME_CHARS])


class RequestModel(BaseModel):
    """The base of every model read from a request body (here and in `tessel.server.embeddings`): known
    fields only, the others refused by name (`_refuse_unsupported`)."""

    model_config = ConfigDict(extra="forbid")
    what: ClassVar[str] = "the request"

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # pydantic reports the wrong type
        data = {key: value for key, value in data.items() if value is not None}  # null: the default
        if "n" in cls.model_fields:  # a request for choices: best_of is judged against its n
            _check_best_of(data)
            data.pop("best_of", None)
        unsupported = [
            key
            for key, value in data.items()
            if key not in cls.model_fields
            and not (key in NO_OP_VALUES and _is_no_op(value, NO_OP_VALUES[key]))
        ]
        if unsupported:
            names = ", ".join(_shown(str(key)) for key in unsupported[:10])
            why = (
                "the legacy functions API is not supported (use tools); "
                if _TOOL_FIELDS & set(unsupported)
                else ""
            )
            raise ValueError(
                f"{cls.what} has unsupported field(s) {names}: {why}tessel does not implement them"
            )
        return {key: value for key, value in data.items() if key in cls.model_fields}


def _check_best_of(data: dict[str, Any]) -> None:
    """`best_of` is a no-op only when it equals n (every candidate returned); refused otherwise."""
    if "best_of" not in data:
        return
    best_of, n = data["best_of"], data.get("n", 1)
    if type(best_of) is int and type(n) is int and best_of == n:
        return
    raise ValueError(
        f"best_of is {_shown_value(best_of)} but n is {_shown_value(n)}: tessel does not implement "
        "best_of (picking the n best of several candidates); leave it out or send best_of equal to n"
    )


def _shown_value(value: Any) -> str:
    if isinstance(value, bool | float) or (isinstance(value, int) and abs(value) < 10**6):
        return repr(value)
    return "a large number" if isinstance(value, int) else f"a {type(value).__name__}"


def _is_no_op(value: Any, no_ops: list[Any]) -> bool:
    return any(type(value) is type(no_op) and value == no_op for no_op in no_ops) or (
        isinstance(value, int | float) and not isinstance(value, bool) and value in no_ops
    )


class StreamOptions(RequestModel):
    what: ClassVar[str] = "stream_options"
    include_usage: StrictBool = False


def _response_format(value: Any) -> GuidedDecoding | None:
    """OpenAI's `response_format`: text (no guide), json_object, or json_schema {name, schema, strict}."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidGuidedDecoding("response_format must be an object with a type")
    kind = value["type"]
    if kind in ("text", "json_object") and set(value) == {"type"}:
        return None if kind == "text" else GuidedDecoding("json_object")
    if kind != "json_schema":
        raise InvalidGuidedDecoding(
            f"response_format {kind[:40]!r} with fields {sorted(value)} is not supported; "
            "use {type: text}, {type: json_object} or {type: json_schema, json_schema: {name, schema}}"
        )
    spec = value.get("json_schema")
    if set(value) != {"type", "json_schema"} or not isinstance(spec, dict) or "schema" not in spec:
        raise InvalidGuidedDecoding("response_format json_schema needs json_schema: {name, schema, strict}")
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise InvalidGuidedDecoding(f"response_format.json_schema has unknown field(s) {sorted(unknown)}")
    return guided_spec.json_schema(spec["schema"], "response_format.json_schema.schema")


def _guide(build: Any) -> Any:
    return BeforeValidator(lambda value: None if value is None else build(value))


class _SamplingFields(RequestModel):
    model: ModelName = None
    max_tokens: MaxTokens = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    n: Annotated[int, BeforeValidator(_choices)] = 1
    stop: Stop = Field(default_factory=list)
    seed: Seed = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    user: Annotated[str | None, BeforeValidator(_optional_text("user"))] = None  # OpenAI's end-user id
    # structured outputs: OpenAI's response_format, and vLLM's guided_* extensions (at most one)
    response_format: Annotated[GuidedDecoding | None, _guide(_response_format)] = None
    guided_json: Annotated[
        GuidedDecoding | None, _guide(lambda v: guided_spec.json_schema(v, "guided_json"))
    ] = None
    guided_regex: Annotated[GuidedDecoding | None, _guide(guided_spec.regex)] = None
    guided_choice: Annotated[GuidedDecoding | None, _guide(guided_spec.choice)] = None
    guided_grammar: Annotated[GuidedDecoding | None, _guide(guided_spec.lark)] = None

    @model_validator(mode="after")
    def _one_guide(self) -> _SamplingFields:
        given = [name for name in _GUIDE_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} both constrain the output: send one of them")
        return self

    def guided(self) -> GuidedDecoding | None:
        """What the output must match, from whichever guide field was sent."""
        return next((getattr(self, n) for n in _GUIDE_FIELDS if getattr(self, n) is not None), None)

    def stop_list(self) -> list[str]:
        return list(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


_GUIDE_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _prompt(prompt: Any) -> str | list[int]:
    """One prompt: a string, token ids, or a one-element list of either."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ValueError(f"got {len(prompt)} prompts: tessel takes one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        return check_text(prompt, "prompt")
    if not isinstance(prompt, list) or not all(type(t) is int for t in prompt):
        raise ValueError("the prompt must be a string or a list of token ids (integers)")
    if not prompt:
        raise ValueError("the prompt is empty")
    if min(prompt) < 0:
        raise ValueError("token ids must be non-negative")
    return prompt


class CompletionRequest(_SamplingFields):
    prompt: Annotated[str | list[int], BeforeValidator(_prompt)]
    echo: StrictBool = False
    logprobs: Annotated[int | None, BeforeValidator(check_logprobs)] = None
    suffix: Annotated[str | None, BeforeValidator(_optional_text("suffix"))] = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix


def _role(role: Any) -> str:
    if role not in CHAT_ROLES:
        shown = _shown(role) if isinstance(role, str) else type(role).__name__
        why = " (the legacy functions API is not supported; use tools)" if role == "function" else ""
        raise ValueError(f"role {shown} is not supported{why}; use one of {', '.join(CHAT_ROLES)}")
    return role


def _content(content: Any) -> str | None:
    """A message's text: a string, or a list of `{"type": "text", "text": ...}` parts joined; None only
    for an assistant message with tool calls (checked by `ChatMessage`)."""
    if content is None:
        return None
    if isinstance(content, str):
        return check_text(content, "content")
    if not isinstance(content, list):
        raise ValueError("content must be a string or a list of text parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            shown = _shown(kind) if isinstance(kind, str) else repr(type(kind).__name__)
            raise ValueError(f"content parts of type {shown} are not supported (text only)")
        extra = set(part) - {"type", "text"}
        if extra:
            raise ValueError(
                f"text parts take only type and text, not {', '.join(_shown(str(k)) for k in extra)}"
            )
        texts.append(check_text(part.get("text"), "content"))
    return "".join(texts)


def _message_tool_calls(value: Any) -> list[dict[str, Any]] | None:
    """An assistant's earlier calls: [{id, type: function, function: {name, arguments: JSON text}}]."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise ValueError("tool_calls must be a list")
    calls = []
    for call in value:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError("each tool call needs function: {name, arguments}")
        arguments = function.get("arguments", "{}")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise ValueError(f"tool call {function['name'][:64]!r} has arguments that are not JSON") from None
        entry = {
            "type": "function",
            "function": {"name": check_text(function["name"], "name"), "arguments": parsed},
        }
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        calls.append(entry)
    return calls


class ChatMessage(RequestModel):
    what: ClassVar[str] = "a message"

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("role") is not None:
            _role(data["role"])  # a `tool` message is refused for its role, before its tool_call_id
        return super()._refuse_unsupported(data)

    role: Annotated[str, BeforeValidator(_role)]
    content: Annotated[str | None, BeforeValidator(_content)] = None
    name: Annotated[str | None, BeforeValidator(_optional_text("name"))] = None
    tool_calls: Annotated[list[dict[str, Any]] | None, BeforeValidator(_message_tool_calls)] = None
    tool_call_id: Annotated[str | None, BeforeValidator(_optional_text("tool_call_id"))] = None

    @model_validator(mode="after")
    def _content_needed(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        return self.content or ""

    def template_dict(self) -> dict[str, Any]:
        """What the chat template sees: tool calls with their arguments as objects, as HF templates
        expect (OpenAI sends them as JSON text)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[int | None, BeforeValidator(lambda v: check_logprobs(v, "top_logprobs"))] = None
    tools: Annotated[list[ToolSpec], BeforeValidator(parse_tools)] = Field(default_factory=list)
    tool_choice: Annotated[str | None, BeforeValidator(parse_tool_choice)] = None
    parallel_tool_calls: StrictBool = True

    @model_validator(mode="after")
    def _fields_agree(self) -> ChatCompletionRequest:
        """top_logprobs needs logprobs; tool_choice names a given tool; one constraint on the output."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        check_tool_request(self.tools, self.chosen_tool())
        if self.chosen_tool() not in ("none", "auto") and self.guided() is not None:
            raise ValueError(
                f"tool_choice {self.chosen_tool()!r} and a response format both constrain the output"
            )
        return self

    def chosen_tool(self) -> str:
        """tool_choice: "none", "auto" (the default with tools), "required" or a function's name."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def calls_tools(self) -> bool:
        return bool(self.tools) and self.chosen_tool() != "none"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses ---------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: parallel lists over tokens; `None` for the first prompt token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallItem(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(ToolCallItem):
    index: int


class _WithoutNoToolCalls(BaseModel):
    """A message that leaves `tool_calls` out when there are none (as OpenAI's answers do)."""

    @model_serializer(mode="wrap")
    def _drop_absent_tool_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class AssistantMessage(_WithoutNoToolCalls):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallItem] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(_WithoutNoToolCalls):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tessel"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered with the template."""

    what: ClassVar[str] = "the request"
    model: ModelName = None
    prompt: Annotated[str | None, BeforeValidator(_optional_text("prompt"))] = None
    messages: list[ChatMessage] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(RequestModel):
    model: ModelName = None
    tokens: list[Annotated[int, BeforeValidator(lambda t: check_int(t, "tokens"))]]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
