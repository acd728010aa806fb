"""The paths a plan's micro-batches take through its stage processes: the one module that knows a
run plan's routes.

Every plan runs as paths over stage processes. A pipeline plan is one path through all its stages,
in order; a flow plan (plan file v4) places one layer range on each device and routes requests over
several paths through the placement graph, paths sharing devices (GPU X holds layers 0-19 and feeds
both Y and Z). The runtime runs one process per placement that some path uses, so a placement's
weights are loaded once and its KV pool serves every path through it:

- rank 0 is a first placement (layers from 0): the first stage of a pipeline, or the placement the
  most flow leaves from; it runs the engine's scheduler and its own layers;
- each request is dealt a path on arrival (`tessel.engine.slots`, by the paths' weights) and pinned
  to one of that path's in-flight slots (its `micro_batches`);
- each micro-batch carries its path (`BatchMessage.path`, ranks in order): a stage computes it and
  sends it to the path's next stage; the path's last stage samples and sends the tokens to rank 0.
  A path that does not start on rank 0 gets its micro-batches' token ids from rank 0 (no stream),
  and its first placement embeds;
- a placement with several predecessors takes micro-batches from any of them: a sequence stays on
  one path, so only a path's own order matters, and that order each link keeps.

KV blocks: rank 0's block tables use one id space cut into a range per path (`path_block_ranges`):
a path gets the fewest blocks its share of any of its placements' pools holds (the plan's `kv_gib`
for the path there over the placement's, else its weight over theirs), and no more than its slots
can fill. Each placement's pool holds the ranges of the paths through it, back to back, and maps the
ids of a micro-batch's metadata to its own (`FlowBlocks`) before computing it; with one path the ids
are the pool's own. With several paths the links use gloo through host memory (no NCCL), prompts are
not cut into CPP chunks, preempted requests are recomputed (a swap's KV copies would have to follow
the request's path), and the prefix cache is off (a cached block's KV is only on the placements of
the path that computed it): `PathFeatures` says which of these a plan's paths allow.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tessel.errors import TesselError
from tessel.layers.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from tessel.plan.replicas.weighted_turns import WeightedTurns

if TYPE_CHECKING:
    from tessel.pipeline.run_plan import RunPlan


@dataclass(frozen=True, slots=True)
class FlowPath:
    """One path of a flow plan as the runtime runs it: the ranks of its placements, in order."""

    index: int  # the plan's replica index
    ranks: tuple[int, ...]
    weight: float  # its share of the requests
    micro_batches: int  # its in-flight slots
    kv_gib: tuple[float | None, ...] = ()  # per placement of the path: the plan's KV for this path


# ---- the plan -------------------------------------------------------------------------------------
def flow_stages(plan, source: Path) -> tuple[list, tuple[FlowPath, ...]]:  # noqa: ANN001 (PlanFile)
    """The placements to run, in rank order (each a `PlanStage` of a path through it, its KV the
    paths' together), and the paths over their ranks. Rank 0 is the first placement most flow
    leaves from; the others follow by where their layers start, then as the plan lists them."""
    first_stage: dict[str, object] = {}
    kv: dict[str, list[float | None]] = {}
    out_of_source: dict[str, float] = {}
    for replica in plan.replicas:
        for stage in replica.stages:
            first_stage.setdefault(stage.device, stage)
            kv.setdefault(stage.device, []).append(stage.kv_gib)
        first = replica.stages[0].device
        out_of_source[first] = out_of_source.get(first, 0.0) + replica.weight
    listed = [p.device for p in plan.flow.placements]
    order = {device: position for position, device in enumerate(listed)}
    root = max(out_of_source, key=lambda d: (out_of_source[d], -order.get(d, len(order))))
    others = sorted(
        (d for d in first_stage if d != root),
        key=lambda d: (first_stage[d].unit_start, order.get(d, len(order))),
    )
    devices = [root, *others]
    rank = {device: r for r, device in enumerate(devices)}
    stages = []
    for device in devices:
        stage = first_stage[device]
        shares = kv[device]
        total_kv = None if any(x is None for x in shares) else sum(shares)
        stages.append(stage.model_copy(update={"kv_gib": total_kv}))
    paths = tuple(
        FlowPath(
            r.index,
            tuple(rank[s.device] for s in r.stages),
            r.weight,
            r.micro_batches or max(2, len(r.stages)),
            tuple(s.kv_gib for s in r.stages),
        )
        for r in plan.replicas
    )
    return stages, paths


def share_micro_batches(paths: tuple[FlowPath, ...], total: int) -> tuple[FlowPath, ...]:
    """`--micro-batches N` for a flow plan: N slots shared by the paths by their weights (at least
    one each; the paths' shares as `WeightedTurns` deals them)."""
    if total < len(paths):
        raise TesselError(
            f"--micro-batches {total}: a flow plan of {len(paths)} paths needs at least one slot per path"
        )
    assigner = WeightedTurns([p.weight for p in paths], dealt=[1] * len(paths))
    for _ in range(total - len(paths)):
        assigner.next()
    counts = assigner.counts
    return tuple(
        FlowPath(p.index, p.ranks, p.weight, count, p.kv_gib) for p, count in zip(paths, counts, strict=True)
    )


def refuse_replica(source: Path) -> TesselError:
    return TesselError(
        f"{source}: a flow plan's paths share GPUs, so one path cannot run alone: serve or launch the "
        "whole plan (drop --replica); its requests are routed over the paths by the flow weights"
    )


def describe(plan) -> list[str]:  # noqa: ANN001 (RunPlan)
    """One line per placement process and one per path (printed at start)."""
    lines = [
        f"placement {r}: {s.device} layers {s.layer_start}-{s.layer_end - 1} (one process)"
        for r, s in enumerate(plan.stages)
    ]
    for path in plan.paths:
        hops = " -> ".join(plan.stages[r].device for r in path.ranks)
        lines.append(f"path {path.index} (weight {path.weight:.3f}, {path.micro_batches} slots): {hops}")
    return lines


def neighbours(paths: tuple[FlowPath, ...]) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
    """(successors, predecessors) of each rank over the paths' hops; rank 0 hands a path that does
    not start on it its token ids, so it precedes that path's first placement."""
    succ: dict[int, set[int]] = {}
    pred: dict[int, set[int]] = {}
    for path in paths:
        hops = path.ranks if path.ranks[0] == 0 else (0, *path.ranks)
        for a, b in zip(hops, hops[1:], strict=False):
            succ.setdefault(a, set()).add(b)
            pred.setdefault(b, set()).add(a)
    return succ, pred


# ---- KV blocks per path ---------------------------------------------------------------------------
def path_shares(paths: tuple[FlowPath, ...]) -> dict[tuple[int, int], float]:
    """(path position, rank) -> the share of the placement's KV pool the path gets: its `kv_gib`
    there over all paths' through it, or, where the plan gives none, its weight over theirs."""
    through: dict[int, list[tuple[int, float | None, float]]] = {}
    for i, path in enumerate(paths):
        kv = path.kv_gib or (None,) * len(path.ranks)
        for rank, gib in zip(path.ranks, kv, strict=True):
            through.setdefault(rank, []).append((i, gib, path.weight))
    shares = {}
    for rank, entries in through.items():
        use_kv = all(gib is not None and gib > 0 for _, gib, _ in entries)
        total = sum((gib if use_kv else w) for _, gib, w in entries)
        for i, gib, w in entries:
            shares[(i, rank)] = (gib if use_kv else w) / total
    return shares


def path_block_ranges(
    paths: tuple[FlowPath, ...], capacities: list[int], blocks_per_seq: int, max_num_seqs: int
) -> list[tuple[int, int]]:
    """Each path's block ids [start, end) in the one id space rank 0's block tables use: a path gets
    the fewest blocks its share of any of its placements' pools holds (`capacities`: blocks per
    rank), and no more than its slots' sequences (`max_num_seqs` each) can fill; the paths through
    rank 0 come first, so rank 0's own ids need no translation."""
    shares = path_shares(paths)
    sizes = []
    for i, path in enumerate(paths):
        size = min(int(capacities[r] * shares[(i, r)] + 1e-9) for r in path.ranks)
        size = min(size, path.micro_batches * max_num_seqs * blocks_per_seq)
        if size < blocks_per_seq:
            tight = min(path.ranks, key=lambda r: capacities[r] * shares[(i, r)])
            raise TesselError(
                f"flow path {path.index}: its share of placement {tight}'s KV pool holds {size} blocks, "
                f"fewer than one sequence of max_model_len needs ({blocks_per_seq}); raise --kv-cache-gib "
                "or lower --max-model-len"
            )
        sizes.append(size)
    order = sorted(range(len(paths)), key=lambda i: (paths[i].ranks[0] != 0, i))
    ranges: list[tuple[int, int]] = [(0, 0)] * len(paths)
    start = 0
    for i in order:
        ranges[i] = (start, start + sizes[i])
        start += sizes[i]
    return ranges


@dataclass(slots=True)
class FlowBlocks:
    """One placement's view of the paths' block ranges: its pool holds the ranges of the paths
    through it, back to back, and `local_of` maps a global block id to its own (None: the same)."""

    ranges: list[tuple[int, int]]
    local_blocks: int
    local_of: torch.Tensor | None
    block_size: int

    @classmethod
    def for_rank(
        cls, paths: tuple[FlowPath, ...], ranges: list[tuple[int, int]], rank: int, block_size: int
    ) -> FlowBlocks:
        mine = sorted(ranges[i] for i, p in enumerate(paths) if rank in p.ranks)
        local = sum(b - a for a, b in mine)
        if mine and mine[0][0] == 0 and all(x[1] == y[0] for x, y in zip(mine, mine[1:], strict=False)):
            return cls(ranges, local, None, block_size)
        table = torch.zeros(max(b for _, b in ranges), dtype=torch.int64)  # ids not its own: block 0
        at = 0
        for a, b in mine:
            table[a:b] = torch.arange(at, at + b - a)
            at += b - a
        return cls(ranges, local, table, block_size)

    def local_meta(self, meta: AttentionMetadata) -> AttentionMetadata:
        """`meta` with this placement's block ids (slots, block tables); decode groups lose the
        gather built for the global ids (`StageRunner.adopt` builds it again)."""
        if self.local_of is None:
            return meta
        device = meta.slot_mapping.device
        if self.local_of.device != device:
            self.local_of = self.local_of.to(device)  # once: the placement's device
        table = self.local_of

        def ids(x: torch.Tensor) -> torch.Tensor:
            mapped = table[x.to(torch.int64).clamp(min=0)]
            return torch.where(x >= 0, mapped, x.to(torch.int64)).to(x.dtype)

        bs = self.block_size
        slots = meta.slot_mapping
        slot_mapping = torch.where(slots >= 0, ids(slots // bs) * bs + slots % bs, slots)
        groups = [
            DecodeGroup(g.start, g.end, ids(g.block_tables), g.context_lens) for g in meta.decode_groups
        ]
        prefills = [
            PrefillChunk(p.start, p.num_tokens, p.context_len, _or_none(p.block_table, ids))
            for p in meta.prefills
        ]
        return AttentionMetadata(slot_mapping, meta.num_decode_tokens, groups, prefills)


def _or_none(x: torch.Tensor | None, f):  # noqa: ANN001, ANN202
    return None if x is None else f(x)


def flow_max_seqs(paths: tuple[FlowPath, ...], max_num_seqs: int) -> int:
    """The most sequences a stage's default KV pool is sized for: `max_num_seqs` on one path (its
    slots share them), every path's slots' on several."""
    if len(paths) == 1:
        return max_num_seqs
    return sum(p.micro_batches for p in paths) * max_num_seqs


# ---- a plan's paths ---------------------------------------------------------------------------------
def pipeline_path(stages: tuple, micro_batches: int) -> tuple[FlowPath, ...]:  # noqa: ANN001 (RunStage)
    """A pipeline plan's one path: every stage in order, all the requests."""
    kv = tuple(s.kv_gib for s in stages)
    return (FlowPath(0, tuple(range(len(stages))), 1.0, micro_batches, kv),)


def plan_paths(plan: RunPlan, micro_batches: int | None = None) -> tuple[FlowPath, ...]:
    """The paths `plan` runs, with `--micro-batches N` shared over them where given."""
    return plan.paths if micro_batches is None else share_micro_batches(plan.paths, micro_batches)


def is_flow(plan: RunPlan) -> bool:
    """Whether the plan routes over several paths (a flow plan) rather than one pipeline."""
    paths = plan.paths
    return len(paths) > 1 or (len(paths) == 1 and paths[0].ranks != tuple(range(len(plan.stages))))


@dataclass(frozen=True, slots=True)
class PathFeatures:
    """What the runtime can do on a plan's paths: with several paths sharing placements, KV copies,
    cached blocks and CPP chunks would have to follow each request's path, and links stay on gloo."""

    one_path: bool

    @classmethod
    def of(cls, plan: RunPlan) -> PathFeatures:
        return cls(not is_flow(plan))

    @property
    def prefix_caching(self) -> bool:
        return self.one_path

    @property
    def cpp(self) -> bool:
        return self.one_path

    @property
    def nccl(self) -> bool:
        return self.one_path

    @property
    def swap_refused(self) -> str | None:
        if self.one_path:
            return None
        return (
            "preemption mode swap is not served on a flow plan yet (the KV copies would have to follow "
            "each request's path); use --preemption-mode recompute or auto"
        )


def path_of_slots(paths: tuple[FlowPath, ...]) -> list[int]:
    """The path (its position) of each in-flight slot, slots numbered path by path."""
    return [i for i, p in enumerate(paths) for _ in range(p.micro_batches)]


def last_ranks(paths: tuple[FlowPath, ...]) -> list[int]:
    """The ranks that sample (the paths' last stages), in rank order: each sends tokens to rank 0."""
    return sorted({p.ranks[-1] for p in paths})
