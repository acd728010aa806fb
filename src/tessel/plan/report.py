"""What a plan predicts, the plan file it writes (`tessel.plan.files.plan_file`) and the rich tables
`tessel plan` prints.

Predicted metrics, from the pipeline of m micro-batches of b requests each (b from the workload):

    TTFT       = prefill makespan  = sum_j T_j^pre + (m - 1) max_j T_j^pre
                 (the last of m micro-batches admitted together gets its first token then)
    TPOT       = decode makespan   = sum_j T_j^dec + (m - 1) max_j T_j^dec
                 (one decode step of every micro-batch; each request gets one token per step)
    throughput = m * b * n_out / (TTFT + n_out * TPOT)   generated tokens per second
                 (n_out = mean output tokens; a batch of m * b requests from prompt to last token)

With the planner's weights (prefill 1, decode n_out) the objective equals TTFT + n_out * TPOT.

Beside it, a prediction that is not the objective (`steady_state_tok_s`): under continuous batching
the k = m micro-batches keep circulating, and each round (one pass of every micro-batch) takes

    R = max(sum_j T_j, k max_j T_j)     per pass kind (prefill, decode)

(a micro-batch's next pass waits for its own previous one through every stage; the bottleneck
serves k passes a round), so the pipeline fill sum_j T_j - max_j T_j is not paid every round once
k >= S. steady state = k * b * n_out / (R^pre + n_out * R^dec). The objective's figure stays what the
solvers minimise and the bounds price; this one is what `tessel simulate` serves in steady state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tessel.plan.files.plan_file import PLAN_VERSION, PlanFile, parse_plan
from tessel.plan.files.plan_parts import whole_predicted
from tessel.plan.instance import PlanningInstance
from tessel.plan.solution import Evaluation
from tessel.plan.solvers.baselines import BaselineResult
from tessel.plan.steady_state import steady_state_tok_s
from tessel.units import GBPS, GIB, US_PER_S


@dataclass(frozen=True, slots=True)
class Predicted:
    ttft_s: float
    tpot_s: float
    throughput_tok_s: float  # the objective's figure (pipeline fill paid every round)
    steady_state_tok_s: float | None = None  # `steady_state_tok_s`: no fill per round

    def to_json(self) -> dict:
        return {
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "throughput_tok_s": self.throughput_tok_s,
            "steady_state_tok_s": self.steady_state_tok_s,
        }


def steady_state_line(
    steady: float | None, objective_tok_s: float, pipelines: Sequence[tuple[int, Evaluation]]
) -> str | None:
    """What `tessel plan` prints beside the objective's figure: the steady-state prediction and, per
    pipeline ((k, its evaluation) each), what bounds its decode round (None without a figure)."""
    if steady is None or not math.isfinite(steady):
        return None
    why = []
    for k, evaluation in pipelines:
        dec = [s.time_decode_s for s in evaluation.stages]
        n = len(dec)
        rule = "k >= S" if k >= n else "k < S"
        bound = "no fill per round" if k * max(dec) >= sum(dec) else "a round is one pass through every stage"
        why.append(f"k={k}, S={n}, {rule}: {bound}" if len(pipelines) == 1 else f"k={k}, S={n}")
    ratio = f", {steady / objective_tok_s:.3f}x" if objective_tok_s > 0 else ""
    per = "; ".join(why)
    return (
        f"steady state: {steady:.1f} tok/s ({per}){ratio} the objective's figure, which pays the "
        "pipeline fill every round"
    )


def routed_tok_s(figures: Sequence[float], weights: Sequence[float]) -> float:
    """What pipelines serving `figures` tok/s each serve together when requests are dealt to them by
    `weights`: min_r X_r / w_r, the rate at which the first saturates (`whole_predicted`'s rule)."""
    return min(x / w for x, w in zip(figures, weights, strict=True))


def predict(
    instance: PlanningInstance,
    evaluation: Evaluation,
    micro_batch_size: int = 1,
    output_tokens: float | None = None,
) -> Predicted:
    n_out = instance.decode_weight / instance.prefill_weight if output_tokens is None else output_tokens
    ttft, tpot = evaluation.prefill_makespan_s, evaluation.decode_makespan_s
    requests = instance.micro_batches * micro_batch_size
    total = ttft + n_out * tpot
    steady = steady_state_tok_s(
        [s.time_prefill_s for s in evaluation.stages],
        [s.time_decode_s for s in evaluation.stages],
        instance.micro_batches,
        micro_batch_size,
        n_out,
    )
    return Predicted(ttft, tpot, requests * n_out / total if total > 0 else 0.0, steady)


def layer_range(instance: PlanningInstance, unit_start: int, unit_end: int) -> tuple[int, int]:
    """Half-open layers a unit range touches (a layer split at sublayer granularity is in both)."""
    return instance.units[unit_start].layer, instance.units[unit_end - 1].layer + 1


def stage_records(instance: PlanningInstance, evaluation: Evaluation, cluster=None) -> list[dict]:
    """The plan contract's `stages` list."""
    records = []
    for index, se in enumerate(evaluation.stages):
        device = instance.devices[se.stage.device]
        layer_start, layer_end = layer_range(instance, se.stage.unit_start, se.stage.unit_end)
        link = None
        if index + 1 < len(evaluation.stages):
            link = _link_json(instance, se.stage.device, evaluation.stages[index + 1].stage.device, cluster)
        records.append(
            {
                "index": index,
                "device": device.name,
                "gpu_type": device.gpu_type,
                "node": device.node,
                "layer_start": layer_start,
                "layer_end": layer_end,
                "unit_start": se.stage.unit_start,
                "unit_end": se.stage.unit_end,
                "weights_gib": se.weight_bytes / GIB,
                "kv_gib": se.kv_bytes / GIB,
                "offload_gib": se.offload_bytes / GIB,
                **_kv_preemption_json(instance, se),
                "prefill_ms": se.time_prefill_s * 1e3,
                "decode_ms": se.time_decode_s * 1e3,
                "link_to_next": link,
                "emulate_speed": _emulate_speed(cluster, device.name),
                "emulate_schedule": _emulate_schedule(cluster, device.name),
                **_offload_json(instance, evaluation, se, layer_start, cluster),
                "precisions": None
                if evaluation.precisions is None
                else list(evaluation.precisions[se.stage.unit_start : se.stage.unit_end]),
                **_tp_json(device, cluster),
            }
        )
    return records


def _tp_json(device, cluster) -> dict:
    """A stage's degree, rank GPUs and tensor-parallel ring link (plan file version 5; no ring at
    degree 1)."""
    if device.tp_degree == 1:
        return {"tp_degree": 1, "gpus": [device.name], "tp_link": None}
    link = None
    if cluster is not None:
        from tessel.plan.tp.tp_instance import ring_link

        spec = ring_link(cluster, device.gpus)
        link = {"bandwidth_gbps": spec.bandwidth_bytes_per_s / GBPS, "latency_us": spec.latency_s * US_PER_S}
    return {"tp_degree": device.tp_degree, "gpus": list(device.gpus), "tp_link": link}


def replicas_json(replica_plan, cluster, micro_batch_size: int) -> list[dict]:
    """The plan file's `replicas` (version 2) from a `tessel.plan.replicas.replicas.ReplicaPlan`."""
    return [
        {
            "index": index,
            "weight": replica.weight,
            "stages": stage_records(replica.instance, replica.result.evaluation, cluster),
            "predicted": predict(replica.instance, replica.result.evaluation, micro_batch_size).to_json(),
            "objective": replica.result.evaluation.objective,
            "micro_batches": replica.micro_batches,
        }
        for index, replica in enumerate(replica_plan.replicas)
    ]


def flow_json(instance: PlanningInstance, plan, cluster, micro_batch_size: int) -> tuple[list[dict], dict]:
    """The plan file's `replicas` (the paths) and `flow` (version 4) from a `tessel.plan.flow.flow.FlowPlan`;
    each path's stages are evaluated at its micro-batches with the devices' full speed, its predicted
    figures and `time_shares` are the flow plan's."""
    from tessel.plan.flow.flow import SINK, SOURCE
    from tessel.plan.instance import gpu_memory_only, subset, with_micro_batches
    from tessel.plan.solution import Solution, Stage, evaluate

    paths = []
    for index, path in enumerate(plan.paths):
        sub = with_micro_batches(gpu_memory_only(subset(instance, path.devices)), path.micro_batches)
        ranges = [plan.stage_of(d) for d in path.devices]
        local = Solution(tuple(Stage(i, s.unit_start, s.unit_end) for i, s in enumerate(ranges)))
        evaluation = evaluate(sub, local)
        paths.append(
            {
                "index": index,
                "weight": path.weight,
                "stages": stage_records(sub, evaluation, cluster),
                "predicted": Predicted(
                    path.ttft_s, path.tpot_s, path.throughput_tok_s, path.steady_state_tok_s
                ).to_json(),
                "objective": evaluation.objective,
                "micro_batches": path.micro_batches,
                "time_shares": list(path.time_shares),
            }
        )
    placements = []
    for s in plan.stages:
        device = instance.devices[s.device]
        layer_start, layer_end = layer_range(instance, s.unit_start, s.unit_end)
        placements.append(
            {
                "device": device.name,
                "gpu_type": device.gpu_type,
                "node": device.node,
                "layer_start": layer_start,
                "layer_end": layer_end,
                "unit_start": s.unit_start,
                "unit_end": s.unit_end,
            }
        )
    names = {SOURCE: "source", SINK: "sink"}
    edges = [
        {
            "source": names.get(a) or instance.devices[a].name,
            "target": names.get(b) or instance.devices[b].name,
            "weight": weight,
        }
        for (a, b), weight in sorted(plan.edge_weights().items())
    ]
    return paths, {"placements": placements, "edges": edges}


def quality_json(instance: PlanningInstance, evaluation: Evaluation, source: str) -> dict | None:
    """The plan file's `quality` (version 2), None without a precision choice."""
    choice = instance.precision
    if choice is None:
        return None
    budget = choice.quality_budget if math.isfinite(choice.quality_budget) else None
    return {"cost": evaluation.quality, "budget": budget, "theta": choice.theta, "source": source}


def _kv_preemption_json(instance: PlanningInstance, se) -> dict:
    """How the stage brings back evicted KV, how much it evicts, and the host link it was priced on
    (None and 0 when the plan prices no KV restore)."""
    device = instance.devices[se.stage.device]
    h2d, d2h = device.host_to_device_bytes_per_s, device.device_to_host_bytes_per_s
    return {
        "kv_preemption": se.kv_preemption,
        "kv_evicted_gib": se.kv_evicted_bytes / GIB,
        "host_h2d_gbps": h2d / GBPS if h2d > 0 else None,
        "host_d2h_gbps": d2h / GBPS if d2h > 0 else None,
    }


def _emulate_speed(cluster, device: str) -> float:
    return 1.0 if cluster is None else cluster.device(device).emulate_speed


def _offload_json(instance: PlanningInstance, evaluation: Evaluation, se, layer_start: int, cluster) -> dict:
    """A stage's offloading as the runtime performs it: the layers whose weights stream from host
    memory (`tessel.plan.streamed`), the device's host memory and its emulated memory and host link."""
    from tessel.plan.streamed import offload_layers

    per_layer: dict[int, float] = {}
    for u in range(se.stage.unit_start, se.stage.unit_end):
        per_layer[instance.units[u].layer] = per_layer.get(instance.units[u].layer, 0.0) + _unit_bytes(
            instance, evaluation, u
        )
    # evicted KV (swapped or recomputed) is not streamed weights
    streamed = offload_layers(layer_start, list(per_layer.values()), se.offload_bytes - se.kv_evicted_bytes)
    device = instance.devices[se.stage.device]
    found = None if cluster is None else cluster.device(device.name)
    return {
        "offload_layers": streamed or None,
        "host_gib": device.host_bytes / GIB,
        "emulate_memory_gib": None if found is None else found.emulate_memory_gib,
        "emulate_host_gbps": None if found is None else found.emulate_host_gbps,
    }


def _unit_bytes(instance: PlanningInstance, evaluation: Evaluation, unit: int) -> float:
    choice = instance.precision
    if choice is None or evaluation.precisions is None:
        return float(instance.weight_bytes[unit])
    return float(choice.weight_bytes[unit, choice.names.index(evaluation.precisions[unit])])


def _emulate_schedule(cluster, device: str) -> list[list[float]] | None:
    schedule = () if cluster is None else cluster.device(device).emulate_schedule
    return [list(pair) for pair in schedule] or None


def _link_json(instance: PlanningInstance, a: int, b: int, cluster) -> dict:
    if cluster is not None:
        spec = cluster.link(instance.devices[a].name, instance.devices[b].name)
        return {"bandwidth_gbps": spec.bandwidth_bytes_per_s / GBPS, "latency_us": spec.latency_s * US_PER_S}
    return {"bandwidth_gbps": None, "latency_us": None}  # no cluster given: link unknown


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def _finite_tree(value):
    """inf / nan (not valid JSON) become null, at any depth."""
    if isinstance(value, float):
        return _finite(value)
    if isinstance(value, dict):
        return {key: _finite_tree(v) for key, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_tree(v) for v in value]
    return value


def workload_json(workload) -> dict:
    data = workload.model_dump(mode="json")
    data.update(
        {
            "m": workload.micro_batches,
            "micro_batch_size": workload.micro_batch_size,
            "requests_in_flight": workload.requests_in_flight,
            "alpha_f": _finite(workload.alpha_f),
            "alpha_r": workload.alpha_r,
        }
    )
    return data


def baseline_json(
    instance: PlanningInstance, result: BaselineResult, micro_batch_size: int, cluster=None
) -> dict:
    if result.evaluation is None:
        return {
            "feasible": False,
            "reason": result.reason,
            "objective": None,
            "predicted": None,
            "stages": None,
        }
    return {
        "feasible": result.feasible,
        "reason": result.reason,
        "objective": result.evaluation.objective,
        "predicted": predict(instance, result.evaluation, micro_batch_size).to_json(),
        "stages": stage_records(instance, result.evaluation, cluster),
    }


def plan_json(
    instance: PlanningInstance,
    evaluation: Evaluation,
    *,
    model,
    cluster,
    cluster_source: str,
    workload,
    solver: dict,
    baselines: dict[str, BaselineResult],
    dtype: str = "fp16",
    kv_dtype: str = "fp16",
    granularity: str = "layer",
    replicas: list[dict] | None = None,
    quality_source: str = "shape",
    baseline_instance: PlanningInstance | None = None,
    flow: dict | None = None,
) -> PlanFile:
    """The plan file that the simulator, chunk planner and runtime read. With `replicas`
    (`replicas_json`), `evaluation` is the first replica's and `instance` its group's (the top-level
    `stages`), the top-level `predicted` is the whole plan's (`whole_predicted`), and the baselines
    (single pipelines over the whole cluster) belong to `baseline_instance`."""
    b = workload.micro_batch_size
    data = {
        "version": PLAN_VERSION,
        "model": {"name": model.name, "config": dataclasses.asdict(model)},
        "cluster": {"name": cluster.name, "source": cluster_source},
        "workload": workload_json(workload),
        "dtype": dtype,
        "kv_dtype": kv_dtype,
        "granularity": granularity,
        "overlap": bool(instance.overlap),
        "swap_in": instance.swap_in,
        "stages": stage_records(instance, evaluation, cluster),
        "predicted": predict(instance, evaluation, b).to_json(),
        "objective": evaluation.objective,
        "solver": {key: _finite(v) if isinstance(v, float) else v for key, v in solver.items()},
        "baselines": {
            name: baseline_json(baseline_instance or instance, r, b, cluster) for name, r in baselines.items()
        },
        "precisions": list(instance.precision.names) if instance.precision is not None else [],
        "quality": quality_json(instance, evaluation, quality_source),
        "replicas": replicas or [],
        "flow": flow,
    }
    plan = parse_plan(_finite_tree(data), source="tessel plan")
    if not plan.replicas:
        return plan
    return plan.model_copy(update={"predicted": whole_predicted(plan.replicas)})


def decode_utilization(
    instance: PlanningInstance,
    evaluation: Evaluation,
    *,
    model,
    cluster,
    batch_size: int,
    decode_context: float,
    dtype: str = "fp16",
    kv_dtype: str = "fp16",
) -> list:
    """Predicted MFU and MBU of each stage's decode step (b sequences of the workload's mean decode
    context) over its predicted decode time T_j^dec (`tessel.cost.utilization`)."""
    from tessel.cost.tensor_parallel import shard_model
    from tessel.cost.utilization import stage_decode_work, utilization

    out = []
    last = len(evaluation.stages) - 1
    for index, se in enumerate(evaluation.stages):
        stage = se.stage
        units = instance.units[stage.unit_start : stage.unit_end]
        dtypes = (
            evaluation.precisions[stage.unit_start : stage.unit_end]
            if evaluation.precisions is not None
            else [dtype] * len(units)
        )
        slot = instance.devices[stage.device]
        gpu = cluster.device(slot.name).spec
        rank_model = shard_model(model, slot.tp_degree)  # a tensor-parallel stage: one rank's work
        work = stage_decode_work(
            rank_model, gpu, [u.kind for u in units], dtypes, batch_size, batch_size * decode_context,
            kv_dtype=kv_dtype, last=index == last,
        )  # fmt: skip
        out.append(utilization(work, se.time_decode_s, gpu))
    return out


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 100:.1f}"


