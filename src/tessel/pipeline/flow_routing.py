"""A flow plan (plan file v4) on the pipeline runtime: one process per placement, requests routed
over the paths by the flow weights.

A flow plan places one layer range on each device and routes requests over paths through the
placement graph; paths share devices (GPU X holds layers 0-19 and feeds both Y and Z). The runtime
runs one process per placement that some path uses, so a placement's weights are loaded once and
its KV pool serves every path through it:

- rank 0 is a first placement (layers from 0), the one the most flow leaves from; it runs the
  scheduler (`FlowSchedulers`) and its own layers, as stage 0 of a pipeline does;
- each request is assigned a path on arrival (`tessel.plan.replicas.weighted_turns`: deterministic, after n
  requests each path holds within one of w_p x n, as the planner and the simulator deal them) and
  pinned to one of that path's in-flight slots (its `micro_batches`);
- each micro-batch carries its path (`BatchMessage.path`, ranks in order): a placement computes it
  and sends it to the path's next placement; the path's last placement samples and sends the
  tokens to rank 0. A path that does not start on rank 0 gets its micro-batches' token ids from
  rank 0 (`IDS` messages: the metadata and the ids, no stream), and its first placement embeds;
- a placement with several predecessors takes micro-batches from any of them (gloo's receive from
  any source): a sequence stays on one path, so only a path's own order matters, and that order
  each link keeps. Tokens reach rank 0 out of order where paths share a last placement: rank 0
  keeps those that arrive before the ones it waits for. A placement stops once every predecessor
  sent STOP, and then passes STOP on.

KV blocks: rank 0's block tables use one id space cut into a range per path
(`path_block_ranges`): a path gets the fewest blocks its share of any of its placements' pools holds
(the plan's `kv_gib` for the path there over the placement's, else its weight over theirs), and no
more than its slots can fill. Rank 0 allocates a sequence's blocks from its path's range
(`PathBlockManagers`); each placement's pool holds the ranges of the paths through it, back to back,
and maps the ids of a micro-batch's metadata to its own (`FlowBlocks`) before computing it.
Links use gloo through host memory (no NCCL), prompts are not cut into CPP chunks, preempted
requests are recomputed (a swap's KV copies would have to follow the request's path), and the prefix
cache is off (a cached block's KV is only on the placements of the path that computed it).
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from tessel.engine.block_manager import BlockManager
from tessel.engine.model_runner import SampledRows, kv_cache_bytes_per_block, prompt_scorings
from tessel.engine.preemption import Preemptor
from tessel.engine.scheduler import SchedulerConfig, SchedulerOutput
from tessel.engine.sequence import Sequence
from tessel.errors import TesselError
from tessel.layers.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from tessel.pipeline.comm import (
    BATCH,
    HEADER_LEN,
    STOP,
    BatchMessage,
    KvLayout,
    PeerLostError,
    StageComm,
    agree_kv_layout,
    pack_message,
    unpack_message,
)
from tessel.pipeline.driver import PipelineEngine, _InFlight, stage_kv_budget
from tessel.pipeline.pinned_schedulers import PinnedSchedulers
from tessel.pipeline.sampled import from_wire
from tessel.plan.replicas.weighted_turns import WeightedTurns

IDS = 3  # a micro-batch's token ids for a path's first placement (no residual stream)
TOKENS_HEAD = 3  # micro-batch id, payload bytes, tokens


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


def with_micro_batches(paths: tuple[FlowPath, ...], total: int) -> tuple[FlowPath, ...]:
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
        gather built for the global ids (`StageExecutor.adopt` builds it again)."""
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


