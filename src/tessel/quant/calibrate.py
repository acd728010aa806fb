"""Post-training quantisation of a Hugging Face Llama-family checkpoint: `tessel quantize`.

1. Load the fp model with transformers; cut the calibration text into `samples` windows of
   `seq_len` tokens.
2. SmoothQuant (optional): run the windows with hooks on the inputs of q/k/v and gate/up, record
   per-channel max|x|, fold the scales into the RMSNorms and the linears.
3. Static activations (optional): run the windows again, one observer per linear input (q/k/v
   share one, gate/up share one), giving one input scale per linear.
4. Quantise every linear of the decoder layers (not lm_head): round to nearest (`rtn`), or GPTQ
   (`gptq`, `tessel.quant.gptq`: layer by layer on the calibration windows); write a
   compressed-tensors checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from tessel.catalog.hf_config import config_path, read_json_object
from tessel.errors import TesselError
from tessel.models.gguf import resolve_model_path
from tessel.models.quantized.compressed_tensors import module_tensors, quantization_config
from tessel.models.quantized.qparams import QuantRange
from tessel.models.quantized.schemes import QuantizedWeight, Scheme, make_scheme, quantize_weight
from tessel.models.reader import QUANTISED_ARCHITECTURES, ModelFiles, read_model, resolve_model_dir
from tessel.quant.awq import awq_group
from tessel.quant.experts import unstack_experts
from tessel.quant.formats.checkpoint import write_checkpoint
from tessel.quant.gptq import GPTQOptions, gptq_model
from tessel.quant.layer_map import checkpoint_name, model_maps
from tessel.quant.observers import (
    OBSERVERS,
    WEIGHT_OBSERVERS,
    Observer,
    make_observer,
    weight_qparams,
)
from tessel.quant.progress import StepProgress, report
from tessel.quant.smoothquant import InputRecorder, best_alpha, smooth_group, smooth_groups

METHODS = ("rtn", "gptq")


@dataclass(frozen=True, slots=True)
class QuantizeOptions:
    scheme: str = "w8a8"
    act: str = "dynamic"
    observer: str = "minmax"  # static activations
    weight_observer: str = "minmax"
    smoothquant: float | str | None = None  # alpha in [0, 1], or "auto" (per group, SMOOTHQUANT_ALPHA_GRID)
    calib: Path | None = None
    calib_samples: int = 32
    seq_len: int = 512
    group_size: int | None = None
    method: str = "rtn"  # weights: round to nearest, or GPTQ
    act_order: bool = False  # GPTQ: columns by descending Hessian diagonal
    static_groups: bool = False  # GPTQ: group scales from the original weights, up front
    awq: bool = False  # AWQ's activation-aware channel scaling before the weights are rounded
    asym: bool = False  # weight-only schemes: a zero point per scale
    weight_code_bits: int = 8  # w8a8: 7 keeps the int8 codes in [-63, 63] for AVX2 (fbgemm's int8 GEMM)
    float_layers: tuple[int, ...] = ()  # decoder layers whose linears stay float (named in `ignore`)

    def __post_init__(self) -> None:
        self.make_scheme()  # validates scheme / act / group / symmetry
        if self.observer not in OBSERVERS:
            raise TesselError(f"--observer must be one of {', '.join(OBSERVERS)}; got {self.observer!r}")
        if self.weight_observer not in WEIGHT_OBSERVERS:
            raise TesselError(f"--weight-observer must be one of {', '.join(WEIGHT_OBSERVERS)}")
        if isinstance(self.smoothquant, str) and self.smoothquant != "auto":
            try:
                object.__setattr__(self, "smoothquant", float(self.smoothquant))
            except ValueError:
                raise TesselError(
                    f"--smoothquant takes an alpha in [0, 1] or 'auto'; got {self.smoothquant!r}"
                ) from None
        if isinstance(self.smoothquant, float) and not 0 <= self.smoothquant <= 1:
            raise TesselError(f"--smoothquant alpha must be in [0, 1]; got {self.smoothquant}")
        if self.method not in METHODS:
            raise TesselError(f"--method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.act_order and self.method != "gptq":
            raise TesselError("--act-order applies to --method gptq")
        if self.static_groups and self.method != "gptq":
            raise TesselError("--static-groups applies to --method gptq")
        if any(i < 0 for i in self.float_layers):
            raise TesselError(f"--float-layers takes layer indices >= 0; got {list(self.float_layers)}")
        if self.calib_samples < 1 or self.seq_len < 2:
            raise TesselError("--calib-samples must be >= 1 and --seq-len >= 2")
        if self.awq and self.smoothquant is not None:
            raise TesselError("--awq and --smoothquant both rescale the same channels: choose one")
        if self.needs_calibration and self.calib is None:
            raise TesselError(
                "--smoothquant, --awq, --act static and --method gptq calibrate on text: give --calib FILE"
            )

    def make_scheme(self) -> Scheme:
        symmetric = not self.asym
        return make_scheme(
            self.scheme,
            self.act,
            self.group_size,
            symmetric=symmetric,
            weight_code_bits=self.weight_code_bits,
        )

    @property
    def needs_calibration(self) -> bool:
        return self.smoothquant is not None or self.act == "static" or self.method == "gptq" or self.awq


@dataclass(slots=True)
class QuantizeResult:
    out_dir: Path
    scheme: str
    num_linears: int
    calib_tokens: int
    seconds: float
    smoothed_groups: int = 0
    input_scales: dict[str, float] = field(default_factory=dict)
    smoothing_alphas: dict[str, float] = field(default_factory=dict)


def parse_layer_list(text: str, option: str) -> tuple[int, ...]:
    """ "0,17" -> (0, 17); "" -> (); anything else a user error naming `option`."""
    try:
        return tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        message = f"{option} takes comma-separated layer indices such as 0,17; got {text!r}"
        raise TesselError(message) from None


def read_calibration_text(path: Path, option: str = "--calib") -> str:
    """The text of a calibration / training file (`option` names it in errors); empty is refused."""
    from tessel.files import read_nonempty_text_file

    return read_nonempty_text_file(path, option)


def calibration_windows(text: str, tokenizer, samples: int, seq_len: int) -> torch.Tensor:
    """`samples` consecutive windows of `seq_len` tokens of the text: int64 [samples, seq_len]."""
    ids = tokenizer(text)["input_ids"]
    needed = samples * seq_len
    if len(ids) < needed:
        raise TesselError(
            f"the --calib text has {len(ids)} tokens; --calib-samples {samples} x --seq-len {seq_len} "
            f"needs {needed}: lower --calib-samples or --seq-len, or give a longer text"
        )
    return torch.tensor(ids[:needed], dtype=torch.int64).view(samples, seq_len)


def target_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every linear the quantiser rounds (`tessel.quant.layer_map`: not the routers), by module name."""
    return {
        f"model.layers.{i}.{name}": layer.get_submodule(name)
        for i, (layer, layer_map) in enumerate(zip(model.model.layers, model_maps(model), strict=True))
        for name in layer_map.linears
    }


