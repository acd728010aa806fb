"""Flow over placements (issue 33, item 2).

Oracles: brute force over every placement of every device (a range or idle), each valued by a max
flow with node capacities written out here, against the flow MILP (HiGHS); disjoint pipelines priced
as a flow plan against the replica pricing (`predict` at each pipeline's k); a shared device is never
busy more than all its time; placements with no path from the first layer to the last refused."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import numpy as np
import pytest

from plan.test_memory_concurrency import memory_instance
from tessel.errors import TesselError
from tessel.plan.flow.flow import SINK, SOURCE, check_placements, evaluate_flow, from_pipelines, max_flow
from tessel.plan.flow.flow_milp import device_groups, flow_model, solve_flow_milp
from tessel.plan.instance import subset, with_micro_batches
from tessel.plan.replicas.replicas import ReplicaSettings, memory_micro_batches
from tessel.plan.report import predict
from tessel.plan.solution import Solution, Stage, evaluate

RTOL = 1e-6


def _capacity(instance, j: int, start: int, end: int, lifetime: float, eta: float) -> float:
    """The flow model's rate for device j holding [start, end), written out (-1: it cannot hold it)."""
    n_out = instance.decode_weight / instance.prefill_weight
    n = instance.n_units
    d = instance.devices[j]
    weights = instance.weight_bytes[start:end].sum() + (instance.first_bytes if start == 0 else 0)
    weights += instance.last_bytes if end == n else 0
    free = d.memory_bytes * (1 + 1e-6) + 1.0 - instance.workspace_bytes[j] - weights
    if free < 0:
        return -1.0
    pre, dec = instance.prefill, instance.decode
    busy = (pre.unit_time_s[start:end, j] + n_out * dec.unit_time_s[start:end, j]).sum()
    if start == 0:
        busy += pre.first_time_s[j] + n_out * dec.first_time_s[j]
    if end == n:
        busy += pre.last_time_s[j] + n_out * dec.last_time_s[j]
    else:
        others = [k for k in range(instance.n_devices) if k != j]
        busy += max(pre.send_s[j, k] + n_out * dec.send_s[j, k] for k in others)
    kv_one = instance.kv_bytes[start:end].sum() / instance.micro_batches
    return min(eta / busy, free / (lifetime * kv_one))


def _brute(instance, lifetime: float, eta: float) -> float:
    n = instance.n_units
    options = [None, *((s, e) for s in range(n) for e in range(s + 1, n + 1))]
    best = 0.0
    for ranges in itertools.product(options, repeat=instance.n_devices):
        caps, edges = {}, []
        for j, r in enumerate(ranges):
            if r is None:
                continue
            cap = _capacity(instance, j, *r, lifetime, eta)
            if cap < 0:
                break
            caps[j] = cap
        else:
            for j, r in enumerate(ranges):
                if r is None:
                    continue
                if r[0] == 0:
                    edges.append((SOURCE, j))
                if r[1] == n:
                    edges.append((j, SINK))
                edges += [(j, k) for k, q in enumerate(ranges) if q is not None and q[0] == r[1]]
            if edges:
                best = max(best, max_flow(edges, caps)[0])
    return best


@pytest.mark.parametrize(
    ("seed", "n_units", "n_devices"), [(0, 4, 2), (1, 5, 3), (2, 6, 2), (3, 4, 3), (4, 4, 4)]
)
def test_flow_milp_equals_brute_force(seed: int, n_units: int, n_devices: int) -> None:
    instance = memory_instance(seed, n_units, n_devices)
    groups = device_groups(instance)
    assert all(len(g) == 1 for g in groups)
    rng = np.random.default_rng(seed)
    lifetime = float(rng.uniform(0.05, 2.0))
    model = flow_model(instance, groups, lifetime)
    milp = solve_flow_milp(model, time_limit_s=60.0, mip_gap=1e-9)
    expected = _brute(instance, lifetime, 1.0)
    assert milp.value == pytest.approx(expected, rel=1e-5, abs=1e-9)