def stage_table(instance: PlanningInstance, evaluation: Evaluation, title: str, utilizations=None):
    """The stage table; with `utilizations` (`decode_utilization`), decode MFU and MBU columns."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in (
        "#",
        "device",
        "type",
        "layers",
        "weights GiB",
        "KV GiB",
        "offload GiB",
        "prefill ms",
        "decode ms",
    ):
        table.add_column(column, justify="left" if column in ("device", "type") else "right")
    kv = any(se.kv_evicted_bytes > 0 for se in evaluation.stages)  # else `kv_preemption_line` alone
    if kv:
        table.add_column("KV preemption", justify="left")
        table.add_column("KV evicted GiB", justify="right")
    if utilizations is not None:
        table.add_column("decode MFU %", justify="right")
        table.add_column("decode MBU %", justify="right")
    if evaluation.precisions is not None:
        table.add_column("precisions", justify="left", min_width=len("precisions"))  # never cut to "precisi…"
    tp = any(instance.devices[se.stage.device].tp_degree > 1 for se in evaluation.stages)
    if tp:
        table.add_column("TP", justify="right")
    per = instance.n_units // len({unit.layer for unit in instance.units})
    for index, se in enumerate(evaluation.stages):
        device = instance.devices[se.stage.device]
        start, end = layer_range(instance, se.stage.unit_start, se.stage.unit_end)
        layers = (
            f"{start}-{end - 1}"
            if per == 1
            else _unit_label(instance, se.stage.unit_start, se.stage.unit_end)
        )
        table.add_row(
            str(index),
            gpus_text(device.gpus),
            device.gpu_type,
            layers,
            f"{se.weight_bytes / GIB:.1f}",
            f"{se.kv_bytes / GIB:.1f}",
            f"{se.offload_bytes / GIB:.1f}",
            f"{se.time_prefill_s * 1e3:.2f}",
            f"{se.time_decode_s * 1e3:.3f}",
            *([se.kv_preemption or "-", f"{se.kv_evicted_bytes / GIB:.1f}"] if kv else []),
            *utilization_cells(utilizations, index),
            *precision_cells(evaluation, se.stage),
            *([str(device.tp_degree)] if tp else []),
        )
    return table


def gpus_text(gpus: tuple[str, ...] | list[str]) -> str:
    """A stage's GPUs: "dgx/gpu0-3" when they are consecutive GPUs of one node, else comma-joined."""
    if len(gpus) == 1:
        return gpus[0]
    parsed = [gpu.rsplit("/gpu", 1) for gpu in gpus]
    if all(len(p) == 2 and p[1].isdigit() and p[0] == parsed[0][0] for p in parsed):
        numbers = [int(p[1]) for p in parsed]
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            return f"{parsed[0][0]}/gpu{numbers[0]}-{numbers[-1]}"
    return ",".join(gpus)