def input_groups(model: nn.Module) -> dict[str, str]:
    """linear name -> the name of its input group's first linear (q/k/v read one tensor, an expert's
    gate/up one)."""
    out = {}
    for i, layer_map in enumerate(model_maps(model)):
        for group in layer_map.input_groups:
            out |= {f"model.layers.{i}.{name}": f"model.layers.{i}.{group[0]}" for name in group}
    return out


@torch.no_grad()
def _run_windows(model: nn.Module, windows: torch.Tensor, label: str, progress: StepProgress | None) -> None:
    for i, window in enumerate(windows):
        model(input_ids=window[None], use_cache=False)
        report(progress, label, i + 1, len(windows))


def _observe_inputs(
    model: nn.Module,
    modules: dict[str, nn.Module],
    make: Callable[[], Observer | InputRecorder],
    windows,
    label,
    progress,
) -> dict[str, Observer | InputRecorder]:
    """One observer per module of `modules`, fed its input by a pre-hook, over the windows."""
    observers = {name: make() for name in modules}
    handles = [
        module.register_forward_pre_hook(
            lambda _m, args, obs=observers[name]: obs.observe(args[0].reshape(-1, args[0].shape[-1]))
        )
        for name, module in modules.items()
    ]
    try:
        _run_windows(model, windows, label, progress)
    finally:
        for handle in handles:
            handle.remove()
    return observers


