"""The BERT family of post-norm encoders (HF `BertModel`): what sentence-transformers models run on.

    config = BertConfig.from_dir("/models/all-MiniLM-L6-v2")
    model = load_bert(read_encoder(path), torch.float32)
    hidden = model(input_ids, attention_mask)            # [batch, tokens, hidden]
    packed = model.forward_packed(ids, lengths)          # [sum(lengths), hidden], no padding at all

Each layer is post-norm (the LayerNorm after the residual add, unlike the pre-norm Llama decoders):
`x = LN(x + O(attn(x)))`, `x = LN(x + W2 gelu(W1 x))`; the embeddings are word + learned absolute
position + token type (all type 0 here), then a LayerNorm. Attention is bidirectional; q, k and v
are one fused linear. Everything but attention runs on packed tokens [tokens, hidden]: the padded
`forward` pads only around attention (`scaled_dot_product_attention` with a key padding mask);
`forward_packed` pads nowhere, attending per run of equal-length inputs (`Runs`).

Checkpoints name tensors as `BertModel` saves them (`embeddings.word_embeddings.weight`,
`encoder.layer.{i}.attention.self.query.weight`, ...), optionally under a `bert.` prefix (the
`BertFor*` heads); heads (`cls.*`), the pooler and the `position_ids` buffer are not loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.nn import functional as F

from tessel.catalog.bert_config import (  # noqa: F401 (re-exported: the loader's and readers' names)
    ACTIVATIONS,
    DEFAULT_LAYER_NORM_EPS,
    ENCODER_ARCHITECTURES,
    ENCODER_MODEL_TYPES,
    BertConfig,
    encoder_architecture,
)
from tessel.errors import TesselError

if TYPE_CHECKING:
    from tessel.models.reader import EncoderFiles

IGNORED_PREFIXES = ("cls.", "pooler.")  # task heads and the pooler: sentence-transformers uses neither
IGNORED_SUFFIXES = ("position_ids",)  # a buffer of 0..max_positions-1, recomputed


def checkpoint_prefix(names: list[str]) -> str:
    """'bert.' when the encoder's tensors sit under it (`BertForMaskedLM` and the other heads), else ''."""
    return "bert." if any(n.startswith("bert.embeddings.") for n in names) else ""


def is_ignored(name: str, prefix: str) -> bool:
    """A checkpoint tensor the encoder does not load (a task head, the pooler, position ids)."""
    bare = name.removeprefix(prefix)
    return (
        name.startswith(IGNORED_PREFIXES)
        or bare.startswith(IGNORED_PREFIXES)
        or bare.endswith(IGNORED_SUFFIXES)
    )


