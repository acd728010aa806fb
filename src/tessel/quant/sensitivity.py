"""Per-layer quality costs measured on a calibration text: `tessel quantize MODEL --sensitivity OUT.json`.

For each decoder layer i and each precision q, the linear maps of layer i alone are quantised to q
(fake-quant in float32, every other layer float) and the cost is

    cost[q][i] = mean over the calibration tokens of KL(P_float || P_q)   [nats per token]

where P is the model's next-token distribution at that position. The file is the one
`tessel plan --sensitivity` reads (`tessel.plan.precision.quality.SensitivityFile`), with `model` set to the
name the planner gives the same checkpoint (`tessel.catalog.models.load_model`: its directory's
name).

KL rather than the increase of the mean NLL (perplexity):
- it is >= 0 by construction: the NLL change of one int8 layer is smaller than the text's own
  noise and comes out negative on some layers, which a cost cannot be;
- it needs no labels: it measures how far the quantised model moves from the float one on every
  position, not whether it happens to predict this text better;
- it adds up across layers to second order (KL ~ 1/2 d^T F d for a small change d of the logits,
  and the cross terms of independent rounding errors vanish in expectation), which is what the
  planner assumes when it sums per-layer costs (as LLM-PQ sums its variance indicators).

Precisions are what the planner means by them (`tessel.cost.layer.WEIGHT_SCHEMES`): int8 = W8A8,
int8 weights per output channel and int8 activations per token (dynamic, symmetric); int4 = W4A16,
int4 weights per group of input columns, float activations, with `GROUP_SIZE` (128) when it divides
every linear's input width, else the largest power of two below it that does (64 on SmolLM2, whose
hidden size is 576). Weights round to nearest (`schemes.quantize_weight`, minmax).

Work: one float forward per calibration window records each decoder layer's input and the
arguments transformers passes it (mask, rotary tables); quantising layer i then re-runs layers
i..L-1, the final norm and the LM head only: per window and precision L(L+1)/2 layer passes and
L LM-head passes.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tessel.errors import TesselError
from tessel.models.quantized.schemes import GROUP_SIZE, Scheme, make_scheme, quantize_weight
from tessel.quant.layer_map import ROUTER_LEAVES
from tessel.quant.progress import StepProgress, report
from tessel.quant.qat import fake_quantize_per_token  # int8 per token, rounded as the W8A8 kernels do

SENSITIVITY_PRECISIONS = ("int8", "int4")  # what the planner can choose below its float reference


def parse_sensitivity_precisions(text: str) -> tuple[str, ...]:
    """'int8,int4' -> ("int8", "int4"); a user error naming --precisions if empty, unknown or repeated."""
    names = tuple(name.strip().lower() for name in text.split(","))
    if not text.strip() or not all(names):
        raise TesselError(f"--precisions {text!r}: empty precision; give e.g. int8,int4")
    unknown = [name for name in names if name not in SENSITIVITY_PRECISIONS]
    if unknown:
        raise TesselError(
            f"--precisions: unknown precision {unknown[0]!r}; measure some of "
            f"{', '.join(SENSITIVITY_PRECISIONS)} (the float reference costs 0)"
        )
    if len(set(names)) != len(names):
        raise TesselError(f"--precisions {text!r}: a precision is listed twice")
    return names


@dataclass(frozen=True, slots=True)
class SensitivityOptions:
    calib: Path
    precisions: tuple[str, ...] = SENSITIVITY_PRECISIONS
    calib_samples: int = 8
    seq_len: int = 256

    def __post_init__(self) -> None:
        parse_sensitivity_precisions(",".join(self.precisions))
        if self.calib_samples < 1:
            raise TesselError(f"--calib-samples must be >= 1; got {self.calib_samples}")
        if self.seq_len < 2:
            raise TesselError(f"--seq-len must be >= 2; got {self.seq_len}")


@dataclass(slots=True)
class SensitivityResult:
    path: Path
    model: str  # the name `tessel plan --model DIR` gives this checkpoint
    costs: dict[str, list[float]]  # precision -> [layers] mean KL, nats per token
    int4_group_size: int | None
    calib_tokens: int
    seconds: float


def int4_group_size(in_features: list[int]) -> int:
    """GROUP_SIZE if it divides every input width, else the largest power of two below it that does."""
    size = GROUP_SIZE
    while size > 1 and any(k % size for k in in_features):
        size //= 2
    return size


def precision_scheme(precision: str, in_features: list[int]) -> Scheme:
    """The scheme the planner's `precision` means, for linears with these input widths."""
    if precision == "int8":
        return make_scheme("w8a8", "dynamic")
    if precision == "int4":
        return make_scheme("w4a16", group_size=int4_group_size(in_features))
    raise TesselError(f"no quantisation scheme for precision {precision!r}")


