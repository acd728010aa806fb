"""A decode step on the CPU as compiled graphs: the model's own modules, traced between the calls a
graph cannot hold.

Eagerly, a decode step of a few rows spends much of its time dispatching the small ops around the
GEMMs (norms, rotary, splits, views, W8A8's quantiser and epilogue, SiLU-and-mul, the attention's
gathers), each a few to tens of microseconds on a CPU (`benchmarks/decode_profile.py`). Here those
ops run as graphs traced (`make_fx`) and compiled by inductor's C++ backend
(`tessel.kernels.cpu_compile`); figures in docs/results.md (`benchmarks/decode_graph.py`,
`benchmarks/quant.py`).

The step is the model's forward (`LlamaModel.forward`, `LlamaDecoderLayer.forward`) over the layers
it holds, piece by piece, each piece the model's own module or method:

    input norm     the layer's `RMSNorm`, adding the residual (the first layer starts the stream)
    qkv_proj       a linear (below)
    heads          `LlamaAttention.heads`: q, k, v split out of the fused output, q and k rotated
    attention      a cut (below)
    o_proj         a linear
    post norm      `RMSNorm` with the residual
    gate_up_proj   a linear
    act            `LlamaMLP.act` (SiLU-and-mul)
    down_proj      a linear
    ... the next layer, then `last`: the final norm, or `end` (a pipeline stage before the last):
    the residual stream it sends on

Eager before them: the embedding lookup, or the residual stream a later stage received. Each run of
pieces between two cuts is one graph, its weights graph inputs (a norm's through
`torch.func.functional_call`), so the layers with the same shapes share it. The cuts:

    a linear    at one row where every linear has a traced one-row form (`layer.one_row_form()`):
                none, its formula is inside the graph; otherwise its split form (`layer.split()`):
                the quantiser and the epilogue inside the graphs, the library GEMM called between
                them, an opaque linear (any other) called whole (`tessel.layers.linear.forms`)
    attention   with the one-row forms: the new k/v written into the cache (`Attention.store`),
                then `attention_graph` over the block table padded to a bucket of blocks (a power of
                two, at least `MIN_BUCKET_TOKENS` tokens; a sequence compiles a new attention graph
                only when its context doubles); otherwise the layer's own `Attention` on the real rows

So a layer of one row with one-row forms is two graphs (the attention; o_proj to the next layer's
rotary), a layer of split linears five graphs around four GEMM calls and the attention.

Rows come in buckets (`tessel.layers.buckets.bucket_rows`: 1, 2, 4, 8, 16, then multiples of 16);
a step with fewer rows than its bucket pads the graphs' rows (token 0 at position 0: finite, never
read back) and runs the calls and the attention on the real rows only, their outputs copied into
padded buffers. A step of `rows` is taken (`takes`) at one row where every linear has a one-row
form, and at any row count where some linear is split; with every linear called whole the graphs
would hold only the norms, rotary and activation, not worth seconds of compiling per bucket of rows,
so such steps run eager (`tessel.engine.step_plan` asks `takes`).

A one-row step whose layers are all plain W8A8 layers on tessel's int8 GEMV does not run these graphs:
it is one native call (`tessel.engine.native_row`, the operator `tessel::decode_row`), the same
formulas in C++, where the graphs' calls from Python cost about as much as reading the weights.

The numbers are the eager step's formulas, not its bits: inductor sums the norms' and the
attention's reductions in its own order (W8A8 then rounds a code the other way at a near-tie now and
then). Compiling costs seconds per graph on the first step that needs it, or in
`LLMEngine.warm_up()` (inductor keeps the generated code on disk for later processes);
`enforce_eager` turns it off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from tessel.engine.native_row import NativeRow
from tessel.kernels import cpu_compile
from tessel.kernels.rope import rope_tables
from tessel.layers.attention import Attention, AttentionMetadata
from tessel.layers.buckets import bucket_rows
from tessel.layers.embedding import VocabEmbedding
from tessel.layers.linear import SplitLinear, linear_form, split_linear
from tessel.layers.norm import RMSNorm
from tessel.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, StepInputs

MIN_BUCKET_TOKENS = 64  # the smallest attention graph; shorter contexts are padded to it


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


# ---- the pieces of the forward --------------------------------------------------------------------
Values = list[torch.Tensor]  # what flows from one piece to the next (besides the residual stream)


@dataclass(frozen=True, slots=True)
class _Piece:
    """A traced piece of the forward: `apply(values, residual, inputs, tables)` -> (values, residual,
    kept), `inputs` standing for `weights` (graph placeholders when traced), `tables` for the step's
    rope tables. `kept`: tensors the graph returns so that inductor stores them once instead of
    recomputing them inside each reduction that reads them (a one-row form's input and codes)."""

    signature: tuple  # what a graph holding it depends on, besides the inputs' layout
    weights: tuple[torch.Tensor, ...]
    apply: Callable
    arity: int  # how many values it returns
    residual: bool | None = None  # True: sets the residual stream, False: ends it, None: leaves it
    tables: bool = False


@dataclass(frozen=True, slots=True)
class _Call:
    """A linear's library GEMM (an opaque linear: the module) between two graphs, on the real rows."""

    split: SplitLinear
    role: str  # names its padded buffer


@dataclass(frozen=True, slots=True)
class _Attend:
    attn: Attention
    graph: bool  # the one-row attention graph; else the module on the real rows


@dataclass(frozen=True, slots=True)
class _Segment:
    """Consecutive pieces as one compiled graph: inputs (values, the residual where a piece uses it,
    the pieces' weights, the rope tables where a piece reads them) -> (values, the residual where a
    piece set it, what the pieces keep)."""

    key: tuple  # in the compiled-graph cache
    pieces: tuple[_Piece, ...]
    num_values: int  # values in
    uses_residual: bool  # some piece sets or ends it
    takes_residual: bool
    returns_residual: bool
    tables: bool
    arity: int  # values out
    weights: tuple[torch.Tensor, ...]

    def trace(self) -> Callable:
        def segment(*inputs):
            values, rest = list(inputs[: self.num_values]), list(inputs[self.num_values :])
            residual = rest.pop(0) if self.takes_residual else None
            tables = (rest[-2], rest[-1]) if self.tables else None
            kept = []
            for piece in self.pieces:
                n = len(piece.weights)
                values, residual, k = piece.apply(values, residual, rest[:n], tables)
                rest, kept = rest[n:], kept + k
            return (*values, *([residual] if self.returns_residual else []), *kept)

        return segment


def _weighted(module: nn.Module, weights: list[torch.Tensor]) -> Callable:
    """`module` called with `weights` standing for its parameters, in their order."""
    names = [name for name, _ in module.named_parameters()]
    return lambda *args: functional_call(module, dict(zip(names, weights, strict=True)), args)


def _norm(norm: RMSNorm) -> _Piece:
    """`LlamaDecoderLayer.forward`'s norms: norm(x + residual) and the new residual x + residual; the
    first layer's norm(x), the stream starting at x."""

    def apply(values, residual, weights, tables):
        if residual is None:
            return [_weighted(norm, weights)(values[0])], values[0], []
        out, residual = _weighted(norm, weights)(values[0], residual)
        return [out], residual, []

    w = norm.weight.detach()
    return _Piece(("norm", tuple(w.shape), w.dtype, norm.eps), (w,), apply, 1, residual=True)


def _finish(norm: RMSNorm | None) -> _Piece:
    """`LlamaModel.forward` after its last layer: the final norm of hidden + residual, or (a stage
    before the last, `norm` None) the residual stream hidden + residual it sends on."""

    def end(values, residual, weights, tables):
        return [values[0] + residual], None, []

    def last(values, residual, weights, tables):
        return [_weighted(norm, weights)(values[0], residual)[0]], None, []

    if norm is None:
        return _Piece(("end",), (), end, 1, residual=False)
    w = norm.weight.detach()
    return _Piece(("last", tuple(w.shape), w.dtype, norm.eps), (w,), last, 1, residual=False)


class _Heads(nn.Module):
    """`LlamaAttention.heads` as a module's forward, so that its q/k norms' weights (Qwen3) are graph
    inputs (`functional_call`) and layers of one shape share a graph."""

    def __init__(self, attn: LlamaAttention) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return self.attn.heads(qkv, None, (cos, sin))


def _heads(attn: LlamaAttention) -> _Piece:
    heads = _Heads(attn)
    norms = (attn.q_norm, attn.k_norm) if attn.qk_norm else ()
    names = ("attn.q_norm.weight", "attn.k_norm.weight")[: len(norms)]

    def apply(values, residual, weights, tables):
        out = functional_call(heads, dict(zip(names, weights, strict=True)), (values[0], *tables))
        return list(out), residual, []

    shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
    qk_norm = tuple((n.weight.dtype, n.eps) for n in norms)
    return _Piece(("heads", shape, qk_norm), tuple(n.weight.detach() for n in norms), apply, 3, tables=True)


def _act(act: nn.Module) -> _Piece:
    def apply(values, residual, weights, tables):
        return [_weighted(act, weights)(values[0])], residual, []

    weights = tuple(w.detach() for w in act.parameters())
    return _Piece(("act", type(act).__qualname__, *(w.shape for w in weights)), weights, apply, 1)


def _linear(module: nn.Module, one_row: bool, role: str) -> list[_Piece | _Call]:
    """A linear as the step runs it: its one-row form inside the graph, or its split form around its
    GEMM call (an opaque linear: only the call)."""
    if one_row:
        form = linear_form(module)

        def traced(values, residual, weights, tables):
            y, kept = form.apply(values[0], weights)
            return [y], residual, kept

        return [_Piece(("form", form.signature), tuple(form.inputs), traced, 1)]
    split = split_linear(module)
    if not split.traced_pre:
        return [_Call(split, role)]

    def pre(values, residual, weights, tables):
        inputs, carried = split.pre(values[0])
        return [*inputs, *carried], residual, []

    def post(values, residual, weights, tables):
        return [split.post(values[0], values[1:], weights)], residual, []

    return [
        _Piece(("pre", split.signature), (), pre, 1 + split.num_carried),
        _Call(split, role),
        _Piece(("post", split.signature), split.weights, post, 1),
    ]


def _layer(layer: LlamaDecoderLayer, one_row: bool) -> list[_Piece | _Call | _Attend]:
    """`LlamaDecoderLayer.forward`, piece by piece."""
    attn, mlp = layer.self_attn, layer.mlp
    return [
        _norm(layer.input_layernorm),
        *_linear(attn.qkv_proj, one_row, "qkv"),
        _heads(attn),
        _Attend(attn.attn, graph=one_row),
        *_linear(attn.o_proj, one_row, "o"),
        _norm(layer.post_attention_layernorm),
        *_linear(mlp.gate_up_proj, one_row, "gate_up"),
        _act(mlp.act),
        *_linear(mlp.down_proj, one_row, "down"),
    ]


def _linears(layer: LlamaDecoderLayer) -> list[nn.Module]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


# ---- the step -------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Step:
    rows: int
    bucket: int
    meta: AttentionMetadata
    tables: tuple[torch.Tensor, torch.Tensor]
    table: torch.Tensor | None = None  # the one-row attention graph's block table and context
    context: torch.Tensor | None = None


class CpuGraph:
    """`graph(step)` (a `StepInputs`) -> the hidden states [rows, H] of a step of decodes only (a
    pipeline stage before the last: the residual stream to send on; a stage after the first starts
    from the `stream` it received), or None when compiling failed (a warning said
    why, once; `tessel.engine.step_plan` records it and runs this step and the later ones eagerly)."""

    def __init__(
        self, model: LlamaForCausalLM, layers: list[LlamaDecoderLayer], all_rows: bool = False
    ) -> None:
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary
        self.final_norm = inner.norm if inner.part.head else None  # None: send the stream on
        self.layers = layers
        linears = [m for layer in layers for m in _linears(layer)]
        # every linear traced whole at one row, with the attention graph
        self.row_forms = all(linear_form(m) is not None for m in linears)
        # some linear's quantiser and epilogue go into the graphs (worth compiling at any row count)
        self.splits_a_linear = any(split_linear(m).traced_pre for m in linears)
        self.all_rows = all_rows
        attn = layers[0].self_attn
        self._attention_shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.attn.scale)
        self._block_size = attn.attn.k_cache.shape[1]
        self._programs: dict[int, list] = {}
        self._keys: dict[tuple, tuple] = {}
        self._graphs: dict[tuple, Callable] = {}
        self._padded_buffers: dict[tuple[str, int, int], torch.Tensor] = {}
        # one row as one native call where the layers are what it computes (else the graphs)
        self.native_row = None
        if self.row_forms:
            self.native_row = NativeRow.for_layers(layers, self.final_norm, self.rotary.rotary_dim)

    @classmethod
    def for_model(cls, model: LlamaForCausalLM, all_rows: bool = False) -> CpuGraph | None:
        """The graph for `model` (its attention caches set), or None where it cannot run one or would
        take no step. `all_rows`: take every row count even with every linear called whole (the tests'
        float models, whose logits HF gives exactly)."""
        layers = held_layers(model)
        if layers is None:
            return None
        graph = cls(model, layers, all_rows)
        return graph if graph.row_forms or graph.splits_a_linear or all_rows else None

    def takes(self, rows: int) -> bool:
        """Whether a decode step of `rows` runs as this graph (else eager: not worth compiling)."""
        return (rows == 1 and self.row_forms) or self.splits_a_linear or self.all_rows

    def __call__(self, step: StepInputs) -> torch.Tensor | None:
        positions, meta, input_ids, stream = step.positions, step.meta, step.input_ids, step.stream
        rows = positions.shape[0]
        bucket = bucket_rows(rows)
        program = self._programs.get(bucket) or self._program(bucket)
        pad = bucket - rows  # padded rows: token 0 at position 0, or a zero stream
        if pad:
            positions = F.pad(positions, (0, pad))
        step = _Step(rows, bucket, meta, rope_tables(positions, self.rotary.cos, self.rotary.sin))
        if stream is None:
            hidden = self.embed(F.pad(input_ids, (0, pad)) if pad else input_ids)
        else:
            hidden = F.pad(stream, (0, 0, 0, pad)) if pad else stream.contiguous()
        if rows == 1 and self.native_row is not None:
            return self.native_row(hidden, meta, step.tables)
        values: Values | None = [hidden]
        residual = None
        for item in program:
            if isinstance(item, _Segment):
                inputs = [*values, *([residual] if item.takes_residual else []), *item.weights]
                out = self._run(item.key, item.trace, [*inputs, *step.tables] if item.tables else inputs)
                if out is None:
                    return None
                values = list(out[: item.arity])
                if item.uses_residual:
                    residual = out[item.arity] if item.returns_residual else None
            elif isinstance(item, _Call):
                values = [self._gemm(item, values[0], step), *values[1:]]
            else:
                values = self._attend(item, values, step)
                if values is None:
                    return None
        return values[0] if pad == 0 else values[0][:rows]

    # ---- the program of a bucket: the pieces grouped into graphs between the cuts -------------------
    def _program(self, bucket: int) -> list[_Segment | _Call | _Attend]:
        one_row = bucket == 1 and self.row_forms
        items = [item for layer in self.layers for item in _layer(layer, one_row)]
        items.append(_finish(self.final_norm))
        program: list = []
        run: list[_Piece] = []
        num_values, has_residual = 1, False  # the step starts from the embedded ids or the stream
        for item in [*items, None]:
            if isinstance(item, _Piece):
                run.append(item)
                continue
            if run:
                segment = self._segment(bucket, tuple(run), num_values, has_residual)
                program.append(segment)
                num_values, run = segment.arity, []
                has_residual = segment.returns_residual if segment.uses_residual else has_residual
            if isinstance(item, _Attend):
                num_values = 1
            if item is not None:
                program.append(item)
        self._programs[bucket] = program
        return program

    def _segment(
        self, bucket: int, pieces: tuple[_Piece, ...], num_values: int, has_residual: bool
    ) -> _Segment:
        """`pieces` as one graph, from `num_values` values (and the residual stream, if there is one)."""
        uses = [p.residual for p in pieces if p.residual is not None]
        takes = has_residual and bool(uses)
        signature = (bucket, num_values, takes, *(p.signature for p in pieces))
        key = self._keys.setdefault(signature, ("graph", bucket, len(self._keys)))  # short: hashed per call
        weights = tuple(w for p in pieces for w in p.weights)
        tables = any(p.tables for p in pieces)
        returns = bool(uses) and uses[-1]
        return _Segment(
            key, pieces, num_values, bool(uses), takes, returns, tables, pieces[-1].arity, weights
        )

    # ---- the cuts ------------------------------------------------------------------------------------
    def _gemm(self, call: _Call, x: torch.Tensor, step: _Step) -> torch.Tensor:
        """The call on the step's real rows, padded back to the bucket."""
        if step.rows == step.bucket:
            return call.split.call([x])
        return self._padded(call.role, call.split.call([x[: step.rows]]), step.bucket)

    def _attend(self, item: _Attend, values: Values, step: _Step) -> Values | None:
        q, k, v = values
        attn = item.attn
        if not item.graph:
            rows = step.rows
            attended = attn(q[:rows].contiguous(), k[:rows], v[:rows], step.meta)
            return [self._padded("attention", attended.view(rows, -1), step.bucket)]
        if step.table is None:
            self._attention_inputs(step)
        attn.store(k, v, step.meta.slot_mapping)
        key = ("attention", step.bucket, step.table.shape[0], tuple(attn.k_cache.shape))
        inputs = [q.contiguous(), attn.k_cache, attn.v_cache, step.table, step.context]
        out = self._run(key, lambda: attention_graph(*self._attention_shape), inputs)
        return None if out is None else [out[0]]

    def _attention_inputs(self, step: _Step) -> None:
        """The one row's block table padded to its bucket of blocks (padding reads block 0), and its
        context length."""
        group = step.meta.decode_groups[0]
        step.context = group.context_lens.to(torch.int64)
        blocks = -(-int(step.context[0]) // self._block_size)
        step.table = torch.zeros(bucket_blocks(blocks, self._block_size), dtype=torch.int64)
        step.table[:blocks] = group.block_tables[0, :blocks]

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

    def _run(self, key: tuple, make: Callable[[], Callable], inputs: list[torch.Tensor]):
        """The compiled graph of `key` on `inputs` (traced from `make()` on these inputs the first
        time); None when compiling or running fails."""

        def build() -> Callable:
            if key not in self._graphs:
                self._graphs[key] = cpu_compile.compile_graph(make(), inputs)
            return self._graphs[key]

        return cpu_compile.run(build, inputs, "the compiled decode step", "the eager decode step")


def held_layers(model: LlamaForCausalLM) -> list[LlamaDecoderLayer] | None:
    """The decoder layers `model` runs (a pipeline stage: its own), or None where the CPU's compiled
    decode step cannot run them: no compiler, an embedding (first stage) or a final norm (last stage)
    of another kind, weights not float32 on the CPU, a layer other than a plain Llama layer
    (`LlamaDecoderLayer.plain`) with RMSNorms and a float32 paged cache."""
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
    return held


def _plain_layer(layer: nn.Module) -> bool:
    if not isinstance(layer, LlamaDecoderLayer) or not layer.plain:
        return False  # windows, experts, Gemma's norms: not traced piece by piece
    attn = layer.self_attn.attn
    if not isinstance(attn, Attention) or attn.k_cache.dtype != torch.float32 or not attn.k_cache.numel():
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return all(isinstance(n, RMSNorm) and n.weight.dtype == torch.float32 for n in norms)