def test_max_flow_against_a_hand_count() -> None:
    # source -> 0 (cap 3) -> {1 (cap 1), 2 (cap 5)} -> sink: 3
    edges = [(SOURCE, 0), (0, 1), (0, 2), (1, SINK), (2, SINK)]
    value, flow = max_flow(edges, {0: 3.0, 1: 1.0, 2: 5.0})
    assert value == pytest.approx(3.0)
    used = {edge: flow.get(edge, 0.0) for edge in edges}  # edges without flow are left out
    assert used[(0, 1)] + used[(0, 2)] == pytest.approx(3.0)
    assert used[(0, 1)] <= 1.0 + 1e-12


@pytest.mark.parametrize("seed", [5, 6])
def test_disjoint_pipelines_priced_as_replicas(seed: int) -> None:
    """Two disjoint pipelines as a flow plan: each path's throughput is `predict` at the most
    micro-batches its stages hold, as replicas by memory are priced."""
    instance = memory_instance(seed, 4, 4)
    pipelines = [Solution((Stage(0, 0, 2), Stage(1, 2, 4))), Solution((Stage(2, 0, 3), Stage(3, 3, 4)))]
    plan = from_pipelines(instance, pipelines, micro_batch_size=3)
    expected = []
    for solution in pipelines:
        group = tuple(solution.devices)
        local = Solution(tuple(Stage(i, s.unit_start, s.unit_end) for i, s in enumerate(solution.stages)))
        sub = subset(instance, group)
        sub = replace(sub, devices=tuple(replace(d, host_bytes=0.0) for d in sub.devices))
        one = with_micro_batches(sub, 1)
        k = math.floor(memory_micro_batches(one, evaluate(one, local)))
        if k >= 1:
            at_k = with_micro_batches(sub, k)
            expected.append(predict(at_k, evaluate(at_k, local), 3).throughput_tok_s)
    if not expected:
        assert plan is None
        return
    assert plan is not None
    assert plan.throughput_tok_s == pytest.approx(sum(expected), rel=RTOL)
    assert sum(p.weight for p in plan.paths) == pytest.approx(1.0)


def test_shared_device_is_never_busy_beyond_its_time() -> None:
    instance = memory_instance(7, 4, 3)
    instance = replace(instance, kv_bytes=np.asarray(instance.kv_bytes) * 0.05)  # room for both paths
    stages = [Stage(0, 0, 2), Stage(1, 2, 4), Stage(2, 2, 4)]
    plan = evaluate_flow(instance, stages, [((0, 1), 1.0), ((0, 2), 1.0)], micro_batch_size=2)
    assert plan is not None and plan.shared
    n_out = instance.decode_weight / instance.prefill_weight
    busy = {}
    for path in plan.paths:
        rate = path.throughput_tok_s / (2 * n_out)  # micro-batches per second
        solution = Solution(tuple(plan.stage_of(d) for d in path.devices))
        evaluation = evaluate(with_micro_batches(instance, 1), solution)
        for stage in evaluation.stages:
            work = stage.time_prefill_s + n_out * stage.time_decode_s
            busy[stage.stage.device] = busy.get(stage.stage.device, 0.0) + rate * work
    assert max(busy.values()) <= 1.0 + 1e-9
    weights = plan.edge_weights()
    assert sum(w for (a, _), w in weights.items() if a == SOURCE) == pytest.approx(1.0)


def test_placements_without_a_path_are_refused_by_layer_range() -> None:
    instance = memory_instance(8, 6, 3)
    with pytest.raises(TesselError, match=r"no GPU holds layers 2-3"):
        check_placements(instance, [Stage(0, 0, 2), Stage(1, 4, 6)])
    with pytest.raises(TesselError, match=r"no chain of GPU ranges reaches from layer 0 through layers 3-5"):
        check_placements(instance, [Stage(0, 0, 3), Stage(1, 2, 6)])
    check_placements(instance, [Stage(0, 0, 3), Stage(1, 3, 6), Stage(2, 0, 3)])


