"""The Llama family on tessel layers, nano-vllm style: Llama 2/3/3.1, Qwen2/Qwen3, Mistral, Phi-3,
Gemma 3, and the mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE.

q/k/v are one `qkv_proj` and gate/up one `gate_up_proj` (fewer, larger GEMMs); the loader slices the
HF tensors into them (`tessel.models.checkpoint_names`; Phi-3 stores them fused already). What the
relatives add is config-driven (`ModelConfig`): q/k RMSNorm per head before rotary (Qwen3, Gemma 3),
a sliding window per layer (Mistral, Phi-3, Gemma 3's local layers, with their own rope base),
Gemma's norm after attention and around the MLP and its embeddings scaled by sqrt(hidden) (its
(1 + w) norm weights are stored as 1 + w at load), GeGLU, and routed experts in place of the MLP
(`LlamaSparseMoe`: router, `tessel.layers.moe.ExpertMLPs`, Qwen2-MoE's gated shared expert).
The forward pass takes the step's flattened tokens ([T] ids and positions) and returns hidden
states [T, H]; `compute_logits` projects only the rows that get sampled.

The model is stage-aware, as vLLM's are: it runs the decoder layers it holds (`LlamaModel.part`,
a `tessel.models.layer_filter.LayerFilter`: all of them in one process, a pipeline stage's range
otherwise, the others `nn.Identity`). The first stage embeds token ids; a later one takes the
residual stream the stage before it sent. The last stage returns the final hidden states; any
other the residual stream to send on: hidden + residual, the sum the next layer's input norm
takes first, so the next stage's first layer sees exactly what it would see in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

import torch
from torch import nn

from tessel.layers.activation import gated_activation
from tessel.layers.attention import Attention, AttentionMetadata
from tessel.layers.embedding import LMHead, VocabEmbedding
from tessel.layers.moe import ExpertMLPs, route
from tessel.layers.norm import RMSNorm
from tessel.layers.rotary import RotaryEmbedding
from tessel.models.config import ModelConfig
from tessel.models.layer_filter import LayerFilter


@dataclass(slots=True)
class StepInputs:
    """What the model reads in one step: the step's flattened tokens as ids (the first stage) or as
    the residual stream [T, H] a later stage received, their positions [T] and the attention metadata."""

    positions: torch.Tensor
    meta: AttentionMetadata
    input_ids: torch.Tensor | None = None
    stream: torch.Tensor | None = None


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, window: int | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.rotary = [rotary]  # shared across layers; a list keeps it out of this module's children
        scale = config.attn_scale if config.attn_scale is not None else self.head_dim**-0.5
        self.attn = Attention(self.num_heads, self.head_dim, scale, self.num_kv_heads, window)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.heads(self.qkv_proj(hidden), positions)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.reshape(hidden.shape[0], self.q_size))

    def heads(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor | None,
        tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection [T, q_size + 2 kv_size] -> q [T, Hq, D], k and v [T, Hkv, D], q and k
        rotated at `positions` (or by their rope `tables`, as the compiled CPU decode step passes them)."""
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        n = qkv.shape[0]
        qk = qk.view(n, self.num_heads + self.num_kv_heads, self.head_dim)  # rotated in one go
        if self.qk_norm:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        q, k = self.rotary[0].rotate_qk(positions, qk, self.num_heads, tables)
        return q, k, v.view(n, self.num_kv_heads, self.head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        h, i = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=config.mlp_bias)
        self.act = gated_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaSparseMoe(nn.Module):
    """Routed experts in place of the MLP: softmax router, top-k, the experts' weighted sum, plus
    Qwen2-MoE's shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.top_k, self.renormalise = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(h, config.num_experts, bias=False)
        self.experts = ExpertMLPs(config.num_experts, h, config.moe_intermediate_size, config.hidden_act)
        self.shared_expert: LlamaMLP | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.renormalise)
        out = self.experts(x, weights, experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        self.window = config.layer_window(index)
        self.self_attn = LlamaAttention(config, rotary, self.window)
        self.mlp = LlamaSparseMoe(config) if config.is_moe_layer(index) else LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gemma = config.gemma
        if config.gemma:  # a norm on the attention's output, and before and after the MLP
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def plain(self) -> bool:
        """A Llama layer as the compiled CPU decode step traces it: no window, experts or Gemma norms,
        a SwiGLU MLP (Qwen3's q/k norms are part of `LlamaAttention.heads`)."""
        return (
            not (self.window or self.gemma)
            and isinstance(self.mlp, LlamaMLP)
            and (type(self.mlp.act).__name__ == "SiluAndMul")
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        if self.gemma:
            hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
            return self.post_feedforward_layernorm(self.mlp(hidden)), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        # Gemma 3's sliding layers rotate with their own base (and no scaling)
        self.local_rotary: RotaryEmbedding | None = None
        if config.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, config.local_rope_theta
            )
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5 if config.gemma else None
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self._rotary_of(config, i), i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # what this model runs: every layer, the embedding and the final norm (`LayerFilter.prune`
        # narrows it to a pipeline stage's part)
        self.part = LayerFilter(
            0, config.num_hidden_layers, embed=True, head=True, tied=config.tie_word_embeddings
        )

    def _rotary_of(self, config: ModelConfig, index: int) -> RotaryEmbedding:
        local = self.local_rotary is not None and config.layer_window(index) is not None
        return self.local_rotary if local else self.rotary

    def rotaries(self) -> list[RotaryEmbedding]:
        return [self.rotary] if self.local_rotary is None else [self.rotary, self.local_rotary]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        return hidden if self.embed_scale is None else hidden * self.embed_scale

    def forward(self, step: StepInputs) -> torch.Tensor:
        """Token ids [T] (first stage) or the received residual stream [T, H] (a later stage) ->
        the final hidden states [T, H] (last stage) or the residual stream to send on."""
        part = self.part
        if part.embed == (step.stream is not None):
            raise ValueError("the first stage takes token ids, a later stage the residual stream")
        hidden = self.embed(step.input_ids) if step.stream is None else step.stream
        residual = None
        for layer in islice(self.layers, part.layer_start, part.layer_end):
            hidden, residual = layer(step.positions, hidden, residual, step.meta)
        if not part.head:
            return hidden + residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(self, step: StepInputs) -> torch.Tensor:
        return self.model(step)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
