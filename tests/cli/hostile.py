"""Hypothesis strategies for hostile input files: the shapes of tessel's files with wrong values in them,
random bytes, wrong encodings, huge numbers, NaN / inf, deep nesting, surrogates and YAML alias bombs."""

from __future__ import annotations

import json

import yaml
from hypothesis import strategies as st

# Values a hostile file puts where a number, a name or a mapping belongs.
NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, 10**30, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, -0.0, 5e-324]),
)
TEXT = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["", " ", "\ud800", "A100-80G", "T4", "nvlink", "pcie", "\x00", "\u202e", "é" * 50]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def maybe(strategy: st.SearchStrategy, plausible_weight: int = 12) -> st.SearchStrategy:
    """Usually a plausible value from `strategy`, sometimes any hostile value."""
    return st.integers(0, plausible_weight).flatmap(lambda draw: VALUES if draw == 0 else strategy)


def _gpu_group() -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {"type": maybe(st.sampled_from(["A100-80G", "V100-32G", "T4", "H100"]))},
        optional={"count": maybe(st.integers(min_value=1, max_value=12))},
    )


def _link() -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {"bandwidth_gbps": maybe(st.floats(min_value=0.1, max_value=1e4))},
        optional={"latency_us": maybe(st.floats(min_value=0, max_value=1e3))},
    )


def _node() -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {
            "name": maybe(st.sampled_from(["n0", "n1", "node"])),
            "gpus": maybe(_gpu_group() | st.lists(_gpu_group(), max_size=3)),
        },
        optional={
            "intra_link": maybe(st.sampled_from(["pcie", "PCIE"]) | _link()),
            "host_memory_gib": maybe(st.floats(min_value=0, max_value=4096)),
        },
    )


def cluster_data() -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {"name": maybe(st.just("c")), "nodes": maybe(st.lists(_node(), min_size=1, max_size=3))},
        optional={"network": maybe(_link())},
    )


def _tokens() -> st.SearchStrategy:
    plausible = st.one_of(
        st.integers(min_value=1, max_value=4096),
        st.fixed_dictionaries(
            {"mean": maybe(st.floats(min_value=1, max_value=4096))},
            optional={"p99": maybe(st.integers(1, 8192)), "max": maybe(st.integers(1, 10**6))},
        ),
        st.fixed_dictionaries({"samples": maybe(st.lists(st.integers(-1, 5000), max_size=5))}),
    )
    return maybe(plausible)


def workload_data() -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {"name": maybe(st.just("w")), "prompt_tokens": _tokens(), "output_tokens": _tokens()},
        optional={
            "arrival_rate_per_s": maybe(st.floats(min_value=0, max_value=100)),
            "batch_size": maybe(st.integers(-1, 64)),
            "max_micro_batch": maybe(st.integers(-1, 16)),
            "latency_estimate_s": maybe(st.floats(min_value=0, max_value=100)),
        },
    )


def model_config_data() -> st.SearchStrategy:
    small = st.integers(min_value=-2, max_value=4096)
    return st.fixed_dictionaries(
        {
            "hidden_size": maybe(st.sampled_from([64, 128, 576])),
            "num_attention_heads": maybe(st.sampled_from([0, 1, 4, 9])),
            "num_hidden_layers": maybe(small),
            "intermediate_size": maybe(small),
            "vocab_size": maybe(small),
        },
        optional={
            "model_type": maybe(st.sampled_from(["llama", "qwen2", "opt", "mistral"])),
            "num_key_value_heads": maybe(st.sampled_from([0, 1, 3, 4])),
            "head_dim": maybe(small),
            "architectures": maybe(st.lists(TEXT, max_size=2)),
            "rope_theta": maybe(st.floats(min_value=1, max_value=1e7)),
            "max_position_embeddings": maybe(small),
            "tie_word_embeddings": VALUES,
            "num_local_experts": maybe(small),
            "num_experts_per_tok": maybe(small),
            "ffn_dim": maybe(small),
            "word_embed_proj_dim": maybe(small),
        },
    )


