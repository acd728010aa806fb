"""Time the engine's own decoder layer on this machine's CPU or GPU, and fit the profile forms to it.

The layer is `tessel.models.llama.LlamaDecoderLayer` with random weights in the requested shape,
run as the engine runs it: float32 linears packed for oneDNN on CPU (as `ModelRunner` does),
k/v written into a paged KV cache through a slot mapping, prefill chunks through
`flash_attention` over their cached prefix, decode rows through one `paged_decode_attention`
call over block tables (on CPU with the batched form's gather where it applies, as `ModelRunner`
builds it). A prefill point (c, p) runs one sequence's chunk of c tokens after p
cached ones; a decode point (B, S) runs B sequences of S/B cached tokens each, one new token each;
a prefill-batch point n runs n sequences' first PREFILL_BATCH_TOKENS tokens in one pass (the
`prefill_batch` component: what a pass pays once, however many prompts it holds).
So the cost model's fits and the engine time the same code.

Each point: `warmup` untimed runs, then the median of `repeats` timed runs (decode points in rounds
of one run of each, so that a load change on a shared machine hits them alike), under
`torch.inference_mode()` with a fixed thread count; on CUDA, CUDA events around the run after a
synchronize (`make_clock`, `time_runs`: the timer benchmarks/_harness.py uses too). One budget is
shared by every phase of a profile (`tessel.deadline`, `PHASE_WEIGHTS`): points are chosen from a grid
to fit the layer's share (costs estimated from calibration runs), and each timing loop stops at its
phase's deadline with what it has, the fewest points a fit needs at least. The fits and held-out
errors come from `tessel.cost.fit`, the profile format from `tessel.cost.profile` (both torch-free);
torch is imported inside functions here.
"""

from __future__ import annotations

import math
import platform
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import numpy as np

from tessel.cost.fit import MIN_FIT_SIZES, FitReport, fit_component, fit_measurements
from tessel.cost.profile import PREFILL_BATCH, Profile, transport_key
from tessel.deadline import Deadline, Phases, spread_order
from tessel.errors import TesselError
from tessel.profiling.components import EndsShape, host_cores, profile_components
from tessel.profiling.contention import DECODE_POINT, measure_contention
from tessel.profiling.contention import MAX_TOKENS as CONTENTION_MAX_TOKENS
from tessel.profiling.timing import Clock, make_clock, time_runs

DTYPE_NAMES = {
    "float32": "fp32",
    "fp32": "fp32",
    "float16": "fp16",
    "fp16": "fp16",
    "bfloat16": "bf16",
    "bf16": "bf16",
}
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-5
BLOCK_SIZE = 16  # the engine's default KV block size (EngineConfig.block_size)
# Shares of the budget (--budget-s) by phase, in the order they run (`tessel.deadline.Phases`): the
# decoder layer's fits price every stage of every plan, the others one stage's ends, a step or a hop
# (one share per transport). Building the layer and calibrating come before the layer's share.
PHASE_WEIGHTS = {
    "ends": 1.0, "step": 1.0, "transport": 1.0, "contention": 1.0, "layer": 6.0, "prefill_batch": 1.0,
}  # fmt: skip
PREFILL_BUDGET_SHARE = 0.7  # of the layer's time left after calibration; decode gets the rest
MIN_PREFILL_POINTS = 8
MIN_DECODE_POINTS = 6
# Passes over several prompts' chunks (the `prefill_batch` component: what a pass pays once)
PREFILL_BATCH_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
MIN_PREFILL_BATCH_POINTS = MIN_FIT_SIZES  # `fit_component` holds interior points out
PREFILL_BATCH_TOKENS = 32