def _group_inputs(model: nn.Module, make, windows, label, progress) -> dict[str, InputRecorder]:
    """A recorder per smoothable group (`smooth_groups`), by group name."""
    groups = {g.name: g.recorded_at for g in smooth_groups(model)}
    return _observe_inputs(model, groups, make, windows, label, progress)


def _smooth(model, alpha: float | str, windows, progress) -> dict[str, float]:
    """SmoothQuant every group with `alpha` (or, for "auto", each group's best alpha); -> the alphas."""
    recorders = _group_inputs(model, InputRecorder, windows, "smoothquant", progress)
    alphas = {}
    for group in smooth_groups(model):
        recorder = recorders[group.name]
        alphas[group.name] = best_alpha(group, recorder) if alpha == "auto" else float(alpha)
        smooth_group(group, recorder.amax, alphas[group.name])
    return alphas


def _awq(model, scheme: Scheme, windows, progress) -> dict[str, float]:
    """AWQ-scale every SmoothQuant group (tessel.quant.awq); -> the alpha chosen per group."""
    recorders = _group_inputs(model, InputRecorder, windows, "awq", progress)
    return {g.name: awq_group(g, recorders[g.name], scheme) for g in smooth_groups(model)}


def load_hf_model(model_dir: Path):
    """(float32 transformers model, tokenizer) of a directory or .gguf file the model reader accepts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = quantisable(read_model(model_dir, "MODEL")).path  # config and weights agree first
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as error:
        raise TesselError(f"cannot load {model_dir} with transformers: {error}") from None
    unstack_experts(model)  # one nn.Linear per expert, each rounded on its own
    return model.eval(), tokenizer


def quantize_model(
    model_dir: str | Path,
    out_dir: str | Path,
    options: QuantizeOptions,
    progress: StepProgress | None = None,
    *,
    overwrite: bool = False,
) -> QuantizeResult:
    """Quantise the model in `model_dir` under `options`; write the checkpoint to `out_dir` (an existing
    one only with `overwrite`, and only when tessel wrote it: `tessel.files.check_output_directory`)."""
    from tessel.files import check_output_directory

    start = time.perf_counter()
    check_output_directory(out_dir, "--out", inputs=(model_dir, options.calib), overwrite=overwrite)
    model_dir, out_dir = resolve_model_path(model_dir), Path(out_dir)  # a .gguf file: its de-quantised copy
    config = read_model_config(model_dir)
    scheme = options.make_scheme()
    text = read_calibration_text(options.calib) if options.calib is not None else None  # checked if unused
    report(progress, "load", 0, 1)
    model, tokenizer = load_hf_model(model_dir)
    report(progress, "load", 1, 1)
    linears = target_linears(model)
    if not linears:
        raise TesselError(
            f"{model_dir}: found no linear layers under model.layers; is it a Llama-family model?"
        )
    linears, kept_float = _split_float_layers(linears, options.float_layers, len(model.model.layers))
    for name, module in linears.items():
        scheme.check_in_features(module.in_features, name)
    windows = None
    if text is not None and options.needs_calibration:
        windows = calibration_windows(text, tokenizer, options.calib_samples, options.seq_len)
    result = QuantizeResult(
        out_dir, scheme.name, len(linears), 0 if windows is None else windows.numel(), 0.0
    )
    if options.smoothquant is not None:
        result.smoothing_alphas = _smooth(model, options.smoothquant, windows, progress)
        result.smoothed_groups = len(result.smoothing_alphas)
    if options.awq:
        result.smoothing_alphas = _awq(model, scheme, windows, progress)
        result.smoothed_groups = len(result.smoothing_alphas)
    input_scales: dict[str, torch.Tensor] = {}
    if scheme.act_static:
        groups = input_groups(model)
        observers = _observe_inputs(
            model,
            {lead: linears[lead] for lead in set(groups.values()) if lead in linears},
            lambda: make_observer(options.observer, QuantRange()),
            windows,
            "activations",
            progress,
        )
        input_scales = {name: observers[groups[name]].qparams()[0] for name in linears}
        result.input_scales = {name: float(s) for name, s in input_scales.items()}
    weights = _quantize_weights(model, linears, scheme, options, windows, progress)
    act_observer = options.observer if scheme.act_static else None
    report(progress, "write", 0, 1)
    write_quantized(
        model,
        linears,
        scheme,
        weights,
        input_scales,
        config,
        model_dir,
        out_dir,
        act_observer,
        overwrite,
        kept_float,
    )
    report(progress, "write", 1, 1)
    result.seconds = time.perf_counter() - start
    return result


def _split_float_layers(
    linears: dict[str, nn.Linear], float_layers: tuple[int, ...], num_layers: int
) -> tuple[dict[str, nn.Linear], list[str]]:
    """(the linears to round, the names of those `--float-layers` keeps float)."""
    if any(i >= num_layers for i in float_layers):
        raise TesselError(f"--float-layers {list(float_layers)}: the model has layers 0-{num_layers - 1}")
    kept = {f"model.layers.{i}." for i in float_layers}
    floats = [name for name in linears if name.startswith(tuple(kept))] if kept else []
    return {n: m for n, m in linears.items() if n not in floats}, floats


def _quantize_weights(model, linears, scheme, options: QuantizeOptions, windows, progress):
    if options.method == "gptq":
        gptq = GPTQOptions(
            act_order=options.act_order, observer=options.weight_observer, static_groups=options.static_groups
        )
        out = gptq_model(model, windows, scheme, gptq, progress, skip_layers=frozenset(options.float_layers))
        return {name: weight for name, weight in out.items() if name in linears}
    weights = {}
    for done, (name, module) in enumerate(linears.items(), 1):
        weights[name] = quantize_weight(module.weight, scheme, weight_qparams(options.weight_observer))
        report(progress, "weights", done, len(linears))
    return weights


def read_model_config(model_dir: Path) -> dict:
    """The config.json fields of a float model, after the model reader checked it with its weights."""
    model_dir = resolve_model_dir(model_dir, "MODEL")
    config = read_json_object(config_path(model_dir))
    if config.get("quantization_config") is not None:
        raise TesselError(f"{model_dir} is already quantised (config.json has quantization_config)")
    quantisable(read_model(model_dir, "MODEL"))
    return config


def quantisable(files: ModelFiles) -> ModelFiles:
    """`files`, if the quantiser maps its layers (Llama, Qwen2, Mistral); else a user error."""
    architecture = files.config.architecture
    if architecture not in QUANTISED_ARCHITECTURES:
        raise TesselError(
            f"{files.path}: quantising a {architecture} is not supported yet (the quantiser maps the layers "
            f"of {', '.join(QUANTISED_ARCHITECTURES)}); run its float weights"
        )
    return files


def write_quantized(
    model: nn.Module,
    linears: dict[str, nn.Linear],
    scheme: Scheme,
    weights: dict[str, QuantizedWeight],
    input_scales: dict[str, torch.Tensor],
    config: dict,
    model_dir: Path,
    out_dir: Path,
    act_observer: str | None,
    overwrite: bool = False,
    kept_float: list[str] | tuple[str, ...] = (),
) -> Path:
    """The checkpoint: quantised linears from `weights`, every other tensor of `model` as it is, under the
    checkpoint's names (`tessel.quant.layer_map.checkpoint_name`); routers float and named in `ignore`."""
    architecture = type(model).__name__
    tensors: dict[str, torch.Tensor] = {}
    for name, module in linears.items():
        stored = checkpoint_name(name, architecture)
        for leaf, tensor in module_tensors(scheme, weights[name], input_scales.get(name)).items():
            tensors[f"{stored}.{leaf}"] = tensor
        if module.bias is not None:
            tensors[f"{stored}.bias"] = module.bias.detach().float()
    quantised = {f"{name}.weight" for name in linears} | {f"{name}.bias" for name in linears}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, tensor in model.state_dict().items():
        if name in quantised or (name == "lm_head.weight" and tied):
            continue
        tensors[checkpoint_name(name, architecture)] = tensor.detach().contiguous()
    floats = [
        checkpoint_name(f"model.layers.{i}.{name}", architecture)
        for i, layer_map in enumerate(model_maps(model))
        for name in layer_map.float_linears
    ] + [checkpoint_name(name, architecture) for name in kept_float]
    config = dict(config, quantization_config=quantization_config(scheme, act_observer, floats))
    return write_checkpoint(out_dir, model_dir, config, tensors, overwrite=overwrite)
