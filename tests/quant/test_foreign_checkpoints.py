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
from pathlib import Path

import pytest
import torch

import tiny_models
from ct_oracle import CT_SCHEMES, engine_logits, hf_quantized, weight_args, write_with_model_compressor


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


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(frozenset({"avx", "avx2", "fma", "f16c"}), id="avx2"),
        pytest.param(frozenset({"avx2", "avx512f", "avx512_vnni"}), id="avx512-vnni"),
    ],
)
def test_w8a8_checkpoint_keeps_its_8bit_semantics_on_each_cpu(
    tiny_llama, tmp_path, monkeypatch, flags
) -> None:
    """llm-compressor's W8A8 (8-bit per-token activation codes against full-range weights) on the
    path each CPU takes (issue 47): AVX2's `fp16codes` and VNNI's 8-bit `fbgemm` compute the
    checkpoint's integer products, so the logits are transformers' (7-bit activation codes would
    move every row). Only the path choice is the CPU's here; every path runs on this machine."""
    pytest.importorskip("compressed_tensors")
    from tessel.kernels import cpu_features

    if not cpu_features.fbgemm_available():
        pytest.skip("this torch build has no fbgemm")
    monkeypatch.delenv(cpu_features.ENV_OVERRIDE, raising=False)
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: flags)
    from tessel.layers.linear import w8a8

    chosen: list[str] = []  # the path of each W8A8 layer the engine builds

    def choose(*args, **kwargs) -> str:
        chosen.append(cpu_features.choose_int8_path(*args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(w8a8, "choose_int8_path", choose)
    out = write_with_model_compressor(tiny_llama, tmp_path / "w8a8", "w8a8")
    _compare(out, tiny_llama, w4=False)
    assert chosen and set(chosen) == {"fp16codes" if "avx512_vnni" not in flags else "fbgemm"}, chosen


def _oneshot_recipes() -> dict:
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    w8 = {"group_0": {"targets": ["Linear"], "weights": weight_args(8, "channel")}}
    w4 = {"group_0": {"targets": ["Linear"], "weights": weight_args(4, "group")}}
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
