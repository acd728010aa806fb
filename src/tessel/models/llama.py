"""The Llama family (Llama 2/3/3.1, Qwen2, Mistral) on tessel layers, nano-vllm style.

q/k/v are one `qkv_proj` and gate/up one `gate_up_proj` (fewer, larger GEMMs); `load_weights`
slices the HF tensors into them. The forward pass takes the step's flattened tokens
([T] ids and positions) and returns hidden states [T, H]; `compute_logits` projects only the
rows that get sampled.

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

from tessel.layers.activation import SiluAndMul
from tessel.layers.attention import Attention, AttentionMetadata
from tessel.layers.embedding import LMHead, VocabEmbedding
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
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.rotary = [rotary]  # shared across layers; a list keeps it out of this module's children
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

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
        q, k = self.rotary[0].rotate_qk(positions, qk, self.num_heads, tables)
        return q, k, v.view(n, self.num_kv_heads, self.head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=config.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

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
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # what this model runs: every layer, the embedding and the final norm (`LayerFilter.prune`
        # narrows it to a pipeline stage's part)
        self.part = LayerFilter(
            0, config.num_hidden_layers, embed=True, head=True, tied=config.tie_word_embeddings
        )

    def forward(self, step: StepInputs) -> torch.Tensor:
        """Token ids [T] (first stage) or the received residual stream [T, H] (a later stage) ->
        the final hidden states [T, H] (last stage) or the residual stream to send on."""
        part = self.part
        if part.embed == (step.stream is not None):
            raise ValueError("the first stage takes token ids, a later stage the residual stream")
        hidden = self.embed_tokens(step.input_ids) if step.stream is None else step.stream
        residual = None
        for layer in islice(self.layers, part.layer_start, part.layer_end):
            hidden, residual = layer(step.positions, hidden, residual, step.meta)
        if not part.head:
            return hidden + residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # HF tensor name fragment -> (tessel parameter fragment, shard index) for merged projections.
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

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

    def shard_sizes(self, fused: str) -> list[int]:
        c = self.config
        if fused == "qkv_proj":
            return [c.q_size, c.kv_size, c.kv_size]
        return [c.intermediate_size, c.intermediate_size]
