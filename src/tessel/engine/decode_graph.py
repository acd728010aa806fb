"""One sequence's decode step as compiled graphs: the CPU engine's single-stream hot path.

Eagerly, a one-row decode step of SmolLM2-135M (W8A8, int8 LM head) spends less than half its
time in the compiled int8 GEMVs and the rest in the small eager ops around them (norms, rotary,
splits, views, the attention's gathers), each a few to tens of microseconds of dispatch on a CPU
(`benchmarks/decode_profile.py --torch-profiler 30 --lm-head int8`). Compiled, the step runs much
faster (`benchmarks/quant.py`'s `w8a8 rtn int8-head` and its `eager` row; docs/results.md).

Here the step runs as four kinds of graph, traced (`make_fx`) and compiled by inductor's C++
backend (`tessel.kernels.cpu_compile`), each compiled once and shared by every layer with the
same shapes:

    first      layer 0: input norm, qkv projection, rotary                       -> q, k, v
    attention  q against the layer's cached K/V, the block table padded to a bucket of blocks
    middle     layer i's o projection + residual, post-attention norm, MLP + residual,
               then layer i + 1's input norm, qkv projection, rotary              -> q, k, v, residual
    last       the last layer's o projection ... MLP + residual, the final norm   -> hidden
    end        (a pipeline stage before the last) as last, without the norm      -> residual stream

Eager between them: the embedding lookup and, per layer, the new k/v written into the cache. A
pipeline stage runs its layers (`LlamaModel.part`), from the residual stream it received where it
does not embed.
Attention buckets are powers of two of blocks (at least `MIN_BUCKET_TOKENS` tokens), padded
tokens masked to -inf, so a sequence compiles a new attention graph only when its context
doubles. The linears enter through their one-row forms (`tessel.layers.linear.forms`); a model
with a linear that has none or a float dtype other than float32 runs eager.

The numbers are the eager step's formulas, not its bits: inductor sums the norms' and the
attention's reductions in its own order (W8A8 then rounds a code the other way at a near-tie
now and then). Compiling costs seconds per graph on the first step that needs it (inductor
keeps the generated code on disk for later processes); `enforce_eager` turns it off
(`tessel.engine.step_plan` decides which steps run it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from typing import TypeVar

import torch
import torch.nn.functional as F

from tessel.kernels import cpu_compile
from tessel.kernels.rope import rope_rotate, rope_tables
from tessel.layers.attention import Attention, AttentionMetadata
from tessel.layers.embedding import VocabEmbedding
from tessel.layers.linear import Kept, LinearForm, linear_form
from tessel.layers.norm import RMSNorm
from tessel.models.llama import LlamaDecoderLayer, LlamaForCausalLM

T = TypeVar("T")
MIN_BUCKET_TOKENS = 64  # the smallest attention graph; shorter contexts are padded to it


@dataclass(frozen=True, slots=True)
class _Shapes:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float


@dataclass(frozen=True, slots=True)
class _Layer:
    """One decoder layer's graph inputs: weights as the traced forms take them, and its caches."""

    input_norm: torch.Tensor
    qkv: LinearForm
    o: LinearForm
    post_norm: torch.Tensor
    gate_up: LinearForm
    down: LinearForm
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    @property
    def pre_inputs(self) -> list[torch.Tensor]:
        return [self.input_norm, *self.qkv.inputs]

    @property
    def post_inputs(self) -> list[torch.Tensor]:
        return [*self.o.inputs, self.post_norm, *self.gate_up.inputs, *self.down.inputs]

    @property
    def pre_signature(self) -> tuple:
        return (tuple(self.input_norm.shape), self.qkv.signature)

    @property
    def post_signature(self) -> tuple:
        return (self.o.signature, self.gate_up.signature, self.down.signature)


@dataclass(frozen=True, slots=True)
class _Segment:
    """A graph of the step: its key in the compiled-graph cache, its builder, its weight inputs."""

    key: tuple[str, int]
    build: Callable[[], Callable]
    weights: list[torch.Tensor]


