"""The priced pipeline of a plan file's stages (or of one of its baselines), for the simulator.

Stage latencies come from `tessel.chunk.from_plan.build_pipeline` (the cost model: analytic
roofline, or a measured `Profile` of the stage's device type): per stage

    prefill(c, p) = sum of its units' prefill times (+ embedding of c tokens on the first stage)
    decode(B, S)  = sum of its units' decode times (+ embedding / LM head of B tokens)
    send(n)       = link latency + hidden bytes of n tokens / link bandwidth  (0 on the last stage)

Each unit is priced at the weight precision the plan chose for it (a stage's `precisions`, from
`tessel plan --precisions`), the embedding and LM head at the plan's reference precision
(`PlanFile.reference_dtype`), as the planner priced them; so on a mixed-precision plan the planner's
stage times and the simulator's agree (`tests/sim/test_sim_precisions.py`).
Prefill leaves out the final norm + LM head: only the last chunk of a prompt needs logits. The
simulator adds `logits_time_s(n)` (LM head of n tokens on the last stage's GPU) to a batch that
finishes n prompts. Links: `link_to_next.bandwidth_gbps` in gigabits per second, `latency_us`.
A stage with `offload_gib` > 0 streams that much from host memory over its GPU's host-to-device
PCIe in every batch (`SimConfig.offload_s`), added to the batch's compute time, or overlapped
with it (max) when the plan says `overlap: true`: the planner's own stage-time rule.
Of that, the stage's `kv_evicted_gib` is KV, not weights: it is left out of the streaming and kept
off the device instead (`tessel.sim.kv_pool`): the stage holds `kv_gib - kv_evicted_gib` of KV and,
when its sequences hold more, brings the excess back by its `kv_preemption` mode: a swap at the
plan's `host_h2d_gbps` / `host_d2h_gbps` (else the catalog's figures), or its own prefill of it.
CPU stages of one host (`tessel.chunk.from_plan.stage_hosts`; an emulated node runs on the host
that runs the plan) share its cores in the simulator by processor sharing (`SimPipeline.cores`, a
`tessel.sim.simulator.CoreSharing`): the host runs cores / threads of them at full speed (its
profile's `cpu_cores` and `threads`), and an emulated stage of speed s holds a core for s of its
priced time (the runtime sleeps the rest). The stage times keep the cost model's static factor
(every stage computing at once) for the chunk planner; the simulator divides it out. Stages of one
host also share its memory: a profile's `contention:decode` / `contention:prefill` components (the
layer's slowdown per co-runner, `tessel.profiling.contention`) slow each while others compute. With
`background_threads` (other programs' runnable threads on the plan's host, measured), the simulator
shares the cores with them too, a lone stage on its host included. GPU stages that the plan puts
on one GPU under two names (`<node>/gpu<K>`, `<node>/gpu<K>#2`) share it the same way, one at full
speed (the runtime's two processes time-share the GPU).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from tessel.catalog.gpus import get_gpu
from tessel.chunk.from_plan import PlanPipeline, is_cpu, plan_pipeline, stage_hosts
from tessel.chunk.latency import PipelineLatency, StageLatency
from tessel.cost.layer import kv_bytes_per_token
from tessel.cost.profile import Profile
from tessel.errors import TesselError
from tessel.plan.files.plan_file import PlanFile
from tessel.plan.files.plan_parts import PlanStage, PlanVariant, gpu_index
from tessel.sim.kv_pool import KvPool
from tessel.sim.simulator import CoreSharing
from tessel.units import GBPS, GIB


@dataclass(frozen=True, slots=True)
class SimPipeline:
    pipeline: PipelineLatency
    logits_time_s: Callable[[int], float]  # LM head of n prompts' last tokens, on the last stage
    offload_s: tuple[float, ...]  # per stage, per batch: offload_gib over the GPU's host-to-device PCIe
    offload_overlap: bool  # the plan's `overlap`: offload hidden under compute (max) or added
    kv_pools: tuple[KvPool | None, ...] = ()  # per stage that evicts KV: its resident KV and mode
    cores: CoreSharing | None = None  # CPU stages sharing a host's cores (None: none share)


def pipeline_for(
    plan: PlanFile,
    variant: PlanVariant | None = None,
    profiles: Sequence[Profile] = (),
    background_threads: float = 0.0,
) -> SimPipeline:
    """The priced pipeline of the plan's stages, or of one of its baselines (`background_threads`:
    module docstring)."""
    variant = variant or plan.main
    for stage in variant.stages[:-1]:
        if stage.link_bytes_per_s is None:
            raise TesselError(
                f"{plan.path}: {variant.name} stage {stage.index} ({stage.device}) has no link_to_next "
                f"with a positive bandwidth_gbps"
            )
    try:
        priced = plan_pipeline(plan, variant.stages, profiles=profiles)
    except TesselError as error:
        raise TesselError(f"{plan.path}: {variant.name}: {error}") from None
    last = priced.pipeline.stages[-1]

    def logits_time_s(prompts: int) -> float:
        return last.logits_time_s(prompts)

    stages = variant.stages
    offload_s = tuple(
        max(stage.offload_gib - stage.kv_evicted_gib, 0.0) * GIB / _host_link(stage)[0] for stage in stages
    )
    pools = tuple(
        _kv_pool(plan, stage, latency) for stage, latency in zip(stages, priced.pipeline.stages, strict=True)
    )
    kv_pools = pools if any(pools) else ()
    cores = core_sharing(priced, background_threads)
    return SimPipeline(priced.pipeline, logits_time_s, offload_s, plan.overlap, kv_pools, cores)


def core_sharing(priced: PlanPipeline, background_threads: float = 0.0) -> CoreSharing | None:
    """The CPU stages that share a host's cores, with what the simulator needs to share them (module
    docstring); None when no two stages share a host (and no background threads are given) or no
    profile gives the host's cores."""
    hosts: list[Hashable | None] = []
    slots: dict[Hashable, float] = {}
    stages = priced.pipeline.stages
    for spec, host, stage in zip(priced.stages, stage_hosts(priced.stages), stages, strict=True):
        profile = getattr(stage, "profile", None)
        if not is_cpu(spec):
            gpu = shared_gpu(spec.device, host)
            hosts.append(gpu)
            if gpu is not None:
                slots[gpu] = 1.0
            continue
        if profile is None or not profile.cpu_cores:
            hosts.append(None)
            continue
        hosts.append(host)
        slots.setdefault(host, profile.cpu_cores / (profile.threads or 1))
    counts = Counter(host for host in hosts if host is not None)

    def shared(host: Hashable | None) -> bool:  # a lone CPU stage shares its host with the background
        alone = 0 if background_threads > 0 and not isinstance(host, tuple) else 1
        return host is not None and counts[host] > alone

    hosts = [host if shared(host) else None for host in hosts]
    if all(host is None for host in hosts):
        return None
    contention = tuple(
        _contention(getattr(stage, "profile", None), host) for stage, host in zip(stages, hosts, strict=True)
    )
    return CoreSharing(
        tuple(hosts),
        {host: slots[host] for host in hosts if host is not None},
        tuple(getattr(stage, "core_share", 1.0) for stage in priced.pipeline.stages),
        tuple(min(1.0, spec.emulate_speed) for spec in priced.stages),
        {
            host: background_threads
            for host in hosts
            if host is not None and not isinstance(host, tuple) and background_threads > 0
        },
        contention if any(any(c) for c in contention) else (),
    )


