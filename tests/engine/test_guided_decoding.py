"""Guided decoding in the engine (`tessel.engine.guided`), on a tiny random model: the grammar, not
the model, must make every output valid.

Oracles: `jsonschema` validates every JSON output against its schema; llguidance's own matcher,
built fresh from the grammar, accepts every output's token ids; `re.fullmatch` for regexes;
llguidance's `apply_token_bitmask_inplace` for the sampler's mask.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")
pytest.importorskip("llguidance.hf")
torch = pytest.importorskip("torch")

from tessel.engine.guided.decoder import GRAMMAR_DEAD_END  # noqa: E402
from tessel.engine.guided.spec import (  # noqa: E402
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    GuidedDecoding,
    InvalidGuidedDecoding,
    choice,
    json_schema,
    lark,
    regex,
)
from tessel.engine.sampling_params import SamplingParams  # noqa: E402
from tessel.layers.sampler import apply_token_bitmask  # noqa: E402

# bounded schemas: every value has a bounded length, so each output completes within MAX_TOKENS
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["tags", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"enum": [1, 2]}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"type": "string", "pattern": "^[a-z]{1,4}$"},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
]
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def llm(checkpoints: Any) -> Any:
    from tessel.engine.llm_engine import LLM

    return LLM(str(checkpoints("llama")), max_model_len=256, kv_cache_gib=0.01)


def _accepted_by_fresh_matcher(llm: Any, guided: GuidedDecoding, token_ids: list[int]) -> bool:
    tokenizer = llguidance.hf.from_tokenizer(
        llm.tokenizer, n_vocab=llm.model_config.vocab_size, eos_token=sorted(llm.eos_token_ids)
    )
    matcher = llguidance.LLMatcher(tokenizer, guided.grammar())
    return matcher.try_consume_tokens(token_ids) == len(token_ids) and matcher.is_accepting()


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_outputs_validate(llm: Any, schema: dict[str, Any]) -> None:
    guided = json_schema(schema)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s, guided=guided) for s in range(4)]
    for output in llm.generate(["Once upon a time"] * 4, params):
        assert output.finish_reason == "stop", output
        jsonschema.validate(json.loads(output.text), schema)
        assert _accepted_by_fresh_matcher(llm, guided, output.token_ids)
    assert llm.guided._matchers == {}  # finished requests release their matchers


def test_regex_choice_and_json_object(llm: Any) -> None:
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    outputs = llm.generate(
        ["The code is"] * 3,
        [
            SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1, guided=regex(pattern)),
            SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=2, guided=choice(["yes", "no way"])),
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, guided=GuidedDecoding("json_object")),
        ],
    )
    assert re.fullmatch(pattern, outputs[0].text), outputs[0].text
    assert outputs[1].text in ("yes", "no way")
    if outputs[2].finish_reason == "stop":  # any object: only max_tokens bounds it
        assert isinstance(json.loads(outputs[2].text), dict)
    assert outputs[2].text.startswith("{")


def test_guided_and_free_requests_share_a_batch(llm: Any) -> None:
    """A free request batched with guided ones samples exactly as it does alone (greedy)."""
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.generate(["The cat sat"], free)[0].token_ids
    guided = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, guided=json_schema(SCHEMAS[0]))
    together = llm.generate(["The cat sat", "Hello"], [free, guided])
    assert together[0].token_ids == alone
    jsonschema.validate(json.loads(together[1].text), SCHEMAS[0])


def test_a_grammar_no_token_can_satisfy_ends_with_a_finish_reason(llm: Any) -> None:
    empty = lark('start: "ab" A\nA: /[a-z]/ & /[0-9]/')  # after "ab": a letter that is a digit
    output = llm.generate(["hi"], SamplingParams(max_tokens=50, guided=empty))[0]
    assert output.finish_reason == GRAMMAR_DEAD_END
    assert output.text == "ab"


def test_recursive_schema_is_supported(llm: Any) -> None:
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer", "minimum": 0, "maximum": 9},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["v"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    }
    output = llm.generate(
        ["tree:"], SamplingParams(max_tokens=200, temperature=0.0, guided=json_schema(tree))
    )[0]
    if output.finish_reason == "stop":  # recursion may run to max_tokens: then it stops on length
        jsonschema.validate(json.loads(output.text), tree)
    assert (
        _accepted_by_fresh_matcher(llm, json_schema(tree), output.token_ids)
        or output.finish_reason == "length"
    )


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ({"type": "nonsense"}, "nonsense"),
        ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength"),
    ],
)
def test_schemas_that_cannot_guide_are_refused(llm: Any, spec: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidGuidedDecoding, match=named):
        llm.guided.compile(json_schema(spec))


def test_schema_limits_are_named() -> None:
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(InvalidGuidedDecoding, match="max_schema_depth"):
        json_schema(deep)
    big = {"type": "object", "description": "x" * MAX_SCHEMA_CHARS}
    with pytest.raises(InvalidGuidedDecoding, match="max_schema_chars"):
        json_schema(big)
    with pytest.raises(InvalidGuidedDecoding, match="JSON Schema"):
        json_schema("not a schema")


def test_compile_is_cached_by_grammar_text(llm: Any) -> None:
    first = llm.guided.compile(json_schema(SCHEMAS[1]))
    again = llm.guided.compile(json_schema(json.loads(json.dumps(SCHEMAS[1]))))
    assert first is again


@pytest.mark.parametrize(("rows", "vocab"), [(1, 32), (3, 100), (5, 1000)])
def test_apply_token_bitmask_matches_llguidance(rows: int, vocab: int) -> None:
    import llguidance.torch

    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32)
    logits = torch.randn(rows + 2, vocab)
    picked = torch.tensor([i + 1 for i in range(rows)])  # rows 0 and rows + 1 are not guided
    expected = logits.clone()
    oracle_rows = expected[picked].clone()
    llguidance.torch.apply_token_bitmask_inplace(oracle_rows, bitmask)
    expected[picked] = oracle_rows
    assert torch.equal(apply_token_bitmask(logits, bitmask, picked), expected)


def test_a_row_that_allows_nothing_is_left_unmasked() -> None:
    logits = torch.randn(2, 40)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    assert torch.equal(apply_token_bitmask(logits, bitmask, torch.tensor([1])), logits)