def bucket_blocks(blocks: int, block_size: int) -> int:
    """The attention graph's table length for a context of `blocks` blocks: a power of two."""
    least = -(-MIN_BUCKET_TOKENS // block_size)
    return max(least, 1 << (blocks - 1).bit_length())


def attention_graph(num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> Callable:
    """The traceable one-row attention: (q [1, Hq, D], k_cache, v_cache [blocks, block_size, Hkv, D],
    table int64 [B], context int64 [1]) -> (out [1, Hq * D], probabilities), over the B blocks of
    `table`, tokens at or past `context` masked out."""
    group = num_heads // num_kv_heads

    def attention(q, k_cache, v_cache, table, context):
        tokens = table.shape[0] * k_cache.shape[1]
        k = k_cache[table].reshape(tokens, num_kv_heads, head_dim).permute(1, 0, 2)
        v = v_cache[table].reshape(tokens, num_kv_heads, head_dim).permute(1, 0, 2)
        queries = q.reshape(num_kv_heads, group, head_dim)
        # broadcast products summed: inductor fuses the gather into both reductions (faster than the
        # eager path's gathers and matmuls at SmolLM2's heads: `benchmarks/decode_graph.py`)
        scores = (queries[:, :, None, :] * k[:, None]).sum(-1) * scale  # [Hkv, group, tokens]
        scores = scores.masked_fill(torch.arange(tokens) >= context, float("-inf"))
        p = scores.softmax(-1)  # a graph output, so it is stored, not recomputed per head_dim column
        out = (p[..., None] * v[:, None]).sum(-2)  # [Hkv, group, D]
        return out.reshape(1, num_heads * head_dim), p

    return attention


class DecodeGraph:
    """`graph(input_ids, positions, meta)` -> final hidden [1, H] of a one-sequence decode step, or
    None when compiling failed (a warning said why, once; `tessel.engine.step_plan` records it and
    runs this step and the later ones eagerly)."""

    def __init__(self, model: LlamaForCausalLM, layers: list[_Layer]) -> None:
        c, part = model.config, model.model.part
        attn = model.model.layers[part.layer_start].self_attn
        self.shapes = _Shapes(
            c.hidden_size,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            c.rms_norm_eps,
            attn.attn.scale,
        )
        self.embed = model.model.embed_tokens
        self.rotary = model.model.rotary
        self.final_norm = model.model.norm.weight.detach() if part.head else None  # None: send the stream
        self.layers = layers
        self.block_size = layers[0].k_cache.shape[1]
        self._graphs: dict[tuple, Callable] = {}
        # keys, builders and weight inputs worked out once, not per step (signatures read every
        # input's shape and strides)
        self._keys: dict[tuple, tuple[str, int]] = {}
        first = layers[0]
        self._first_segment = _Segment(
            self._key("first", first.pre_signature), functools.partial(self._first, first), first.pre_inputs
        )
        self._segments = [self._segment(i) for i in range(len(layers))]
        self._cache_shape = tuple(first.k_cache.shape)

    def _key(self, kind: str, *signature: tuple) -> tuple[str, int]:
        """A short key per distinct signature, so a step's 61 graph calls do not hash the nested
        signatures (every input's shape and strides) again."""
        return self._keys.setdefault((kind, *signature), (kind, len(self._keys)))

    def _segment(self, i: int) -> _Segment:
        """What runs after layer i's attention: `middle` into layer i + 1, `last` or `end`."""
        layer = self.layers[i]
        if i + 1 == len(self.layers) and self.final_norm is None:
            key = self._key("end", layer.post_signature)
            return _Segment(key, functools.partial(self._end, layer), layer.post_inputs)
        if i + 1 == len(self.layers):
            key = self._key("last", layer.post_signature)
            return _Segment(key, functools.partial(self._last, layer), [*layer.post_inputs, self.final_norm])
        nxt = self.layers[i + 1]
        key = self._key("middle", layer.post_signature, nxt.pre_signature)
        build = functools.partial(self._middle, layer, nxt)
        return _Segment(key, build, [*layer.post_inputs, *nxt.pre_inputs])

    @classmethod
    def for_model(cls, model: LlamaForCausalLM) -> DecodeGraph | None:
        """The graph for `model` (its attention caches set), or None where it cannot run one."""
        layers = graph_layers(model, _layer)
        return None if layers is None else cls(model, layers)

    def __call__(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        stream: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """A pipeline stage that does not embed starts from the residual `stream` it received and,
        before the last stage, returns the stream to send on (`LlamaModel.forward`)."""
        group = meta.decode_groups[0]
        context = group.context_lens.to(torch.int64)
        blocks = -(-int(context[0]) // self.block_size)
        table = torch.zeros(bucket_blocks(blocks, self.block_size), dtype=torch.int64)
        table[:blocks] = group.block_tables[0, :blocks]
        c2, s2 = rope_tables(positions, self.rotary.cos, self.rotary.sin)
        slots = meta.slot_mapping
        hidden = self.embed(input_ids) if stream is None else stream
        residual = hidden
        first = self._first_segment
        out = self._run(first.key, first.build, [hidden, *first.weights, c2, s2])
        if out is None:
            return None
        q, k, v = out[:3]
        nk, d = self.shapes.num_kv_heads, self.shapes.head_dim
        attention_key = ("attention", table.shape[0], self._cache_shape)
        for layer, segment in zip(self.layers, self._segments, strict=True):
            layer.k_cache.view(-1, nk, d).index_copy_(0, slots, k)
            layer.v_cache.view(-1, nk, d).index_copy_(0, slots, v)
            inputs = [q.contiguous(), layer.k_cache, layer.v_cache, table, context]
            out = self._run(attention_key, self._attention, inputs)
            if out is None:
                return None
            if segment.key[0] in ("last", "end"):
                out = self._run(segment.key, segment.build, [out[0], residual, *segment.weights])
                return None if out is None else out[0]
            out = self._run(segment.key, segment.build, [out[0], residual, *segment.weights, c2, s2])
            if out is None:
                return None
            q, k, v, residual = out[:4]
        raise AssertionError("unreachable: the last layer returns")

    # ---- compiling --------------------------------------------------------------------------------
    def _run(self, key: tuple, make: Callable[[], Callable], inputs: list[torch.Tensor]):
        """The compiled graph of `key` on `inputs` (traced on these inputs the first time); None
        when compiling or running fails."""

        def build() -> Callable:
            if key not in self._graphs:
                self._graphs[key] = cpu_compile.compile_graph(make(), inputs)
            return self._graphs[key]

        return cpu_compile.run(build, inputs, "the compiled decode step", "the eager decode step")

    # Each builder traces with the forms of the layers it is built for; layers whose signatures
    # match take the same inputs in the same order, so they share the graph.
    def _first(self, layer: _Layer) -> Callable:
        def first(hidden, norm, *rest):
            q, k, v, kept = self._pre(hidden, norm, layer.qkv, rest)
            return (q, k, v, *kept)

        return first

    def _middle(self, layer: _Layer, nxt: _Layer) -> Callable:
        def middle(attended, residual, *rest):
            hidden, residual, kept, rest = self._post(attended, residual, layer, list(rest))
            residual = hidden + residual  # the next layer's input norm adds the residual first
            q, k, v, kept_pre = self._pre(residual, rest[0], nxt.qkv, rest[1:])
            return (q, k, v, residual, *kept, *kept_pre)

        return middle

    def _last(self, layer: _Layer) -> Callable:
        s = self.shapes

        def last(attended, residual, *rest):
            hidden, residual, kept, rest = self._post(attended, residual, layer, list(rest))
            return (torch.rms_norm(hidden + residual, (s.hidden,), rest[0], s.eps), *kept)

        return last

    def _end(self, layer: _Layer) -> Callable:
        def end(attended, residual, *rest):
            hidden, residual, kept, _ = self._post(attended, residual, layer, list(rest))
            return (hidden + residual, *kept)  # the residual stream, as the eager stage sends it

        return end

    def _attention(self) -> Callable:
        s = self.shapes
        return attention_graph(s.num_heads, s.num_kv_heads, s.head_dim, s.scale)

    # ---- the traced pieces --------------------------------------------------------------------------
    def _pre(self, residual_sum, norm, qkv: LinearForm, rest) -> tuple:
        """Input norm, qkv projection, rotary: (q, k, v, kept); `rest` = qkv's inputs, c2, s2."""
        s = self.shapes
        n = len(qkv.inputs)
        x = torch.rms_norm(residual_sum, (s.hidden,), norm, s.eps)
        y, kept = qkv.apply(x, list(rest[:n]))
        c2, s2 = rest[n], rest[n + 1]
        q_width = (s.num_heads + s.num_kv_heads) * s.head_dim
        qk = rope_rotate(y[:, :q_width].reshape(1, s.num_heads + s.num_kv_heads, s.head_dim), (c2, s2))
        v = y[:, q_width:].reshape(1, s.num_kv_heads, s.head_dim)
        return qk[:, : s.num_heads], qk[:, s.num_heads :], v, kept

    def _post(self, attended, residual, layer: _Layer, rest: list) -> tuple:
        """o projection + residual, norm, MLP -> (mlp out, residual, kept, the inputs left over)."""
        s = self.shapes
        kept: Kept = []
        y, k1 = layer.o.apply(attended, rest)
        rest = rest[len(layer.o.inputs) :]
        residual = y + residual
        x = torch.rms_norm(residual, (s.hidden,), rest[0], s.eps)
        rest = rest[1:]
        gate_up, k2 = layer.gate_up.apply(x, rest)
        rest = rest[len(layer.gate_up.inputs) :]
        gate, up = gate_up.chunk(2, dim=-1)
        out, k3 = layer.down.apply(F.silu(gate) * up, rest)
        rest = rest[len(layer.down.inputs) :]
        kept += k1 + k2 + k3
        return out, residual, kept, rest


def graph_layers(model: LlamaForCausalLM, build: Callable[[LlamaDecoderLayer], T | None]) -> list[T] | None:
    """`build(layer)` for each decoder layer `model` runs (a pipeline stage: its own), or None where
    the CPU's compiled decode steps cannot run them: no compiler, an embedding (first stage) or a
    final norm (last stage) of another kind, weights not float32 on the CPU, a layer other than a
    Llama layer with RMSNorms and a float32 paged cache, or a layer `build` refuses."""
    inner = getattr(model, "model", None)
    if inner is None or not cpu_compile.compiler_available():
        return None
    part = inner.part
    if part.embed and not isinstance(inner.embed_tokens, VocabEmbedding):
        return None
    if part.head and not isinstance(inner.norm, RMSNorm):
        return None
    held = list(islice(inner.layers, part.layer_start, part.layer_end))
    if not held or not all(_plain_layer(layer) for layer in held):
        return None
    weight = inner.embed_tokens.weight if part.embed else held[0].input_layernorm.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    layers = [build(layer) for layer in held]
    return None if any(layer is None for layer in layers) else layers


def _plain_layer(layer: torch.nn.Module) -> bool:
    if not isinstance(layer, LlamaDecoderLayer):
        return False
    attn = layer.self_attn.attn
    if not isinstance(attn, Attention) or attn.k_cache.dtype != torch.float32 or not attn.k_cache.numel():
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return all(isinstance(n, RMSNorm) and n.weight.dtype == torch.float32 for n in norms)


def _layer(layer: LlamaDecoderLayer) -> _Layer | None:
    """The graph inputs of a decoder layer, or None where one of its linears has no traced form."""
    attn, mlp = layer.self_attn, layer.mlp
    forms = [linear_form(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(f is None for f in forms):
        return None
    qkv, o, gate_up, down = forms
    return _Layer(
        layer.input_layernorm.weight.detach(), qkv, o,
        layer.post_attention_layernorm.weight.detach(), gate_up, down,
        attn.attn.k_cache, attn.attn.v_cache,
    )  # fmt: skip