# ---- never worse, plan file, simulate -------------------------------------------------------------


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_choice_is_never_worse_than_replicas_single_or_swarm(seed: int) -> None:
    from tessel.plan.flow.flow_choice import choose_with_flow
    from tessel.plan.flow.swarm import swarm_like

    instance = memory_instance(seed, 5, 4)
    choice = choose_with_flow(instance, 2, ReplicaSettings(time_limit_s=4.0, concurrency="memory"))
    assert choice.throughput_tok_s >= choice.replicas.throughput_tok_s * (1 - 1e-9)
    assert choice.throughput_tok_s >= choice.replicas.single_tok_s * (1 - 1e-9)
    swarm = swarm_like(instance, 2)
    if swarm is not None:
        assert choice.throughput_tok_s >= swarm.throughput_tok_s * (1 - 1e-9)
    assert choice.throughput_tok_s <= choice.bound_tok_s * (1 + 1e-6)
    assert choice.pipelines_bound_tok_s <= choice.bound_tok_s * (1 + 1e-6)
    if choice.disjoint and not choice.offloads:  # disjoint pipelines in GPU memory: the tighter bound holds
        assert choice.throughput_tok_s <= choice.pipelines_bound_tok_s * (1 + 1e-6)


@pytest.fixture(scope="module")
def flow_document():
    """A flow plan file (version 4) for LLaMA-2-13B on llmpq-t4-v100: the Swarm-like plan, whose
    paths share GPUs."""
    from tessel.plan.api import PlanSettings, prepare_plan
    from tessel.plan.flow.swarm import swarm_like
    from tessel.plan.report import flow_json, plan_json
    from tessel.plan.solvers.baselines import run_baselines

    problem = prepare_plan("llama-2-13b", "llmpq-t4-v100", "offline-batch", PlanSettings())
    instance, b = problem.instance, problem.workload.micro_batch_size
    plan = swarm_like(instance, b)
    assert plan is not None and plan.shared
    paths, flow = flow_json(instance, plan, problem.cluster, b)
    first = paths[0]
    from tessel.plan.instance import gpu_memory_only, subset, with_micro_batches

    devices = plan.paths[0].devices
    sub = with_micro_batches(gpu_memory_only(subset(instance, devices)), plan.paths[0].micro_batches)
    local = Solution(
        tuple(Stage(i, plan.stage_of(d).unit_start, plan.stage_of(d).unit_end) for i, d in enumerate(devices))
    )
    workload = problem.workload.model_copy(
        update={"batch_size": plan.micro_batches * b, "max_micro_batch": plan.micro_batches}
    )
    document = plan_json(
        sub,
        evaluate(sub, local),
        model=problem.model,
        cluster=problem.cluster,
        cluster_source=problem.cluster_source,
        workload=workload,
        solver={"name": "flow"},
        baselines=run_baselines(instance),
        replicas=paths,
        baseline_instance=instance,
        flow=flow,
    )
    assert first["micro_batches"] == plan.paths[0].micro_batches
    return json.loads(document.dump()), plan, problem


def test_flow_plan_file_round_trips(flow_document) -> None:
    from tessel.plan.files.plan_file import PLAN_VERSION, parse_plan

    document, plan, _ = flow_document
    parsed = parse_plan(document)
    assert parsed.version == PLAN_VERSION == 5
    assert parsed.flow is not None and len(parsed.flow.placements) == len(plan.stages)
    assert parsed.predicted.throughput_tok_s == pytest.approx(plan.throughput_tok_s, rel=1e-6)
    out = sum(e.weight for e in parsed.flow.edges if e.source == "source")
    assert out == pytest.approx(1.0)
    older = {key: value for key, value in document.items() if key not in ("flow", "replicas")}
    assert parse_plan({**older, "version": 3}).flow is None  # an older version still reads


def _mutated(document, edit):
    copy = json.loads(json.dumps(document))
    edit(copy)
    return copy


