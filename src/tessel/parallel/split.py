"""Which part of the model each tensor-parallel rank holds.

Attention is split by KV-head groups: rank r holds a contiguous run of KV heads and the query heads
that read them (GQA groups stay whole), so each rank's paged KV cache holds only its heads and
`Attention` runs unchanged on them. A degree that does not divide the KV heads gives ranks
unequal runs (SmolLM2's 3 KV heads over 2 ranks: 2 and 1). The MLP's intermediate columns are
split evenly even then: the ranks meet at an all-reduce after the attention and another after the
MLP, so a layer takes the slowest rank's attention plus the slowest rank's MLP, and columns moved
to the rank with fewer heads (to even the weights) only lengthen the MLP's slowest share (SmolLM2:
688 + 848 columns gave 0.589M + 1.465M weights on the slowest sides, 768 + 768 give 0.589M + 1.327M,
where one process runs 3.54M). The embedding and the LM head are split by
vocabulary rows, padded to the same row count on every rank (the logits gather needs equal shapes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tessel.errors import TesselError
from tessel.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class RankShard:
    """What rank `rank` holds: KV heads [kv_start, kv_stop), their query heads, intermediate columns
    [inter_start, inter_stop) and vocabulary rows [vocab_start, vocab_start + vocab_rows) (those past
    the vocabulary are zero padding)."""

    rank: int
    kv_start: int
    kv_stop: int
    q_per_kv: int
    inter_start: int
    inter_stop: int
    vocab_start: int
    vocab_rows: int

    @property
    def num_kv_heads(self) -> int:
        return self.kv_stop - self.kv_start

    @property
    def q_start(self) -> int:
        return self.kv_start * self.q_per_kv

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.q_per_kv

    @property
    def intermediate_size(self) -> int:
        return self.inter_stop - self.inter_start


@dataclass(frozen=True, slots=True)
class TPSplit:
    degree: int
    shards: tuple[RankShard, ...]

    @classmethod
    def of(cls, config: ModelConfig, degree: int, where: str = "the engine") -> TPSplit:
        """The split of `config` over `degree` ranks; TesselError (naming `where`, e.g. "stage 1")
        when it cannot be split so."""
        check_degree(config, degree, where)
        kv = _even_runs(config.num_key_value_heads, degree)
        q_per_kv = config.num_attention_heads // config.num_key_value_heads
        inter = _even_runs(config.intermediate_size, degree)
        rows = -(-config.vocab_size // degree)
        shards = []
        kv_start = inter_start = 0
        for rank in range(degree):
            shards.append(
                RankShard(
                    rank,
                    kv_start,
                    kv_start + kv[rank],
                    q_per_kv,
                    inter_start,
                    inter_start + inter[rank],
                    rank * rows,
                    rows,
                )
            )
            kv_start += kv[rank]
            inter_start += inter[rank]
        return cls(degree, tuple(shards))

    def local_config(self, config: ModelConfig, rank: int) -> ModelConfig:
        """The config rank `rank`'s modules are built from: its heads, KV heads and MLP width (the
        vocabulary stays whole: the embedding and LM head modules are swapped for their slices)."""
        shard = self.shards[rank]
        return replace(
            config,
            num_attention_heads=shard.num_heads,
            num_key_value_heads=shard.num_kv_heads,
            intermediate_size=shard.intermediate_size,
        )


def check_degree(config: ModelConfig, degree: int, where: str = "the engine") -> None:
    """Refuse a tensor-parallel degree `config` cannot be split into, naming `where` and the numbers."""
    if degree < 1:
        raise TesselError(f"{where}: the tensor-parallel degree must be >= 1, got {degree}")
    if degree == 1:
        return
    if config.num_attention_heads % config.num_key_value_heads:
        raise TesselError(
            f"{where}: {config.num_attention_heads} attention heads are not a multiple of "
            f"{config.num_key_value_heads} KV heads; the heads cannot be split into GQA groups"
        )
    if degree > config.num_key_value_heads:
        raise TesselError(
            f"{where}: tensor-parallel degree {degree} exceeds the model's {config.num_key_value_heads} "
            f"KV heads ({config.num_attention_heads} attention heads): a rank would hold no KV head; "
            f"use a degree of at most {config.num_key_value_heads}"
        )
    if config.num_experts:
        raise TesselError(
            f"{where}: tensor parallelism does not split mixture-of-experts layers yet "
            f"({config.architecture}, {config.num_experts} experts); run it with degree 1"
        )
    if config.intermediate_size < degree:
        raise TesselError(f"{where}: the MLP width {config.intermediate_size} is below the degree {degree}")


def _even_runs(total: int, parts: int) -> list[int]:
    """`total` units in `parts` runs as even as can be, the larger first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]
