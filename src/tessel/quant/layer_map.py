"""Which linears of a transformers decoder layer the quantiser rounds, which read one tensor, and
which module produces that tensor (where SmoothQuant and AWQ fold their scales).

Per layer, names relative to the layer:

    Llama, Qwen2/3, Mistral    input_layernorm -> q/k/v;  o_proj;  post_attention_layernorm -> gate/up;
                               up_proj -> down_proj
    Gemma 3                    as Llama, but gate/up read pre_feedforward_layernorm (post_attention_layernorm
                               normalises the attention output before the residual add: it feeds no
                               linear); its norms compute x * (1 + w), so a scale folds as (1 + w) / s - 1
    Phi-3                      input_layernorm -> qkv_proj (fused);  post_attention_layernorm -> gate_up_proj;
                               down_proj reads act(gate) * up: its producer is the second half of
                               gate_up_proj's rows
    MoE layers (Mixtral, Qwen2/3-MoE), experts unstacked by `tessel.quant.experts`:
                               post_attention_layernorm -> every expert's gate/up (+ the shared expert's),
                               the router and Qwen2-MoE's shared-expert gate reading it too: they are
                               scaled with it and stay float (`float_readers`); each expert's up_proj ->
                               its down_proj. Each expert is its own input group (its Hessian, its
                               observer: the rows routed to it).

`checkpoint_name` maps a module name to the Hugging Face checkpoint's (Mixtral's experts are stored
as `block_sparse_moe.experts.e.w1/w3/w2`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

UNIT_OFFSET_NORMS = frozenset({"Gemma3ForCausalLM"})  # RMSNorm scales by (1 + w)
ROUTER_LEAVES = frozenset({"gate", "shared_expert_gate"})  # an MoE block's float readers
MIXTRAL_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


@dataclass(frozen=True, slots=True)
class SmoothSpec:
    """A producer whose output `linears` (quantised) and `float_readers` (kept float) read."""

    producer: str
    linears: tuple[str, ...]
    float_readers: tuple[str, ...] = ()
    producer_rows: str = "all"  # "second_half": Phi-3's gate_up_proj feeds down_proj through its up half
    unit_offset: bool = False  # the producer is a norm computing x * (1 + w)

    @property
    def recorded_at(self) -> str:
        """The module whose input is the producer's whole output (a router sees every token)."""
        return (self.float_readers or self.linears)[0]


@dataclass(slots=True)
class LayerMap:
    """A decoder layer's quantised linears: groups reading one tensor, and the smoothable producers."""

    input_groups: list[tuple[str, ...]] = field(default_factory=list)
    smooth: list[SmoothSpec] = field(default_factory=list)
    float_linears: list[str] = field(default_factory=list)  # routers: left in float, named in `ignore`

    @property
    def linears(self) -> list[str]:
        return [name for group in self.input_groups for name in group]


def layer_map(layer: nn.Module, architecture: str) -> LayerMap:
    """The map of one transformers decoder layer of `architecture` (experts already unstacked)."""
    unit = architecture in UNIT_OFFSET_NORMS
    out = LayerMap()
    attn = layer.self_attn
    fused = hasattr(attn, "qkv_proj")
    qkv = ("self_attn.qkv_proj",) if fused else tuple(f"self_attn.{p}_proj" for p in "qkv")
    out.input_groups += [qkv, ("self_attn.o_proj",)]
    out.smooth.append(SmoothSpec("input_layernorm", qkv, unit_offset=unit))
    gemma = hasattr(layer, "pre_feedforward_layernorm")
    mlp_norm = "pre_feedforward_layernorm" if gemma else "post_attention_layernorm"
    mlp = layer.mlp
    if hasattr(mlp, "experts"):
        _moe(out, mlp, mlp_norm, unit)
    else:
        _mlp(out, "mlp", mlp, mlp_norm, unit)
    return out


def _mlp(out: LayerMap, prefix: str, mlp: nn.Module, norm: str | None, unit: bool) -> tuple[str, ...]:
    """A gated MLP's groups (its gate/up smoothed from `norm` when given); -> its gate/up names."""
    if hasattr(mlp, "gate_up_proj") and isinstance(mlp.gate_up_proj, nn.Linear):  # Phi-3: fused
        gate_up, rows = (f"{prefix}.gate_up_proj",), "second_half"
    else:
        gate_up, rows = (f"{prefix}.gate_proj", f"{prefix}.up_proj"), "all"
    down = (f"{prefix}.down_proj",)
    out.input_groups += [gate_up, down]
    if norm is not None:
        out.smooth.append(SmoothSpec(norm, gate_up, unit_offset=unit))
    out.smooth.append(SmoothSpec(gate_up[-1], down, producer_rows=rows))
    return gate_up


def _moe(out: LayerMap, mlp: nn.Module, norm: str, unit: bool) -> None:
    gate_ups: tuple[str, ...] = ()
    for e in range(len(mlp.experts)):
        gate_ups += _mlp(out, f"mlp.experts.{e}", mlp.experts[e], None, unit)
    if getattr(mlp, "shared_expert", None) is not None:
        gate_ups += _mlp(out, "mlp.shared_expert", mlp.shared_expert, None, unit)
    readers = tuple(f"mlp.{leaf}" for leaf in sorted(ROUTER_LEAVES) if hasattr(mlp, leaf))
    out.float_linears += readers
    out.smooth.append(SmoothSpec(norm, gate_ups, readers, unit_offset=unit))


def model_maps(model: nn.Module) -> list[LayerMap]:
    """One map per decoder layer of a transformers causal LM."""
    architecture = type(model).__name__
    return [layer_map(layer, architecture) for layer in model.model.layers]


def checkpoint_name(name: str, architecture: str) -> str:
    """The Hugging Face checkpoint's name for module / tensor `name` of the transformers model."""
    if architecture != "MixtralForCausalLM" or ".mlp." not in name:
        return name
    name = f"{name.replace('.mlp.', '.block_sparse_moe.')}."  # a trailing dot matches a leaf too
    if ".experts." in name:
        for ours, theirs in MIXTRAL_EXPERT_NAMES.items():
            name = name.replace(f".{ours}.", f".{theirs}.")
    return name[:-1]
