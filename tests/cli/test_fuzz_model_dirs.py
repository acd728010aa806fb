"""Fuzz the model reader with model directories: a tiny checkpoint whose config.json fields take hostile
values, whose safetensors bytes are corrupted, or (quantised) whose checkpoint tensors are replaced.

The reader and the loader give a model or a TesselError with a message; `tessel generate` and
`tessel quantize` succeed or exit 2 with a message; never another exception, never a hang (each
example runs under a SIGALRM guard). A config the reader accepts cannot make the engine allocate
more than the files hold, so an accepted example runs at the size of the tiny model.
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path

import hostile
import pytest
import torch
from cli_helpers import succeeds_or_user_error, time_guard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import tiny_models
from tessel.errors import TesselError
from tessel.models.loader import load_model
from tessel.models.reader import read_model

READER_SETTINGS = settings(
    max_examples=80,
    deadline=timedelta(seconds=20),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
CLI_SETTINGS = settings(
    max_examples=12,
    deadline=timedelta(seconds=60),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
_FOLDER = Path(tempfile.mkdtemp(prefix="tessel-fuzz-models-"))
_COUNTER = itertools.count()

CONFIG_FIELDS = [
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "hidden_act",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "torch_dtype",
    "bos_token_id",
    "eos_token_id",
    "architectures",
    "model_type",
    "sliding_window",
    "quantization_config",
]
DELETE = object()
NEAR_VALID = st.sampled_from([0, 1, 2, 3, 7, 8, 16, 32, 63, 64, 128, 384, 10**9, 2**31 - 1, 2**31, 1e-6, 0.5])
FIELD_VALUES = st.one_of(hostile.VALUES, NEAR_VALID, st.just(DELETE))


@pytest.fixture(scope="module")
def tiny() -> Path:
    return tiny_models.make_tiny_checkpoint(_FOLDER / "tiny", "llama", seed=11)


def _copy(source: Path) -> Path:
    target = _FOLDER / f"m{next(_COUNTER)}" / source.name
    shutil.copytree(source, target)
    return target


def _with_config_changes(tiny: Path, changes: dict[str, object]) -> Path:
    path = _copy(tiny)
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    return path


def _loads_or_refuses(path: Path) -> None:
    with time_guard(20):
        try:
            read_model(path)
            load_model(path, torch.float32)
        except TesselError as error:
            assert str(error).strip() and "\n" not in str(error)


CHANGES = st.dictionaries(st.sampled_from(CONFIG_FIELDS), FIELD_VALUES, min_size=1, max_size=3)


@READER_SETTINGS
@given(changes=CHANGES)
def test_config_fields_with_hostile_values(tiny: Path, changes: dict) -> None:
    _loads_or_refuses(_with_config_changes(tiny, changes))


@READER_SETTINGS
@given(data=st.data())
def test_corrupted_safetensors_bytes(tiny: Path, data) -> None:
    path = _copy(tiny)
    weights = path / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    header_end = 8 + int.from_bytes(raw[:8], "little")
    how = data.draw(st.sampled_from(["header", "anywhere", "cut", "append"]))
    if how in ("header", "anywhere"):
        end = header_end if how == "header" else len(raw)
        for _ in range(data.draw(st.integers(1, 6))):
            raw[data.draw(st.integers(0, end - 1))] = data.draw(st.integers(0, 255))
    elif how == "cut":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        raw += data.draw(st.binary(min_size=1, max_size=64))
    weights.write_bytes(bytes(raw))
    _loads_or_refuses(path)


@pytest.fixture(scope="module")
def quantized(tiny: Path) -> dict[str, Path]:
    from tessel.quant.calibrate import QuantizeOptions, quantize_model

    out = {}
    (_FOLDER / "quantized").mkdir()
    for name, options in {
        "w8a8": QuantizeOptions("w8a8"),
        "w4a16-asym": QuantizeOptions("w4a16", group_size=32, asym=True),
    }.items():
        out[name] = quantize_model(tiny, _FOLDER / "quantized" / name, options).out_dir
    return out


TENSOR_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32, torch.int64]
SPECIAL_VALUES = st.sampled_from([0.0, -1.0, float("nan"), float("inf"), 1e-30, 1e30, 3.0])


def _hostile_tensor(data, like: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    dtype = data.draw(st.sampled_from([like.dtype, *TENSOR_DTYPES]))
    shape = data.draw(
        st.sampled_from([tuple(like.shape), (), (1,), (like.shape[0],), (like.shape[0] + 1, 1)])
    )
    values = (
        torch.full(shape, data.draw(SPECIAL_VALUES)) if data.draw(st.booleans()) else torch.randn(shape) * 100
    )
    if not dtype.is_floating_point:
        values = values.nan_to_num(0.0, 0.0, 0.0).clamp(-100, 100)
    return values.to(dtype)


@READER_SETTINGS
@given(data=st.data())
def test_quantized_checkpoint_tensors_replaced(quantized: dict[str, Path], data) -> None:
    path = _copy(quantized[data.draw(st.sampled_from(sorted(quantized)))])
    tensors = load_file(str(path / "model.safetensors"))
    layer = data.draw(st.sampled_from(sorted(n for n in tensors if n.startswith("model.layers.1.self_attn"))))
    what = data.draw(st.sampled_from(["replace", "drop", "add"]))
    if what == "replace":
        tensors[layer] = _hostile_tensor(data, tensors[layer])
    elif what == "drop":
        del tensors[layer]
    else:
        tensors[layer.rsplit(".", 1)[0] + ".weight_g_idx"] = torch.arange(64, dtype=torch.int32)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    _loads_or_refuses(path)


@pytest.mark.slow
@CLI_SETTINGS
@given(changes=CHANGES)
def test_generate_and_quantize_with_hostile_config_fields(tiny: Path, changes: dict) -> None:
    path = _with_config_changes(tiny, changes)
    succeeds_or_user_error(["generate", "--model", path, "--prompt", "hi", "--max-tokens", "1"])
    succeeds_or_user_error(["quantize", path, "--out", path.parent / "out", "--scheme", "w8a16"])
