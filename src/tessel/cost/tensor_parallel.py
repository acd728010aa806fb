"""Price of a tensor-parallel stage: d GPUs of one type on one machine running the same layers.

Megatron-style sharding (what vLLM and every engine do inside a machine): the q/k/v and the MLP's
up/gate projections are split by columns, the output and down projections by rows, so each rank
holds a/d query heads, g/d KV heads and f/d of the FFN width, and a layer needs two all-reduces of
the hidden states (after attention, after the MLP). The embedding and LM head are split by vocab
rows (one all-reduce after the embedding, an all-gather of the logits).

A rank's work is then exactly that of one GPU running the *sharded model* (`shard_model`): the
same hidden size and head dim, a/d heads, g/d KV heads, f/d FFN width, V/d vocab rows. Every
roofline formula of `tessel.cost.roofline` applies to it unchanged: FLOPs, weight bytes and KV
bytes per rank are 1/d of the layer's (norm weights, 2h per layer, are kept whole on every rank),
and the kernel launches are not divided. No extra efficiency factor is applied to the smaller
GEMMs: the sharded shapes of the models tessel plans (h >= 4096) stay large.

All-reduce of n bytes over a ring of d ranks (Patarasuk & Yuan, "Bandwidth optimal all-reduce
algorithms", 2009; NCCL's ring): 2(d - 1) steps, each sending n/d bytes over the ring's slowest
link, so `2 (d - 1) * (latency + n / (d * bandwidth))`. The links are the cluster file's:
NVLink at the catalog's per-direction figure with 2 us latency, PCIe peer-to-peer at the host PCIe
figure with 10 us (`tessel.plan.files.cluster`, or what `tessel probe` measured). An all-gather
is half of that (d - 1 steps).

A degree that does not divide the heads is refused by the planner (`degree_problem`), but the engine's
`--tensor-parallel-size` splits such a model unevenly (`tessel.parallel.split`: SmolLM2's 3 KV heads
over 2 ranks as 2 + 1). Such a stage is priced at its busiest rank: `TensorParallel.rank_model`
holds that rank's shard (`uneven_rank_model`), which then replaces `shard_model`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tessel.catalog.models import ModelSpec
from tessel.cost import layer as L
from tessel.cost.link import LinkSpec

TP_DEGREES = (1, 2, 4, 8)  # the degrees a stage may take (powers of two, at most one 8-GPU machine)
ALL_REDUCES_PER_UNIT = {"layer": 2, "attention": 1, "mlp": 1}  # row-parallel outputs per unit
ALL_REDUCES_EMBED = 1  # vocab-parallel embedding: each rank looks up its rows, then one all-reduce


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """A stage's tensor parallelism: its degree, the slowest link of its ring and, for an uneven
    split, the busiest rank's shard (None: `shard_model`'s even one)."""

    degree: int
    link: LinkSpec
    rank_model: ModelSpec | None = None

    def __post_init__(self) -> None:
        if self.degree < 1:
            raise ValueError(f"a tensor-parallel degree is >= 1, got {self.degree}")

    def all_reduce_s(self, n_bytes: float) -> float:
        """Ring all-reduce of n bytes over the degree's ranks (module docstring); 0 at degree 1."""
        d = self.degree
        if d == 1 or n_bytes <= 0:
            return 0.0
        return 2 * (d - 1) * (self.link.latency_s + n_bytes / (d * self.link.bandwidth_bytes_per_s))

    def all_gather_s(self, n_bytes: float) -> float:
        """Ring all-gather of n bytes in total (each rank holds n/d): half an all-reduce."""
        return self.all_reduce_s(n_bytes) / 2

    # `model` below is the sharded model (`shard_model`) or the whole one: both have the hidden size

    def unit_comm_s(self, model: ModelSpec, kind: str, tokens: float, act_dtype: str) -> float:
        """The all-reduces of one unit over `tokens` tokens' hidden states."""
        n_bytes = L.hidden_bytes(model, tokens, act_dtype)
        return ALL_REDUCES_PER_UNIT[kind] * self.all_reduce_s(n_bytes)

    def embed_comm_s(self, model: ModelSpec, tokens: float, act_dtype: str) -> float:
        return ALL_REDUCES_EMBED * self.all_reduce_s(L.hidden_bytes(model, tokens, act_dtype))

    def logits_comm_s(self, shard: ModelSpec, tokens: float, act_dtype: str) -> float:
        """All-gather of `tokens` rows of logits, each rank holding `shard.vocab_size` columns (the
        vocab padded to a multiple of the degree, as vLLM pads it)."""
        return self.all_gather_s(tokens * shard.vocab_size * self.degree * L.dtype_bytes(act_dtype))


def degree_problem(model: ModelSpec, degree: int) -> str | None:
    """Why `model` cannot be split `degree` ways (heads, KV heads), or None when it can."""
    if degree not in TP_DEGREES:
        return f"tensor-parallel degree {degree} is not one of {', '.join(map(str, TP_DEGREES))}"
    if degree == 1:
        return None
    if model.encoder:
        return f"{model.name} is an encoder; tessel runs encoders at degree 1"
    for field, count in (("heads", model.num_heads), ("KV heads", model.num_kv_heads)):
        if count % degree:
            return f"degree {degree} does not divide the {count} {field} of {model.name}"
    return None


def allowed_degrees(model: ModelSpec, max_degree: int) -> tuple[int, ...]:
    """The degrees `model` splits into, up to `max_degree`."""
    return tuple(d for d in TP_DEGREES if d <= max_degree and degree_problem(model, d) is None)


def stage_rank_model(model: ModelSpec, tp: TensorParallel | None) -> ModelSpec:
    """What the busiest rank of a stage computes: `tp.rank_model` where set, else the even shard."""
    if tp is None:
        return model
    return tp.rank_model if tp.rank_model is not None else shard_model(model, tp.degree)


def uneven_rank_model(
    model: ModelSpec, degree: int, *, heads: int, kv_heads: int, intermediate_size: int
) -> ModelSpec:
    """One rank's shard of an uneven split: its heads, KV heads and MLP columns as given (the
    runtime's split), its vocabulary rows ceil(V / degree) as every rank's."""
    if not (0 < kv_heads <= heads and 0 < intermediate_size and 1 <= degree):
        raise ValueError(
            f"a rank holds at least one head, KV head and MLP column: heads {heads}, KV heads "
            f"{kv_heads}, MLP columns {intermediate_size} (degree {degree})"
        )
    return replace(
        model,
        name=f"{model.name}/tp{degree}-rank",
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=math.ceil(model.vocab_size / degree),
    )


def shard_model(model: ModelSpec, degree: int) -> ModelSpec:
    """What one of `degree` ranks computes and holds (module docstring). Degree 1: the model."""
    if degree == 1:
        return model
    problem = degree_problem(model, degree)
    if problem is not None:
        raise ValueError(problem)
    return replace(
        model,
        name=f"{model.name}/tp{degree}",
        num_heads=model.num_heads // degree,
        num_kv_heads=model.num_kv_heads // degree,
        intermediate_size=math.ceil(model.intermediate_size / degree),
        shared_expert_intermediate_size=math.ceil(model.shared_expert_intermediate_size / degree),
        vocab_size=math.ceil(model.vocab_size / degree),
    )
