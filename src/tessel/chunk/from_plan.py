"""Stage latencies of a plan, from the cost model: what the chunk planner runs on.

Stage s holding units U_s (decoder layers, or attention/MLP blocks at sublayer granularity) of the
model on a GPU of type g, with link L_s to the next stage:

    prefill_s(c, p) = sum_{u in U_s} unit_prefill_time_s(u, g, c, p)  (+ embed_time_s(c) on the first stage)
    decode_s(B, S)  = sum_{u in U_s} unit_decode_time_s(u, g, B, S)   (+ embedding / LM head of B tokens
                                                                       on the first / last stage)
    send_s(c)       = link_time_s(L_s, hidden_bytes(model, c, activation dtype))   (0 on the last stage)

The final norm + LM head of prefill runs once, for the last token of the last chunk: it is the
pipeline's `tail_s` (added to TTFT), not part of every chunk. With a profile's components: the
first stage's batches add the engine's per-step work (`step_time_s`), and a hop between two stages
of one host costs the profiled message (`transport`) instead of the cluster link. CPU stages on one
host share its cores: their compute times are multiplied by max(1, stages x threads / cores)
(`core_share`: every stage computing at once, as in a full pipeline). A measured `Profile` of a stage's
device type replaces the roofline as `tessel.cost` decides (same device type, shape and dtype:
the fit; same device type only: its efficiencies).

Weight precision per unit (`tessel plan --precisions`): each unit is priced at the precision the
plan chose for it, with the cost-model calls and the profile choice the planner made
(`tessel.plan.build`): an int8 unit is W8A8 at the device's int8 rate, an int4 unit W4A16 at the
fp16 rate. The embedding, the LM head and the activations sent between stages stay at the
plan's reference precision (`PlanFile.reference_dtype`), as in the planner. A stage's units are
grouped by (kind, precision) in `unit_counts`.

The planner evaluates millions of (c, p) pairs for a 128K prompt, so `CostModelStage` also
answers whole arrays: parts that depend on c only are computed by the scalar cost model once per
distinct c; the (c, p) roofline is a numpy twin of `tessel.cost.roofline`, checked against the
scalar functions on sample points when the stage is built (a mismatch, e.g. a cost-model change
the twin does not know, falls back to scalar calls: slower, same numbers).

A tensor-parallel stage (plan file version 5: `tp_degree` > 1 and its ring's `tp_link`) is priced as
the planner prices it (`tessel.cost.tensor_parallel`): one rank running the sharded model, plus each
unit's all-reduces over the ring for the pass's tokens, an all-reduce after the embedding and an
all-gather of the logits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tessel.catalog.gpus import GpuSpec, get_gpu
from tessel.catalog.models import ModelSpec
from tessel.chunk.latency import PipelineLatency
from tessel.cost import layer as L
from tessel.cost import roofline as R
from tessel.cost.link import LinkSpec, link_time_s
from tessel.cost.profile import Profile
from tessel.cost.tensor_parallel import TensorParallel, stage_rank_model
from tessel.errors import TesselError
from tessel.plan.files.plan_file import PlanFile, load_plan
from tessel.plan.files.plan_parts import PlanStage, unit_kind, units_per_layer

TWIN_CHECK_POINTS = 24  # (c, p) samples the numpy twin is checked on
TWIN_RTOL = 1e-9


UnitGroup = tuple[str, str, int]  # (kind, weight precision, how many)


@dataclass(frozen=True, slots=True)
class CostModelStage:
    """A `StageLatency` for a run of units on one device, priced by `tessel.cost`.

    `unit_counts` holds (kind, precision, count) groups; a (kind, count) pair means `dtype`. Units
    at `dtype` use `profile`; units at another precision the profile `tessel.cost.roofline.
    select_profile` picks for it from `profiles` (what the planner does per precision)."""

    model: ModelSpec
    gpu: GpuSpec
    unit_counts: tuple[UnitGroup, ...] | tuple[tuple[str, int], ...]
    first: bool
    last: bool
    dtype: str = "fp16"  # the reference: embedding, LM head, activations, pair-form unit groups
    kv_dtype: str = "fp16"
    link: LinkSpec | None = None  # to the next stage; None on the last
    profile: Profile | None = None
    profiles: tuple[Profile, ...] = ()  # candidates for units at other precisions
    core_share: float = 1.0  # compute times x this: CPU stages sharing one host's cores (see build_pipeline)
    transport: str | None = None  # the hop to the next stage within one host ("host", "nccl"): profiled
    tp: TensorParallel | None = None  # a tensor-parallel stage (`model` is then one rank's shard)
    twin_ok: bool = field(default=True, compare=False)
    _precision_profiles: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        groups = tuple(_group(entry, self.dtype) for entry in self.unit_counts)
        object.__setattr__(self, "unit_counts", groups)
        for _kind, precision, _count in groups:
            L.weight_param_bytes(precision)  # an unknown precision is a user error, raised here
            if precision not in self._precision_profiles:
                self._precision_profiles[precision] = self._select_profile(precision)

    def _select_profile(self, precision: str) -> Profile | None:
        if precision == self.dtype:
            return self.profile
        candidates = self.profiles or ((self.profile,) if self.profile is not None else ())
        return R.select_profile(candidates, self.model, self.gpu, precision)

    def profile_for(self, precision: str) -> Profile | None:
        """The profile that prices units at `precision` on this stage (None: the roofline's defaults)."""
        if precision not in self._precision_profiles:
            return self._select_profile(precision)
        return self._precision_profiles[precision]

    @classmethod
    def build(cls, **kwargs) -> CostModelStage:
        stage = cls(**kwargs)
        return stage if _twin_agrees(stage) else cls(**kwargs, twin_ok=False)

    # ---- the StageLatency protocol (scalar: the reference) ----------------------------------

    def _units_time_s(self, unit_time_s, size: int, context_tokens: int) -> float:
        """Sum of `unit_time_s` (prefill: chunk, offset; decode: batch, sum of contexts) over units,
        each group at its own precision, plus their all-reduces over `size` tokens."""
        return self._units_comm_s(size) + sum(
            count
            * unit_time_s(
                self.model,
                self.gpu,
                kind,
                size,
                context_tokens,
                dtype=precision,
                kv_dtype=self.kv_dtype,
                profile=self.profile_for(precision),
            )
            for kind, precision, count in self.unit_counts
        )

    def _ends_time_s(self, tokens: int, lm_head: bool) -> float:
        """The embedding on the first stage and, when `lm_head`, the LM head on the last one."""
        time = 0.0
        if self.first:
            time += self._embed_time_s(tokens)
        if lm_head and self.last:
            time += self._lm_head_s(tokens)
        return time

    def _units_comm_s(self, tokens: int) -> float:
        """The all-reduces of the stage's units over `tokens` tokens (0 without tensor parallelism)."""
        if self.tp is None:
            return 0.0
        act = L.activation_dtype(self.dtype)
        return sum(
            count * self.tp.unit_comm_s(self.model, kind, tokens, act) for kind, _q, count in self.unit_counts
        )

    def _lm_head_s(self, rows: int) -> float:
        time = R.lm_head_time_s(self.model, self.gpu, rows, self.dtype, profile=self.profile)
        if self.tp is not None:
            time += self.tp.logits_comm_s(self.model, rows, L.activation_dtype(self.dtype))
        return time

    def prefill_time_s(self, chunk_tokens: int, offset_tokens: int) -> float:
        if chunk_tokens <= 0:
            return 0.0
        time = self._units_time_s(R.unit_prefill_time_s, chunk_tokens, offset_tokens)
        return (time + self._ends_time_s(chunk_tokens, lm_head=False)) * self.core_share

    def prefill_pass_time_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """One pass over several sequences' prefill chunks ((tokens, offset) each): every chunk's
        time, less what the pass pays once (`roofline.prefill_shared_s`) for each chunk past the first."""
        chunks = [(c, p) for c, p in chunks if c > 0]
        times = [self.prefill_time_s(c, p) for c, p in chunks]
        if len(times) <= 1:
            return sum(times)
        shared_s = self._pass_shared_s(*chunks[0]) * self.core_share
        return max(sum(times) - (len(times) - 1) * shared_s, max(times))

    def _pass_shared_s(self, chunk_tokens: int, offset_tokens: int) -> float:
        """Per pass, the seconds of the profiled units' prefill paid once (analytic units: none)."""
        total = 0.0
        for kind, precision, count in self.unit_counts:
            profile = self.profile_for(precision)
            exact = R.exact_profile(profile, self.model, self.gpu, precision)
            if exact is None:
                continue
            share = 1.0
            if kind != "layer":
                c, p = np.float64(chunk_tokens), np.float64(offset_tokens)
                efficiency = R.efficiency_for(profile, self.gpu)
                attention = self._analytic("attention", precision, c, p, efficiency)
                mlp = self._analytic("mlp", precision, c, p, efficiency)
                share = float((attention if kind == "attention" else mlp) / (attention + mlp))
            total += count * R.prefill_shared_s(exact, self.gpu) * share
        return total

    def decode_time_s(self, batch_size: int, sum_context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        time = self._units_time_s(R.unit_decode_time_s, batch_size, sum_context_tokens)
        return (time + self._ends_time_s(batch_size, lm_head=True)) * self.core_share

    def step_time_s(self, sequences: int) -> float:
        """The engine's work outside the model for a batch of `sequences` sequences (scheduling,
        inputs, appending the tokens): on the first stage, where the runtime's scheduler runs."""
        if not self.first:
            return 0.0
        return R.step_overhead_s(self.gpu, sequences, self.dtype, profile=self.profile) * self.core_share

    def send_time_s(self, tokens: int) -> float:
        if self.link is None or tokens <= 0:
            return 0.0
        n_bytes = L.hidden_bytes(self.model, tokens, L.activation_dtype(self.dtype))
        if self.transport is not None:
            measured = R.transport_time_s(self.profile, self.transport, self.gpu, self.dtype, n_bytes)
            if measured is not None:
                return measured
        return link_time_s(self.link, n_bytes)

    # ---- vectorised --------------------------------------------------------------------------

    def prefill_signature(self) -> tuple:
        """Stages with equal signatures have equal prefill times (the planner computes them once)."""
        profiles = tuple(
            None if self.profile_for(precision) is None else id(self.profile_for(precision))
            for _kind, precision, _count in self.unit_counts
        )
        profile = None if self.profile is None else id(self.profile)
        return (
            self.model,
            self.gpu.name,
            self.unit_counts,
            self.first,
            self.dtype,
            self.kv_dtype,
            profile,
            profiles,
            self.core_share,
            self.tp,
        )

    def send_signature(self) -> tuple:
        return (self.model.hidden_size, self.dtype, self.link)

    def send_times_s(self, tokens: np.ndarray) -> np.ndarray:
        return _c_only(self.send_time_s, tokens)

    def prefill_times_s(self, chunk_tokens: np.ndarray, offset_tokens: np.ndarray) -> np.ndarray:
        c = np.asarray(chunk_tokens, dtype=np.float64)
        p = np.asarray(offset_tokens, dtype=np.float64)
        if not self.twin_ok:
            return np.vectorize(self.prefill_time_s, otypes=[float])(chunk_tokens, offset_tokens)
        total = np.zeros(np.broadcast_shapes(c.shape, p.shape))
        for kind, precision, count in self.unit_counts:
            total = total + count * self._unit_prefill(kind, precision, c, p)
        if self.first:
            total = total + _c_only(self._embed_time_s, c)
        if self.tp is not None:
            total = total + _c_only(self._units_comm_s, c)
        return np.where(c > 0, total * self.core_share, 0.0)

    def _embed_time_s(self, tokens: int) -> float:
        time = R.embed_time_s(self.model, self.gpu, tokens, self.dtype, profile=self.profile)
        if self.tp is not None:
            time += self.tp.embed_comm_s(self.model, tokens, L.activation_dtype(self.dtype))
        return time

    def tail_s(self) -> float:
        """Final norm + LM head for one token (the last prompt token's logits), on this stage."""
        return self.logits_time_s(1)

    def logits_time_s(self, prompts: int) -> float:
        """Final norm + LM head + sampling of `prompts` rows on this stage (its cores shared)."""
        return self._lm_head_s(prompts) * self.core_share

    def _unit_prefill(self, kind: str, precision: str, c: np.ndarray, p: np.ndarray) -> np.ndarray:
        profile = self.profile_for(precision)
        efficiency = R.efficiency_for(profile, self.gpu)
        exact = R.exact_profile(profile, self.model, self.gpu, precision)
        if exact is None:
            return self._analytic(kind, precision, c, p, efficiency)
        fit = exact.prefill
        layer_s = (
            np.maximum(fit.a0 + np.maximum(fit.time_s(c, p) - fit.a0, 0.0), 0.0) / self.gpu.emulate_speed
        )
        if kind == "layer":
            return layer_s
        attention = self._analytic("attention", precision, c, p, efficiency)
        mlp = self._analytic("mlp", precision, c, p, efficiency)
        return layer_s * (attention if kind == "attention" else mlp) / (attention + mlp)

    def _analytic(
        self, kind: str, precision: str, c: np.ndarray, p: np.ndarray, efficiency: R.Efficiency
    ) -> np.ndarray:
        """numpy twin of `roofline._analytic_prefill_s` for one sequence, units at `precision`."""
        model, gpu, act = self.model, self.gpu, L.activation_dtype(precision)
        if model.is_moe and kind != "attention":  # experts touched depend on the token count
            n_bytes = _per_distinct(lambda n: L.weight_bytes_read(model, kind, precision, n), c)
        else:
            n_bytes = float(L.weight_bytes_read(model, kind, precision, 1))
        n_bytes = n_bytes + c * L.activation_elems_per_token(model, kind) * L.dtype_bytes(act)
        if kind != "mlp":
            n_bytes = n_bytes + L.kv_bytes_per_token(model, self.kv_dtype) * (p + c)
        weight_peak = gpu.peak_flops(L.compute_dtype(precision))
        compute = L.matmul_flops(model, kind, 1.0) * c / (efficiency.compute * weight_peak)
        pairs = c * (p + c / 2)
        compute = compute + L.attention_core_flops(model, kind, 1.0) * pairs / (
            efficiency.compute * gpu.peak_flops(act)
        )
        memory = n_bytes / (efficiency.memory * gpu.mem_bandwidth_bytes_per_s)
        return np.maximum(compute, memory) + R.KERNELS_PER_UNIT[kind] * R.KERNEL_LAUNCH_OVERHEAD_S


def _group(entry: tuple, dtype: str) -> UnitGroup:
    """(kind, count) at `dtype`, or (kind, precision, count), as a (kind, precision, count) group."""
    if len(entry) == 2:
        return (entry[0], dtype, int(entry[1]))
    kind, precision, count = entry
    return (kind, precision, int(count))


AFFINE_PROBES = (1, 2, 17, 1000, 65536)


def _c_only(fn, values: np.ndarray) -> np.ndarray:
    """fn(c) (scalar, 0 at c <= 0) over an array. Transfers and the embedding gather are affine in
    c for c >= 1 (latency + bytes/bandwidth); that is checked on probe points, then used in closed
    form; otherwise fn runs once per distinct c."""
    values = np.asarray(values)
    probes = np.array([fn(c) for c in AFFINE_PROBES])
    slope = probes[1] - probes[0]
    intercept = probes[0] - slope
    if np.allclose(intercept + slope * np.array(AFFINE_PROBES), probes, rtol=1e-12, atol=0.0):
        return np.where(values > 0, intercept + slope * values, 0.0)
    return _per_distinct(fn, values)


def _per_distinct(fn, values: np.ndarray) -> np.ndarray:
    """fn (scalar) over an array, called once per distinct value."""
    values = np.asarray(values)
    distinct, inverse = np.unique(values, return_inverse=True)
    results = np.array([fn(int(v)) if float(v).is_integer() else fn(float(v)) for v in distinct], dtype=float)
    return results[inverse].reshape(values.shape)


def _twin_agrees(stage: CostModelStage) -> bool:
    rng = np.random.default_rng(0)
    c = np.concatenate([[1, 16, 64, 512, 4096, 32768], rng.integers(1, 65536, TWIN_CHECK_POINTS - 6)])
    p = np.concatenate([[0, 0, 4096, 100, 0, 65536], rng.integers(0, 131072, TWIN_CHECK_POINTS - 6)])
    twin = stage.prefill_times_s(c, p)
    scalar = np.array([stage.prefill_time_s(int(a), int(b)) for a, b in zip(c, p, strict=True)])
    return bool(np.allclose(twin, scalar, rtol=TWIN_RTOL, atol=0.0))


# ---- plan files --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StageSpec:
    """What the chunk planner needs of one plan stage."""

    device: str
    gpu_type: str
    unit_start: int
    unit_end: int  # half-open
    link: LinkSpec | None
    emulate_speed: float = 1.0  # the device runs at this fraction of its type's speed (cluster `emulate`)
    precisions: tuple[str, ...] | None = None  # weight precision per unit (None: the pipeline's dtype)
    node: str = ""  # the cluster node (host) the device is on
    tp: TensorParallel | None = None  # tensor parallelism over the stage's GPUs (None: one GPU)


@dataclass(frozen=True, slots=True)
class PlanPipeline:
    """A plan's pipeline, priced: the stages' latencies plus what TTFT adds after the last chunk."""

    pipeline: PipelineLatency
    tail_s: float
    model: ModelSpec
    stages: tuple[StageSpec, ...]
    labels: dict[str, str]

    @property
    def flops_linear_tokens(self) -> float:
        """Matmul FLOPs per token / attention FLOPs per (query, key) pair: Seq1F1B's equal-FLOP rule."""
        return L.matmul_flops(self.model, "layer", 1.0) / L.attention_core_flops(self.model, "layer", 1.0)


def build_pipeline(
    model: ModelSpec,
    stages: Sequence[StageSpec],
    *,
    granularity: str = "layer",
    dtype: str = "fp16",
    kv_dtype: str = "fp16",
    profiles: Sequence[Profile] = (),
    labels: dict[str, str] | None = None,
) -> PlanPipeline:
    if granularity not in ("layer", "sublayer"):
        raise TesselError(f"granularity {granularity!r}: expected 'layer' or 'sublayer'")
    n_units = model.num_layers * units_per_layer(granularity)
    if not stages:
        raise TesselError("a plan needs at least one stage")
    expected = 0
    for stage in stages:
        if stage.unit_start != expected or stage.unit_end <= stage.unit_start:
            raise TesselError(
                f"stage on {stage.device} covers units {stage.unit_start}..{stage.unit_end}; stages must "
                f"cover 0..{n_units} in order without gaps"
            )
        expected = stage.unit_end
        if stage.precisions is not None and len(stage.precisions) != stage.unit_end - stage.unit_start:
            raise TesselError(
                f"stage on {stage.device}: {len(stage.precisions)} precisions for "
                f"{stage.unit_end - stage.unit_start} units"
            )
    if expected != n_units:
        raise TesselError(f"the stages cover {expected} units, the model has {n_units} ({granularity})")
    built = []
    hosts = stage_hosts(stages)
    for position, stage in enumerate(stages):
        gpu = get_gpu(stage.gpu_type).emulated(stage.emulate_speed)
        last = position == len(stages) - 1
        if not last and stage.link is None:
            raise TesselError(f"stage {position} ({stage.device}) has no link to the next stage")
        stage_model = stage_rank_model(model, stage.tp)
        profile = R.select_profile(list(profiles), stage_model, gpu, dtype)
        transport = None
        if not last and hosts[position] == hosts[position + 1]:
            transport = hop_transport(stage, stages[position + 1])
        built.append(
            CostModelStage.build(
                model=stage_model,
                gpu=gpu,
                unit_counts=_unit_counts(stage, granularity, dtype),
                first=position == 0,
                last=last,
                dtype=dtype,
                kv_dtype=kv_dtype,
                link=None if last else stage.link,
                profile=profile,
                profiles=tuple(profiles),
                core_share=core_share(stages, hosts, position, R.cores_profile(profiles, gpu, profile)),
                transport=transport,
                tp=stage.tp,
            )
        )
    return PlanPipeline(PipelineLatency(tuple(built)), built[-1].tail_s(), model, tuple(stages), labels or {})


def is_cpu(stage: StageSpec) -> bool:
    return get_gpu(stage.gpu_type).base_name.lower() == "cpu"


def stage_hosts(stages: Sequence[StageSpec]) -> list[str]:
    """The host each stage runs on: its node; an emulated device (cluster `emulate`) runs on the host
    that runs the plan, taken to be the first stage's that is not emulated."""
    real = [stage.node for stage in stages if stage.emulate_speed == 1.0]
    local = real[0] if real else ""
    return [local if stage.emulate_speed != 1.0 else stage.node for stage in stages]


def hop_transport(sender: StageSpec, receiver: StageSpec) -> str:
    """How hidden states cross a hop within one host, as `tessel.pipeline.devices.link_transport`
    decides: GPU to GPU over NCCL between two GPUs, else through host buffers over gloo."""
    gpus = not is_cpu(sender) and not is_cpu(receiver) and sender.device != receiver.device
    return "nccl" if gpus else "host"


def core_share(
    stages: Sequence[StageSpec], hosts: list[str], position: int, profile: Profile | None
) -> float:
    """How much slower a CPU stage computes because the CPU stages of its host share its cores:
    max(1, stages on the host x threads per stage / cores), with the cores and threads of the host's
    profile. It assumes the host's stages compute at the same time (a full pipeline: every stage
    busy with its own micro-batch; an upper bound when bubbles leave some idle, and where an emulated
    slow stage sleeps part of its time). 1 for a GPU, and without a profile that knows the cores."""
    stage = stages[position]
    if not is_cpu(stage) or profile is None or not profile.cpu_cores:
        return 1.0
    sharing = sum(1 for s, host in zip(stages, hosts, strict=True) if is_cpu(s) and host == hosts[position])
    return R.core_share_factor(sharing, profile)


def _unit_counts(stage: StageSpec, granularity: str, dtype: str) -> tuple[UnitGroup, ...]:
    """(kind, precision, count) of the stage's units, sorted."""
    units = range(stage.unit_start, stage.unit_end)
    precisions = stage.precisions or (dtype,) * len(units)
    counted = Counter((unit_kind(u, granularity), q) for u, q in zip(units, precisions, strict=True))
    return tuple((kind, q, count) for (kind, q), count in sorted(counted.items()))


def plan_profiles(
    plan: PlanFile, profiles: Sequence[str | Path | Profile], force: bool = False
) -> list[Profile]:
    """`profiles` loaded and checked against the plan's device types (every pipeline it holds) and
    model shape (`tessel.cost.profile_check`): another device's, model's or tessel's is refused,
    or used with a warning when `force`."""
    from tessel.cost.profile_check import checked_profiles

    stages = [stage for variant in (*plan.variants, *plan.replica_variants) for stage in variant.stages]
    types = {get_gpu(stage.gpu_type).base_name for stage in stages}
    return checked_profiles(
        profiles, types, L.profile_shape(plan.model_spec), force=force, model_name=plan.model_name,
        cluster_name=plan.cluster_name,
    )  # fmt: skip


def load_plan_pipeline(
    path: str | Path, profiles: Sequence[str | Path | Profile] = (), force_profile: bool = False
) -> PlanPipeline:
    """The priced pipeline of a `tessel plan --json` file, checked against its named cluster; the
    profiles checked against the plan (`plan_profiles`)."""
    plan = load_plan(path)
    plan.check_named_cluster()
    profiles = plan_profiles(plan, profiles, force_profile)
    labels = {"model": plan.model_spec.name, "cluster": plan.cluster_name, "source": str(path)}
    return plan_pipeline(plan, plan.stages, profiles=profiles, labels=labels)


def plan_pipeline(
    plan: PlanFile,
    stages: Sequence[PlanStage],
    *,
    profiles: Sequence[Profile] = (),
    labels: dict[str, str] | None = None,
) -> PlanPipeline:
    """The priced pipeline of a plan's stages (its own or one baseline's)."""
    return build_pipeline(
        plan.model_spec,
        [stage_spec(stage, plan.reference_dtype) for stage in stages],
        granularity=plan.granularity,
        dtype=plan.reference_dtype,
        kv_dtype=plan.kv_dtype,
        profiles=profiles,
        labels=labels,
    )


def stage_spec(stage: PlanStage, dtype: str = "fp16") -> StageSpec:
    """A plan stage for the chunk planner; its units at their precisions (`dtype` where it has none)."""
    link = None
    if stage.link_bytes_per_s is not None:
        link = LinkSpec(stage.link_bytes_per_s, stage.link_latency_s)
    tp = None
    if stage.tp_degree > 1:
        ring = stage.tp_link_spec
        if ring is None:
            raise TesselError(
                f"stage {stage.index} ({stage.device}): tp_degree {stage.tp_degree} without `tp_link` "
                "(bandwidth_gbps, latency_us of its ring): its all-reduces cannot be priced"
            )
        tp = TensorParallel(stage.tp_degree, ring)
    return StageSpec(
        stage.device,
        stage.gpu_type,
        stage.unit_start,
        stage.unit_end,
        link,
        stage.emulate_speed,
        stage.unit_precisions(dtype),
        stage.node,
        tp,
    )


def even_split_pipeline(
    model: ModelSpec,
    cluster,
    n_stages: int | None = None,
    *,
    dtype: str = "fp16",
    kv_dtype: str = "fp16",
    profiles: Sequence[Profile] = (),
) -> PlanPipeline:
    """The first `n_stages` devices of a `tessel.plan.files.cluster.Cluster` in file order, layers split
    evenly (the earlier stages take one more when they don't divide), links from the cluster."""
    devices = list(cluster.devices)
    n = len(devices) if n_stages is None else n_stages
    if not 1 <= n <= len(devices):
        raise TesselError(
            f"--stages must be between 1 and {len(devices)} (devices in {cluster.name}), got {n}"
        )
    n = min(n, model.num_layers)
    devices = devices[:n]
    base, extra = divmod(model.num_layers, n)
    stages, start = [], 0
    for i, device in enumerate(devices):
        end = start + base + (1 if i < extra else 0)
        link = cluster.link(device, devices[i + 1]) if i < n - 1 else None
        stages.append(StageSpec(device.name, device.gpu_type, start, end, link, node=device.node))
        start = end
    labels = {"model": model.name, "cluster": cluster.name, "source": "even layer split"}
    return build_pipeline(model, stages, dtype=dtype, kv_dtype=kv_dtype, profiles=profiles, labels=labels)
