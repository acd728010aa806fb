"""Parameters, FLOPs and bytes moved of one decoder layer and its attention and MLP blocks.

For a Llama-family layer (hidden h, heads a, KV heads g, head dim d, FFN width f):

    attention matmuls   P_attn = h*a*d + 2*h*g*d + a*d*h          (q, k, v, o)
    MLP matmuls         P_mlp  = 3*h*f  (gated: gate, up, down)   or 2*h*f (plain, OPT)
    norms               h per RMSNorm, 2h per LayerNorm; the attention block owns the input norm,
                        the MLP block the post-attention norm
    biases              Qwen2: q/k/v (a*d + 2*g*d); OPT: q/k/v/o and fc1/fc2

    prefill, c tokens at offset p:  FLOPs 2*c*P_matmul + 4*a*d*c*(p + c/2)
                                     bytes b_w*P + 2*g*d*b_kv*(p + c) + activations
    decode, B sequences, contexts s_i: FLOPs 2*B*P_matmul + 4*a*d*sum(s_i)
                                     bytes b_w*P + 2*g*d*b_kv*sum(s_i) + activations

The 4*a*d term (QK^T and PV) belongs to the attention block; MLP blocks carry none.

Encoders (BERT, `ModelSpec.encoder`): post-norm layers of the same parameters as a plain (OPT-like)
layer with LayerNorms and biases (q/k/v/o, fc1/fc2 with a GELU between them); attention is
bidirectional, so a sequence of n tokens has n^2 (query, key) pairs, not n(n+1)/2, and nothing is
cached: no KV bytes, no decode. One forward of a sequence of n tokens:

    FLOPs  L * (2*n*P_matmul + 4*a*d*n^2)          (`encoder_forward_flops`)

Embeddings (word, position, token type) and their LayerNorm sit on the first stage; the last stage
holds nothing (no LM head). Sentence pooling (a mean over the tokens, h additions per token, under
1e-4 of a layer's FLOPs) is not counted.

Mixture of experts (Mixtral) is counted dense-equivalent: a layer *holds* all E experts, a token
*computes* through k of them, and a pass *reads* the experts its T tokens touch, E*(1-(1-k/E)^T)
in expectation (each token picks k of E, treated as uniform and independent).

dtype "int8" means W8A8 as tessel's quantisation does it: decoder linear weights in int8; norms,
biases, embedding and LM head stay fp16 (SmoothQuant and compressed-tensors leave them unquantised);
activations and the KV cache are `act_dtype` / `kv_dtype`.

Weight precisions (`WEIGHT_SCHEMES`), what each means for bytes and compute:

    fp32 / fp16 / bf16   weights and activations in that dtype; GEMMs at its peak
    int8                 W8A8: int8 per-channel weights, int8 per-token activations; GEMMs at the int8 peak
    int4                 W4A16 (AWQ / GPTQ layout): int4 weights in groups of `INT4_GROUP_SIZE` with one
                         fp16 scale each, dequantised to fp16 inside the GEMM: GEMMs at the fp16 peak,
                         only the bytes moved shrink
"""

from __future__ import annotations

from tessel.catalog.models import ModelSpec
from tessel.errors import TesselError

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "fp8": 1}
BLOCK_KINDS = ("layer", "attention", "mlp")
UNQUANTISED_BYTES = 2  # fp16: what int8 (W8A8) keeps for norms, biases, embedding and LM head
INT4_GROUP_SIZE = 128  # AWQ's and GPTQ's default group size (one fp16 scale per 128 weights)
FLOAT_WEIGHTS = frozenset({"fp32", "fp16", "bf16"})  # precisions that keep weights as floats
WEIGHT_SCHEMES = {
    "fp32": "W32A32",
    "fp16": "W16A16",
    "bf16": "W16A16 (bf16)",
    "int8": "W8A8",
    "int4": f"W4A16, groups of {INT4_GROUP_SIZE}",
}


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise TesselError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def activation_dtype(dtype: str) -> str:
    """The dtype activations flow in when weights are `dtype` (fp16 for int8 W8A8 and int4 W4A16)."""
    return "fp16" if dtype in ("int8", "fp8", "int4") else dtype


def weight_param_bytes(dtype: str) -> float:
    """Bytes per matmul weight: the dtype's, and for int4 half a byte plus its group's fp16 scale."""
    if dtype == "int4":
        return 0.5 + UNQUANTISED_BYTES / INT4_GROUP_SIZE
    return float(dtype_bytes(dtype))


def compute_dtype(dtype: str) -> str:
    """The dtype whose peak the weight GEMMs run at: int8 (W8A8) at int8, int4 (W4A16) at fp16."""
    return "fp16" if dtype == "int4" else dtype


def _check_kind(kind: str) -> None:
    if kind not in BLOCK_KINDS:
        raise TesselError(f"unknown unit kind {kind!r}; use one of {', '.join(BLOCK_KINDS)}")


def _norm_params(model: ModelSpec) -> int:
    return model.hidden_size * (2 if model.norm_kind == "layernorm" else 1)