def kv_preemption_line(evaluation: Evaluation) -> str | None:
    """Each stage's way back for evicted KV, in one line (None when the plan prices none)."""
    modes = [se.kv_preemption for se in evaluation.stages]
    if any(mode is None for mode in modes):
        return None
    evicted = sum(se.kv_evicted_bytes for se in evaluation.stages) / GIB
    return (
        "KV preemption per stage (evicted KV comes back by the cheaper way on its device): "
        + ", ".join(f"{index} {mode}" for index, mode in enumerate(modes))
        + f"; {evicted:.1f} GiB evicted in all"
    )


def idle_devices_line(instance: PlanningInstance, evaluation: Evaluation) -> str | None:
    """The devices the plan leaves idle (None when it uses them all): a plan is never slower for a
    device more, since it may leave that device out."""
    used = {se.stage.device for se in evaluation.stages}
    idle = [gpu for j, device in enumerate(instance.devices) if j not in used for gpu in device.gpus]
    if not idle:
        return None
    total = sum(len(device.gpus) for device in instance.devices)
    return (
        f"idle: {len(idle)} of {total} GPUs ({', '.join(idle)}); "
        "the plan is faster without them in its pipeline"
    )


def utilization_cells(utilizations, index: int) -> list[str]:
    if utilizations is None:
        return []
    return [_percent(utilizations[index].mfu), _percent(utilizations[index].mbu)]


