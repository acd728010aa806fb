"""The one-row decode step as one native call (`tessel.kernels.decode_row`), where the model's layers
are what that operator computes: plain Llama layers (`LlamaDecoderLayer.plain`, as the compiled step
requires; Qwen3's q/k norms included) whose four linears are W8A8 with dynamic activations on
tessel's int8 GEMV (the one-row form `w8a8_int8_gemv`), rotary over the whole head, one RMSNorm
epsilon.

`NativeRow.for_layers` says whether the step can take it (None: the compiled graphs keep the row);
`NativeRow(hidden, step)` runs the held layers on the embedded token (or the received stream) and
returns what the compiled graphs would: the final norm's output, or the residual stream a stage
before the last sends on. The operator reads each layer's weights as the model holds them (packed
once by the layer; moved, once, into one stretch of huge pages, `tessel.kernels.huge_pages`) and
writes the new k/v into the layer's cache, as `Attention.store` does.
"""

from __future__ import annotations

import torch

from tessel.kernels import decode_row, huge_pages
from tessel.layers.attention import AttentionMetadata
from tessel.layers.linear import linear_form
from tessel.layers.norm import RMSNorm
from tessel.models.llama import LlamaDecoderLayer

NATIVE_FORM = "w8a8_int8_gemv"
# a layer's tensors: two norms, q/k norms (empty: none), four linears' packed, wsum128, scale, bias
PER_LAYER = 20
PACKED_AT = (4, 8, 12, 16)  # where in them the packed weights are, in the order the step reads them


def _linear_tensors(module: torch.nn.Module) -> list[torch.Tensor] | None:
    """packed, wsum128, scale, bias (empty: none) of a linear whose one-row form is the int8 GEMV."""
    form = linear_form(module)
    if form is None or form.kind != NATIVE_FORM:
        return None
    packed, wsum128, scale = form.tensors
    bias = torch.empty(0) if form.bias is None else form.bias.detach().float().contiguous()
    return [packed, wsum128, scale.detach().float().contiguous(), bias]


def _norms(layer: LlamaDecoderLayer) -> list[RMSNorm]:
    attn = layer.self_attn
    qk = [attn.q_norm, attn.k_norm] if attn.qk_norm else []
    return [layer.input_layernorm, layer.post_attention_layernorm, *qk]


def _layer_tensors(layer: LlamaDecoderLayer) -> list[torch.Tensor] | None:
    attn, mlp = layer.self_attn, layer.mlp
    linears = [_linear_tensors(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(t is None for t in linears):
        return None
    norms = [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
    if attn.qk_norm:
        norms += [attn.q_norm.weight.detach(), attn.k_norm.weight.detach()]
    else:
        norms += [torch.empty(0), torch.empty(0)]
    return [*norms, *(t for tensors in linears for t in tensors)]


class NativeRow:
    def __init__(
        self,
        layers: list[LlamaDecoderLayer],
        weights: list[torch.Tensor],
        final_norm: RMSNorm | None,
        eps: float,
    ) -> None:
        attn = layers[0].self_attn
        self.layers = layers
        self.weights = weights
        self.final_norm = None if final_norm is None else final_norm.weight.detach()
        self.eps = eps
        self.heads, self.kv_heads, self.scale = attn.num_heads, attn.num_kv_heads, attn.attn.scale

    @classmethod
    def for_layers(
        cls, layers: list[LlamaDecoderLayer], final_norm: RMSNorm | None, rotary_dim: int
    ) -> NativeRow | None:
        """The native step for these held (plain, float32-cached) layers, or None where it cannot
        run them or is turned off ($TESSEL_DECODE_ROW=off)."""
        if not decode_row.enabled():
            return None
        attn = layers[0].self_attn
        if rotary_dim != attn.head_dim or attn.head_dim % 2:
            return None  # partial rotary: the graphs keep the row
        norms = [n for layer in layers for n in _norms(layer)]
        eps = {n.eps for n in [*norms, *([final_norm] if final_norm is not None else [])]}
        if len(eps) != 1:
            return None
        weights = []
        for layer in layers:
            tensors = _layer_tensors(layer)
            if tensors is None:
                return None
            weights.extend(tensors)
        if not decode_row.available():
            return None
        huge_pages.rehome([weights[i] for i in range(len(weights)) if i % PER_LAYER in PACKED_AT])
        return cls(layers, weights, final_norm, eps.pop())

    def __call__(
        self, hidden: torch.Tensor, meta: AttentionMetadata, tables: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """hidden [1, H] (the embedded token or the received stream), the step's metadata and rope
        tables ([1, 1, D] each) -> [1, H]."""
        group = meta.decode_groups[0]
        k_caches = [layer.self_attn.attn.k_cache for layer in self.layers]
        v_caches = [layer.self_attn.attn.v_cache for layer in self.layers]
        return torch.ops.tessel.decode_row(
            hidden,
            self.weights,
            k_caches,
            v_caches,
            tables[0].reshape(-1),
            tables[1].reshape(-1),
            meta.slot_mapping,
            group.block_tables[0],
            group.context_lens,
            self.heads,
            self.kv_heads,
            self.scale,
            self.eps,
            self.final_norm,
        )
