"""Which slice of each checkpoint tensor a tensor-parallel rank reads.

q_proj, k_proj, v_proj (weight, bias)   rows of the rank's query / KV heads     column-parallel
qkv_proj (fused, Phi-3)                 those three row runs, concatenated
gate_proj, up_proj                      rows of the rank's MLP columns          column-parallel
gate_up_proj (fused)                    both row runs, concatenated
o_proj.weight, down_proj.weight         the same runs as columns                row-parallel
o_proj.bias, down_proj.bias             whole on rank 0, zeros elsewhere (added once)
embed_tokens, lm_head                   the rank's vocabulary rows (padded with zeros)
anything else (norms, q/k norms)        whole on every rank
"""

from __future__ import annotations

from dataclasses import dataclass

from tessel.models.config import ModelConfig
from tessel.parallel.split import RankShard


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """The runs [start, stop) along `dim` a rank reads, concatenated in order; `leader_only`: the
    whole tensor on rank 0, zeros on the others."""

    dim: int = 0
    runs: tuple[tuple[int, int], ...] = ()
    leader_only: bool = False


WHOLE = None  # every rank reads the tensor whole


def slice_of(name: str, config: ModelConfig, shard: RankShard) -> TensorSlice | None:
    """The slice of checkpoint tensor `name` (HF naming) that `shard`'s rank reads (None: whole)."""
    d = config.head_dim
    q = (shard.q_start * d, (shard.q_start + shard.num_heads) * d)
    kv = (shard.kv_start * d, shard.kv_stop * d)
    inter = (shard.inter_start, shard.inter_stop)
    vocab = (shard.vocab_start, min(config.vocab_size, shard.vocab_start + shard.vocab_rows))
    part = name.rsplit(".", 2)
    module, kind = (part[-2], part[-1]) if len(part) == 3 else ("", name)
    if module == "q_proj":
        return TensorSlice(0, (q,))
    if module in ("k_proj", "v_proj"):
        return TensorSlice(0, (kv,))
    if module == "qkv_proj":
        k_at, v_at = config.q_size, config.q_size + config.kv_size
        return TensorSlice(0, (q, _shift(kv, k_at), _shift(kv, v_at)))
    if module in ("gate_proj", "up_proj"):
        return TensorSlice(0, (inter,))
    if module == "gate_up_proj":
        return TensorSlice(0, (inter, _shift(inter, config.intermediate_size)))
    if module in ("o_proj", "down_proj"):
        if kind == "bias":
            return TensorSlice(leader_only=True)
        return TensorSlice(1, (q if module == "o_proj" else inter,))
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return TensorSlice(0, (vocab,))
    return WHOLE


def _shift(run: tuple[int, int], by: int) -> tuple[int, int]:
    return run[0] + by, run[1] + by