def precision_cells(evaluation: Evaluation, stage) -> list[str]:
    """The stage's precisions ('fp16 x6, int8 x4') as a table cell, when the plan chose them."""
    from tessel.plan.precision.precision import stage_precision_text

    if evaluation.precisions is None:
        return []
    return [stage_precision_text(evaluation.precisions, stage.unit_start, stage.unit_end)]


def _unit_label(instance: PlanningInstance, start: int, end: int) -> str:
    first, last = instance.units[start], instance.units[end - 1]
    start = f"{first.layer}{'' if first.kind == 'attention' else '.mlp'}"
    return f"{start}-{last.layer}{'' if last.kind == 'mlp' else '.attn'}"


def comparison_table(
    instance: PlanningInstance,
    evaluation: Evaluation,
    baselines: dict[str, BaselineResult],
    micro_batch_size: int,
):
    from rich.table import Table

    ours = predict(instance, evaluation, micro_batch_size)
    table = Table(title="tessel vs baselines (same cost model)", title_justify="left")
    for column in ("plan", "objective s", "TTFT s", "TPOT ms", "tok/s", "tessel speedup", "note"):
        table.add_column(column, justify="left" if column in ("plan", "note") else "right")
    table.add_row(
        "tessel",
        f"{evaluation.objective:.3f}",
        f"{ours.ttft_s:.3f}",
        f"{ours.tpot_s * 1e3:.2f}",
        f"{ours.throughput_tok_s:.1f}",
        "1.00x",
        "",
    )
    for name, result in baselines.items():
        if result.evaluation is None or not result.feasible:
            table.add_row(name, "-", "-", "-", "-", "-", f"infeasible: {_short(result.reason)}")
            continue
        theirs = predict(instance, result.evaluation, micro_batch_size)
        speedup = ours.throughput_tok_s / theirs.throughput_tok_s if theirs.throughput_tok_s else math.inf
        table.add_row(
            name,
            f"{result.evaluation.objective:.3f}",
            f"{theirs.ttft_s:.3f}",
            f"{theirs.tpot_s * 1e3:.2f}",
            f"{theirs.throughput_tok_s:.1f}",
            f"{speedup:.2f}x",
            "",
        )
    return table


def _short(reason: str | None, limit: int = 70) -> str:
    reason = reason or ""
    first = reason.split("; ")[0]
    more = reason.count("; ")
    text = first if len(first) <= limit else first[: limit - 3] + "..."
    return text + (f" (+{more} more)" if more else "")
