"""An opt-in int8 LM head: the engine's `lm_head="int8"` (`tessel generate|serve --lm-head int8`).

Checkpoints keep the LM head float (`ignore: [lm_head]`; SmolLM2's is tied to the embedding), and
by default so does the engine. With `int8`, the head's weight (the embedding's when tied; the
embedding itself stays float for the lookup) is rounded per output row at load time,

    scale[v] = max_k |W[v, k]| / 127,   q[v, k] = round(W[v, k] / scale[v])   in [-127, 127]

(`tessel.models.quantized.schemes.quantize_weight` under w8a16, as the decoder linears), and the head runs
on the module the checkpoint's scheme runs its decoder linears with:

    w8a8 checkpoint                    -> `W8A8Linear`, int8 activations per token (dynamic: the head
                                          has no calibrated input scale), the CPU's int8 path
    float or weight-only, CPU float32  -> `W8A16Linear` (the int8 GEMV for a one-row step)
    weight-only, CUDA                  -> `W8A16Linear` (Triton)
    otherwise                          -> a float `nn.Linear` holding the de-quantised rows

A decode step reads 1 byte per head weight instead of 4 (SmolLM2: 28 MB instead of 113 MB).
"""

from __future__ import annotations

import torch
from torch import nn

from tessel.errors import TesselError
from tessel.layers.embedding import LMHead, QuantizedLMHead
from tessel.layers.linear import W8A8Linear, W8A16Linear, dequantized_linear
from tessel.models.quantized.schemes import Scheme, make_scheme, quantize_weight

LM_HEAD_MODES = ("float", "int8")  # float: as the checkpoint says (the default)


def check_lm_head_mode(mode: object) -> str:
    """`mode` if it names an LM head mode, else a TesselError saying which ones exist."""
    if not isinstance(mode, str) or mode not in LM_HEAD_MODES:
        raise TesselError(f"lm_head must be one of {', '.join(LM_HEAD_MODES)}; got {mode!r}")
    return mode


def quantize_lm_head(
    head: LMHead, scheme: Scheme | None, dtype: torch.dtype, device: str | torch.device
) -> QuantizedLMHead:
    """The int8 head for a model whose decoder linears follow `scheme` (None: a float checkpoint)."""
    weight = head.weight.detach()
    quantized = quantize_weight(weight, make_scheme("w8a16"))
    q, scale = quantized.q, quantized.scale.reshape(-1)
    return QuantizedLMHead(_module(q, scale, scheme, dtype, torch.device(device)))


def _module(
    q: torch.Tensor, scale: torch.Tensor, scheme: Scheme | None, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    if scheme is not None and not scheme.weight_only:
        return W8A8Linear(q.to(device), scale.to(device))
    if device.type == "cuda":
        return W8A16Linear(q.to(device), scale.to(device))
    if device.type == "cpu" and dtype == torch.float32:
        return W8A16Linear(q.cpu(), scale.cpu())
    weight = (q.float() * scale[:, None].float()).to(device)
    return dequantized_linear(weight, None, dtype)