@dataclass(frozen=True, slots=True)
class LayerShape:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if (
            min(self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim)
            <= 0
        ):
            raise TesselError(f"layer shape must be positive, got {self}")
        if self.num_heads % self.num_kv_heads:
            raise TesselError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def scaled(self, factor: int) -> LayerShape:
        """Width / factor, same head dim: fewer heads (KV heads kept >= 1 and dividing the heads)."""
        if factor == 1:
            return self
        heads = max(1, self.num_heads // factor)
        kv = max(1, self.num_kv_heads // factor)
        while heads % kv:
            kv -= 1
        return LayerShape(
            heads * self.head_dim, max(1, self.intermediate_size // factor), heads, kv, self.head_dim
        )

    @property
    def matmul_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        return h * self.num_heads * d * 2 + 2 * h * self.num_kv_heads * d + 3 * h * self.intermediate_size

    def prefill_flops(self, c: float, p: float) -> float:
        return 2 * c * self.matmul_params + 4 * self.num_heads * self.head_dim * c * (p + c / 2)

    def decode_flops(self, batch: float, sum_context: float) -> float:
        return 2 * batch * self.matmul_params + 4 * self.num_heads * self.head_dim * sum_context


def parse_tiny_shape(text: str, head_dim: int | None = None) -> LayerShape:
    """ "h,f,heads,kv_heads" -> LayerShape (head dim h/heads)."""
    try:
        h, f, heads, kv = (int(x) for x in text.split(","))
    except ValueError:
        raise TesselError(f"--tiny-shape wants four integers h,f,heads,kv_heads, got {text!r}") from None
    if heads <= 0 or h % heads:
        raise TesselError(f"--tiny-shape: hidden size {h} must be a multiple of the head count {heads}")
    return LayerShape(h, f, heads, kv, head_dim or h // heads)


@dataclass(frozen=True, slots=True)
class ProfileSettings:
    device: str = "cpu"  # "cpu" or "cuda"
    dtype: str = "fp32"
    budget_s: float = 60.0
    threads: int | None = 1  # CPU threads (None: torch's default)
    clock: str = "auto"  # "wall", "cpu" (process CPU time), "auto": cpu for 1 CPU thread, else wall
    warmup: int = 1
    repeats: int = 5
    max_chunk_tokens: int = 1024
    max_offset_tokens: int = 4096
    max_decode_batch: int = 32
    max_decode_context: int = 4096
    min_point_s: float = 0.05  # keep timing a point until its runs add up to this
    seed: int = 0
    # distinct copies of the layer run in sequence per timed run (the time is divided by it): with a
    # model's layer count, the weights stream from memory as in the engine instead of staying in cache
    layer_copies: int = 1
    cuda_graphs: bool = False  # time decode points as replayed CUDA graphs (as the engine runs them)
    # on a CPU with room for another stage: the decode layer beside a co-runner too (`contends`)
    contention: bool = False


def prefill_grid(settings: ProfileSettings) -> list[tuple[int, int]]:
    """(c, p) candidates: c on a geometric ladder of powers of two (and their 1.5x), p likewise from 0."""
    chunks = _ladder(16, settings.max_chunk_tokens)
    offsets = [0] + _ladder(128, settings.max_offset_tokens)
    return [(c, p) for c in chunks for p in offsets]


def check_prefill_grid(settings: ProfileSettings) -> None:
    """Refuse settings whose prefill grid has fewer points than the fit needs (a TesselError naming
    the options), before anything is loaded or timed."""
    points = len(prefill_grid(settings))
    if points < MIN_PREFILL_POINTS:
        raise TesselError(
            f"--max-chunk {settings.max_chunk_tokens} with --max-offset {settings.max_offset_tokens} "
            f"leaves {points} prefill point(s) to time; the fit needs at least {MIN_PREFILL_POINTS}: "
            "raise --max-chunk (chunks of 16, 32, 48, 64, 96, 128, ... tokens up to it) or "
            "--max-offset (offsets of 0, 128, 192, 256, ... up to it)"
        )


DECODE_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 17, 24, 32, 33, 48, 49, 64, 65, 96, 128)
SHORT_DECODE_CONTEXT = 32


def decode_grid(settings: ProfileSettings) -> list[tuple[int, int]]:
    """(B, S) candidates (S = B * context): batch sizes on both sides of each GEMM tile edge
    (`tessel.cost.fit.ROW_BLOCK`: 16 and 17, 32 and 33, ...) and between them, up to
    `max_decode_batch` (always included); per-sequence contexts a short one and 128.. (two contexts
    at least, so the context term is told apart from the batch's)."""
    batches = [b for b in DECODE_BATCHES if b < settings.max_decode_batch] + [settings.max_decode_batch]
    contexts = sorted({SHORT_DECODE_CONTEXT, *_ladder(128, max(settings.max_decode_context, 128))})
    return [(b, b * s) for b in batches for s in contexts]


def decode_anchor_points(points: list[tuple[int, int]]) -> set[int]:
    """Indices of the decode points a thinned grid keeps: every batch at the shortest context, and
    the anchor batches (`row_anchors`: the tile edges, the smallest and largest) at the longest."""
    from tessel.cost.fit import row_anchors

    batches = np.array([b for b, _ in points], float)
    contexts = [s // b for b, s in points]
    anchor = row_anchors(batches)
    return {
        i
        for i in range(len(points))
        if contexts[i] == min(contexts) or (anchor[i] and contexts[i] == max(contexts))
    }


def _ladder(low: int, high: int) -> list[int]:
    values, x = [], low
    while x <= high:
        values.append(x)
        if x * 3 // 2 <= high and x >= 32:
            values.append(x * 3 // 2)
        x *= 2
    return sorted(set(values)) or [high]


def choose_points(
    points: list[tuple[int, int]],
    cost_s: Callable[[int, int], float],
    budget_s: float,
    minimum: int,
    keep: set[int] = frozenset(),
) -> list[tuple[int, int]]:
    """Keep the cheapest points whose estimated total fits the budget (at least `minimum`), in a
    spread-out order: thinning the grid evenly rather than dropping its expensive corner first.
    The points at indices `keep` stay whatever they cost."""
    costs = np.array([cost_s(c, p) for c, p in points])
    order = np.argsort(costs, kind="stable")
    total = np.cumsum(costs[order])
    n_fit = max(minimum, int(np.searchsorted(total, budget_s, side="right")))
    if n_fit >= len(points):
        return points
    # thin evenly over the grid: every k-th point of the cost order keeps the range covered
    step = len(points) / n_fit
    chosen = {int(order[min(len(points) - 1, int(i * step))]) for i in range(n_fit)}
    # and always the cheapest few so that the small-chunk end is well covered
    chosen |= {int(i) for i in order[: max(2, n_fit // 4)]}
    chosen |= set(keep)
    while sum(costs[i] for i in chosen) > budget_s and len(chosen) > max(minimum, len(keep)):
        chosen.remove(max(chosen - set(keep), key=lambda i: costs[i]))
    return [points[i] for i in sorted(chosen)]


class _Layer:
    """The engine's decoder layer over a paged KV cache with room for `max_batch` sequences of
    `max_tokens` tokens each (block tables drawn at random from the pool, as a busy engine has)."""

    def __init__(
        self,
        shape: LayerShape,
        settings: ProfileSettings,
        max_tokens: int,
        max_batch: int,
        pack_cpu_linears: bool = True,
    ) -> None:
        import torch

        from tessel.layers.rotary import RotaryEmbedding
        from tessel.models.config import ModelConfig

        self.torch = torch
        self.shape = shape
        self.device = torch.device(settings.device)
        self.dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[settings.dtype]
        config = ModelConfig(
            architecture="LlamaForCausalLM",
            vocab_size=1,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=shape.num_heads,
            num_key_value_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            max_position_embeddings=max_tokens,
            rms_norm_eps=RMS_NORM_EPS,
            rope_theta=ROPE_THETA,
        )
        gen = torch.Generator(device="cpu").manual_seed(settings.seed)
        rotary = RotaryEmbedding(shape.head_dim, max_tokens, ROPE_THETA)
        self.rotary = rotary
        self.copies = [
            self._copy(config, rotary, gen, pack_cpu_linears) for _ in range(settings.layer_copies)
        ]
        self.module = self.copies[0]
        rotary.build_tables(self.device)
        self.blocks_per_seq = -(-max_tokens // BLOCK_SIZE)
        num_blocks = max_batch * self.blocks_per_seq
        g, d = shape.num_kv_heads, shape.head_dim
        cache = torch.randn(2, num_blocks, BLOCK_SIZE, g, d, generator=gen).to(self.device, self.dtype)
        for module in self.copies:  # one KV pool for every copy (memory); each copy's own weights
            module.self_attn.attn.k_cache, module.self_attn.attn.v_cache = cache[0], cache[1]
        self.k_cache = cache[0]
        order = torch.randperm(num_blocks, generator=gen).view(max_batch, self.blocks_per_seq)
        self.block_tables = order.to(self.device)

    def _copy(self, config, rotary, gen, pack_cpu_linears: bool):  # noqa: ANN001, ANN202
        """One decoder layer with its own random weights."""
        import torch

        from tessel.layers.linear import pack_linears
        from tessel.models.llama import LlamaDecoderLayer

        module = LlamaDecoderLayer(config, rotary)
        with torch.no_grad():
            for param in module.parameters():
                if param.dim() >= 2:  # linears and stacked experts; the norms keep their ones
                    param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))
        module.to(self.device, self.dtype).eval().requires_grad_(False)
        if pack_cpu_linears and self.device.type == "cpu":
            pack_linears(module)
        return module

    def forward(self, positions, hidden, residual, meta):
        """One step of every copy in turn, as the engine runs a model's layers; -> the residual stream."""
        for module in self.copies:
            hidden, residual = module(positions, hidden, residual, meta)
        return hidden + residual

    def _slots(self, seq: int, start: int, end: int):
        torch = self.torch
        pos = torch.arange(start, end, device=self.device)
        return self.block_tables[seq, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    def _hidden(self, rows: int):
        torch = self.torch
        return torch.randn(rows, self.shape.hidden_size, device=self.device, dtype=self.dtype)

    def prefill_inputs(self, c: int, p: int, seq: int = 0, x=None, residual=None):
        """Sequence `seq`'s chunk of c tokens after p cached ones: (positions, hidden, residual, meta)."""
        from tessel.layers.attention import AttentionMetadata, PrefillChunk

        torch = self.torch
        table = self.block_tables[seq, : -(-(p + c) // BLOCK_SIZE)] if p > 0 else None
        meta = AttentionMetadata(slot_mapping=self._slots(seq, p, p + c))
        meta.prefills.append(PrefillChunk(0, c, p + c, table))
        x = self._hidden(c) if x is None else x
        residual = self.torch.zeros_like(x) if residual is None else residual
        return torch.arange(p, p + c, device=self.device), x, residual, meta

    def prefill_batch_inputs(self, sequences: int, c: int):
        """One pass over the first c tokens of sequences 0..sequences-1 (nothing cached), as the
        engine batches several prompts: (positions, hidden, residual, meta)."""
        from tessel.layers.attention import AttentionMetadata, PrefillChunk

        torch = self.torch
        slots = torch.cat([self._slots(seq, 0, c) for seq in range(sequences)])
        meta = AttentionMetadata(slot_mapping=slots)
        meta.prefills.extend(PrefillChunk(seq * c, c, c, None) for seq in range(sequences))
        x = self._hidden(sequences * c)
        positions = torch.arange(c, device=self.device).repeat(sequences)
        return positions, x, torch.zeros_like(x), meta

    def decode_inputs(self, batch: int, context: int, x=None, residual=None):
        """One new token for each of sequences 0..batch-1 after `context` cached tokens."""
        from tessel.kernels.paged_decode import decode_gather
        from tessel.layers.attention import AttentionMetadata, DecodeGroup

        torch = self.torch
        slots = torch.cat([self._slots(seq, context, context + 1) for seq in range(batch)])
        width = -(-(context + 1) // BLOCK_SIZE)
        tables = self.block_tables[:batch, :width].to(torch.int32)
        lens = torch.full((batch,), context + 1, dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=batch)
        group = DecodeGroup(0, batch, tables, lens)
        if not self.k_cache.is_cuda:  # the CPU's batched form where it applies, as `ModelRunner` builds it
            group.gather = decode_gather(tables, lens, self.k_cache)
        meta.decode_groups.append(group)
        x = self._hidden(batch) if x is None else x
        residual = torch.zeros_like(x) if residual is None else residual
        return torch.full((batch,), context, device=self.device), x, residual, meta


def _timer(settings: ProfileSettings) -> Clock:
    return make_clock("cuda" if settings.device == "cuda" else "cpu" if settings.clock == "cpu" else "wall")


def _measure(
    layer: _Layer,
    inputs,
    settings: ProfileSettings,
    clock: Clock,
    graph: bool = False,
    deadline: Deadline | None = None,
) -> float:
    """Median of at least `repeats` timed runs, and of more while they add up to less than
    `min_point_s` (cheap points get enough runs for a median that shrugs off preemption), fewer once
    `deadline` has passed (`time_runs`); seconds per layer (a run of all the layer's copies divided by
    their number). `graph`: the runs replay one CUDA graph of the copies (`cuda_graph_timing`)."""
    from tessel.profiling.cuda_graph_timing import decode_step

    (times,) = time_runs(
        [decode_step(lambda: layer.forward(*inputs), graph)],
        clock,
        warmup=settings.warmup,
        repeats=settings.repeats,
        min_total_s=settings.min_point_s,
        deadline=deadline,
    )
    return statistics.median(times) / len(layer.copies)


def _measure_rounds(
    layer: _Layer, inputs: list, settings: ProfileSettings, clock: Clock, deadline: Deadline | None = None
) -> list[float]:
    """Like `_measure` for many points at once, timed in rounds of one run of each (`time_runs`): a
    load change on a shared machine then hits every point alike instead of bending the fit at the
    points it happened to hit; the median of each point's runs, seconds per layer."""
    fns = [lambda point=point: layer.forward(*point) for point in inputs]
    runs = time_runs(
        fns,
        clock,
        warmup=settings.warmup,
        repeats=settings.repeats,
        min_total_s=settings.min_point_s,
        deadline=deadline,
    )
    return [statistics.median(times) / len(layer.copies) for times in runs]


def resolve_clock(settings: ProfileSettings) -> ProfileSettings:
    """`auto`: process CPU time for a one-thread CPU run (immune to other processes taking the core
    mid-run, which inflates wall time on a shared machine), wall time otherwise; CUDA uses events."""
    if settings.clock not in ("auto", "wall", "cpu"):
        raise TesselError(f"--clock must be auto, wall or cpu, got {settings.clock!r}")
    if settings.device == "cuda":
        return replace(settings, clock="cuda")
    if settings.clock == "auto":
        return replace(settings, clock="cpu" if settings.threads == 1 else "wall")
    return settings


def check_device(settings: ProfileSettings) -> None:
    import torch

    if settings.device == "cuda" and not torch.cuda.is_available():
        raise TesselError("--device cuda: no CUDA device visible to PyTorch here; use --device cpu")
    if settings.device not in ("cpu", "cuda"):
        raise TesselError(f"--device must be cpu or cuda, got {settings.device!r}")
    if settings.device == "cpu" and settings.dtype == "fp16":
        raise TesselError("--dtype float16 is not profiled on CPU (PyTorch's CPU fp16 matmuls are emulated)")


@dataclass(frozen=True, slots=True)
class Measurements:
    prefill_points: np.ndarray  # [n, 2]: chunk tokens, offset tokens
    prefill_times_s: np.ndarray
    decode_points: np.ndarray  # [m, 2]: batch size, sum of contexts
    decode_times_s: np.ndarray
    prefill_batch_sizes: np.ndarray  # sequences of PREFILL_BATCH_TOKENS tokens in one pass
    prefill_batch_times_s: np.ndarray


def measure_layer(
    shape: LayerShape,
    settings: ProfileSettings,
    progress: Callable[[int, int], None] | None = None,
    phases: Phases | None = None,
    warn: Callable[[str], None] | None = None,
) -> Measurements:
    """Time the layer over grids chosen to fit its phases of the budget (`phases` "layer" and
    "prefill_batch"; by default `settings.budget_s` shared as `PHASE_WEIGHTS` says). Each timing loop
    stops at its phase's deadline with what it has, the fewest points a fit needs at least; `warn`
    says up front when those take longer than the budget has left. `progress(done, total)` per point."""
    import torch

    check_device(settings)
    settings = resolve_clock(settings)
    if phases is None:
        weights = {name: PHASE_WEIGHTS[name] for name in ("layer", "prefill_batch")}
        phases = Deadline.after(settings.budget_s).phases(weights)
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    pre_grid, dec_grid = prefill_grid(settings), decode_grid(settings)
    max_tokens = max(max(c + p for c, p in pre_grid), max(s // b + 1 for b, s in dec_grid))
    max_batch = max(max(b for b, _ in dec_grid), max(PREFILL_BATCH_SIZES))
    with torch.inference_mode():  # building and calibrating come out of the budget before any share
        layer = _Layer(shape, settings, max_tokens, max_batch)
        costs = _calibrate(layer, settings, pre_grid, dec_grid)
        fewest_s, left_s = costs.fewest_s(pre_grid, dec_grid), phases.deadline.left_s()
        if warn is not None and fewest_s > left_s:
            warn(
                f"the fewest timed runs of the decoder layer take about {fewest_s:.0f} s here, more than the "
                f"{left_s:.0f} s left of the budget: this profile will take that long and more (a larger "
                "--scale times a smaller layer)"
            )
        phases.reserve(
            "prefill_batch", costs.prefill_batch_round_s(PREFILL_BATCH_SIZES[:MIN_PREFILL_BATCH_POINTS])
        )
        grids = _time_grids(layer, costs, pre_grid, dec_grid, phases.start("layer"), progress)
        deadline = phases.start("prefill_batch")
        sizes = _prefill_batch_sizes(costs, max_tokens, deadline)
        inputs = [layer.prefill_batch_inputs(n, PREFILL_BATCH_TOKENS) for n in sizes]
        fitting = _fitting_warmup(settings, costs.prefill_batch_round_s(sizes), deadline)
        batch_t = _measure_rounds(layer, inputs, fitting, costs.clock, deadline) if sizes else []
    return Measurements(*grids, np.array(sizes, float), np.array(batch_t))


def _time_grids(
    layer: _Layer,
    costs: _Costs,
    pre_grid: list[tuple[int, int]],
    dec_grid: list[tuple[int, int]],
    deadline: Deadline,
    progress: Callable[[int, int], None] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(prefill points, their seconds per layer, decode points, theirs): the points chosen to fit
    `deadline` (prefill `PREFILL_BUDGET_SHARE` of what decode's one round leaves), timed until it passes."""
    settings, clock, anchors = costs.settings, costs.clock, decode_anchor_points(dec_grid)
    grids = deadline.phases({"prefill": PREFILL_BUDGET_SHARE, "decode": 1 - PREFILL_BUDGET_SHARE})
    fewest_dec = choose_points(dec_grid, costs.decode, 0.0, MIN_DECODE_POINTS, anchors)
    grids.reserve("decode", costs.decode_round_s(fewest_dec))
    pre_deadline = grids.start("prefill")
    pre = choose_points(pre_grid, costs.prefill, pre_deadline.left_s(), MIN_PREFILL_POINTS)
    dec_budget_s = deadline.left_s() - pre_deadline.left_s()
    dec = choose_points(dec_grid, costs.decode, dec_budget_s, MIN_DECODE_POINTS, anchors)
    total = len(pre) + len(dec)
    report = progress or (lambda done, total: None)

    def prefill(point: tuple[int, int], until: Deadline) -> float:
        fitting = _fitting_warmup(settings, costs.run_s(costs.prefill_layer_s(*point)), until)
        return _measure(layer, layer.prefill_inputs(*point), fitting, clock, deadline=until)

    pre, pre_t = _measure_spread(
        pre, costs.prefill, MIN_PREFILL_POINTS, pre_deadline, prefill, lambda done: report(done, total)
    )
    dec_deadline = grids.start("decode")
    if settings.cuda_graphs and settings.device == "cuda":  # one captured graph per point at a time

        def replayed(point: tuple[int, int], until: Deadline) -> float:
            inputs = layer.decode_inputs(point[0], point[1] // point[0])
            return _measure(layer, inputs, settings, clock, graph=True, deadline=until)

        dec, dec_t = _measure_spread(
            dec,
            costs.decode,
            MIN_DECODE_POINTS,
            dec_deadline,
            replayed,
            lambda n: report(len(pre) + n, total),
        )
    else:
        inputs = [layer.decode_inputs(b, s // b) for b, s in dec]
        fitting = _fitting_warmup(settings, costs.decode_round_s(dec), dec_deadline)
        dec_t = _measure_rounds(layer, inputs, fitting, clock, dec_deadline)
        report(len(pre) + len(dec), len(pre) + len(dec))
    return np.array(pre, float), np.array(pre_t), np.array(dec, float), np.array(dec_t)


@dataclass(frozen=True, slots=True)
class _Costs:
    """Estimated wall seconds of the layer's points, from calibration runs: prefill at the seconds per
    FLOP of a mid-grid chunk; decode at the larger of that rate's and the smallest batch's time (weights
    stream from memory however few rows they multiply); a pass over n prompts n times one prompt's.
    `clock` times the points themselves."""

    shape: LayerShape
    settings: ProfileSettings
    clock: Clock
    prefill_s_per_flop: float
    decode_s_per_flop: float
    decode_floor_s: float
    batch_s_per_sequence: float

    def run_s(self, layer_s: float) -> float:
        """One timed run of a point: all the layer's copies."""
        return layer_s * self.settings.layer_copies

    def point_s(self, layer_s: float) -> float:
        """A point's warm-up and timed runs (`time_runs`)."""
        run = self.run_s(layer_s)
        return self.settings.warmup * run + max(self.settings.repeats * run, self.settings.min_point_s)

    def prefill_layer_s(self, c: int, p: int) -> float:
        return self.prefill_s_per_flop * self.shape.prefill_flops(c, p)

    def decode_layer_s(self, b: int, s: int) -> float:
        return max(self.decode_floor_s, self.decode_s_per_flop * self.shape.decode_flops(b, s))

    def prefill(self, c: int, p: int) -> float:
        return self.point_s(self.prefill_layer_s(c, p))

    def decode(self, b: int, s: int) -> float:
        return self.point_s(self.decode_layer_s(b, s))

    def decode_round_s(self, points: Sequence[tuple[int, int]]) -> float:
        """One run of each decode point."""
        return sum(self.run_s(self.decode_layer_s(b, s)) for b, s in points)

    def prefill_batch_round_s(self, sizes: Sequence[int]) -> float:
        """One run of a pass over n prompts' first PREFILL_BATCH_TOKENS tokens, for each n of `sizes`."""
        return sum(self.run_s(n * self.batch_s_per_sequence) for n in sizes)

    def fewest_s(self, pre_grid: list[tuple[int, int]], dec_grid: list[tuple[int, int]]) -> float:
        """One timed run of each of the cheapest points the fits need: what the layer's phases (the
        grids, the passes over several prompts) take at least, however short the budget."""
        pre = sorted(self.run_s(self.prefill_layer_s(c, p)) for c, p in pre_grid)[:MIN_PREFILL_POINTS]
        dec = choose_points(dec_grid, self.decode, 0.0, MIN_DECODE_POINTS, decode_anchor_points(dec_grid))
        batch = self.prefill_batch_round_s(PREFILL_BATCH_SIZES[:MIN_PREFILL_BATCH_POINTS])
        return sum(pre) + self.decode_round_s(dec) + batch


def _calibrate(layer: _Layer, settings: ProfileSettings, pre_grid, dec_grid) -> _Costs:
    """One run (after one untimed) of a mid-grid prefill chunk, a mid-grid decode step, the smallest
    decode step and a pass over one prompt: the cost estimates that choose the points. Timed in wall
    seconds, the budget's, whatever clock times the points (process CPU time runs slower than the
    wall clock on a loaded host)."""
    clock = make_clock("cuda-wall" if settings.device == "cuda" else "wall")
    shape, once = layer.shape, replace(settings, warmup=1, repeats=1, min_point_s=0.0)
    pre_cal, dec_cal, dec_small = pre_grid[len(pre_grid) // 2], dec_grid[len(dec_grid) // 2], min(dec_grid)
    pre_s = _measure(layer, layer.prefill_inputs(*pre_cal), once, clock)
    dec_s = _measure(layer, layer.decode_inputs(dec_cal[0], dec_cal[1] // dec_cal[0]), once, clock)
    floor_s = _measure(layer, layer.decode_inputs(dec_small[0], dec_small[1] // dec_small[0]), once, clock)
    batch_s = _measure(layer, layer.prefill_batch_inputs(1, PREFILL_BATCH_TOKENS), once, clock)
    pre_rate, dec_rate = pre_s / shape.prefill_flops(*pre_cal), dec_s / shape.decode_flops(*dec_cal)
    return _Costs(shape, settings, _timer(settings), pre_rate, dec_rate, floor_s, batch_s)


def _measure_spread(
    points: list[tuple[int, int]],
    cost_s: Callable[[int, int], float],
    fewest: int,
    deadline: Deadline,
    measure: Callable[[tuple[int, int], Deadline], float],
    on_point: Callable[[int], object],
) -> tuple[list[tuple[int, int]], list[float]]:
    """(points, `measure(point, its deadline)` of each) of `points` timed one at a time, in
    `spread_order` from the cheapest to the dearest, until `deadline` has passed and `fewest` are
    timed. Each point's runs get its estimated cost's share of the time left for those not yet timed:
    when the estimates were low, every point gets fewer runs rather than the last ones none."""
    by_cost = sorted(points, key=lambda point: cost_s(*point))
    order = [by_cost[rank] for rank in spread_order(len(points))]
    timed, times = [], []
    for index, point in enumerate(order):
        if len(timed) >= fewest and deadline.passed():
            break
        pending_s = sum(cost_s(*later) for later in order[index:])
        times.append(measure(point, deadline.share(cost_s(*point) / pending_s if pending_s > 0 else 1.0)))
        timed.append(point)
        on_point(len(timed))
    return timed, times


def _fitting_warmup(settings: ProfileSettings, round_s: float, deadline: Deadline) -> ProfileSettings:
    """`settings` with as many of its warm-up rounds as fit before one timed round by `deadline`
    (`round_s`: a round's estimated seconds): a short budget times cold rather than not at all."""
    fit = int(deadline.left_s() // round_s) - 1 if round_s > 0 else settings.warmup
    return replace(settings, warmup=max(0, min(settings.warmup, fit)))


def _prefill_batch_sizes(costs: _Costs, max_tokens: int, deadline: Deadline) -> list[int]:
    """The passes over several prompts to time: the fewest a fit takes (the smallest sizes), and more
    while a warm-up round and a timed one of them fit the time `deadline` leaves."""
    if PREFILL_BATCH_TOKENS > max_tokens:
        return []
    rounds = costs.settings.warmup + 1
    sizes = list(PREFILL_BATCH_SIZES)
    while (
        len(sizes) > MIN_PREFILL_BATCH_POINTS
        and rounds * costs.prefill_batch_round_s(sizes) > deadline.left_s()
    ):
        sizes.pop()
    return sizes


def implied_efficiencies(
    shape: LayerShape, report: FitReport, device_type: str, dtype: str
) -> tuple[float | None, float | None]:
    """(compute, memory) efficiency vs the catalog peak: 2*P_matmul / a1 FLOP/s per token, and
    weight bytes / b0 for a decode step (memory-bound at batch 1)."""
    from tessel.catalog.gpus import get_gpu

    try:
        gpu = get_gpu(device_type)
    except TesselError:
        return None, None
    compute = None
    if report.prefill.a1 > 0:
        compute = 2 * shape.matmul_params / report.prefill.a1 / gpu.peak_flops(dtype)
    memory = None
    step_s = report.decode.b0 + report.decode.b1
    if step_s > 0:
        itemsize = {"fp32": 4, "fp16": 2, "bf16": 2}[dtype]
        memory = shape.matmul_params * itemsize / step_s / gpu.mem_bandwidth_bytes_per_s
    return compute, memory


def catalog_name_for(device_name: str, known: list[str]) -> str | None:
    """The catalog GPU a CUDA device name denotes: every part of the catalog name ("A100", "80G")
    must be a word of the device name ("NVIDIA A100-SXM4-80GB"; memory parts match "80GB");
    the most specific match wins. None when nothing matches."""
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    best, best_parts = None, 0
    for name in known:
        parts = name.upper().split("-")
        ok = all((part + "B" in words) if re.fullmatch(r"\d+G", part) else part in words for part in parts)
        if ok and len(parts) > best_parts:
            best, best_parts = name, len(parts)
    return best


def device_type_name(device: str) -> str:
    """Catalog name of this machine's device: "cpu", or the catalog GPU the CUDA device is (its
    own name when the catalog has no such GPU: the profile then only matches that name)."""
    if device == "cpu":
        return "cpu"
    import torch

    from tessel.catalog.gpus import known_gpus

    cuda_name = torch.cuda.get_device_name(0)
    return catalog_name_for(cuda_name, known_gpus()) or cuda_name


def profile_layer(
    shape: LayerShape,
    settings: ProfileSettings,
    *,
    progress: Callable[[int, int], None] | None = None,
    meta: dict[str, str] | None = None,
    ends: EndsShape | None = None,
    checkpoint: Path | None = None,
    transports: tuple[str, ...] = (),
    note: Callable[[str], None] | None = None,
    deadline: Deadline | None = None,
    warn: Callable[[str], None] | None = None,
) -> tuple[Profile, FitReport, Measurements]:
    """Measure, fit and package a `Profile` (device type named as in the catalog); with `ends`, a
    `checkpoint` or `transports`, the other priced components too (`component_profiler`). Every
    phase shares `deadline` (default: `settings.budget_s` from now) by `PHASE_WEIGHTS`; `warn` says
    up front when the fewest timed runs the fits need will take longer than the budget."""
    import torch

    settings = replace(settings, dtype=DTYPE_NAMES.get(settings.dtype, settings.dtype))
    if settings.dtype not in ("fp32", "fp16", "bf16"):
        raise TesselError(f"--dtype must be float32, bfloat16 or float16, got {settings.dtype!r}")
    check_prefill_grid(settings)
    deadline = deadline if deadline is not None else Deadline.after(settings.budget_s)
    phases = deadline.phases(_phase_weights(ends, checkpoint, transports, contends(settings)))
    resolved = resolve_clock(settings)
    check_device(resolved)
    if resolved.threads is not None:
        torch.set_num_threads(resolved.threads)
    # the other components first: their set-up (processes to start, an engine or an LM head to build)
    # is paid while the budget is whole, and the layer's loops, which shrink to fit, take what is left
    components = profile_components(
        resolved, _timer(resolved), ends, checkpoint, transports, note, phases=phases
    )
    if "contention" in phases.pending:
        if note is not None:
            note("the layer beside a co-runner (memory contention)")
        until = phases.start("contention")
        make_layer = partial(_Layer, shape, resolved, CONTENTION_MAX_TOKENS, DECODE_POINT[0])
        components |= measure_contention(make_layer, resolved.threads or 1, _timer(resolved), deadline=until)
    if note is not None:
        note("the decoder layer")
    data = measure_layer(shape, settings, progress, phases, warn)
    report = fit_measurements(
        data.prefill_points, data.prefill_times_s, data.decode_points, data.decode_times_s
    )
    device_type = device_type_name(settings.device)
    compute, memory = implied_efficiencies(shape, report, device_type, settings.dtype)
    if len(data.prefill_batch_sizes) >= MIN_PREFILL_BATCH_POINTS:
        components[PREFILL_BATCH] = fit_component(
            data.prefill_batch_sizes, data.prefill_batch_times_s, "sequences",
            {"chunk_tokens": PREFILL_BATCH_TOKENS},
        )  # fmt: skip
    info = {
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "prefill_points": str(len(data.prefill_times_s)),
        "decode_points": str(len(data.decode_times_s)),
        "prefill_heldout_rel_error": f"{report.prefill_heldout_error:.4f}",
        "decode_heldout_rel_error": f"{report.decode_heldout_error:.4f}",
        "repeats": str(settings.repeats),
        "layer_copies": str(settings.layer_copies),
        "clock": resolve_clock(settings).clock,
        "warmup": str(settings.warmup),
    }
    profile = Profile(
        device_type=device_type,
        model_shape=shape.as_dict(),
        dtype=settings.dtype,
        prefill=report.prefill,
        decode=report.decode,
        heldout_rel_error=report.heldout_error,
        compute_efficiency=compute,
        memory_efficiency=memory,
        meta=info | (meta or {}),
        components=components,
        cpu_cores=host_cores() if settings.device == "cpu" else None,
        threads=torch.get_num_threads() if settings.device == "cpu" else None,
    )
    return profile, report, data


def contends(settings: ProfileSettings) -> bool:
    """Whether the profile times the layer beside a co-runner too (`tessel.profiling.contention`):
    when asked, on a CPU with room for another stage of as many threads."""
    return settings.contention and settings.device == "cpu" and host_cores() >= 2 * (settings.threads or 1)


def _phase_weights(
    ends: EndsShape | None, checkpoint: Path | None, transports: tuple[str, ...], contention: bool = False
) -> dict:
    """`PHASE_WEIGHTS` of the phases this profile runs."""
    weights = {name: PHASE_WEIGHTS[name] for name in ("layer", "prefill_batch")}
    if contention:
        weights["contention"] = PHASE_WEIGHTS["contention"]
    if ends is not None:
        weights["ends"] = PHASE_WEIGHTS["ends"]
    if checkpoint is not None:
        weights["step"] = PHASE_WEIGHTS["step"]
    return weights | {transport_key(transport): PHASE_WEIGHTS["transport"] for transport in transports}