def attention_matmul_params(model: ModelSpec) -> int:
    h, a, g, d = model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim
    return h * a * d + 2 * h * g * d + a * d * h


def _attention_vector_params(model: ModelSpec) -> int:
    a, g, d = model.num_heads, model.num_kv_heads, model.head_dim
    bias = {"none": 0, "qkv": a * d + 2 * g * d, "all": a * d + 2 * g * d + model.hidden_size}
    qk_norms = 2 * d if model.qk_norm else 0
    return bias[model.attention_bias] + qk_norms + _norm_params(model)


def expert_matmul_params(model: ModelSpec) -> int:
    """Matmul parameters of one expert MLP (the whole MLP of a dense model)."""
    matrices = 3 if model.mlp_kind == "gated" else 2
    return matrices * model.hidden_size * model.intermediate_size


def _router_params(model: ModelSpec) -> int:
    """The router, plus a shared expert and its sigmoid gate (Qwen2-MoE): what every token runs."""
    if not model.is_moe:
        return 0
    shared = model.shared_expert_intermediate_size
    shared_params = 3 * model.hidden_size * shared + model.hidden_size if shared else 0
    return model.hidden_size * model.num_experts + shared_params


def _mlp_vector_params(model: ModelSpec) -> int:
    bias = model.num_experts * (model.intermediate_size + model.hidden_size) if model.mlp_bias else 0
    return bias + _norm_params(model)


def unit_params(model: ModelSpec, kind: str) -> int:
    """Parameters held by one unit: a layer, or its attention or MLP block (norms included)."""
    _check_kind(kind)
    attention = attention_matmul_params(model) + _attention_vector_params(model)
    mlp = model.num_experts * expert_matmul_params(model) + _router_params(model) + _mlp_vector_params(model)
    return {"layer": attention + mlp, "attention": attention, "mlp": mlp}[kind]


def layer_params(model: ModelSpec) -> int:
    """Parameters of one decoder layer: P = h*a*d + 2*h*g*d + a*d*h + 3*h*f + 2h (Llama)."""
    return unit_params(model, "layer")


def embedding_params(model: ModelSpec) -> int:
    return (model.vocab_size + model.learned_position_rows) * model.hidden_size


def total_params(model: ModelSpec) -> int:
    """All parameters, each counted once (a tied LM head is the embedding)."""
    lm_head = 0 if model.tied_embeddings else model.vocab_size * model.hidden_size
    return model.num_layers * layer_params(model) + embedding_params(model) + _norm_params(model) + lm_head


def weight_bytes(model: ModelSpec, kind: str, dtype: str) -> float:
    """Bytes of one unit's weights; with int8 / int4, norms and biases stay fp16."""
    _check_kind(kind)
    b_w = weight_param_bytes(dtype)
    b_vec = max(b_w, UNQUANTISED_BYTES)
    attention = attention_matmul_params(model) * b_w + _attention_vector_params(model) * b_vec
    mlp_matmul = model.num_experts * expert_matmul_params(model) + _router_params(model)
    mlp = mlp_matmul * b_w + _mlp_vector_params(model) * b_vec
    return {"layer": attention + mlp, "attention": attention, "mlp": mlp}[kind]


def embedding_bytes(model: ModelSpec, dtype: str) -> int:
    """Token embedding (+ OPT's learned positions; + BERT's positions, token types and their
    LayerNorm), held by the first stage."""
    norm = _norm_params(model) if model.encoder else 0
    return (embedding_params(model) + norm) * max(weight_param_bytes(dtype), UNQUANTISED_BYTES)


def lm_head_bytes(model: ModelSpec, dtype: str, *, on_first_stage: bool = False) -> int:
    """Final norm + LM head, held by the last stage.

    With tied embeddings the LM head is the embedding matrix: when the last stage is not also the
    first it still needs its own copy (V*h), so that copy is counted here; only when one stage holds
    both (`on_first_stage=True`) is it free.
    """
    if model.encoder:
        return 0  # no LM head and no final norm (BERT's LayerNorm after the embeddings is the first stage's)
    b = max(weight_param_bytes(dtype), UNQUANTISED_BYTES)
    head = 0 if (model.tied_embeddings and on_first_stage) else model.vocab_size * model.hidden_size
    return (head + _norm_params(model)) * b


def kv_bytes_per_token(model: ModelSpec, kv_dtype: str = "fp16") -> int:
    """KV cache of one token in one layer: 2*g*d*b_kv (0 for an encoder: it caches nothing)."""
    if model.encoder:
        return 0
    return 2 * model.num_kv_heads * model.head_dim * dtype_bytes(kv_dtype)


def hidden_bytes(model: ModelSpec, tokens: int, act_dtype: str = "fp16") -> int:
    """Hidden states of `tokens` tokens, as sent between pipeline stages: c*h*b_act."""
    return int(tokens) * model.hidden_size * dtype_bytes(act_dtype)


