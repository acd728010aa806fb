"""The oracle for compressed-tensors checkpoints: HF transformers loads one through the
`compressed-tensors` package (which de-quantises the weights); for int8 activations each decoder
linear additionally sees its input fake-quantised (per token, or by its static input scale), which
is the function tessel's int8 GEMM computes. `engine_logits` is tessel's side of the comparison.
`write_with_model_compressor` writes such a checkpoint without llm-compressor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from tessel import LLM, SamplingParams
from tessel.engine.scheduler import SchedulerOutput
from tessel.engine.sequence import Sequence


def hf_quantized(path: str | Path) -> torch.nn.Module:
    """transformers + compressed-tensors model of the checkpoint at `path` (activations as declared)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)
    ).eval()
    for module in model.modules():  # compressed-tensors 0.19 would fake-quantise inputs too, by max / 127.5
        if hasattr(module, "quantization_scheme"):
            module.quantization_enabled = False
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    acts = next(iter(config["config_groups"].values())).get("input_activations")
    if acts is None:
        return model
    static = not acts.get("dynamic")
    input_scales = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for n in f.keys():
                if n.endswith(".input_scale"):
                    input_scales[n.removesuffix(".input_scale")] = f.get_tensor(n).float()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            scale = input_scales.get(name) if static else None
            module.register_forward_pre_hook(lambda _m, args, s=scale: (fake_quant(args[0], s),))
    return model


def fake_quant(x: torch.Tensor, static_scale: torch.Tensor | None) -> torch.Tensor:
    """int8 symmetric: per token (dynamic, [-127, 127] by max|x| / 127, as vLLM) or by one static scale."""
    if static_scale is not None:
        return torch.round(x / static_scale).clamp(-127, 127) * static_scale
    s = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127
    return torch.round(x / s) * s


def engine_logits(path: str | Path, ids: list[int]) -> torch.Tensor:
    """tessel's prefill logits [len(ids), vocab] for one sequence."""
    llm = LLM(path, max_model_len=128, block_size=8)
    seq = Sequence("x", ids, SamplingParams(temperature=0), block_size=8)
    llm.block_manager.allocate(seq, 0)
    return llm.runner.forward_logits(SchedulerOutput(prefills=[(seq, len(ids))]))


def fake_quantized_hf(float_dir: str | Path, quant_dir: str | Path) -> torch.nn.Module:
    """The float transformers model of `float_dir` computing what the checkpoint in `quant_dir` says:
    its float tensors (smoothed norms, routers), each quantised linear's de-quantised weight and, for
    int8 activations, its input fake-quantised (per token, or by its static scale). For what
    transformers cannot load as compressed-tensors (its stacked MoE experts): experts are unstacked
    first (`tessel.quant.experts`), names mapped by `tessel.quant.layer_map.checkpoint_name`."""
    from transformers import AutoModelForCausalLM

    from tessel.models.quantized.compressed_tensors import parse_quantization_config, read_module
    from tessel.quant.calibrate import target_linears
    from tessel.quant.experts import unstack_experts
    from tessel.quant.layer_map import checkpoint_name

    model = AutoModelForCausalLM.from_pretrained(str(float_dir), dtype=torch.float32).eval()
    unstack_experts(model)
    quant_dir = Path(quant_dir)
    scheme = parse_quantization_config(json.loads((quant_dir / "config.json").read_text()))
    with safe_open(str(quant_dir / "model.safetensors"), "pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys()}
    architecture = type(model).__name__
    with torch.no_grad():
        for name, param in model.named_parameters():
            tensor = stored.get(checkpoint_name(name, architecture))
            if tensor is not None and tensor.dtype.is_floating_point and tensor.shape == param.shape:
                param.copy_(tensor)
        for name, linear in target_linears(model).items():
            if checkpoint_name(name, architecture) in scheme.float_linears:
                continue  # stored float (`--float-layers`), copied above
            weight, input_scale = read_module(stored.__getitem__, checkpoint_name(name, architecture), scheme)
            linear.weight.copy_(weight.dequantize())
            if not scheme.weight_only:
                s = input_scale.float() if scheme.act_static else None
                linear.register_forward_pre_hook(lambda _m, args, s=s: (fake_quant(args[0], s),))
    return model


W4_GROUP = 32  # divides the tiny model's hidden 64 and FFN 128


def weight_args(bits: int, strategy: str, symmetric: bool = True) -> dict:
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
    "w8a8": ({"weights": weight_args(8, "channel"), "input_activations": PER_TOKEN_INT8}, "int-quantized"),
    "w8a16": ({"weights": weight_args(8, "channel")}, "pack-quantized"),
    "w4a16-g32": ({"weights": weight_args(4, "group")}, "pack-quantized"),
    # asymmetric (llm-compressor's W4A16_ASYM layout): zero points packed along the rows
    "w4a16-g32-asym": ({"weights": weight_args(4, "group", symmetric=False)}, "pack-quantized"),
    "w8a16-asym": ({"weights": weight_args(8, "channel", symmetric=False)}, "pack-quantized"),
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
    """The model at `source` quantised to `name` and saved through compressed-tensors' ModelCompressor,
    as llm-compressor's save path writes it (min/max scales: the full int range)."""
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