def agree_flow_blocks(paths: tuple[FlowPath, ...], rank: int, capacity: int, layout: KvLayout) -> FlowBlocks:
    """A collective at start, after `agree_kv_layout`: every placement offers the blocks its own
    budget holds; all compute the same path ranges (`path_block_ranges`)."""
    try:
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, torch.tensor([capacity], dtype=torch.int64))
    except RuntimeError as error:
        raise PeerLostError(f"stage {rank}: the flow plan's KV handshake failed: {error}") from error
    bs = layout.block_size
    blocks_per_seq = -(-layout.max_model_len // bs)
    ranges = path_block_ranges(paths, [int(t.item()) for t in gathered], blocks_per_seq, layout.max_num_seqs)
    return FlowBlocks.for_rank(paths, ranges, rank, bs)


def flow_max_seqs(paths: tuple[FlowPath, ...], max_num_seqs: int) -> int:
    """The most sequences every path's slots run together: what a placement's pool is capped at."""
    return sum(p.micro_batches for p in paths) * max_num_seqs


class PathBlockManagers:
    """Rank 0's block manager over the paths: one `BlockManager` per path over its id range, each
    sequence served by its path's (`assign` first); what the engine reads of one block manager."""

    def __init__(self, ranges: list[tuple[int, int]], block_size: int) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = False
        self.managers = [_RangeBlocks(a, b, block_size) for a, b in ranges]
        self._path_of: dict[int, int] = {}
        self._default = min(range(len(ranges)), key=lambda i: ranges[i][0])  # ids from 0: rank 0 holds them

    def assign(self, seq: Sequence, path: int) -> None:
        self._path_of[seq.seq_id] = path

    def forget(self, seq: Sequence) -> None:
        self._path_of.pop(seq.seq_id, None)

    def _of(self, seq: Sequence) -> BlockManager:
        return self.managers[self._path_of.get(seq.seq_id, self._default)]

    @property
    def num_total_blocks(self) -> int:
        return sum(m.num_total_blocks for m in self.managers)

    @property
    def num_free_blocks(self) -> int:
        return sum(m.num_free_blocks for m in self.managers)

    def free_blocks_of(self, seq: Sequence) -> int:
        return self._of(seq).num_free_blocks

    def num_prefix_hits(self, seq: Sequence) -> int:
        return 0

    def can_allocate(self, seq: Sequence, hits: int) -> bool:
        return self._of(seq).can_allocate(seq, hits)

    def allocate(self, seq: Sequence, hits: int) -> None:
        self._of(seq).allocate(seq, hits)

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        return self._of(seq).reserve(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        self._of(seq).free(seq)

    def register_computed_blocks(self, seq: Sequence) -> None:
        return None


class _RangeBlocks(BlockManager):
    """A `BlockManager` whose block ids are [start, end) (no prefix cache)."""

    def __init__(self, start: int, end: int, block_size: int) -> None:
        super().__init__(end - start, block_size, enable_prefix_caching=False)
        self.start = start
        self.free_blocks = type(self.free_blocks)((start + i, None) for i in range(end - start))

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        self.blocks[block_id - self.start].ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id - self.start]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks[block_id] = None


# ---- requests to paths ----------------------------------------------------------------------------
class FlowSchedulers(PinnedSchedulers):
    """In-flight slots grouped by path: a request is assigned a path (`WeightedTurns`), then the
    path's slot with the fewest unfinished requests."""

    def __init__(
        self, paths: tuple[FlowPath, ...], config: SchedulerConfig, block_manager: BlockManager
    ) -> None:
        super().__init__(sum(p.micro_batches for p in paths), config, block_manager)
        self.block_manager = block_manager
        self.paths = paths
        self.path_of_slot = [i for i, p in enumerate(paths) for _ in range(p.micro_batches)]
        self.assigner = WeightedTurns([p.weight for p in paths])
        self.path_of_seq: dict[int, int] = {}  # until its release reaches its path's last placement

    @property
    def requests_per_path(self) -> list[int]:
        return list(self.assigner.counts)

    def add(self, seq: Sequence) -> None:
        path = self.assigner.next()
        self.path_of_seq[seq.seq_id] = path
        if isinstance(self.block_manager, PathBlockManagers):
            self.block_manager.assign(seq, path)
        mine = [s for s, p in enumerate(self.path_of_slot) if p == path]
        slot = min(mine, key=lambda i: (self.slots[i].num_unfinished, i))
        self._slot_of[seq.seq_id] = slot
        self.slots[slot].add(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        super().finish(seq, reason)
        if isinstance(self.block_manager, PathBlockManagers):
            self.block_manager.forget(seq)

    def route(self, slot: int) -> tuple[int, ...]:
        return self.paths[self.path_of_slot[slot]].ranks

    def releases_for(self, slot: int, released: list[int]) -> tuple[list[int], list[int]]:
        """(the finished sequences of `slot`'s path, to send with its micro-batch; the others, kept
        for a micro-batch of theirs): a seeded request's generator lives on its path's last placement."""
        path = self.path_of_slot[slot]
        mine = [s for s in released if self.path_of_seq.get(s, path) == path]
        for seq_id in mine:
            self.path_of_seq.pop(seq_id, None)
        return mine, [s for s in released if s not in set(mine)]


# ---- the links ------------------------------------------------------------------------------------
class FlowComm(StageComm):
    """A placement's links: micro-batches to the next placement of their path, from any
    predecessor; tokens from a path's last placement to rank 0. gloo through host memory."""

    def __init__(self, paths: tuple[FlowPath, ...], rank: int, world_size: int, device, dtype) -> None:  # noqa: ANN001
        super().__init__(rank, world_size, device, dtype)
        succ, pred = neighbours(paths)
        self.successors = sorted(succ.get(rank, ()))
        self.predecessors = sorted(pred.get(rank, ()))
        self._token_source: dict[int, int] = {}  # rank 0: micro-batch -> the placement that samples it
        self._early: dict[int, SampledRows] = {}  # rank 0: tokens that came before the ones awaited
        self._stops = 0

    def _next_of(self, path: tuple[int, ...]) -> int:
        if self.rank == 0 and path[0] != 0:
            return path[0]
        return path[path.index(self.rank) + 1]

    def send_batch(self, message: BatchMessage, hidden: torch.Tensor | None, input_ids=None) -> None:  # noqa: ANN001
        """`hidden` to the next placement of the message's path; rank 0 with `hidden` None sends the
        token ids instead (to a path's first placement)."""
        dst = self._next_of(message.path)
        if self.rank == 0:
            self._token_source[message.batch_id] = message.path[-1]
        payload = pack_message(message)
        if hidden is None:
            ids = input_ids.to("cpu", torch.int64).contiguous()
            header = torch.tensor([IDS, payload.numel(), ids.numel(), 0], dtype=torch.int64)
            self._isend((header, payload, ids), dst)
        else:
            rows, cols = hidden.shape
            header = torch.tensor([BATCH, payload.numel(), rows, cols], dtype=torch.int64)
            self._isend((header, payload, self._outgoing(hidden.to(self.dtype))), dst)
        if self.rank == 0:
            self.progress.last_s = time.time()
        else:
            self._handed_on(message.batch_id)

    def send_stop(self) -> None:
        for dst in self.successors:
            self._isend((torch.tensor([STOP, 0, 0, 0], dtype=torch.int64),), dst)

    def recv_flow(self) -> tuple[BatchMessage, torch.Tensor | None, torch.Tensor | None] | None:
        """The next micro-batch from any predecessor: (message, stream or None, token ids or None);
        None once every predecessor said stop."""
        try:
            while True:
                header = torch.empty(HEADER_LEN, dtype=torch.int64)
                src = dist.recv(header)  # from any source
                kind, size, rows, cols = (int(v) for v in header.tolist())
                if kind != STOP:
                    break
                self._stops += 1
                if self._stops >= len(self.predecessors):
                    self.progress.last_s = time.time()
                    return None
            payload = torch.empty(size, dtype=torch.uint8)
            dist.recv(payload, src)
            stream = ids = None
            if kind == IDS:
                ids = torch.empty(rows, dtype=torch.int64)
                dist.recv(ids, src)
                ids = ids.to(self.device)
            else:
                stream = self._incoming_from(src, rows, cols)
        except RuntimeError as error:
            raise PeerLostError(f"stage {self.rank}: receiving a micro-batch failed: {error}") from error
        self.progress.active_since = self.progress.last_s = time.time()
        return unpack_message(payload, self.device), stream, ids

    def _incoming_from(self, src: int, rows: int, cols: int) -> torch.Tensor:
        if self.device.type == "cpu":
            hidden = torch.empty(rows, cols, dtype=self.dtype)
            dist.recv(hidden, src)
            return hidden
        staged = torch.empty(rows, cols, dtype=self.dtype, pin_memory=True)
        dist.recv(staged, src)
        return staged.to(self.device, non_blocking=True)

    def send_tokens(self, batch_id: int, sampled: SampledRows) -> None:
        payload = pickle.dumps((sampled.logprobs, sampled.prompt_logprobs)) if sampled.has_logprobs else b""
        head = torch.tensor([batch_id, len(payload), len(sampled.tokens)], dtype=torch.int64)
        tensors = [head]
        if sampled.tokens:
            tensors.append(torch.tensor(sampled.tokens, dtype=torch.int64))
        if payload:
            tensors.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self._isend(tuple(tensors), 0)
        self._handed_on(batch_id)

    def recv_tokens(self, batch_id: int, count: int) -> SampledRows:
        """Rank 0: micro-batch `batch_id`'s tokens, from the last placement of its path (keeping any
        of its other micro-batches that come first)."""
        src = self._token_source.pop(batch_id)
        self.progress.owed_batch, self.progress.owed_since = batch_id, time.time()
        try:
            while batch_id not in self._early:
                head = torch.empty(TOKENS_HEAD, dtype=torch.int64)
                dist.recv(head, src)
                got, size, n = head.tolist()
                tokens = torch.empty(n, dtype=torch.int64)
                if n:
                    dist.recv(tokens, src)
                payload = torch.empty(size, dtype=torch.uint8)
                if size:
                    dist.recv(payload, src)
                self._early[got] = from_wire(tokens.tolist(), payload.numpy().tobytes())
        except RuntimeError as error:
            raise PeerLostError(f"stage 0: receiving tokens from stage {src} failed: {error}") from error
        self.progress.owed_since = None
        self._handed_on(batch_id)
        rows = self._early.pop(batch_id)
        if len(rows.tokens) != count:
            raise PeerLostError(
                f"stage 0: micro-batch {batch_id} came back with {len(rows.tokens)} tokens, not {count}"
            )
        return rows


# ---- rank 0 ---------------------------------------------------------------------------------------
class FlowEngineMixin:
    """What a `PipelineEngine` does differently on a flow plan: slots by path, each micro-batch sent
    along its slot's path, recompute-only preemption, no CPP chunks, and no prefix cache (a cached
    block's KV is only on the placements of the path that computed it)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        kwargs["enable_prefix_caching"] = False
        self._micro_batches = kwargs.get("micro_batches")
        super().__init__(*args, **kwargs)

    def _flow_paths(self) -> tuple[FlowPath, ...]:
        micro_batches = self._micro_batches
        paths = self.plan.paths
        return paths if micro_batches is None else with_micro_batches(paths, micro_batches)

    def _num_kv_blocks(self) -> int:
        """Rank 0's pool: the block ranges of the paths through it (`path_block_ranges`, agreed with
        every placement, each offering what its own budget holds)."""
        config, bs = self.config, self.config.block_size
        blocks_per_seq = -(-self.max_model_len // bs)
        capacity = config.num_kv_blocks
        paths = self._flow_paths()
        if capacity is None:
            per_block = kv_cache_bytes_per_block(self.model, bs, self.dtype)
            budget = stage_kv_budget(self.plan, 0, config.kv_cache_gib)
            capacity = budget.blocks(per_block, blocks_per_seq, flow_max_seqs(paths, config.max_num_seqs))
        layout = KvLayout(capacity, bs, config.pack_cpu_linears, config.max_num_seqs, self.max_model_len)
        if self.comm is None:
            ranges = path_block_ranges(paths, [capacity], blocks_per_seq, config.max_num_seqs)
            self._flow_blocks = FlowBlocks.for_rank(paths, ranges, 0, bs)
        else:
            agree_kv_layout(capacity, layout)
            self._flow_blocks = agree_flow_blocks(paths, 0, capacity, layout)
        return self._flow_blocks.local_blocks

    def _make_schedulers(self, micro_batches: int | None) -> FlowSchedulers:
        """Slots by path, over one block manager per path's id range (recompute-only preemption)."""
        self.block_manager = PathBlockManagers(self._flow_blocks.ranges, self.config.block_size)
        self.preemptor = self._build_preemptor()
        return FlowSchedulers(self._flow_paths(), self.scheduler.config, self.block_manager)

    def _build_preemptor(self) -> Preemptor:
        if self.config.preemption_mode == "swap":
            raise TesselError(
                "preemption mode swap is not served on a flow plan yet (the KV copies would have to follow "
                "each request's path); use --preemption-mode recompute or auto"
            )
        return Preemptor("recompute", self.block_manager)

    @property
    def requests_per_path(self) -> list[int]:
        return self.scheduler.requests_per_path

    def _send(self, slot: int, batch: SchedulerOutput, apply: SchedulerOutput | None) -> None:
        input_ids, positions, meta, sample_rows = self.runner.prepare(batch)
        sampled = [seq for seq, n in batch.scheduled() if seq.num_computed_tokens + n == len(seq)]
        scorings = prompt_scorings(batch)
        path = self.scheduler.route(slot)
        released, self._released = self.scheduler.releases_for(slot, self._released)
        message = BatchMessage(
            next(self._batch_ids),
            positions,
            meta,
            sample_rows,
            [(seq.seq_id, seq.params) for seq in sampled],
            released,
            [scoring for _, scoring in scorings],
            {s.seq_id: self.resume_draws.pop(s.seq_id) for s in sampled if s.seq_id in self.resume_draws},
            path=path,
        )
        seq_ids = [s.seq_id for s, _ in batch.scheduled()]
        record = _InFlight(message.batch_id, slot, apply, sampled, scorings, seq_ids=seq_ids)
        if path[0] == 0:
            started = time.perf_counter()
            hidden = self.runner.run_stage(positions, meta, input_ids=input_ids)
            if path == (0,):
                record.result = self.stage.sample(hidden, message)
            self.stage.account(started, batch.num_tokens)
            if path != (0,):
                self.comm.send_batch(message, hidden)
        else:
            self.comm.send_batch(message, None, input_ids)
        self._in_flight.append(record)
        self._busy[slot] += 1
        self._seqs_in_flight.update(record.seq_ids)


class FlowPipelineEngine(FlowEngineMixin, PipelineEngine):
    """Rank 0 of a flow plan under `tessel launch`."""


# ---- the other placements -------------------------------------------------------------------------
def serve_flow_stage(comm: FlowComm, executor, blocks: FlowBlocks) -> None:  # noqa: ANN001 (StageExecutor)
    """Run micro-batches from any predecessor until every one said stop; each runs on this
    placement's block ids (`blocks`) and goes on with the global ones."""
    executor.progress = comm.progress
    while (received := comm.recv_flow()) is not None:
        message, stream, ids = received
        local = replace(message, meta=blocks.local_meta(message.meta))
        executor.adopt(local)
        started = time.perf_counter()
        out = executor.runner.run_stage(local.positions, local.meta, input_ids=ids, stream=stream)
        last = message.path[-1] == comm.rank
        sampled = executor.sample(out, message) if last else None
        executor.account(started, out.shape[0])
        if last:
            comm.send_tokens(message.batch_id, sampled)
        else:
            comm.send_batch(message, out)
    comm.send_stop()
    comm.flush()
