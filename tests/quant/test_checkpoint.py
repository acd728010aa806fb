"""The compressed-tensors checkpoint format: packing against the package's own helpers, configs
that the package validates, config parsing (bad configs name their field), atomic writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hostile_models
from tessel.errors import TesselError
from tessel.models.quantized.compressed_tensors import (
    module_tensors,
    pack,
    parse_quantization_config,
    quantization_config,
    read_module,
    unpack,
)
from tessel.models.quantized.schemes import dequantize_weight, make_scheme, quantize_weight
from tessel.quant.formats.checkpoint import write_checkpoint

SCHEMES = [
    make_scheme("w8a8"),
    make_scheme("w8a8", act="static"),
    make_scheme("w8a16"),
    make_scheme("w4a16"),
    make_scheme("w4a16", group_size=32),
    make_scheme("w4a16", group_size=32, symmetric=False),
    make_scheme("w8a16", symmetric=False),
]


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_matches_compressed_tensors(bits: int) -> None:
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    half = 1 << (bits - 1)
    q = torch.randint(-half, half, (7, 96), dtype=torch.int8)
    packed = pack(q, bits)
    assert torch.equal(packed, helpers.pack_to_int32(q, bits))
    assert torch.equal(unpack(packed, bits, 96), q)
    assert torch.equal(helpers.unpack_from_int32(packed, bits, torch.Size([7, 96])), q)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 7, 12, 16])
def test_zero_points_pack_along_rows_as_compressed_tensors(bits: int, rows: int) -> None:
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    half = 1 << (bits - 1)
    zero_point = torch.randint(-half, half, (rows, 3), dtype=torch.int8)
    packed = pack(zero_point.t(), bits).t()
    assert torch.equal(packed, helpers.pack_to_int32(zero_point, bits, packed_dim=0))
    assert torch.equal(
        helpers.unpack_from_int32(packed, bits, torch.Size([rows, 3]), packed_dim=0), zero_point
    )


def test_asymmetric_weights_fit_a_shifted_range_better() -> None:
    w = torch.rand(16, 128) * 0.9 + 0.1 * torch.randn(16, 128)  # mostly positive rows
    errors = {}
    for symmetric in (True, False):
        qw = quantize_weight(w, make_scheme("w4a16", group_size=32, symmetric=symmetric))
        assert (qw.zero_point is None) == symmetric
        errors[symmetric] = float((qw.dequantize() - w).pow(2).sum())
    assert errors[False] < 0.6 * errors[True]


@pytest.mark.parametrize(
    "scheme",
    SCHEMES,
    ids=lambda s: f"{s.name}-{s.group_size}-{s.act_static}-{'sym' if s.symmetric else 'asym'}",
)
def test_config_round_trips_and_compressed_tensors_accepts_it(scheme) -> None:
    config = quantization_config(scheme, "entropy" if scheme.act_static else None)
    assert parse_quantization_config({"quantization_config": json.loads(json.dumps(config))}) == scheme
    ct = pytest.importorskip("compressed_tensors.quantization")
    parsed = ct.QuantizationConfig.model_validate(config)
    group = parsed.config_groups["group_0"]
    assert parsed.format == ("pack-quantized" if scheme.weight_only else "int-quantized")
    assert group.weights.num_bits == scheme.weight_bits and group.weights.group_size == scheme.group_size
    assert (group.input_activations is None) == scheme.weight_only
    assert parsed.ignore == ["lm_head"]


@pytest.mark.parametrize(
    "scheme",
    SCHEMES,
    ids=lambda s: f"{s.name}-{s.group_size}-{s.act_static}-{'sym' if s.symmetric else 'asym'}",
)
def test_module_tensors_read_back_and_decompress_with_compressed_tensors(scheme) -> None:
    w = torch.randn(48, 128) * torch.linspace(0.1, 3, 128)
    qw = quantize_weight(w, scheme)
    tensors = module_tensors(scheme, qw, torch.tensor([0.05]) if scheme.act_static else None)
    back, input_scale = read_module(lambda name: tensors[name.removeprefix("m.x.")], "m.x", scheme)
    assert torch.equal(back.q, qw.q) and torch.equal(back.scale, qw.scale)
    assert (back.zero_point is None) == scheme.symmetric
    if not scheme.symmetric:
        assert torch.equal(back.zero_point, qw.zero_point)
    assert (input_scale is not None) == scheme.act_static
    # the weight error of round-to-nearest: at most half a step of the row's (group's) scale
    step = qw.scale.repeat_interleave(128 // qw.scale.shape[1], dim=1)
    assert torch.all((qw.dequantize() - w).abs() <= step / 2 * (1 + 1e-5))
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(quantization_config(scheme, "minmax"))
    compressor = BaseCompressor.get_value_from_registry(config.format)
    decompressed = compressor.decompress(dict(tensors), config.config_groups["group_0"])
    assert ct is not None
    torch.testing.assert_close(decompressed["weight"].float(), qw.dequantize(), rtol=0, atol=1e-6)


def test_group_weights_match_per_channel_observer_per_group() -> None:
    w = torch.randn(5, 96)
    qw = quantize_weight(w, make_scheme("w4a16", group_size=32))
    for g in range(3):
        block = w[:, 32 * g : 32 * (g + 1)]
        amax = block.abs().amax(dim=1)
        ref = torch.max(amax / 7.5, torch.tensor(1.1920929e-07))  # compressed-tensors: all of [-8, 7]
        assert torch.equal(qw.scale[:, g], ref)
    assert int(qw.q.min()) >= -8 and int(qw.q.max()) <= 7
    assert torch.equal(dequantize_weight(qw.q, qw.scale, 32), qw.dequantize())


BAD_CONFIGS = {
    "quant_method": {"quant_method": "gptq"},
    "format": {"format": "marlin-24"},
    "ignore": {"ignore": ["lm_head", "re:.*down_proj"]},  # one layer by full name is accepted: --float-layers
    "kv_cache_scheme": {"kv_cache_scheme": {"num_bits": 8}},
    "config_groups": {"config_groups": {}},
    "sparsity_config": {"sparsity_config": {"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}},
    "transform_config": {"transform_config": {"config_groups": {"u": {"type": "hadamard"}}}},
}


@pytest.mark.parametrize("field", list(BAD_CONFIGS))
def test_unsupported_config_names_the_field(field: str) -> None:
    config = dict(quantization_config(make_scheme("w8a8")), **BAD_CONFIGS[field])
    with pytest.raises(TesselError, match=f"quantization_config.{field}"):
        parse_quantization_config({"quantization_config": config})


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("weights", "symmetric"), False, "weights.symmetric"),
        (("weights", "num_bits"), 2, "weights.num_bits"),
        (("weights", "type"), "float", "weights.type"),
        (("input_activations", "strategy"), "group", "input_activations.strategy"),
        (("input_activations", "num_bits"), 4, "input_activations.num_bits"),
        (("weights", "actorder"), "group", "weights.actorder"),  # stores weight_g_idx
        (("weights", "actorder"), "dynamic", "weights.actorder"),
    ],
)
def test_unsupported_group_fields_are_named(path, value, field: str) -> None:
    config = quantization_config(make_scheme("w8a8"))
    config["config_groups"]["group_0"][path[0]][path[1]] = value
    with pytest.raises(TesselError, match=f"config_groups.group_0.{field}"):
        parse_quantization_config({"quantization_config": config})


@pytest.mark.parametrize("actorder", ["static", "weight"])
@pytest.mark.parametrize(
    "scheme",
    SCHEMES,
    ids=lambda s: f"{s.name}-{s.group_size}-{s.act_static}-{'sym' if s.symmetric else 'asym'}",
)
def test_gptq_weight_activation_order_reads_as_the_plain_layout(scheme, actorder: str) -> None:
    """llm-compressor's GPTQModifier writes actorder "static": rounding order only, no weight_g_idx."""
    config = quantization_config(scheme)
    config["config_groups"]["group_0"]["weights"]["actorder"] = actorder
    assert parse_quantization_config({"quantization_config": config}) == scheme


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 300) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


