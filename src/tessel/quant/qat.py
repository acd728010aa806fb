"""Quantisation-aware training: fake-quantised linears with a clipped straight-through estimator.

    forward:   w_fq = clamp(round(w / s), qmin, qmax) * s        (per output channel or group)
    backward:  dL/dw = dL/dw_fq  where qmin * s <= w <= qmax * s, else 0   (clipped STE)

The weight scales are fixed at the PTQ starting point (`--weight-observer`; `mse` clips, `minmax`
does not); W8A8 also fake-quantises each linear's input per token (dynamic, so nothing is
clipped: gradient 1). `tessel qat` fine-tunes briefly with AdamW on a text and writes the same
compressed-tensors checkpoint as `tessel quantize`, with the trained weights under those scales.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tessel.errors import TesselError
from tessel.models.gguf import resolve_model_path
from tessel.models.quantized.qparams import QuantRange
from tessel.models.quantized.schemes import QuantizedWeight, Scheme, make_scheme, quantize_weight
from tessel.quant.limits import MAX_QAT_LR, MAX_QAT_STEPS, MIN_QAT_LR
from tessel.quant.observers import weight_qparams
from tessel.quant.progress import StepProgress, report

ACT_RANGE = QuantRange(8, symmetric=True)


class FakeQuantSTE(torch.autograd.Function):
    """x -> clamp(round(x / scale), qmin, qmax) * scale; gradient 1 inside the clip range, 0 outside."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
        y = x / scale
        ctx.save_for_backward((y >= qmin) & (y <= qmax))
        return torch.clamp(torch.round(y), qmin, qmax) * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (inside,) = ctx.saved_tensors
        return grad * inside, None, None, None


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, qrange: QuantRange) -> torch.Tensor:
    return FakeQuantSTE.apply(x, scale, qrange.qmin, qrange.qmax)


def fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    scale = x.detach().abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / ACT_RANGE.qmax
    return fake_quantize(x, scale, ACT_RANGE)


class QATLinear(nn.Module):
    """An nn.Linear whose weight (and, for W8A8, input) is fake-quantised in the forward."""

    def __init__(self, linear: nn.Linear, scheme: Scheme, weight_observer: str = "minmax") -> None:
        super().__init__()
        self.linear, self.scheme = linear, scheme
        start = quantize_weight(linear.weight, scheme, weight_qparams(weight_observer))
        self.register_buffer("weight_scale", start.scale)  # [N, groups], fixed

    def _expanded_scale(self) -> torch.Tensor:
        n, k = self.linear.weight.shape
        return self.weight_scale.repeat_interleave(k // self.weight_scale.shape[1], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = fake_quantize(self.linear.weight, self._expanded_scale(), self.scheme.weight_range)
        if not self.scheme.weight_only:
            x = fake_quantize_per_token(x)
        return F.linear(x, w, self.linear.bias)

    def quantized_weight(self) -> QuantizedWeight:
        """The trained weight under the fixed scales, as the checkpoint stores it."""
        with torch.no_grad():
            w = self.linear.weight.float()
            q = torch.clamp(torch.round(w / self._expanded_scale()), self.scheme.weight_range.qmin,
                            self.scheme.weight_range.qmax).to(torch.int8)  # fmt: skip
        return QuantizedWeight(q, self.weight_scale.clone(), self.scheme.group_size)


def prepare_qat(
    model: nn.Module, linears: dict[str, nn.Linear], scheme: Scheme, weight_observer: str
) -> dict:
    """Swap each named linear of `model` for a QATLinear in place; -> name -> QATLinear."""
    swapped = {}
    for name, linear in linears.items():
        parent_name, leaf = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        swapped[name] = QATLinear(linear, scheme, weight_observer)
        setattr(parent, leaf, swapped[name])
    return swapped


@dataclass(frozen=True, slots=True)
class QATOptions:
    scheme: str = "w4a16"
    train: Path | None = None
    steps: int = 50
    lr: float = 1e-5
    seq_len: int = 256
    batch_size: int = 1
    group_size: int | None = None
    weight_observer: str = "mse"

    def __post_init__(self) -> None:
        make_scheme(self.scheme, "dynamic", self.group_size)
        if self.train is None:
            raise TesselError("tessel qat trains on text: give --train FILE")
        lr_ok = math.isfinite(self.lr) and MIN_QAT_LR <= self.lr <= MAX_QAT_LR
        if not 1 <= self.steps <= MAX_QAT_STEPS or not lr_ok or self.batch_size < 1 or self.seq_len < 2:
            raise TesselError(
                f"--steps must be in [1, {MAX_QAT_STEPS:,}], --lr in [{MIN_QAT_LR:g}, {MAX_QAT_LR:g}], "
                "--batch-size >= 1 and --seq-len >= 2"
            )


@dataclass(slots=True)
class QATResult:
    out_dir: Path
    losses: list[float]
    seconds: float


def train_qat(
    model_dir: str | Path,
    out_dir: str | Path,
    options: QATOptions,
    progress: StepProgress | None = None,
    *,
    overwrite: bool = False,
) -> QATResult:
    """Fine-tune `model_dir` with fake-quantised linears; write the quantised checkpoint to `out_dir` (an
    existing one only with `overwrite`, and only when tessel wrote it). A loss or weight that turns
    non-finite stops the run with a TesselError, and nothing is written."""
    from tessel.files import check_output_directory
    from tessel.quant import calibrate

    start = time.perf_counter()
    check_output_directory(out_dir, "--out", inputs=(model_dir, options.train), overwrite=overwrite)
    text = calibrate.read_calibration_text(options.train, "--train")
    model_dir = resolve_model_path(model_dir)
    scheme = make_scheme(options.scheme, "dynamic", options.group_size)
    model, tokenizer = calibrate.load_hf_model(model_dir)
    config = calibrate.read_model_config(model_dir)
    linears = calibrate.target_linears(model)
    for name, module in linears.items():
        scheme.check_in_features(module.in_features, name)
    ids = tokenizer(text)["input_ids"]
    count = len(ids) // options.seq_len
    if count < options.batch_size:
        raise TesselError(
            f"--train text has {len(ids)} tokens, fewer than --batch-size {options.batch_size} x --seq-len "
            f"{options.seq_len}; give a longer text or lower them"
        )
    windows = torch.tensor(ids[: count * options.seq_len]).view(count, options.seq_len)
    generator = torch.Generator().manual_seed(0)
    qat = prepare_qat(model, linears, scheme, options.weight_observer)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=options.lr, weight_decay=0.0)
    losses = []
    for step in range(options.steps):
        batch = windows[torch.randint(0, count, (options.batch_size,), generator=generator)]
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise _diverged(step + 1, options, f"the training loss is {losses[-1]}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        report(progress, "qat", step + 1, options.steps)
    if not all(bool(torch.isfinite(p).all()) for p in params):
        raise _diverged(options.steps, options, "the weights are not finite")
    model.eval()
    weights = {name: module.quantized_weight() for name, module in qat.items()}
    for name, module in qat.items():  # back to plain linears for the state dict
        parent_name, leaf = name.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), leaf, module.linear)
    calibrate.write_quantized(
        model, linears, scheme, weights, {}, config, model_dir, Path(out_dir), None, overwrite
    )
    return QATResult(Path(out_dir), losses, time.perf_counter() - start)


def _diverged(step: int, options: QATOptions, what: str) -> TesselError:
    """The error that stops a run whose loss or weights turned inf / nan (the learning rate is too large)."""
    return TesselError(
        f"qat diverged at step {step} of {options.steps}: {what}; nothing was written. "
        f"Give a smaller --lr (now {options.lr:g})"
    )
