"""Checkpoints tessel did not write: tessel's engine runs them as transformers + compressed-tensors do.

1. Written exactly as llm-compressor's save path writes them, without llm-compressor: the
   `compressed-tensors` package initialises the model's quantisation parameters
   (`apply_quantization_config`), its own `calculate_qparams` gives the min/max scales (what
   llm-compressor's minmax observer calls; the full int range, so int8 -128 and int4 -8 occur),
   then `ModelCompressor.from_pretrained_model` + `compress_model` + `save_pretrained` +
   `update_config`. W8A8 (int-quantized), W8A16 per channel and W4A16 group 32 (pack-quantized),
   symmetric and asymmetric (zero points).
2. Written by llm-compressor's `oneshot` itself (RTN, SmoothQuant, GPTQ with its activation
   order): skipped unless `llmcompressor` is importable (it pins an older transformers /
   compressed-tensors, so it lives in the benchmark venv; docs/quant.md).

Oracle: `ct_oracle.hf_quantized` (transformers de-quantising through compressed-tensors, inputs
fake-quantised per token for int8 activations) against `ct_oracle.engine_logits`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import tiny_models
from ct_oracle import engine_logits, hf_quantized

W4_GROUP = 32  # divides the tiny model's hidden 64 and FFN 128


def _weights(bits: int, strategy: str, symmetric: bool = True) -> dict:
    group_size = W4_GROUP if strategy == "group" else None
    return {
        "num_bits": bits,
        "type": "int",
        "symmetric": symmetric,
        "strategy": strategy,
        "group_size": group_size,
    }


PER_TOKEN_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
CT_SCHEMES = {  # name -> (config group, format)
    "w8a8": ({"weights": _weights(8, "channel"), "input_activations": PER_TOKEN_INT8}, "int-quantized"),
    "w8a16": ({"weights": _weights(8, "channel")}, "pack-quantized"),
    "w4a16-g32": ({"weights": _weights(4, "group")}, "pack-quantized"),
    # asymmetric (llm-compressor's W4A16_ASYM layout): zero points packed along the rows
    "w4a16-g32-asym": ({"weights": _weights(4, "group", symmetric=False)}, "pack-quantized"),
    "w8a16-asym": ({"weights": _weights(8, "channel", symmetric=False)}, "pack-quantized"),
}


def _set_minmax_qparams(module: torch.nn.Module) -> None:
    from compressed_tensors.quantization.utils import calculate_qparams

    args = module.quantization_scheme.weights
    w = module.weight.detach()
    rows = w if args.group_size is None else w.reshape(w.shape[0], -1, args.group_size)
    lo = rows.amin(dim=-1).reshape(w.shape[0], -1)
    hi = rows.amax(dim=-1).reshape(w.shape[0], -1)
    scale, zero_point = calculate_qparams(lo, hi, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))


def write_with_model_compressor(source: Path, out: Path, name: str) -> Path:
    """The tiny model quantised to `name` and saved through compressed-tensors' ModelCompressor."""
    from compressed_tensors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from transformers import AutoModelForCausalLM

    group, fmt = CT_SCHEMES[name]
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    config = QuantizationConfig(
        config_groups={"group_0": {"targets": ["Linear"], **group}},
        ignore=["lm_head"],
        quantization_status=QuantizationStatus.INITIALIZED,
    )
    apply_quantization_config(model, config)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            _set_minmax_qparams(module)
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    for item in source.iterdir():  # tokenizer files, as llm-compressor's oneshot copies them
        if item.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(item, out / item.name)
    return out


def _compare(path: Path, source: Path, w4: bool) -> None:
    ids = torch.randint(4, 300, (23,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        expected = hf_quantized(path)(torch.tensor([ids])).logits[0]
    got = engine_logits(path, ids)
    scale = float(expected.abs().max())
    groups = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]
    if next(iter(groups.values())).get("input_activations") is None:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * scale)
    else:  # a token whose activation sits on a rounding tie (fp32 x / s) may round the other way:
        # that token's row moves by a step, every other row agrees to float32 rounding
        row_error = (got - expected).abs().amax(dim=1) / scale
        assert int((row_error > 1e-4).sum()) <= 1 and float(row_error.max()) < 0.03, row_error
    fp = engine_logits(source, ids)
    relative = float((got - fp).norm() / fp.norm())
    assert 0 < relative < (0.5 if w4 else 0.1), relative


@pytest.mark.parametrize("name", list(CT_SCHEMES))
def test_model_compressor_checkpoint_runs_in_the_engine_as_in_transformers(
    tiny_llama, tmp_path, name: str
) -> None:
    pytest.importorskip("compressed_tensors")
    out = write_with_model_compressor(tiny_llama, tmp_path / name, name)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == CT_SCHEMES[name][1] and qc["quantization_status"] == "compressed"
    _compare(out, tiny_llama, w4=name.startswith("w4"))


def _oneshot_recipes() -> dict:
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    w8 = {"group_0": {"targets": ["Linear"], "weights": _weights(8, "channel")}}
    w4 = {"group_0": {"targets": ["Linear"], "weights": _weights(4, "group")}}
    ignore = ["lm_head"]
    return {
        "w8a8 rtn": [QuantizationModifier(targets="Linear", scheme="W8A8", ignore=ignore)],
        "w8a8 sq0.8 gptq": [
            SmoothQuantModifier(smoothing_strength=0.8),
            GPTQModifier(targets="Linear", scheme="W8A8", ignore=ignore),
        ],
        "w8a16": [QuantizationModifier(config_groups=w8, ignore=ignore)],
        "w4a16 g32 gptq": [GPTQModifier(config_groups=w4, ignore=ignore)],
    }


ONESHOT_CASES = ["w8a8 rtn", "w8a8 sq0.8 gptq", "w8a16", "w4a16 g32 gptq"]


@pytest.mark.parametrize("name", ONESHOT_CASES)
def test_llm_compressor_oneshot_checkpoint_runs_in_the_engine(tiny_llama, tmp_path, name: str) -> None:
    pytest.importorskip("llmcompressor")
    from datasets import Dataset
    from llmcompressor import oneshot

    ids = tiny_models.build_tokenizer()((tiny_models.CORPUS + "\n") * 6)["input_ids"]
    rows = [ids[i * 32 : (i + 1) * 32] for i in range(4)]
    data = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * 32] * 4})
    out = tmp_path / name.replace(" ", "_")
    oneshot(
        model=str(tiny_llama),
        dataset=data,
        recipe=_oneshot_recipes()[name],
        output_dir=str(out),
        num_calibration_samples=4,
        max_seq_length=32,
    )
    _compare(out, tiny_llama, w4=name.startswith("w4"))