def _contention(profile: Profile | None, host: Hashable | None) -> tuple[float, float]:
    """A CPU stage's (decode, prefill) slowdown per stage computing beside it on its host, from its
    profile's `contention:*` components (`tessel.profiling.contention`); (0, 0) without them, for a
    GPU, or alone."""
    if profile is None or host is None or isinstance(host, tuple):
        return (0.0, 0.0)
    fits = [profile.component(f"contention:{kind}") for kind in ("decode", "prefill")]
    return tuple(0.0 if fit is None else fit.c1 for fit in fits)


def shared_gpu(device: str, host: str) -> tuple[str, str, int] | None:
    """("gpu", host, K) for a GPU stage on `<node>/gpu<K>`: a plan's two names of one GPU
    (`<node>/gpu<K>` and `<node>/gpu<K>#2`) give one key, so their stages share the GPU as the
    runtime's processes time-share it; None when the device names no index."""
    index = gpu_index(device)
    return None if index is None else ("gpu", host, index)


def _host_link(stage: PlanStage) -> tuple[float, float]:
    """(host -> device, device -> host) bytes/s of a stage's GPU: the plan's, else the catalog's."""
    gpu = get_gpu(stage.gpu_type)
    h2d = gpu.pcie_h2d_bytes_per_s if stage.host_h2d_gbps is None else stage.host_h2d_gbps * GBPS
    d2h = gpu.pcie_d2h_bytes_per_s if stage.host_d2h_gbps is None else stage.host_d2h_gbps * GBPS
    return h2d, d2h


def _kv_pool(plan: PlanFile, stage: PlanStage, latency: StageLatency) -> KvPool | None:
    """The stage's resident KV and how evicted KV comes back; None when it evicts none."""
    if stage.kv_preemption is None or stage.kv_evicted_gib <= 0 or not stage.kv_gib:
        return None
    layers = sum(1 for u in range(stage.unit_start, stage.unit_end) if plan.unit_kind(u) != "mlp")
    if layers == 0:
        return None
    token_bytes = kv_bytes_per_token(plan.model_spec, plan.kv_dtype) * layers
    resident = int(max(stage.kv_gib - stage.kv_evicted_gib, 0.0) * GIB // token_bytes)
    if stage.kv_preemption == "swap":
        h2d, d2h = _host_link(stage)

        def restore_s(tokens: int) -> float:
            return tokens * token_bytes * (1.0 / h2d + 1.0 / d2h)
    else:

        def restore_s(tokens: int) -> float:
            return latency.prefill_time_s(tokens, 0)

    return KvPool(resident, stage.kv_preemption, restore_s)


def kv_capacity_tokens(plan: PlanFile, variant: PlanVariant | None = None) -> int | None:
    """Tokens of KV the plan reserved: min over stages of kv_gib / (KV bytes per token x its
    attention layers); None when a stage gives no kv_gib."""
    variant = variant or plan.main
    per_token_layer = kv_bytes_per_token(plan.model_spec, plan.kv_dtype)
    capacity = None
    for stage in variant.stages:
        kinds = [plan.unit_kind(u) for u in range(stage.unit_start, stage.unit_end)]
        layers = sum(1 for kind in kinds if kind != "mlp")
        if layers == 0:
            continue  # MLP blocks only: no KV here
        if not stage.kv_gib:
            return None
        tokens = int(stage.kv_gib * GIB // (per_token_layer * layers))
        capacity = tokens if capacity is None else min(capacity, tokens)
    return capacity