def _scale_source_edges(doc):
    for edge in doc["flow"]["edges"]:
        if edge["source"] == "source":
            edge["weight"] *= 0.8


def _drop_first_placements(doc):
    first = doc["flow"]["placements"]
    doc["flow"]["placements"] = [p for p in first if p["unit_start"] != 0]


def _halve_a_device_edge(doc):
    edge = next(e for e in doc["flow"]["edges"] if e["source"] != "source" and e["target"] != "sink")
    edge["weight"] *= 0.5


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_scale_source_edges, r"flow weights at the source sum to 0\.8, not 1"),
        (_drop_first_placements, r"no path from the first layer to the last: no GPU holds layers? 0"),
        (_halve_a_device_edge, r"flow weights into .* differ"),
    ],
)
def test_bad_flow_plan_files_are_refused(flow_document, tmp_path, edit, message) -> None:
    from tessel.plan.files.plan_file import load_plan

    document, _, _ = flow_document
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_mutated(document, edit)))
    with pytest.raises(TesselError, match=message):
        load_plan(path)


def test_simulate_routes_requests_over_the_flow_paths(flow_document, tmp_path) -> None:
    from tessel.sim.api import simulate_plan

    document, plan, _ = flow_document
    path = tmp_path / "flow.json"
    path.write_text(json.dumps(document))
    report = simulate_plan(path, "offline-batch")
    run = report.runs[0]
    assert run.metrics.requests == 64
    assert len(run.variant.stages) == sum(len(p.devices) for p in plan.paths)


def test_plan_command_writes_the_flow_plan_and_its_closest_vllm_export(flow_document, tmp_path) -> None:
    """The `tessel plan --replicas auto` rendering of a winning flow plan: tables, comparison line,
    a version-4 plan file that loads, and a vLLM export of the paths sharing no GPU with a warning."""
    import io

    from rich.console import Console

    from tessel.commands.plan_flow import print_comparison, print_flow, write_and_export
    from tessel.plan.api import PlanSettings
    from tessel.plan.files.plan_file import load_plan
    from tessel.plan.flow.flow_choice import FlowChoice
    from tessel.plan.flow.flow_milp import FlowSearch
    from tessel.plan.replicas.replicas import ReplicaPlan

    _, plan, problem = flow_document
    choice = FlowChoice(
        ReplicaPlan((), 0.0, 0.0, 0, False, 0.0), FlowSearch(plan, (), 0.0, "swarm-like"), 0.0
    )
    assert choice.kind == "flow" and choice.flow is plan
    out = io.StringIO()
    console = Console(file=out, width=200)
    print_flow(console, problem.instance, choice)
    print_comparison(console, choice)
    path = tmp_path / "flow.json"
    write_and_export(console, problem, choice, PlanSettings(), path, "vllm")
    text = out.getvalue()
    assert "chosen: flow" in text and "placements" in text
    assert "vLLM cannot route requests over shared placements" in text
    loaded = load_plan(path)
    assert loaded.flow is not None and len(loaded.replicas) == len(plan.paths)


def test_tuned_placement_is_never_worse_than_swarm_like() -> None:
    import time

    from tessel.plan.flow.flow_heuristics import tuned_placement
    from tessel.plan.flow.swarm import swarm_like

    instance = memory_instance(13, 6, 5)
    swarm = swarm_like(instance, 2)
    tuned = tuned_placement(instance, 2, time.perf_counter() + 30.0)
    if swarm is None:
        return
    assert tuned is not None and tuned.throughput_tok_s >= swarm.throughput_tok_s * (1 - 1e-12)


def test_pipeline_runtime_refuses_a_flow_plan(flow_document, tmp_path) -> None:
    from tessel.pipeline.run_plan import load_run_plan

    document, _, _ = flow_document
    path = tmp_path / "flow.json"
    path.write_text(json.dumps(document))
    with pytest.raises(TesselError, match="a flow plan's paths share GPUs"):
        load_run_plan(path, replica=0)