def profile_data() -> st.SearchStrategy:
    coefficient = maybe(st.floats(min_value=0, max_value=1e-3))
    return st.fixed_dictionaries(
        {
            "version": maybe(st.just(1)),
            "device_type": maybe(st.sampled_from(["cpu", "A100-80G"])),
            "model_shape": maybe(
                st.dictionaries(st.sampled_from(["hidden_size", "num_heads"]), maybe(st.integers(1, 64)))
            ),
            "dtype": maybe(st.just("fp32")),
            "prefill": maybe(
                st.fixed_dictionaries(
                    {"a0": coefficient, "a1": coefficient, "a2": coefficient, "a3": coefficient}
                )
            ),
            "decode": maybe(st.fixed_dictionaries({"b0": coefficient, "b1": coefficient, "b2": coefficient})),
            "heldout_rel_error": maybe(st.floats(min_value=0, max_value=1)),
        },
        optional={"meta": VALUES, "compute_efficiency": VALUES, "memory_efficiency": VALUES},
    )


def trace_rows() -> st.SearchStrategy:
    row = st.fixed_dictionaries(
        {
            "arrival_s": maybe(st.floats(min_value=0, max_value=100)),
            "prompt_tokens": maybe(st.integers(1, 4096)),
            "output_tokens": maybe(st.integers(1, 64)),
        }
    )
    return st.lists(maybe(row, 5), min_size=0, max_size=6)


def as_yaml(data: object) -> bytes:
    try:
        return yaml.safe_dump(data, allow_unicode=True).encode("utf-8", "surrogatepass")
    except (yaml.YAMLError, ValueError, TypeError, RecursionError):
        return as_json(data)


def as_json(data: object) -> bytes:
    return json.dumps(data).encode("utf-8", "surrogatepass")


def as_csv(rows: list) -> bytes:
    lines = ["arrival_s,prompt_tokens,output_tokens"]
    for row in rows:
        values = row.values() if isinstance(row, dict) else [row]
        lines.append(",".join(str(value) for value in values))
    return "\n".join(lines).encode("utf-8", "surrogatepass")


def as_jsonl(rows: list) -> bytes:
    return "\n".join(json.dumps(row) for row in rows).encode("utf-8", "surrogatepass")


# Files no serializer produces: broken bytes, other encodings, parser-stressing text.
YAML_BOMB = (
    "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
    "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
    "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
    "name: *f\nnodes: *f\nprompt_tokens: *f\noutput_tokens: *f\n"
)
NASTY_TEXTS = [
    YAML_BOMB,
    "name: &a [*a]\nnodes: *a\n",
    "[" * 5000 + "]" * 5000,
    "{" * 3000,
    "name: x\nnodes:\n  - name: n\n    gpus: {type: T4, count: 1" + "0" * 5000 + "}\n",
    "name: x\nnodes: [{name: n, gpus: {type: T4}, host_memory_gib: 1e999}]\n",
    "!!python/object/apply:os.system [echo hi]\n",
    "name: 2001-12-14t21:59:43.10-05:00\n",
    "\ufeffname: bom\n",
    "name: \x07\n",
    "%YAML 9.9\n---\nname: x\n",
    '{"version": 1e999}',
    '{"version": 1, "stages": [' + "[" * 2000 + "]" * 2000 + "]}",
    "arrival_s,prompt_tokens,output_tokens\n" + '"' + "x" * 200000 + '"\n',
    "arrival_s,prompt_tokens,output_tokens\n0,1\x00,1\n",
]


def raw_bytes() -> st.SearchStrategy:
    text = st.text(max_size=200)
    return st.one_of(
        st.binary(max_size=600),
        text.map(lambda t: t.encode("utf-16")),
        text.map(lambda t: t.encode("latin-1", "replace")),
        st.text(
            alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=5
        ).map(lambda t: ("name: " + t).encode("utf-8", "surrogatepass")),
        st.sampled_from(NASTY_TEXTS).map(lambda t: t.encode("utf-8")),
    )
