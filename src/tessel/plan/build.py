"""Turn a model, a cluster and a workload into the numbers every solver reads (`PlanningInstance`).

With R requests in flight split into m micro-batches of b = ceil(R / m) requests (the workload
derives all three), for every unit u (a decoder layer, or its attention / MLP block) and device j:

- prefill pass: one micro-batch, b prompts of the mean prompt length, from offset 0;
- decode pass: one step of that micro-batch, each sequence at the mean decode context
  (prompt + half the output);
- first stage: embedding lookup of the pass's tokens; last stage: final norm + LM head for one
  token per sequence (prefill only needs the last token's logits), and a float32 logits buffer;
- send_s[j, k]: the hidden states of one pass's tokens over the cluster link j -> k;
- kv_bytes[u]: KV of every micro-batch in flight (m * b requests) at full length
  (prompt max + output max): pipeline stages keep all of them, not one;
- workspace_bytes[j]: peak activations of the largest prefill pass (b prompts at max length);
- memory_bytes: the GPU's memory less what CUDA reserves; host_bytes: the node's host memory
  split evenly over its GPUs;
- kv_restore (`kv_preemption="auto"`, with swap_in "charged"): per device, swapping evicted KV out
  and back costs 1/d2h + 1/h2d seconds per byte over its host link (cluster `pcie_gen` / `host_link`,
  else the catalog's), recomputing it costs the device's prefill time of one micro-batch of contexts
  at the mean decode context (when preemption strikes) per KV byte of that context (profile or roofline);
- offloaded weights stream as whole layers (`stream_layers`, with swap_in "charged"), as the runtime
  streams them, and a CPU device's copies take its compute's cores (`copies_share_compute`) at no
  more than half its achieved memory bandwidth (the profile's memory efficiency; a copy reads and
  writes each byte), below its emulated host link when that is faster;
- objective weights: prefill_weight = 1 and decode_weight = mean output tokens, so the objective is
  one request's latency: prefill makespan + output_tokens x decode makespan.
- with `precisions` (more than one weight precision), every unit's bytes and times at each of them
  (the cost model at that dtype: `tessel.cost.layer.WEIGHT_SCHEMES`) and its quality cost
  (`tessel.plan.precision.quality`); the budget is `quality_budget`, else `theta` alone, else the default
  (`tessel.plan.precision.precision.default_budget`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tessel.catalog.gpus import GpuSpec
from tessel.catalog.models import ModelSpec, load_model
from tessel.cost import layer as L
from tessel.cost.link import link_time_s
from tessel.cost.profile import Profile
from tessel.cost.profile_check import checked_profiles
from tessel.cost.roofline import (
    core_share_factor,
    cores_profile,
    efficiency_for,
    embed_time_s,
    lm_head_time_s,
    select_profile,
    step_overhead_s,
    transport_time_s,
    unit_decode_time_s,
    unit_prefill_time_s,
)
from tessel.dtypes import parse_dtype
from tessel.errors import TesselError
from tessel.plan.encoder import encoder_workload
from tessel.plan.files.cluster import Cluster, load_cluster
from tessel.plan.files.workload import Workload, load_workload
from tessel.plan.instance import (
    SWAP_IN_POLICIES,
    DeviceSlot,
    KvRestore,
    PassCosts,
    PlanningInstance,
    PrecisionChoice,
    Unit,
)

GRANULARITIES = {"layer": ("layer",), "sublayer": ("attention", "mlp")}
# "auto": evicted KV priced per device by the cheaper of swap and recompute; "off": streamed like weights
KV_PREEMPTION_PRICING = ("auto", "off")
LOGITS_BYTES_PER_ELEMENT = 4  # logits are upcast to float32 before sampling (vLLM, HF)
# Quality costs are nats per token summed over the layers (an int4 layer costs well under one): a
# budget of a million is no budget, a theta of a million seconds per nat makes quality all that counts.
MAX_QUALITY_BUDGET = 1e6
MAX_THETA = 1e6


def _check_emulated_memory(model: ModelSpec, cluster: Cluster, dtype: str) -> None:
    """An emulated device memory (`emulate: {memory_gib}`) must hold one decoder layer's weights:
    streamed layers are copied into it whole (`tessel.engine.weight_stream`)."""
    layer_bytes = L.weight_bytes(model, "layer", dtype)
    for device in cluster.devices:
        cap = getattr(device, "emulate_memory_gib", None)
        if cap is not None and cap * 2**30 < layer_bytes:
            raise TesselError(
                f"{device.name}: its emulated memory of {cap:g} GiB is below one decoder layer of "
                f"{model.name} ({layer_bytes / 2**30:.4f} GiB at {dtype}); give emulate memory_gib at "
                "least that"
            )


def build_instance(
    model: ModelSpec | str | Path,
    cluster: Cluster | str | Path,
    workload: Workload | str | Path,
    *,
    granularity: str = "layer",
    dtype: str = "fp16",
    kv_dtype: str = "fp16",
    overlap: bool = False,
    swap_in: str = "charged",
    profiles: Sequence[Profile] = (),
    precisions: Sequence[str] = (),
    quality_budget: float | None = None,
    theta: float | None = None,
    checkpoint: Path | None = None,
    sensitivity: Path | None = None,
    kv_preemption: str = "auto",
    force_profile: bool = False,
) -> PlanningInstance:
    """The planning problem of serving `model` on `cluster` under `workload` (names or objects); a
    profile of another device type, model shape or tessel is refused unless `force_profile`."""
    model = model if isinstance(model, ModelSpec) else load_model(model)
    cluster = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    workload = workload if isinstance(workload, Workload) else load_workload(workload)
    workload = encoder_workload(workload, model)  # an encoder reads at most its positions
    if granularity not in GRANULARITIES:
        raise TesselError(f"unknown granularity {granularity!r}; use one of {', '.join(GRANULARITIES)}")
    if swap_in not in SWAP_IN_POLICIES:
        raise TesselError(f"unknown swap-in policy {swap_in!r}; use one of {', '.join(SWAP_IN_POLICIES)}")
    dtype = parse_dtype(dtype, runtime=False)  # what the catalog prices; else a user error listing that
    kv_dtype = parse_dtype(kv_dtype, runtime=False, kv=True)
    if kv_preemption not in KV_PREEMPTION_PRICING:
        known = ", ".join(KV_PREEMPTION_PRICING)
        raise TesselError(f"unknown kv preemption {kv_preemption!r}; use one of {known}")

    precisions = tuple(precisions)
    if precisions:
        dtype = precisions[0]
    _check_emulated_memory(model, cluster, dtype)
    profiles = _check_profiles_apply(profiles, cluster, model, force_profile)
    kinds = GRANULARITIES[granularity]
    units = tuple(Unit(layer, kind) for layer in range(model.num_layers) for kind in kinds)
    shape = PassShape.of(workload)
    per_type = {
        spec.name: TypeCosts.of(model, spec, kinds, shape, dtype, kv_dtype, tuple(profiles))
        for spec in {device.spec.name: device.spec for device in cluster.devices}.values()
    }
    types = [per_type[device.spec.name] for device in cluster.devices]
    unit_kind_index = np.array([kinds.index(unit.kind) for unit in units])

    def pass_costs(prefill: bool) -> PassCosts:
        if model.encoder and not prefill:  # an encoder has no decode step: that pass costs nothing
            n = len(cluster.devices)
            zeros = np.zeros(n)
            return PassCosts(np.zeros((len(units), n)), zeros, zeros, np.zeros((n, n)))
        tokens = shape.prefill_tokens if prefill else shape.batch
        send_bytes = L.hidden_bytes(model, tokens, L.activation_dtype(dtype))
        send = np.array(
            [[0.0 if a is b else hop_s(a, b, send_bytes) for b in cluster.devices] for a in cluster.devices]
        )
        times = np.array([t.prefill_s if prefill else t.decode_s for t in types]).T * shares  # [kinds, N]
        first = np.array([t.embed_prefill_s if prefill else t.embed_decode_s for t in types])
        last = np.array([t.head_prefill_s if prefill else t.head_decode_s for t in types])
        return PassCosts(
            unit_time_s=times[unit_kind_index],
            first_time_s=first * shares,
            last_time_s=last * shares,
            send_s=send,
        )

    # CPU devices of one host share its cores (an emulated node runs on the cluster's first CPU
    # node): priced as if every one of them computes at once (`core_share_factor`), and a hop
    # within a host costs the profiled message where the profile has one, as `tessel.chunk.from_plan`
    device_profiles = [select_profile(tuple(profiles), model, d.spec, dtype) for d in cluster.devices]
    hosts = _device_hosts(cluster)
    shares = np.array(
        [
            core_share_factor(sum(1 for h in hosts if h == host), cores_profile(profiles, d.spec, profile))
            if host is not None
            else 1.0
            for host, profile, d in zip(hosts, device_profiles, cluster.devices, strict=True)
        ]
    )

    def hop_s(a, b, n_bytes: float) -> float:  # noqa: ANN001
        i, j = cluster.devices.index(a), cluster.devices.index(b)
        if hosts[i] is not None and hosts[i] == hosts[j]:
            measured = transport_time_s(device_profiles[i], "host", a.spec, dtype, n_bytes)
            if measured is not None:
                return measured
        return link_time_s(cluster.link(a, b), n_bytes)

    choice, quality_source = None, None
    if len(precisions) > 1:
        choice, quality_source = _precision_choice(
            model,
            cluster,
            kinds,
            units,
            shape,
            precisions,
            kv_dtype,
            tuple(profiles),
            shares,
            quality_budget=quality_budget,
            theta=theta,
            checkpoint=checkpoint,
            sensitivity=sensitivity,
        )
    elif quality_budget is not None or theta is not None or sensitivity is not None:
        raise TesselError("--quality-budget, --theta and --sensitivity need --precisions with two or more")
    kv_tokens = workload.micro_batches * shape.batch * workload.max_kv_tokens
    kv_per_layer = L.kv_bytes_per_token(model, kv_dtype) * kv_tokens
    act = L.activation_dtype(dtype)
    return PlanningInstance(
        units=units,
        devices=tuple(
            DeviceSlot(
                name=device.name,
                gpu_type=device.gpu_type,
                node=device.node,
                memory_bytes=float(device.spec.usable_bytes),
                host_bytes=float(cluster.host_bytes(device)),
                host_to_device_bytes_per_s=_host_copy_rate(model, device, dtype, tuple(profiles)),
                device_to_host_bytes_per_s=device.spec.pcie_d2h_bytes_per_s,
                copies_share_compute=_is_cpu(device),  # a CPU copies with its cores
            )
            for device in cluster.devices
        ),
        prefill=pass_costs(prefill=True),
        decode=pass_costs(prefill=False),
        weight_bytes=np.array([float(L.weight_bytes(model, unit.kind, dtype)) for unit in units]),
        kv_bytes=np.array([0.0 if unit.kind == "mlp" else float(kv_per_layer) for unit in units]),
        workspace_bytes=np.full(
            len(cluster.devices), float(L.workspace_bytes(model, shape.max_prefill_tokens, act))
        ),
        first_bytes=float(L.embedding_bytes(model, dtype)),
        last_bytes=float(
            L.lm_head_bytes(model, dtype)
            + (0 if model.encoder else shape.batch * model.vocab_size * LOGITS_BYTES_PER_ELEMENT)
        ),
        micro_batches=workload.micro_batches,
        prefill_weight=1.0,
        # an encoder's one output per request is its embedding: throughput is then sequences/s
        decode_weight=1.0 if model.encoder else workload.output_tokens.mean_tokens,
        overlap=overlap,
        swap_in=swap_in,
        stream_layers=swap_in == "charged",  # the runtime streams whole layers (tessel.plan.streamed)
        precision=choice,
        kv_restore=kv_restore(model, cluster, shape, dtype, kv_dtype, tuple(profiles))
        if kv_preemption == "auto" and swap_in == "charged" and not model.encoder  # encoders hold no KV
        else None,
        labels={
            "model": model.name,
            "cluster": cluster.name,
            "workload": workload.name,
            "granularity": granularity,
            "dtype": dtype,
            "kv_dtype": kv_dtype,
            **({"precisions": ",".join(precisions), "quality_source": quality_source} if choice else {}),
        },
    )


def _is_cpu(device) -> bool:
    return device.gpu_type.lower() == "cpu"


def _host_copy_rate(model: ModelSpec, device, dtype: str, profiles: tuple[Profile, ...]) -> float:
    """Bytes/s a streamed weight arrives at over the device's host link. A CPU copies with its own
    cores and memory: no faster than its link (emulated or its DRAM) nor than its achieved memory
    bandwidth (the profile's, else the catalog default efficiency) over two, as a copy reads and
    writes every byte."""
    spec = device.spec
    if not _is_cpu(device):
        return spec.pcie_h2d_bytes_per_s
    profile = select_profile(profiles, model, spec, dtype)
    copy_rate = spec.mem_bandwidth_bytes_per_s * efficiency_for(profile, spec).memory / 2
    return min(spec.pcie_h2d_bytes_per_s, copy_rate)


def kv_restore(
    model: ModelSpec,
    cluster: Cluster,
    shape: PassShape,
    dtype: str,
    kv_dtype: str,
    profiles: tuple[Profile, ...],
) -> KvRestore:
    """Seconds per evicted KV byte on every device of `cluster`, by swap and by recompute (module
    docstring)."""
    swap, recompute = [], []
    context = max(round(shape.decode_context), 1)
    kv_bytes = L.kv_bytes_per_token(model, kv_dtype) * context * shape.batch  # one layer's
    for device in cluster.devices:
        spec = device.spec
        swap.append(1.0 / spec.pcie_d2h_bytes_per_s + 1.0 / spec.pcie_h2d_bytes_per_s)
        profile = select_profile(profiles, model, spec, dtype)
        layer_s = unit_prefill_time_s(
            model, spec, "layer", context, 0, batch_size=shape.batch, dtype=dtype, kv_dtype=kv_dtype,
            profile=profile,
        )  # fmt: skip
        recompute.append(layer_s / kv_bytes)
    return KvRestore(np.array(swap), np.array(recompute))


def _precision_choice(
    model: ModelSpec,
    cluster: Cluster,
    kinds: tuple[str, ...],
    units: tuple[Unit, ...],
    shape: PassShape,
    precisions: tuple[str, ...],
    kv_dtype: str,
    profiles: tuple[Profile, ...],
    shares: np.ndarray,
    *,
    quality_budget: float | None,
    theta: float | None,
    checkpoint: Path | None,
    sensitivity: Path | None,
) -> tuple[PrecisionChoice, str]:
    """Bytes, times and quality cost of every unit at every precision (see the module docstring),
    and where the quality costs came from; the times x each device's core share, as at one precision."""
    from tessel.plan.precision.precision import default_budget
    from tessel.plan.precision.quality import quality_costs

    specs = {device.spec.name: device.spec for device in cluster.devices}
    kind_index = np.array([kinds.index(unit.kind) for unit in units])
    prefill, decode = [], []
    for name in precisions:
        per_type = {
            t: TypeCosts.of(model, spec, kinds, shape, name, kv_dtype, profiles) for t, spec in specs.items()
        }
        types = [per_type[device.spec.name] for device in cluster.devices]
        prefill.append(np.array([t.prefill_s for t in types]).T[kind_index] * shares)  # [U, N]
        decode.append(np.array([t.decode_s for t in types]).T[kind_index] * shares)
    weight = np.array(
        [[float(L.weight_bytes(model, unit.kind, name)) for name in precisions] for unit in units]
    )
    quality, source = quality_costs(model, precisions, kinds, checkpoint=checkpoint, sensitivity=sensitivity)
    if quality_budget is not None and not 0 <= quality_budget <= MAX_QUALITY_BUDGET:
        raise TesselError(
            f"--quality-budget must be a number in [0, {MAX_QUALITY_BUDGET:g}], got {quality_budget}"
        )
    if theta is not None and not 0 <= theta <= MAX_THETA:
        raise TesselError(f"--theta must be a number in [0, {MAX_THETA:g}], got {theta}")
    budget = quality_budget
    if budget is None and theta is None:
        reference_int8 = (precisions[0], "int8")
        if sensitivity is not None and "int8" not in precisions:
            raise TesselError("the default quality budget needs int8 costs; give --quality-budget or --theta")
        int8, _ = quality_costs(model, reference_int8, kinds, checkpoint=checkpoint, sensitivity=sensitivity)
        budget = default_budget(int8[:, 1])
    choice = PrecisionChoice(
        names=precisions,
        weight_bytes=weight,
        prefill_time_s=np.stack(prefill, axis=2),
        decode_time_s=np.stack(decode, axis=2),
        quality=quality,
        quality_budget=float("inf") if budget is None else float(budget),
        theta=float(theta or 0.0),
    )
    return choice, source


def _check_profiles_apply(
    profiles: Sequence[Profile | str | Path], cluster: Cluster, model: ModelSpec, force: bool
) -> list[Profile]:
    """A profile measured on a device type the cluster does not have, on another model shape or by
    another tessel prices nothing it was meant to: refused, naming each difference (a user who
    passed it expects it used), or used with a warning when forced (`tessel.cost.profile_check`)."""
    types = {device.spec.base_name for device in cluster.devices}
    return checked_profiles(
        profiles, types, L.profile_shape(model), force=force, model_name=model.name, cluster_name=cluster.name
    )


def _device_hosts(cluster: Cluster) -> list[str | None]:
    """The host of each CPU device (its node; an emulated node: the first CPU node that is not
    emulated), None for a GPU."""
    cpus = [d for d in cluster.devices if d.spec.base_name.lower() == "cpu"]
    real = [d.node for d in cpus if d.emulate_speed == 1.0]
    local = real[0] if real else (cpus[0].node if cpus else None)
    return [
        None if d.spec.base_name.lower() != "cpu" else (d.node if d.emulate_speed == 1.0 else local)
        for d in cluster.devices
    ]


def capacity_shortfall_bytes(instance: PlanningInstance) -> float:
    """How far what must be held exceeds all device and host memory; > 0 means it cannot fit.

    Held: every unit's weights and KV, the embedding (first stage), the LM head (last stage) and
    the smallest device's activation workspace (at least one device runs); with a precision choice,
    every unit at its fewest bytes. A lower bound: a plan
    also needs each used device's workspace, and contiguous runs rarely pack memory perfectly.
    """
    weights = instance.weight_bytes
    if instance.precision is not None:  # at the precision with the fewest bytes, whatever the budget
        weights = instance.precision.weight_bytes.min(axis=1)
    held = float(np.sum(weights) + np.sum(instance.kv_bytes))
    held += instance.first_bytes + instance.last_bytes + float(np.min(instance.workspace_bytes))
    capacity = sum(device.memory_bytes + device.host_bytes for device in instance.devices)
    return held - capacity


@dataclass(frozen=True, slots=True)
class PassShape:
    """Token counts of the two passes, from the workload."""

    batch: int  # requests per micro-batch
    prompt_mean: float
    prefill_tokens: int  # tokens of one prefill pass
    max_prefill_tokens: int  # tokens of the largest prefill pass (prompts at max length)
    decode_context: float  # mean context of a sequence during decode

    @classmethod
    def of(cls, workload: Workload) -> PassShape:
        batch = workload.micro_batch_size
        prompt = workload.prompt_tokens
        return cls(
            batch=batch,
            prompt_mean=prompt.mean_tokens,
            prefill_tokens=round(batch * prompt.mean_tokens),
            max_prefill_tokens=batch * prompt.max_tokens,
            decode_context=workload.mean_decode_context_tokens,
        )


@dataclass(frozen=True, slots=True)
class TypeCosts:
    """Times of one device type: per unit kind (in `kinds` order), and the first / last stage extras."""

    prefill_s: list[float]
    decode_s: list[float]
    embed_prefill_s: float
    embed_decode_s: float
    head_prefill_s: float
    head_decode_s: float

    @classmethod
    def of(
        cls,
        model: ModelSpec,
        spec: GpuSpec,
        kinds: tuple[str, ...],
        shape: PassShape,
        dtype: str,
        kv_dtype: str,
        profiles: tuple[Profile, ...],
    ) -> TypeCosts:
        profile = select_profile(profiles, model, spec, dtype)
        options = {"dtype": dtype, "kv_dtype": kv_dtype, "profile": profile}
        b = shape.batch
        return cls(
            prefill_s=[
                unit_prefill_time_s(model, spec, kind, shape.prompt_mean, 0, batch_size=b, **options)
                for kind in kinds
            ],
            decode_s=[
                unit_decode_time_s(model, spec, kind, b, b * shape.decode_context, **options)
                for kind in kinds
            ],
            # the first stage also runs the engine's per-step work (a profile's "step" fit, else 0)
            embed_prefill_s=embed_time_s(model, spec, shape.prefill_tokens, dtype, profile=profile)
            + step_overhead_s(spec, b, dtype, profile=profile),
            embed_decode_s=embed_time_s(model, spec, b, dtype, profile=profile)
            + step_overhead_s(spec, b, dtype, profile=profile),
            head_prefill_s=lm_head_time_s(model, spec, b, dtype, profile=profile),
            head_decode_s=lm_head_time_s(model, spec, b, dtype, profile=profile),
        )