# the fields llm-compressor writes, so that fuzzing reaches them, and any other name
KNOWN_KEYS = ["format", "ignore", "kv_cache_scheme", "sparsity_config", "transform_config", "actorder"]
KNOWN_KEYS += ["strategy", "group_size", "num_bits", "dynamic", "symmetric", "type", "scale_dtype"]
KEYS = st.sampled_from(KNOWN_KEYS) | st.text(max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    mutations=st.lists(
        st.tuples(st.sampled_from(["", "weights", "input_activations"]), KEYS, JSON),
        max_size=4,
    ),
    base=st.sampled_from(SCHEMES),
)
def test_fuzzed_configs_parse_or_raise_tessel_error(mutations, base) -> None:
    config = quantization_config(base)
    group = config["config_groups"]["group_0"]
    for where, key, value in mutations:
        target = config if where == "" else group.get(where)
        if isinstance(target, dict):
            target[key] = value
    try:
        parse_quantization_config({"quantization_config": config})
    except TesselError:
        pass


@settings(max_examples=50, deadline=None)
@given(value=JSON)
def test_any_json_quantization_config_is_parsed_or_rejected(value) -> None:
    try:
        parse_quantization_config({"quantization_config": value})
    except TesselError:
        pass


def test_failed_write_leaves_nothing_in_out(tmp_path, tiny_llama) -> None:
    out = tmp_path / "out"
    with pytest.raises(AttributeError):  # the write fails after the tokenizer files were copied
        write_checkpoint(out, tiny_llama, {"a": 1}, {"x": "not a tensor"})  # type: ignore[dict-item]
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == []


