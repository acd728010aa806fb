"""The fields of config.json that only some architectures have, read for `tessel.catalog.hf_config`.

    attention_fields(fields, family, num_layers)   sliding window and the type of every layer
    moe_fields(fields, family, num_layers)         experts, top-k, routing, which layers route
    family_fields(fields, family)                  q/k norms, Gemma 3's activation, scalars, biases

HF semantics, per family (transformers 5 modelling code):

- a layer of type "sliding_attention" with a window W attends to keys at distance < W; Mistral,
  Mixtral and Phi-3 apply `sliding_window` to every layer; Qwen2/Qwen3 (and their MoE) only with
  `use_sliding_window`, to the layers `layer_types` marks (else from `max_window_layers` on);
  Gemma 3 to the layers `layer_types` marks (else all but every `sliding_window_pattern`-th).
- Mixtral routes every layer, always renormalising the top-k weights; Qwen2-MoE / Qwen3-MoE route
  layer i when `(i + 1) % decoder_sparse_step == 0` and i is not in `mlp_only_layers`, renormalising
  only with `norm_topk_prob`; Qwen2-MoE adds a shared expert scaled by a sigmoid gate.

Pure Python: the catalog must import without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessel.errors import TesselError

if TYPE_CHECKING:
    from tessel.catalog.hf_config import ConfigFields

# What the engine runs (`tessel list models --runnable`); the planner also reads OPTForCausalLM.
RUNNABLE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Phi3ForCausalLM",
    "Gemma3ForCausalLM",
)
LIST_RUNNABLE = "tessel list models --runnable"
FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
# The most routed experts per layer in a published model is 256 (DeepSeek-V3); the bound keeps a
# config claiming millions from sizing a router and a loop over them.
MAX_EXPERTS = 4096
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "gemma3_text")
QWEN_FAMILIES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
WINDOW_ON_EVERY_LAYER = ("mistral", "mixtral", "phi3")
# transformers' defaults where config.json leaves a field out (their config classes).
QWEN_MAX_WINDOW_LAYERS = 28
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_QUERY_PRE_ATTN_SCALAR = 256.0
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_ACTIVATION = "gelu_pytorch_tanh"
MOE_DEFAULTS = {  # family -> (experts, experts per token, expert width, shared expert width)
    "mixtral": (8, 2, None, 0),
    "qwen2_moe": (60, 4, 1408, 5632),
    "qwen3_moe": (128, 8, 768, 0),
}


def attention_fields(fields: ConfigFields, family: str, num_layers: int) -> dict:
    """`sliding_window` (the window in use, or None) and `layer_types` (one per layer, all full
    without a window)."""
    window = _window(fields, family)
    if window is None:
        return {"sliding_window": None, "layer_types": (FULL,) * num_layers}
    types = _layer_types(fields, family, num_layers)
    return {"sliding_window": window, "layer_types": types}


def _window(fields: ConfigFields, family: str) -> int | None:
    if family in QWEN_FAMILIES and not fields.flag("use_sliding_window", False):
        return None  # transformers drops the window then, whatever `sliding_window` says
    if family not in (*QWEN_FAMILIES, *WINDOW_ON_EVERY_LAYER, "gemma3_text"):
        return None  # Llama has no sliding window
    if fields.get("sliding_window") is None:
        if family == "gemma3_text":
            raise TesselError(f"{fields.source}: Gemma 3 needs 'sliding_window' (its local layers' window)")
        return None
    return fields.count("sliding_window")  # 0 or negative refused: a window of no tokens


def _layer_types(fields: ConfigFields, family: str, num_layers: int) -> tuple[str, ...]:
    if family in WINDOW_ON_EVERY_LAYER:
        return (SLIDING,) * num_layers
    listed = fields.get("layer_types")
    if listed is not None:
        if not (isinstance(listed, list) and all(t in LAYER_TYPES for t in listed)):
            raise fields.fail("layer_types", f"a list of {' / '.join(LAYER_TYPES)}", listed)
        if len(listed) != num_layers:
            raise TesselError(
                f"{fields.source}: field 'layer_types' lists {len(listed)} layers, "
                f"num_hidden_layers is {num_layers}"
            )
        return tuple(listed)
    if family == "gemma3_text":
        key = "sliding_window_pattern" if fields.get("sliding_window_pattern") is not None else None
        key = key or "_sliding_window_pattern"
        pattern = fields.count(key, default=GEMMA3_SLIDING_PATTERN)
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    first = fields.count("max_window_layers", default=QWEN_MAX_WINDOW_LAYERS, low=0)
    return tuple(SLIDING if i >= first else FULL for i in range(num_layers))


def moe_fields(fields: ConfigFields, family: str, num_layers: int, intermediate_size: int) -> dict:
    """Experts per layer, experts per token, expert and shared-expert widths, top-k renormalisation and
    the layers that route (a dense model: one expert, no routed layer)."""
    if family not in MOE_FAMILIES:
        return {"num_local_experts": 1, "num_experts_per_tok": 1}
    experts_default, per_token_default, width_default, shared_default = MOE_DEFAULTS[family]
    key = (
        "num_experts"
        if family != "mixtral" and fields.get("num_experts") is not None
        else "num_local_experts"
    )
    experts = fields.count(key, default=experts_default, high=MAX_EXPERTS)
    per_token = fields.count("num_experts_per_tok", default=per_token_default)
    if per_token > experts:
        raise TesselError(f"{fields.source}: num_experts_per_tok ({per_token}) exceeds {key} ({experts})")
    if family == "mixtral":
        width, shared, renormalise, routed = intermediate_size, 0, True, tuple(range(num_layers))
    else:
        width = fields.count("moe_intermediate_size", default=width_default)
        shared = 0
        if family == "qwen2_moe":
            shared = fields.count("shared_expert_intermediate_size", default=shared_default, low=0)
        renormalise = fields.flag("norm_topk_prob", False)
        routed = _routed_layers(fields, num_layers)
    return {
        "num_local_experts": experts,
        "num_experts_per_tok": per_token,
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": shared,
        "norm_topk_prob": renormalise,
        "moe_layers": routed,
    }


def _routed_layers(fields: ConfigFields, num_layers: int) -> tuple[int, ...]:
    step = fields.count("decoder_sparse_step", default=1)
    dense = fields.get("mlp_only_layers") or []
    if not (isinstance(dense, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in dense)):
        raise fields.fail("mlp_only_layers", "a list of layer indices", dense)
    if any(not 0 <= i < num_layers for i in dense):
        raise fields.fail("mlp_only_layers", f"layer indices in [0, {num_layers})", dense)
    return tuple(i for i in range(num_layers) if (i + 1) % step == 0 and i not in dense)


def family_fields(fields: ConfigFields, family: str) -> dict:
    """q/k norms, the MLP activation, Gemma 3's attention scalar, and what transformers would do
    differently that tessel does not (refused here, by field)."""
    out: dict = {"qk_norm": family in QK_NORM_FAMILIES}
    if family == "gemma3_text":
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if fields.get(key) is not None:
                raise fields.fail(
                    key, "null (Gemma 3 has no soft-capping; Gemma 2 is not supported)", fields.get(key)
                )
        if fields.flag("use_bidirectional_attention", False):
            raise fields.fail(
                "use_bidirectional_attention", "false (an embedding model, not a decoder)", True
            )
        scalar = fields.positive_float("query_pre_attn_scalar", GEMMA3_QUERY_PRE_ATTN_SCALAR)
        out |= {
            "hidden_act": fields.text("hidden_activation", GEMMA3_ACTIVATION),
            "query_pre_attn_scalar": scalar,
        }
    if family == "phi3":
        _check_full_rotary(fields)
    return out


def _check_full_rotary(fields: ConfigFields) -> None:
    """Phi-3 may rotate only part of each head (`partial_rotary_factor`); tessel rotates it whole."""
    params = fields.get("rope_parameters")
    nested = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    factor = nested if nested is not None else fields.get("partial_rotary_factor")
    if factor is not None and factor != 1.0:
        raise fields.fail(
            "partial_rotary_factor", "1.0 (partial rotary embeddings are not supported)", factor
        )


def gemma3_rope(fields: ConfigFields, rope) -> dict:
    """Gemma 3's two rotary bases: `rope_theta` / `rope_scaling` for full-attention layers and
    `rope_local_base_freq` (default scaling) for sliding ones, or transformers 5's `rope_parameters`
    keyed by layer type. `rope(fields)` is hf_config's flat reader, giving (theta, scaling)."""
    params = fields.get("rope_parameters")
    if isinstance(params, dict) and any(t in params for t in LAYER_TYPES):
        per_type = {}
        for layer_type in LAYER_TYPES:
            sub = params.get(layer_type)
            if not isinstance(sub, dict):
                raise fields.fail(f"rope_parameters.{layer_type}", "an object of rope settings", sub)
            source = f"{fields.source} (rope_parameters.{layer_type})"
            per_type[layer_type] = rope(type(fields)({"rope_parameters": sub}, source))
        (theta, scaling), (local_theta, local_scaling) = per_type[FULL], per_type[SLIDING]
        if local_scaling is not None:
            raise fields.fail(
                "rope_parameters.sliding_attention.rope_type", "default", local_scaling.rope_type
            )
    else:
        theta, scaling = rope(fields)
        local_theta = fields.positive_float("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA)
    return {"rope_theta": theta, "rope_scaling": scaling, "local_rope_theta": local_theta}
