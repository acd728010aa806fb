"""A decode step of several sequences as compiled graphs between the linears' GEMMs (CPU); also
one sequence's where the model has no one-row traced form (`tessel.engine.decode_graph`). The
engine takes it for models with a split linear (`tessel.engine.step_plan`).

At 32 rows the library GEMMs are most of a step, and the ops between them (norms, rotary, splits,
W8A8's per-token quantiser and epilogue, SiLU-and-mul) are eager dispatch, each a few to tens of
microseconds, which compiled graphs save (`benchmarks/decode_profile.py --concurrent 32
--torch-profiler 20`; docs/results.md). Here those ops run as
graphs traced (`make_fx`) and compiled by inductor's C++ backend (`tessel.kernels.cpu_compile`),
and each GEMM is called eagerly between them, split by `tessel.layers.linear.forms` (fbgemm's
int8 GEMM alone, its quantiser and epilogue in the graphs; any other linear whole). Per layer:

    first / next  (down's post + residual,) input norm, qkv's pre     graph (layer 0: "first")
    qkv           GEMM                                                 eager
    rotary        qkv's post, rotary -> q, k, v                        graph
    attention     the layer's own module on the real rows: cache write, paged decode
    o_in          o's pre (only where it computes anything)            graph
    o             GEMM
    post_attn     o's post + residual, post-attention norm, gate_up's pre   graph
    gate_up       GEMM
    act           gate_up's post, SiLU-and-mul, down's pre             graph
    down          GEMM
    last          (after the last layer) down's post + residual, final norm   graph
    end           (a pipeline stage before the last) down's post + residual: the stream   graph

A pipeline stage runs its layers (`LlamaModel.part`), from the residual stream it received where
it does not embed.

Graphs are compiled per bucket of rows (`tessel.layers.buckets.bucket_rows`: 1, 2, 4, 8, 16, then
multiples of 16) and shared by every layer with the same shapes, on the first step that needs them
or by `LLMEngine.warm_up()` (seconds per bucket; inductor keeps the generated code on disk for later
processes). A step with fewer rows than its bucket pads the
graphs' rows (token 0 at position 0: finite, never read back); the GEMMs and the attention run on
the real rows only, their outputs copied into padded buffers.

The numbers are the eager step's formulas, not its bits: inductor sums the norms' reductions in
its own order (W8A8 then rounds a code the other way at a near-tie now and then), as in the
one-sequence step (`tessel.engine.decode_graph`). `enforce_eager` turns it off (`tessel.engine.step_plan`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tessel.engine.decode_graph import graph_layers
from tessel.kernels import cpu_compile
from tessel.kernels.rope import rope_rotate, rope_tables
from tessel.layers.attention import Attention, AttentionMetadata
from tessel.layers.buckets import bucket_rows
from tessel.layers.linear import SplitLinear, split_linear
from tessel.models.llama import LlamaDecoderLayer, LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: SplitLinear
    o: SplitLinear
    post_norm: torch.Tensor
    gate_up: SplitLinear
    down: SplitLinear
    attention: Attention


@dataclass(frozen=True, slots=True)
class _Shapes:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


def _residual(split: SplitLinear, acc: torch.Tensor, rest: tuple) -> torch.Tensor:
    """`split`'s output + the residual, from a graph's inputs after the GEMM's output: what its
    post carries, its weights, the residual, one more tensor (a norm's weight)."""
    n = split.num_carried
    return split.post(acc, list(rest[:n]), list(rest[n:-2])) + rest[-2]


def _pre_outputs(split: SplitLinear, x: torch.Tensor) -> list[torch.Tensor]:
    """A graph's tail that feeds `split`'s call: its inputs, then what its post carries."""
    inputs, carried = split.pre(x)
    return [*inputs, *carried]


class BatchDecodeGraph:
    """`graph(input_ids, positions, meta)` -> final hidden [rows, H] of a step of decodes only, or
    None when compiling failed (a warning said why, once; `tessel.engine.step_plan` records it and
    runs this step and the later ones eagerly)."""

    def __init__(self, model: LlamaForCausalLM, layers: list[_Layer]) -> None:
        inner, c = model.model, model.config
        attn = inner.layers[inner.part.layer_start].self_attn
        self.shapes = _Shapes(c.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim, c.rms_norm_eps)
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary
        self.final_norm = inner.norm.weight.detach() if inner.part.head else None  # None: send the stream
        self.layers = layers
        self._graphs: dict[tuple, Callable] = {}
        self._padded_buffers: dict[tuple[str, int, int], torch.Tensor] = {}

    @property
    def splits_a_linear(self) -> bool:
        """Whether some linear is split (its quantiser and epilogue in the graphs); with every linear
        called whole the graphs hold only the norms, rotary and activation (the engine's choice:
        `tessel.engine.step_plan`)."""
        return any(
            s.traced_pre for layer in self.layers for s in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )

    @classmethod
    def for_model(cls, model: LlamaForCausalLM) -> BatchDecodeGraph | None:
        """The graphs for `model` (its attention caches set), or None where it cannot run them."""
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
        rows = positions.shape[0]
        bucket = bucket_rows(rows)
        pos = F.pad(positions, (0, bucket - rows))
        c2, s2 = rope_tables(pos, self.rotary.cos, self.rotary.sin)
        if stream is None:
            hidden = self.embed(F.pad(input_ids, (0, bucket - rows)))
        else:
            hidden = F.pad(stream, (0, 0, 0, bucket - rows))  # padded rows: zeros, finite
        first = self.layers[0]
        out = self._run("first", bucket, (first.qkv,), self._first, [hidden, first.input_norm])
        for i, layer in enumerate(self.layers):
            if out is None:
                return None
            out = self._layer(i, layer, out, rows, bucket, meta, (c2, s2))
        return None if out is None else out[0][:rows]

    def _layer(self, i: int, layer: _Layer, out: list, rows: int, bucket: int, meta, tables) -> list | None:
        """Layer i from its qkv call's inputs (`out`: the call's inputs, carried, residual) to the
        next layer's (or, after the last, [final hidden])."""
        n = 1 + layer.qkv.num_carried
        calls, residual = out[:n], out[n]
        acc = self._gemm("qkv", layer.qkv, calls[:1], rows, bucket)
        qkv_in = [acc, *calls[1:], *layer.qkv.weights, *tables]
        out = self._run("rotary", bucket, (layer.qkv,), self._rotary, qkv_in)
        if out is None:
            return None
        q, k, v = (t[:rows] for t in out)
        attended = layer.attention(q.contiguous(), k, v, meta)
        x = self._padded("attention", attended.view(rows, -1), bucket)
        calls = [x]
        if layer.o.traced_pre:
            calls = self._run("o_in", bucket, (layer.o,), self._o_in, [x])
            if calls is None:
                return None
        acc = self._gemm("o", layer.o, calls[:1], rows, bucket)
        post_in = [acc, *calls[1:], *layer.o.weights, residual, layer.post_norm]
        out = self._run("post_attn", bucket, (layer.o, layer.gate_up), self._post_attn, post_in)
        if out is None:
            return None
        n = 1 + layer.gate_up.num_carried
        calls, residual = out[:n], out[n]
        acc = self._gemm("gate_up", layer.gate_up, calls[:1], rows, bucket)
        act_in = [acc, *calls[1:], *layer.gate_up.weights]
        calls = self._run("act", bucket, (layer.gate_up, layer.down), self._act, act_in)
        if calls is None:
            return None
        acc = self._gemm("down", layer.down, calls[:1], rows, bucket)
        down_in = [acc, *calls[1:], *layer.down.weights, residual]
        if i + 1 == len(self.layers) and self.final_norm is None:
            return self._run("end", bucket, (layer.down,), self._end, down_in)
        if i + 1 == len(self.layers):
            return self._run("last", bucket, (layer.down,), self._last, [*down_in, self.final_norm])
        nxt = self.layers[i + 1]
        return self._run("next", bucket, (layer.down, nxt.qkv), self._next, [*down_in, nxt.input_norm])

    # ---- eager pieces ------------------------------------------------------------------------------
    def _gemm(self, role: str, split: SplitLinear, calls: list[torch.Tensor], rows: int, bucket: int):
        """`split`'s call on the real rows, padded back to the bucket."""
        if rows == bucket:
            return split.call(calls)
        return self._padded(role, split.call([t[:rows] for t in calls]), bucket)

    def _padded(self, role: str, t: torch.Tensor, bucket: int) -> torch.Tensor:
        """t [rows, N] in the first rows of a [bucket, N] buffer kept for this role (rows past the
        step's hold zeros or an earlier step's values: finite, never read back)."""
        if t.shape[0] == bucket:
            return t
        key = (role, bucket, t.shape[1])
        buffer = self._padded_buffers.get(key)
        if buffer is None:
            buffer = self._padded_buffers[key] = torch.zeros(bucket, t.shape[1])
        buffer[: t.shape[0]].copy_(t)
        return buffer

    def _run(self, kind: str, bucket: int, splits: tuple, make: Callable, inputs: list) -> list | None:
        """The compiled graph of `kind` for these splits' signatures on `inputs`; None on failure."""
        key = (kind, bucket, *(s.signature for s in splits))

        def build() -> Callable:
            if key not in self._graphs:
                self._graphs[key] = cpu_compile.compile_graph(make(*splits), inputs)
            return self._graphs[key]

        return cpu_compile.run(build, inputs, "the compiled batch decode step", "the eager decode step")

    # ---- the traced pieces (builders: the splits they trace -> the function) -----------------------
    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.rms_norm(x, (self.shapes.hidden,), weight, self.shapes.eps)

    def _first(self, qkv: SplitLinear) -> Callable:
        def first(hidden, norm):
            return (*_pre_outputs(qkv, self._norm(hidden, norm)), hidden)

        return first

    def _rotary(self, qkv: SplitLinear) -> Callable:
        s = self.shapes
        n, q_width = qkv.num_carried, (s.num_heads + s.num_kv_heads) * s.head_dim

        def rotary(acc, *rest):
            y = qkv.post(acc, list(rest[:n]), list(rest[n:-2]))
            heads = y[:, :q_width].reshape(y.shape[0], s.num_heads + s.num_kv_heads, s.head_dim)
            qk = rope_rotate(heads, (rest[-2], rest[-1]))
            v = y[:, q_width:].reshape(y.shape[0], s.num_kv_heads, s.head_dim)
            return qk[:, : s.num_heads], qk[:, s.num_heads :], v

        return rotary

    def _o_in(self, o: SplitLinear) -> Callable:
        def o_in(x):
            return tuple(_pre_outputs(o, x))

        return o_in

    def _post_attn(self, o: SplitLinear, gate_up: SplitLinear) -> Callable:
        def post_attn(acc, *rest):
            residual = _residual(o, acc, rest)
            return (*_pre_outputs(gate_up, self._norm(residual, rest[-1])), residual)

        return post_attn

    def _act(self, gate_up: SplitLinear, down: SplitLinear) -> Callable:
        n = gate_up.num_carried

        def act(acc, *rest):
            gate, up = gate_up.post(acc, list(rest[:n]), list(rest[n:])).chunk(2, dim=-1)
            return tuple(_pre_outputs(down, F.silu(gate) * up))

        return act

    def _next(self, down: SplitLinear, qkv: SplitLinear) -> Callable:
        def next_layer(acc, *rest):
            residual = _residual(down, acc, rest)
            return (*_pre_outputs(qkv, self._norm(residual, rest[-1])), residual)

        return next_layer

    def _last(self, down: SplitLinear) -> Callable:
        def last(acc, *rest):
            residual = _residual(down, acc, rest)
            return (self._norm(residual, rest[-1]),)

        return last

    def _end(self, down: SplitLinear) -> Callable:
        n = down.num_carried

        def end(acc, *rest):  # the residual stream, as the eager stage sends it
            return (down.post(acc, list(rest[:n]), list(rest[n:-1])) + rest[-1],)

        return end


def _layer(layer: LlamaDecoderLayer) -> _Layer:
    """A decoder layer's pieces (every linear has a split form)."""
    attn, mlp = layer.self_attn, layer.mlp
    return _Layer(
        layer.input_layernorm.weight.detach(), split_linear(attn.qkv_proj), split_linear(attn.o_proj),
        layer.post_attention_layernorm.weight.detach(), split_linear(mlp.gate_up_proj),
        split_linear(mlp.down_proj), attn.attn,
    )  # fmt: skip