def profile_shape(model: ModelSpec) -> dict[str, int]:
    """The model shape a `Profile` is keyed by (`Profile.model_shape`)."""
    return {
        "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size,
        "num_heads": model.num_heads,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
    }


# ---- FLOPs ----------------------------------------------------------------------------------


def _mlp_active_matmul_params(model: ModelSpec) -> int:
    return model.experts_per_token * expert_matmul_params(model) + _router_params(model)


def matmul_flops(model: ModelSpec, kind: str, tokens: float) -> float:
    """2 * tokens * (active matmul parameters): the weight GEMMs of `tokens` tokens."""
    _check_kind(kind)
    attention = attention_matmul_params(model)
    mlp = _mlp_active_matmul_params(model)
    return 2.0 * tokens * {"layer": attention + mlp, "attention": attention, "mlp": mlp}[kind]


def attention_core_flops(model: ModelSpec, kind: str, query_key_pairs: float) -> float:
    """QK^T and PV: 4*a*d per (query, key) pair; 0 for an MLP block."""
    _check_kind(kind)
    return 0.0 if kind == "mlp" else 4.0 * model.num_heads * model.head_dim * query_key_pairs


def prefill_query_key_pairs(chunk_tokens: float, offset_tokens: float) -> float:
    """Causal pairs of a chunk of c tokens after p cached ones: c*(p + c/2)."""
    return chunk_tokens * (offset_tokens + chunk_tokens / 2)


def query_key_pairs(model: ModelSpec, chunk_tokens: float, offset_tokens: float) -> float:
    """(query, key) pairs a chunk attends over: causal for a decoder, every pair for an encoder
    (which always sees its whole sequence at once: c^2)."""
    if model.encoder:
        return chunk_tokens * (offset_tokens + chunk_tokens)
    return prefill_query_key_pairs(chunk_tokens, offset_tokens)


def encoder_forward_flops(model: ModelSpec, sequence_tokens: float) -> float:
    """FLOPs of one encoder forward over one sequence of n tokens: every layer's weight GEMMs
    (2*n*P_matmul) and bidirectional attention (4*a*d*n^2)."""
    if not model.encoder:
        raise TesselError(f"model {model.name} is a decoder; encoder_forward_flops prices encoders")
    n = sequence_tokens
    layer = matmul_flops(model, "layer", n) + attention_core_flops(model, "layer", n * n)
    return model.num_layers * layer


# ---- bytes moved ----------------------------------------------------------------------------


def expected_experts_touched(model: ModelSpec, tokens: float) -> float:
    """Experts a pass of `tokens` tokens reads: E*(1 - (1 - k/E)^T); 1 for a dense model."""
    if not model.is_moe:
        return 1.0
    e, k = model.num_experts, model.experts_per_token
    return e * (1.0 - (1.0 - k / e) ** max(tokens, 0.0))


def weight_bytes_read(model: ModelSpec, kind: str, dtype: str, tokens: float) -> float:
    """Weight bytes one pass over `tokens` tokens reads (all of them, except untouched experts)."""
    held = weight_bytes(model, kind, dtype)
    if kind == "attention" or not model.is_moe:
        return float(held)
    untouched = model.num_experts - expected_experts_touched(model, tokens)
    return held - untouched * expert_matmul_params(model) * weight_param_bytes(dtype)


def block_dims(model: ModelSpec) -> tuple[int, int, int, int, int]:
    """(hidden, heads, KV heads, head dim, intermediate): the sizes a layer's formulas are written in."""
    return (
        model.hidden_size,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
        model.intermediate_size,
    )


def activation_elems_per_token(model: ModelSpec, kind: str) -> int:
    """Activation elements read + written per token, each op reading inputs and writing outputs once.

    attention: norm (2h), qkv proj (h + (a+2g)d), attention (2ad), o proj (ad + h), residual (3h)
    mlp gated: norm (2h), gate/up (h + 2f), act-and-mul (3f), down (f + h), residual (3h)
    mlp plain: norm (2h), fc1 (h + f), act (2f), fc2 (f + h), residual (3h)
    """
    _check_kind(kind)
    h, a, g, d, f = block_dims(model)
    attention = 7 * h + (a + 2 * g) * d + 3 * a * d
    f_active = f * model.experts_per_token + model.shared_expert_intermediate_size
    mlp = 7 * h + (6 if model.mlp_kind == "gated" else 4) * f_active
    return {"layer": attention + mlp, "attention": attention, "mlp": mlp}[kind]


def workspace_bytes(model: ModelSpec, tokens: int, act_dtype: str = "fp16") -> int:
    """Peak activation memory of a pass over `tokens` tokens: the residual stream, its normed copy
    and the widest intermediate (q/k/v + attention output, or gate/up + product)."""
    h, a, g, d = model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim
    f_active = model.intermediate_size * model.experts_per_token + model.shared_expert_intermediate_size
    widest = max((a + 2 * g) * d + a * d, 3 * f_active)
    return int(tokens) * (2 * h + widest) * dtype_bytes(act_dtype)