def expected_shapes(config: BertConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Checkpoint name (without prefix) -> (shape, the config fields behind it)."""
    c, h = config, config.hidden_size
    out = {
        "embeddings.word_embeddings.weight": ((c.vocab_size, h), "vocab_size x hidden_size"),
        "embeddings.position_embeddings.weight": ((c.max_position_embeddings, h), "max_position_embeddings"),
        "embeddings.token_type_embeddings.weight": ((c.type_vocab_size, h), "type_vocab_size"),
        "embeddings.LayerNorm.weight": ((h,), "hidden_size"),
        "embeddings.LayerNorm.bias": ((h,), "hidden_size"),
    }
    per_layer = {
        "attention.self.query": (h, h),
        "attention.self.key": (h, h),
        "attention.self.value": (h, h),
        "attention.output.dense": (h, h),
        "intermediate.dense": (c.intermediate_size, h),
        "output.dense": (h, c.intermediate_size),
    }
    for i in range(c.num_hidden_layers):
        layer = f"encoder.layer.{i}."
        for leaf, (rows, cols) in per_layer.items():
            out[f"{layer}{leaf}.weight"] = ((rows, cols), "hidden_size, intermediate_size")
            out[f"{layer}{leaf}.bias"] = ((rows,), "hidden_size, intermediate_size")
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            out[f"{layer}{norm}.weight"] = ((h,), "hidden_size")
            out[f"{layer}{norm}.bias"] = ((h,), "hidden_size")
    return out


# ---- the model ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Packing:
    """Where a batch's real tokens sit: the model runs on the packed tokens [tokens, hidden] (no padding
    in the linears, norms and MLP) and pads only around attention. `index`: each token's row in the
    padded [batch * longest] layout (None: no padding at all); `key_mask`: [batch, 1, 1, longest]."""

    batch: int
    longest: int
    index: torch.Tensor | None
    key_mask: torch.Tensor | None

    @classmethod
    def from_mask(cls, attention_mask: torch.Tensor) -> Packing:
        batch, longest = attention_mask.shape
        if bool(attention_mask.all()):
            return cls(batch, longest, None, None)
        keep = attention_mask.to(torch.bool)
        index = keep.reshape(-1).nonzero().squeeze(1)
        return cls(batch, longest, index, keep[:, None, None, :])

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """[tokens, width] -> [batch, longest, width] (zeros at padding)."""
        if self.index is None:
            return packed.view(self.batch, self.longest, -1)
        padded = packed.new_zeros(self.batch * self.longest, packed.shape[-1])
        padded[self.index] = packed
        return padded.view(self.batch, self.longest, -1)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """[batch, longest, width] -> [tokens, width]."""
        flat = padded.reshape(self.batch * self.longest, -1)
        return flat if self.index is None else flat[self.index]

    def positions(self, device: torch.device) -> torch.Tensor:
        """Each packed token's position (its column in the padded layout) [tokens]."""
        columns = torch.arange(self.longest, device=device).expand(self.batch, -1)
        return self.unpad(columns.unsqueeze(-1)).squeeze(-1)

    def attention(self, qkv: torch.Tensor, bias: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
        """Packed fused qkv without its bias [tokens, 3 * hidden] -> attention output [tokens, hidden]."""
        b, t = self.batch, self.longest
        qkv = self.pad(qkv.add_(bias)).view(b, t, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=self.key_mask)
        return self.unpad(attn.transpose(1, 2))


@dataclass(frozen=True, slots=True)
class Runs:
    """Inputs packed end to end with no padding anywhere: `runs` are (count, length) groups of
    consecutive inputs of one length (sorting inputs by length makes few, large runs). Attention runs
    per run, as a batch of equal-length inputs, so it needs no mask and no padded copy."""

    runs: tuple[tuple[int, int], ...]
    positions_: torch.Tensor

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device: torch.device | str = "cpu") -> Runs:
        if not lengths or min(lengths) < 1:
            raise TesselError(f"every input needs at least one token; got lengths {list(lengths)[:8]}")
        runs: list[list[int]] = []
        for length in lengths:
            if runs and runs[-1][1] == length:
                runs[-1][0] += 1
            else:
                runs.append([1, length])
        positions = torch.cat([torch.arange(length).repeat(count) for count, length in runs])
        return cls(tuple((c, n) for c, n in runs), positions.to(device))

    def positions(self, device: torch.device) -> torch.Tensor:
        return self.positions_.to(device)

    def attention(self, qkv: torch.Tensor, bias: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
        """Packed fused qkv without its bias [tokens, 3 * hidden] -> attention output [tokens, hidden]."""
        out = qkv.new_empty(qkv.shape[0], heads * head_dim)
        scale, start, bias = head_dim**-0.5, 0, bias.view(3, heads, head_dim)
        for count, length in self.runs:
            rows = count * length
            # one pass adds the bias and regroups to [3, inputs * heads, length, head_dim]; bmm reads
            # k transposed in place; baddbmm's input is ignored (beta=0), a scalar expanded
            grouped = qkv.new_empty(3, count, heads, length, head_dim)
            run = qkv[start : start + rows].view(count, length, 3, heads, head_dim)
            torch.add(run, bias, out=grouped.permute(1, 3, 0, 2, 4))
            q, k, v = grouped.view(3, count * heads, length, head_dim)
            ignored = q.new_empty(()).expand(count * heads, length, length)
            scores = torch.baddbmm(ignored, q, k.transpose(1, 2), beta=0, alpha=scale)
            attn = torch.bmm(torch.softmax(scores, dim=-1), v).view(count, heads, length, head_dim)
            out[start : start + rows].view(count, length, heads, head_dim).copy_(attn.transpose(1, 2))
            start += rows
        return out


class BertEmbeddings(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Packed token ids and their positions [tokens] -> packed [tokens, hidden]."""
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])


class BertLayer(nn.Module):
    """One post-norm layer: fused qkv, bidirectional attention, output + LN, GELU MLP + LN."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        h = c.hidden_size
        self.num_heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.gelu_approximate = ACTIVATIONS[c.hidden_act]
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.up = nn.Linear(h, c.intermediate_size)
        self.down = nn.Linear(c.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, packing: Packing | Runs) -> torch.Tensor:
        """Packed [tokens, hidden] -> packed [tokens, hidden]."""
        # biases join in passes made anyway (the regrouping for attention; the residual adds, made in
        # place on x, which each LayerNorm then replaces), so no linear's output is written twice
        qkv = torch.mm(x, self.qkv.weight.t())
        attn = packing.attention(qkv, self.qkv.bias, self.num_heads, self.head_dim)
        x = self.attn_norm(torch.addmm(x, attn, self.attn_out.weight.t(), out=x).add_(self.attn_out.bias))
        up = torch.ops.aten.gelu_(self.up(x), approximate=self.gelu_approximate)
        return self.out_norm(torch.addmm(x, up, self.down.weight.t(), out=x).add_(self.down.bias))


class BertEncoder(nn.Module):
    """`forward(input_ids [B, T], attention_mask [B, T] of 0/1)` -> last hidden states [B, T, hidden]
    (zeros at padding)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        packing = Packing.from_mask(attention_mask)
        ids = packing.unpad(input_ids.unsqueeze(-1)).squeeze(-1)
        return packing.pad(self.run(ids, packing))

    def forward_packed(self, ids: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """Inputs packed end to end (token ids [sum(lengths)], `lengths` in order) -> hidden states
        [sum(lengths), hidden], with no padding anywhere; inputs sorted by length run fastest."""
        if ids.shape != (sum(lengths),):
            total = sum(lengths)
            raise TesselError(f"packed ids have shape {tuple(ids.shape)}; the lengths add up to {total}")
        return self.run(ids, Runs.from_lengths(lengths, ids.device))

    def run(self, ids: torch.Tensor, packing: Packing | Runs) -> torch.Tensor:
        x = self.embeddings(ids, packing.positions(ids.device))
        for layer in self.layers:
            x = layer(x, packing)
        return x


# ---- loading -----------------------------------------------------------------------------------

# checkpoint leaf -> (our module, which third of the fused qkv or None)
_LAYER_NAMES = {
    "attention.self.query": ("qkv", 0),
    "attention.self.key": ("qkv", 1),
    "attention.self.value": ("qkv", 2),
    "attention.output.dense": ("attn_out", None),
    "attention.output.LayerNorm": ("attn_norm", None),
    "intermediate.dense": ("up", None),
    "output.dense": ("down", None),
    "output.LayerNorm": ("out_norm", None),
}


def parameter_target(name: str) -> tuple[str, int | None]:
    """Our parameter name for a (prefix-free) checkpoint name, and its third of qkv (or None)."""
    if not name.startswith("encoder.layer."):
        return name, None
    index, rest = name.removeprefix("encoder.layer.").split(".", 1)
    leaf, kind = rest.rsplit(".", 1)
    module, third = _LAYER_NAMES[leaf]
    return f"layers.{index}.{module}.{kind}", third


def load_bert(checked: EncoderFiles, dtype: torch.dtype, device: str | torch.device = "cpu") -> BertEncoder:
    """The encoder with the weights of a checkpoint `reader.read_encoder` checked."""
    config = checked.config
    with torch.device("meta"):
        model = BertEncoder(config)
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    loaded: set[tuple[str, int | None]] = set()
    for file in checked.files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                prefix = checkpoint_prefix(list(f.keys()))
                for name in f.keys():
                    if is_ignored(name, prefix):
                        continue
                    target, third = parameter_target(name.removeprefix(prefix))
                    data = params[target].data
                    if third is not None:
                        size = data.shape[0] // 3
                        data = data.narrow(0, third * size, size)
                    data.copy_(f.get_tensor(name))
                    loaded.add((target, third))
        except (SafetensorError, OSError) as error:
            raise TesselError(f"{file}: not a readable safetensors file ({error}); re-download it") from None
    wanted = {(n, t) for n in params for t in ((0, 1, 2) if ".qkv." in n else (None,))}
    if wanted - loaded:
        missing = sorted(str(n) for n in wanted - loaded)
        raise TesselError(
            f"{checked.path}: the checkpoint lacks {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}"
        )
    return model.eval().requires_grad_(False)