TENSORS = st.builds(
    lambda dtype, shape, fill: torch.full(shape, fill).to(dtype),
    st.sampled_from([torch.int8, torch.int32, torch.int64, torch.float32]),
    st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple),
    st.integers(-3, 3),
)


@settings(max_examples=200, deadline=None)
@given(
    scheme=st.sampled_from(SCHEMES),
    tensors=st.dictionaries(
        st.sampled_from(
            ["weight", "weight_scale", "weight_packed", "weight_shape", "weight_zero_point", "input_scale"]
        ),
        TENSORS,
    ),
)
def test_hostile_module_tensors_raise_only_tessel_error(scheme, tensors) -> None:
    def get(name: str) -> torch.Tensor:
        leaf = name.removeprefix("m.")
        if leaf not in tensors:
            raise TesselError(f"missing {name}")
        return tensors[leaf]

    try:
        weight, _ = read_module(get, "m", scheme)
    except TesselError:
        return
    assert weight.q.dtype == torch.int8 and weight.scale.shape[0] == weight.q.shape[0]


def _w8a8_module(scale: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"m.weight": torch.ones(4, 8, dtype=torch.int8), "m.weight_scale": scale}


@pytest.mark.parametrize(
    "scale, message",
    [
        (torch.zeros(4, 1), "m.weight_scale has zero or negative values"),
        (-torch.ones(4, 1), "m.weight_scale has zero or negative values"),
        (torch.tensor([[1.0], [float("nan")], [1.0], [1.0]]), "m.weight_scale has non-finite values"),
        (torch.full((4, 1), float("inf")), "m.weight_scale has non-finite values"),
        (torch.ones(4, 1, dtype=torch.int32), "m.weight_scale is torch.int32; scales are stored as floating"),
    ],
)
def test_scales_that_are_not_positive_finite_floats_are_refused_by_name(scale, message: str) -> None:
    tensors = _w8a8_module(scale)
    with pytest.raises(TesselError, match=message) as error:
        read_module(tensors.__getitem__, "m", make_scheme("w8a8"))
    assert "has shape" not in str(error.value)  # what is wrong, not the shape again


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_a_static_input_scale_must_be_positive_and_finite(value: float) -> None:
    tensors = _w8a8_module(torch.ones(4, 1)) | {"m.input_scale": torch.tensor([value])}
    with pytest.raises(TesselError, match=r"m\.input_scale has (zero or negative|non-finite) values"):
        read_module(tensors.__getitem__, "m", make_scheme("w8a8", act="static"))


@pytest.fixture(scope="module")
def w8a8_checkpoint(tiny_llama, tmp_path_factory) -> Path:
    from tessel.quant.calibrate import QuantizeOptions, quantize_model

    out = tmp_path_factory.mktemp("w8a8") / "w8a8"
    quantize_model(tiny_llama, out, QuantizeOptions("w8a8"))
    return out


@pytest.mark.parametrize("edit", sorted(hostile_models.SCALE_EDITS))
def test_a_w8a8_checkpoint_with_bad_scales_is_refused_at_load(w8a8_checkpoint, tmp_path, edit: str) -> None:
    from typer.testing import CliRunner

    from tessel import LLM
    from tessel.cli import app

    change, wanted = hostile_models.SCALE_EDITS[edit]
    model = hostile_models.broken_copy(w8a8_checkpoint, tmp_path / "m", change)
    result = CliRunner().invoke(
        app, ["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "1"]
    )
    error = result.exception
    assert isinstance(error, TesselError) and error.exit_code == 2, result.output + repr(error)
    message = str(error)
    assert "\n" not in message and hostile_models.SCALE in message and wanted in message, message
    with pytest.raises(TesselError, match=wanted):
        LLM(model)
