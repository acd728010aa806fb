"""A tensor-parallel rank's model: built from its own config, each tensor read as its slice only.

The model is built on the meta device from the rank's config (`TPSplit.local_config`: its heads, KV
heads and MLP width) with the embedding and LM head at the rank's vocabulary rows, materialised,
then filled through `safe_open(...).get_slice(name)[runs]`, which reads only those bytes of the
file: no rank ever holds a full copy of a split tensor. The loaded modules are then wrapped where
ranks combine (`tessel.parallel.layers.parallelise`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tessel.errors import TesselError
from tessel.layers.embedding import LMHead, VocabEmbedding
from tessel.models.checkpoint_names import parameter_of, shard_view, shards_of
from tessel.models.config import ModelConfig
from tessel.models.layer_filter import LayerFilter
from tessel.models.llama import LlamaForCausalLM
from tessel.models.loader import default_dtype, materialise
from tessel.models.reader import SKIPPED_SUFFIXES, checkpoint_files, read_model
from tessel.parallel.group import TPGroup
from tessel.parallel.layers import parallelise
from tessel.parallel.quantize import quantize_rank_layers
from tessel.parallel.shard_rules import TensorSlice, slice_of
from tessel.parallel.split import RankShard, TPSplit

VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")  # padded to the rank's rows


@dataclass(slots=True)
class LoadedRank:
    model: LlamaForCausalLM
    bytes_read: int  # checkpoint bytes this rank read


def load_rank(
    path: str | Path,
    dtype: torch.dtype,
    group: TPGroup,
    split: TPSplit,
    layers: LayerFilter | None = None,
    precisions: dict[int, tuple[str, str]] | None = None,
) -> LoadedRank:
    """Rank `group.rank`'s part of the model in `path` (with `layers`: of that pipeline stage);
    `precisions`: a plan's per-layer (attention, MLP) weight precisions (`tessel.parallel.quantize`)."""
    checked = read_model(path)
    if checked.scheme is not None:
        raise TesselError(
            f"{checked.path}: a quantised checkpoint cannot run tensor-parallel yet; use a float one"
        )
    config, shard = checked.config, split.shards[group.rank]
    with torch.device("meta"), default_dtype(dtype):
        model = LlamaForCausalLM(split.local_config(config, group.rank))
        model.model.embed_tokens = VocabEmbedding(shard.vocab_rows, config.hidden_size)
        model.lm_head = LMHead(shard.vocab_rows, config.hidden_size)
        if layers is not None:
            layers.prune(model)
    model = materialise(model, group.device, frozenset())
    if config.tie_word_embeddings and isinstance(model.lm_head, LMHead):
        model.lm_head.tie(model.model.embed_tokens)
    for rotary in model.model.rotaries():
        rotary.build_tables(group.device)
    bytes_read = load_shards(model, checked.path, config, shard, layers)
    if precisions:
        quantize_rank_layers(model, precisions, dtype, group)
    parallelise(model, group, shard.vocab_start, config.vocab_size)
    return LoadedRank(model.eval().requires_grad_(False), bytes_read)


def load_shards(
    model: LlamaForCausalLM,
    path: Path,
    config: ModelConfig,
    shard: RankShard,
    layers: LayerFilter | None = None,
) -> int:
    """Fill `model` (a rank's, unwrapped) with its slices of the checkpoint -> bytes read."""
    params = dict(model.named_parameters(remove_duplicate=False))
    local = model.config
    expected = {(name, s) for name in params for s in shards_of(name, local)}
    if config.tie_word_embeddings:
        expected.discard(("lm_head.weight", None))
    loaded: set[tuple[str, Hashable]] = set()
    bytes_read = 0
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if _skipped(name, config, layers):
                        continue
                    target, part = parameter_of(name, config)
                    if target not in params:
                        raise TesselError(
                            f"{file.name}: unexpected tensor {name!r} for {config.architecture}"
                        )
                    dest = shard_view(target, params[target].data, part, local)
                    bytes_read += _fill(dest, f, name, slice_of(name, config, shard), shard.rank)
                    if config.gemma and name.endswith("norm.weight"):
                        dest.add_(1.0)
                    loaded.add((target, part))
        except (SafetensorError, OSError) as error:
            raise TesselError(f"{file}: not a readable safetensors file ({error})") from None
    missing = sorted(f"{name}" for name, _ in expected - loaded)
    if missing:
        raise TesselError(f"{path}: the checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:5]}")
    return bytes_read


def _skipped(name: str, config: ModelConfig, layers: LayerFilter | None) -> bool:
    return (
        name.endswith(SKIPPED_SUFFIXES)
        or (name == "lm_head.weight" and config.tie_word_embeddings)
        or (layers is not None and not layers.holds(name))
    )


def _fill(dest: torch.Tensor, f, name: str, piece: TensorSlice | None, rank: int) -> int:  # noqa: ANN001
    """Copy the rank's slice of tensor `name` into `dest` (zero padding past it) -> bytes read."""
    if piece is not None and piece.leader_only and rank != 0:
        dest.zero_()
        return 0
    if piece is None or piece.leader_only:
        data = f.get_slice(name)[:]
    else:
        view = f.get_slice(name)
        runs = [view[a:b] if piece.dim == 0 else view[:, a:b] for a, b in piece.runs]
        data = runs[0] if len(runs) == 1 else torch.cat(runs, dim=piece.dim)
    if name in VOCAB_TENSORS and data.shape[0] < dest.shape[0]:
        dest[data.shape[0] :].zero_()  # vocabulary padding rows
        dest = dest[: data.shape[0]]
    if tuple(data.shape) != tuple(dest.shape):
        raise TesselError(
            f"tensor {name!r}: the rank's slice has shape {tuple(data.shape)}, expected {tuple(dest.shape)}"
        )
    dest.copy_(data)
    return data.numel() * data.element_size()