def _linears(layer: nn.Module) -> list[nn.Linear]:
    """The layer's linears the quantiser rounds: not an MoE router (`tessel.quant.layer_map`)."""
    return [
        module
        for name, module in layer.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in ROUTER_LEAVES
    ]


def _in_features(layers: nn.ModuleList) -> list[int]:
    return [linear.in_features for layer in layers for linear in _linears(layer)]


@contextlib.contextmanager
def fake_quantized(layer: nn.Module, scheme: Scheme) -> Iterator[None]:
    """Within the block, every nn.Linear of `layer` computes with its weight rounded under `scheme`
    (and, for W8A8, its input rounded per token); restored afterwards, exceptions included."""
    saved, handles = [], []
    try:
        for linear in _linears(layer):
            fake = quantize_weight(linear.weight, scheme).dequantize().to(linear.weight.dtype)
            saved.append((linear, linear.weight))
            linear.weight = nn.Parameter(fake, requires_grad=False)
            if not scheme.weight_only:
                handles.append(
                    linear.register_forward_pre_hook(
                        lambda _m, args: (fake_quantize_per_token(args[0]), *args[1:])
                    )
                )
        yield
    finally:
        for handle in handles:
            handle.remove()
        for linear, weight in saved:
            linear.weight = weight


@dataclass(slots=True)
class _LayerCall:
    """What one decoder layer was called with in the float pass (hidden states split out)."""

    hidden: torch.Tensor
    args: tuple
    kwargs: dict

    def run(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if "hidden_states" in self.kwargs:
            out = layer(*self.args, **{**self.kwargs, "hidden_states": hidden})
        else:
            out = layer(hidden, *self.args, **self.kwargs)
        return out[0] if isinstance(out, tuple) else out


def decoder_parts(model: nn.Module) -> tuple[nn.ModuleList, nn.Module, nn.Module]:
    """(decoder layers, final norm, LM head) of a transformers causal LM of the Llama family."""
    decoder = model.get_decoder()
    layers, norm, head = getattr(decoder, "layers", None), getattr(decoder, "norm", None), None
    head = model.get_output_embeddings()
    if not isinstance(layers, nn.ModuleList) or not len(layers) or norm is None or head is None:
        raise TesselError(
            f"{type(model).__name__}: no decoder layers / final norm / LM head found; "
            "--sensitivity measures Llama-family models"
        )
    return layers, norm, head


@torch.no_grad()
def _float_pass(model: nn.Module, window: torch.Tensor) -> tuple[list[_LayerCall], torch.Tensor]:
    """One window through the float model: each layer's call, and the log-probabilities [T, V]."""
    layers, _, _ = decoder_parts(model)
    calls: list[_LayerCall] = []

    def record(_module, args, kwargs):
        if args:
            calls.append(_LayerCall(args[0], args[1:], dict(kwargs)))
        else:
            calls.append(_LayerCall(kwargs["hidden_states"], (), dict(kwargs)))

    handles = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in layers]
    try:
        logits = model(input_ids=window[None], use_cache=False).logits[0]
    finally:
        for handle in handles:
            handle.remove()
    return calls, torch.log_softmax(logits.float(), dim=-1)


@torch.no_grad()
def _logits_from(model: nn.Module, calls: list[_LayerCall], start: int) -> torch.Tensor:
    """Logits [T, V] from layer `start`'s recorded input through the rest of the model as it is now."""
    layers, norm, head = decoder_parts(model)
    hidden = calls[start].hidden
    for index in range(start, len(layers)):
        hidden = calls[index].run(layers[index], hidden)
    return head(norm(hidden))[0]


