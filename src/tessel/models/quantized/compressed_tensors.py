"""Quantised checkpoints in the compressed-tensors layout (what llm-compressor writes and vLLM loads).

config.json gains

    "quantization_config": {
      "quant_method": "compressed-tensors", "format": "int-quantized" | "pack-quantized",
      "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": null,
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {...}, "input_activations": {...}}}}

and each quantised linear `<prefix>` stores (symmetric: no zero points)

    int-quantized (w8a8):          <prefix>.weight int8 [N, K], .weight_scale [N, 1], .input_scale [1]
    pack-quantized (w8a16, w4a16): <prefix>.weight_packed int32 [N, K * bits / 32], .weight_scale [N, groups],
                                   .weight_shape int64 [2]
    asymmetric weight-only (`--asym`): also .weight_zero_point int32 [ceil(N * bits / 32), groups],
                                   the int8 zero points packed along the output rows

`pack-quantized` puts 32 / bits values per int32, value + 2**(bits-1) in bits, lowest bits first
(compressed_tensors.compressors.pack_quantized.helpers.pack_to_int32; tested against it). This
module is the one place that lays out and reads the format; `tessel.quant.formats.checkpoint` writes
the checkpoint directory.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import torch

from tessel.errors import TesselError
from tessel.models.quantized.schemes import QuantizedWeight, Scheme

QUANT_METHOD = "compressed-tensors"
INT_QUANTIZED = "int-quantized"
PACK_QUANTIZED = "pack-quantized"
QUANTIZED_STATUS = "compressed"
FORMAT_VERSION = "0.20.0"  # the compressed-tensors release whose layout this follows (and tests against)
IGNORED = ["lm_head"]
FLOAT_ROUTER = re.compile(r"(model\.layers\.\d+\.)?(mlp|block_sparse_moe)\.(gate|shared_expert_gate)\$?")
DECODER_LINEAR = re.compile(r"model\.layers\.\d+\.[A-Za-z0-9_.]+")
ACTORDERS_WITHOUT_G_IDX = (None, False, "weight", "static")  # compressed-tensors' ActivationOrdering


def _args(
    bits: int,
    strategy: str,
    dynamic: bool,
    group_size: int | None,
    observer: str | None = None,
    symmetric: bool = True,
) -> dict[str, Any]:
    return {
        "num_bits": bits,
        "type": "int",
        "symmetric": symmetric,
        "group_size": group_size,
        "strategy": strategy,
        "dynamic": dynamic,
        "actorder": None,
        "block_structure": None,
        "observer": observer,
        "observer_kwargs": {},
    }


def checkpoint_format(scheme: Scheme) -> str:
    return PACK_QUANTIZED if scheme.weight_only else INT_QUANTIZED


def quantization_config(
    scheme: Scheme, act_observer: str | None = None, float_linears: list[str] | tuple[str, ...] = ()
) -> dict[str, Any]:
    """The `quantization_config` of a checkpoint of `scheme`; `float_linears` (MoE routers) join `ignore`."""
    strategy = "channel" if scheme.group_size is None else "group"
    weights = _args(scheme.weight_bits, strategy, False, scheme.group_size, "minmax", scheme.symmetric)
    acts = None
    if not scheme.weight_only:
        if scheme.act_static:
            acts = _args(8, "tensor", False, None, act_observer)
        else:
            acts = _args(8, "token", True, None)
    return {
        "quant_method": QUANT_METHOD,
        "format": checkpoint_format(scheme),
        "quantization_status": QUANTIZED_STATUS,
        "version": FORMAT_VERSION,
        "global_compression_ratio": None,
        "ignore": [*IGNORED, *float_linears],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": acts,
                "output_activations": None,
                "format": None,
            }
        },
    }


def _field(cond: bool, field: str, value: Any, wanted: str) -> None:
    if not cond:
        raise TesselError(f"quantization_config.{field} = {value!r} is not supported; tessel reads {wanted}")


def _ignorable(name: str) -> bool:
    """lm_head, an MoE router (the engine keeps both in float; by name or llm-compressor's regex), or a
    decoder-layer linear by its full name (`tessel quantize --float-layers`)."""
    return (
        name in ("lm_head", "re:.*lm_head")
        or bool(FLOAT_ROUTER.fullmatch(name.removeprefix("re:.*")))
        or bool(DECODER_LINEAR.fullmatch(name))
    )


def _float_linears(ignore: list[str]) -> frozenset[str]:
    """The decoder-layer linears `ignore` leaves float, routers aside (those are float anyway)."""
    return frozenset(n for n in ignore if DECODER_LINEAR.fullmatch(n) and not FLOAT_ROUTER.fullmatch(n))


def parse_quantization_config(config: dict[str, Any]) -> Scheme | None:
    """The scheme of a config.json dict; None when it has no quantization_config."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    _field(isinstance(qc, dict), "", type(qc).__name__, "an object")
    method = qc.get("quant_method")
    _field(method == QUANT_METHOD, "quant_method", method, f"{QUANT_METHOD!r} checkpoints")
    fmt = qc.get("format")
    _field(fmt in (INT_QUANTIZED, PACK_QUANTIZED), "format", fmt, f"{INT_QUANTIZED!r} or {PACK_QUANTIZED!r}")
    ignore = qc.get("ignore") or []
    _field(
        isinstance(ignore, list) and all(isinstance(i, str) and _ignorable(i) for i in ignore),
        "ignore",
        ignore,
        "['lm_head'] and MoE routers (every other Linear quantised)",
    )
    _field(qc.get("kv_cache_scheme") is None, "kv_cache_scheme", qc.get("kv_cache_scheme"), "null")
    sparsity = qc.get("sparsity_config") or {}  # llm-compressor writes {} when nothing was pruned
    _field(
        isinstance(sparsity, dict) and sparsity.get("format", "dense") == "dense",
        "sparsity_config",
        sparsity,
        "none or format 'dense' (sparse layouts store other tensors)",
    )
    transform = qc.get("transform_config")  # QuIP / SpinQuant rotations, which the engine would not apply
    _field(not transform, "transform_config", transform, "none")
    groups = qc.get("config_groups")
    _field(isinstance(groups, dict) and len(groups) == 1, "config_groups", groups, "exactly one group")
    ((name, group),) = groups.items()
    _field(isinstance(group, dict), f"config_groups.{name}", group, "an object")
    targets = group.get("targets")
    _field(targets == ["Linear"], f"config_groups.{name}.targets", targets, "['Linear']")
    scheme = _group_scheme(f"config_groups.{name}", group, fmt)
    return dataclasses.replace(scheme, float_linears=_float_linears(ignore))


def _group_scheme(where: str, group: dict[str, Any], fmt: str) -> Scheme:
    w = group.get("weights")
    _field(isinstance(w, dict), f"{where}.weights", w, "an object")
    for key, wanted in (("type", "int"), ("dynamic", False)):
        _field(w.get(key, wanted) == wanted, f"{where}.weights.{key}", w.get(key), repr(wanted))
    symmetric = w.get("symmetric", True)
    _field(isinstance(symmetric, bool), f"{where}.weights.symmetric", symmetric, "true or false")
    bits, strategy, group_size = w.get("num_bits"), w.get("strategy"), w.get("group_size")
    _field(bits in (4, 8), f"{where}.weights.num_bits", bits, "4 or 8")
    _field(strategy in ("channel", "group"), f"{where}.weights.strategy", strategy, "'channel' or 'group'")
    if strategy == "group":
        _field(
            isinstance(group_size, int) and group_size > 0, f"{where}.weights.group_size", group_size, "> 0"
        )
    else:
        group_size = None
    # GPTQ's "weight" (alias "static") order changes how weights were rounded, not the layout;
    # "group" (alias "dynamic") stores a permutation (weight_g_idx) that tessel does not apply
    _field(
        w.get("actorder") in ACTORDERS_WITHOUT_G_IDX,
        f"{where}.weights.actorder",
        w.get("actorder"),
        "null, 'weight' or 'static'",
    )
    a = group.get("input_activations")
    _field(
        group.get("output_activations") is None,
        f"{where}.output_activations",
        group.get("output_activations"),
        "null",
    )
    if a is None:
        _field(fmt == PACK_QUANTIZED or bits == 8, "format", fmt, f"{PACK_QUANTIZED!r} for 4-bit weights")
        _field(
            fmt == PACK_QUANTIZED or symmetric, "format", fmt, f"{PACK_QUANTIZED!r} for asymmetric weights"
        )
        return Scheme("w8a16" if bits == 8 else "w4a16", bits, group_size, None, symmetric=symmetric)
    _field(isinstance(a, dict), f"{where}.input_activations", a, "an object or null")
    for key, wanted in (("type", "int"), ("symmetric", True), ("num_bits", 8)):
        _field(a.get(key, wanted) == wanted, f"{where}.input_activations.{key}", a.get(key), repr(wanted))
    kind = (a.get("strategy"), bool(a.get("dynamic")))
    _field(
        kind in (("token", True), ("tensor", False)),
        f"{where}.input_activations.strategy/dynamic",
        kind,
        "('token', dynamic) or ('tensor', static)",
    )
    _field(bits == 8, f"{where}.weights.num_bits", bits, "8 with int8 activations")
    _field(symmetric, f"{where}.weights.symmetric", symmetric, "true with int8 activations")
    _field(fmt == INT_QUANTIZED, "format", fmt, f"{INT_QUANTIZED!r} with int8 activations")
    return Scheme("w8a8", 8, group_size, 8, act_static=kind == ("tensor", False))


def module_tensors(
    scheme: Scheme, weight: QuantizedWeight, input_scale: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of one quantised linear, named relative to its module."""
    out: dict[str, torch.Tensor] = {"weight_scale": weight.scale.float().contiguous()}
    if scheme.weight_only:
        out["weight_packed"] = pack(weight.q, scheme.weight_bits)
        out["weight_shape"] = torch.tensor(list(weight.q.shape), dtype=torch.int64)
        if weight.zero_point is not None:  # packed along the output rows, as compressed-tensors does
            out["weight_zero_point"] = pack(weight.zero_point.to(torch.int8).t(), scheme.weight_bits).t()
    else:
        out["weight"] = weight.q.contiguous()
    if scheme.act_static:
        if input_scale is None:
            raise TesselError("a static-activation scheme needs an input scale per linear; calibrate first")
        out["input_scale"] = input_scale.reshape(1).float()
    return out


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 [N, K] values of `bits` bits -> int32 [N, ceil(K * bits / 32)] (the last word padded with
    zero fields, as compressed-tensors pads)."""
    n, k = q.shape
    per_word = 32 // bits
    values = q.to(torch.int64) + (1 << (bits - 1))
    values = torch.nn.functional.pad(values, (0, -k % per_word)).reshape(n, -1, per_word)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (values << shifts).sum(dim=2)  # the fields occupy disjoint bits, so the sum is their OR
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # wrap into int32


def unpack(packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Inverse of `pack`: int32 [N, K * bits / 32] -> int8 [N, K]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    fields = (packed.to(torch.int64).unsqueeze(2) >> shifts).bitwise_and((1 << bits) - 1)
    return (fields - (1 << (bits - 1))).reshape(packed.shape[0], -1)[:, :in_features].to(torch.int8)


def read_module(
    get: Callable[[str], torch.Tensor], prefix: str, scheme: Scheme
) -> tuple[QuantizedWeight, torch.Tensor | None]:
    """One quantised linear back from `get(name)`: (weight, input scale or None). Bad tensors: TesselError."""
    scale = get(f"{prefix}.weight_scale")
    if scheme.weight_only:
        q = _unpacked_weight(get, prefix, scheme.weight_bits)
    else:
        q = get(f"{prefix}.weight")
        if q.dtype != torch.int8 or q.dim() != 2:
            raise TesselError(
                f"{prefix}.weight is {q.dtype} {tuple(q.shape)}; int-quantized stores int8 [N, K]"
            )
    n, k = q.shape
    if scheme.group_size is not None and k % scheme.group_size:
        raise TesselError(f"{prefix}: group_size {scheme.group_size} does not divide in_features {k}")
    groups = 1 if scheme.group_size is None else k // scheme.group_size
    if scale.numel() != n * groups:
        raise TesselError(f"{prefix}.weight_scale has shape {tuple(scale.shape)}; expected [{n}, {groups}]")
    scale = _positive_scales(scale, f"{prefix}.weight_scale")
    zero_point = None if scheme.symmetric else _zero_points(get, prefix, scheme.weight_bits, n, groups)
    input_scale = None
    if scheme.act_static:
        input_scale = get(f"{prefix}.input_scale")
        if input_scale.numel() != 1:
            raise TesselError(
                f"{prefix}.input_scale has shape {tuple(input_scale.shape)}; expected one value"
            )
        input_scale = _positive_scales(input_scale, f"{prefix}.input_scale").reshape(1)
    return QuantizedWeight(q, scale.reshape(n, groups), scheme.group_size, zero_point), input_scale


def _positive_scales(scale: torch.Tensor, name: str) -> torch.Tensor:
    """`scale` as float32 when every value is a finite number > 0; else TesselError naming the tensor."""
    if not scale.is_floating_point():
        raise TesselError(f"{name} is {scale.dtype}; scales are stored as floating point")
    scale = scale.float()
    if not bool(torch.isfinite(scale).all()):
        raise TesselError(f"{name} has non-finite values (NaN or inf); the checkpoint is corrupt")
    if not bool((scale > 0).all()):
        raise TesselError(f"{name} has zero or negative values; every scale must be > 0")
    return scale


def _zero_points(
    get: Callable[[str], torch.Tensor], prefix: str, bits: int, n: int, groups: int
) -> torch.Tensor:
    """int8 [N, groups] from `<prefix>.weight_zero_point`, int32 packed along the output rows."""
    packed = get(f"{prefix}.weight_zero_point")
    words = -(-n * bits // 32)
    if packed.dtype != torch.int32 or tuple(packed.shape) != (words, groups):
        raise TesselError(
            f"{prefix}.weight_zero_point is {packed.dtype} {tuple(packed.shape)}; asymmetric {bits}-bit "
            f"weights [{n}, {groups} groups] need int32 [{words}, {groups}] (packed along the rows)"
        )
    return unpack(packed.t(), bits, n).t().contiguous()


def _unpacked_weight(get: Callable[[str], torch.Tensor], prefix: str, bits: int) -> torch.Tensor:
    shape = get(f"{prefix}.weight_shape")
    packed = get(f"{prefix}.weight_packed")
    if shape.numel() != 2 or shape.is_floating_point():
        raise TesselError(f"{prefix}.weight_shape must hold two integers; got {shape.tolist()}")
    n, k = (int(v) for v in shape.reshape(-1).tolist())
    words = -(-k * bits // 32)
    if packed.dtype != torch.int32 or tuple(packed.shape) != (n, words) or n < 1 or k < 1:
        raise TesselError(
            f"{prefix}.weight_packed is {packed.dtype} {tuple(packed.shape)}; weight_shape {[n, k]} "
            f"at {bits} bits needs int32 [{n}, {words}]"
        )
    return unpack(packed, bits, k)