def kl_sum_nats(reference_logp: torch.Tensor, logits: torch.Tensor) -> float:
    """Sum over positions of KL(P_ref || P) in nats, from log P_ref [T, V] and logits [T, V]."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    per_token = (reference_logp.exp() * (reference_logp - logq)).sum(dim=-1)
    return float(per_token.double().sum())


def measure_sensitivity(
    model: nn.Module, windows: torch.Tensor, precisions: tuple[str, ...], progress: StepProgress | None = None
) -> dict[str, list[float]]:
    """precision -> [layers] mean KL(float || layer i quantised) per token over `windows` [S, T]."""
    layers, _, _ = decoder_parts(model)
    in_features = _in_features(layers)
    if not in_features:
        raise TesselError("found no linear layers in the decoder layers; is it a Llama-family model?")
    schemes = {name: precision_scheme(name, in_features) for name in precisions}
    sums = {name: [0.0] * len(layers) for name in precisions}
    steps, done = len(windows) * len(layers), 0
    for window in windows:
        calls, reference = _float_pass(model, window)
        for index, layer in enumerate(layers):
            for name, scheme in schemes.items():
                with fake_quantized(layer, scheme):
                    sums[name][index] += kl_sum_nats(reference, _logits_from(model, calls, index))
            done += 1
            report(progress, "sensitivity", done, steps)
    tokens = windows.numel()
    return {name: [max(value / tokens, 0.0) for value in values] for name, values in sums.items()}


@torch.no_grad()
def measure_kl(model: nn.Module, windows: torch.Tensor, layer_precisions: list[str | None]) -> float:
    """Mean KL(float || model with layer i at layer_precisions[i], None = float) per token, in nats.

    What a mixed-precision plan actually costs, to hold the sum of its per-layer costs against."""
    layers, _, _ = decoder_parts(model)
    if len(layer_precisions) != len(layers):
        raise TesselError(f"{len(layer_precisions)} precisions for {len(layers)} layers")
    in_features = _in_features(layers)
    total = 0.0
    for window in windows:
        _, reference = _float_pass(model, window)
        with contextlib.ExitStack() as stack:
            for layer, name in zip(layers, layer_precisions, strict=True):
                if name is not None:
                    stack.enter_context(fake_quantized(layer, precision_scheme(name, in_features)))
            total += kl_sum_nats(reference, model(input_ids=window[None], use_cache=False).logits[0])
    return total / windows.numel()


def write_sensitivity(
    model_dir: str | Path, out: str | Path, options: SensitivityOptions, progress: StepProgress | None = None
) -> SensitivityResult:
    """Measure every layer's cost at each of `options.precisions` and write the sensitivity file."""
    from tessel.catalog.models import load_model
    from tessel.files import check_output_path, write_json_file
    from tessel.models.gguf import resolve_model_path
    from tessel.plan.precision.quality import SensitivityFile
    from tessel.quant.calibrate import calibration_windows, load_hf_model, read_calibration_text

    start = time.perf_counter()
    out = check_output_path(out, "--sensitivity", inputs=(model_dir, options.calib))
    model_dir = resolve_model_path(model_dir)
    spec = load_model(model_dir)  # the name and layer count `tessel plan --model DIR` sees
    text = read_calibration_text(options.calib)
    model, tokenizer = load_hf_model(model_dir)
    windows = calibration_windows(text, tokenizer, options.calib_samples, options.seq_len)
    layers, _, _ = decoder_parts(model)
    if len(layers) != spec.num_layers:
        raise TesselError(f"{model_dir}: config.json has {spec.num_layers} layers, the model {len(layers)}")
    costs = measure_sensitivity(model, windows, options.precisions, progress)
    if not all(math.isfinite(v) for values in costs.values() for v in values):
        raise TesselError(f"{model_dir}: the measured costs are not finite; the model overflows in float32")
    document = SensitivityFile(model=spec.name, num_layers=spec.num_layers, costs=costs)
    write_json_file(out, document.model_dump(), "--sensitivity")
    group = int4_group_size(_in_features(layers)) if "int4" in options.precisions else None
    return SensitivityResult(out, spec.name, costs, group, windows.numel(), time.perf_counter() - start)
