"""The simulator and the chunk planner price a plan's per-unit weight precisions as the planner did.

Oracle: the planner's own evaluation (`tessel.plan.solution.evaluate`) of the same plan, which is the
definition of a stage's time at its chosen precisions; and, end to end, the planner's predicted
throughput for a mixed-precision plan against the simulated one in the regime the planner priced.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from sim.sim_plans import TINY_LLAMA
from tessel.catalog.models import model_from_config
from tessel.cli import app
from tessel.cost import layer as L
from tessel.errors import TesselError
from tessel.plan.build import build_instance
from tessel.plan.files.cluster import load_cluster
from tessel.plan.files.plan_file import load_plan, parse_plan
from tessel.plan.files.workload import Workload
from tessel.plan.report import plan_json
from tessel.plan.solution import Solution, Stage, evaluate
from tessel.sim.api import SimulationSettings, simulate_plan
from tessel.sim.plan_pipeline import pipeline_for
from tessel.units import GIB

CLUSTER = "llmpq-t4-v100"  # four T4 (int8 tensor cores) and two V100 (no int8 tensor cores)
PRECISIONS = ("fp16", "int8", "int4")
STAGE_RTOL = 1e-9  # same cost-model calls in the same order: equal up to float summation order
THROUGHPUT_RTOL = 0.25  # the tolerance of test_sim_cli's planner-vs-simulator check


def _tiny_model():
    return model_from_config(TINY_LLAMA, name="tiny-llama", source="test")


def _workload(batch_size: int, prompt: int, output: int) -> Workload:
    """An offline batch of `batch_size` requests: m = min(batch, 8) micro-batches of ceil(batch / m)."""
    return Workload(
        name="w",
        prompt_tokens={"mean": prompt, "max": 2 * prompt},
        output_tokens={"mean": output, "max": 2 * output},
        batch_size=batch_size,
    )


def _plan_file(instance, solution: Solution, workload: Workload, model, cluster):
    evaluation = evaluate(instance, solution)
    return (
        plan_json(
            instance,
            evaluation,
            model=model,
            cluster=cluster,
            cluster_source=cluster.name,
            workload=workload,
            solver={"name": "test"},
            baselines={},
        ),
        evaluation,
    )


def _random_plan(rng: np.random.Generator, n_units: int, n_devices: int, n_precisions: int) -> Solution:
    used = int(rng.integers(1, min(n_units, n_devices) + 1))
    devices = rng.permutation(n_devices)[:used]
    cuts = np.sort(rng.choice(np.arange(1, n_units), size=used - 1, replace=False))
    counts = np.diff(np.concatenate([[0], cuts, [n_units]]))
    precisions = rng.integers(0, n_precisions, size=n_units)
    return Solution.from_counts(list(devices), list(counts)).with_precisions(precisions)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    names=st.lists(st.sampled_from(("fp32", "bf16", *PRECISIONS)), min_size=2, max_size=4, unique=True),
    batch=st.integers(1, 12),
    prompt=st.integers(1, 700),
)
def test_random_mixed_plans_simulate_at_the_planners_stage_times(seed, names, batch, prompt) -> None:
    """Random tiny plans with random precisions per layer: each stage's weights in the plan file are
    the cost model's bytes at its precisions, each simulated stage's decode step is the planner's stage
    compute time, its prefill too when one request fills a micro-batch, and a short simulation runs."""
    from tessel.plan.precision.precision import parse_precisions

    rng = np.random.default_rng(seed)
    model, cluster = _tiny_model(), load_cluster(CLUSTER)
    workload = _workload(batch, prompt, 7)
    precisions = parse_precisions(",".join(names))
    instance = build_instance(model, cluster, workload, precisions=precisions, theta=0.0)
    solution = _random_plan(rng, instance.n_units, instance.n_devices, len(precisions))
    document, evaluation = _plan_file(instance, solution, workload, model, cluster)
    plan = parse_plan(json.loads(document.dump()))
    priced = pipeline_for(plan).pipeline
    b, context = workload.micro_batch_size, workload.mean_decode_context_tokens
    for written, spec in zip(plan.stages, solution.stages, strict=True):  # memory at the precisions
        held = sum(
            L.weight_bytes(model, "layer", precisions[solution.precisions[u]])
            for u in range(spec.unit_start, spec.unit_end)
        )
        held += instance.first_bytes if spec.unit_start == 0 else 0.0
        held += instance.last_bytes if spec.unit_end == instance.n_units else 0.0
        assert written.weights_gib * GIB == pytest.approx(held, rel=STAGE_RTOL)
    for stage, expected in zip(priced.stages, evaluation.stages, strict=True):
        assert stage.decode_time_s(b, b * context) == pytest.approx(expected.compute_decode_s, rel=STAGE_RTOL)
        if b == 1:  # the planner's prefill pass is one prompt of the mean length from offset 0
            tail = stage.tail_s() if stage.last else 0.0
            got = stage.prefill_time_s(prompt, 0) + tail
            assert got == pytest.approx(expected.compute_prefill_s, rel=STAGE_RTOL)
    report = simulate_plan(
        plan, "default", SimulationSettings(requests=3, seed=seed % 1000, regime="continuous")
    )
    assert report.runs[0].metrics.requests == 3


def test_int8_units_are_priced_at_int8() -> None:
    """The same split at fp16 and at int8 on a T4 (int8 tensor cores: twice the fp16 rate, half the
    bytes): the int8 stage is faster in both passes, and equals the planner's stage time."""
    model, cluster = _tiny_model(), load_cluster(CLUSTER)
    workload = _workload(8, 512, 64)
    instance = build_instance(model, cluster, workload, precisions=("fp16", "int8"), theta=0.0)
    split = Solution((Stage(0, 0, 4), Stage(1, 4, 8)))
    times = {}
    for name, vector in (("fp16", [0] * 8), ("int8", [0] * 4 + [1] * 4)):
        plan, evaluation = _plan_file(instance, split.with_precisions(vector), workload, model, cluster)
        stage = pipeline_for(plan).pipeline.stages[1]
        times[name] = (stage.decode_time_s(1, 600), stage.prefill_time_s(512, 0))
        b, context = workload.micro_batch_size, workload.mean_decode_context_tokens
        assert stage.decode_time_s(b, b * context) == pytest.approx(
            evaluation.stages[1].compute_decode_s, rel=STAGE_RTOL
        )
    assert times["int8"][0] < times["fp16"][0] and times["int8"][1] < times["fp16"][1]


def test_chunk_prices_the_plans_precisions(tmp_path: Path) -> None:
    """`tessel chunk --plan` on a plan with int8 on two T4s: each stage's chunk time is the cost
    model's unit times at the unit's precision, and the chunked TTFT differs from the fp16 plan's."""
    from tessel.catalog.gpus import get_gpu
    from tessel.chunk.from_plan import load_plan_pipeline
    from tessel.cost.roofline import embed_time_s, unit_prefill_time_s

    model, cluster = _tiny_model(), load_cluster(CLUSTER)
    workload = _workload(8, 512, 64)
    instance = build_instance(model, cluster, workload, precisions=("fp16", "int8"), theta=0.0)
    split = Solution((Stage(0, 0, 4), Stage(1, 4, 8)))
    ttft = {}
    for name, vector in (("fp16", [0] * 8), ("mixed", [1, 0, 1, 1, 0, 0, 1, 0])):
        plan, _ = _plan_file(instance, split.with_precisions(vector), workload, model, cluster)
        path = tmp_path / f"{name}.json"
        plan.write(path)
        t4 = get_gpu("T4")
        for stage, spec in zip(load_plan_pipeline(path).pipeline.stages, split.stages, strict=True):
            expected = sum(
                unit_prefill_time_s(model, t4, "layer", 300, 700, dtype=PRECISIONS[vector[u]])
                for u in range(spec.unit_start, spec.unit_end)
            )
            expected += embed_time_s(model, t4, 300) if spec.unit_start == 0 else 0.0
            assert stage.prefill_time_s(300, 700) == pytest.approx(expected, rel=STAGE_RTOL)
        out = tmp_path / f"{name}-chunk.json"
        args = ["chunk", "--plan", str(path), "--seq-len", "4096", "--json", str(out)]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        ttft[name] = json.loads(out.read_text())["ttft_s"]
    assert ttft["mixed"] < ttft["fp16"]


def test_unknown_precision_in_a_plan_names_the_stage_and_field(tmp_path: Path) -> None:
    model, cluster = _tiny_model(), load_cluster(CLUSTER)
    workload = _workload(4, 128, 16)
    instance = build_instance(model, cluster, workload, precisions=("fp16", "int8"), theta=0.0)
    plan, _ = _plan_file(instance, Solution((Stage(0, 0, 3), Stage(1, 3, 8))), workload, model, cluster)
    document = json.loads(plan.dump())
    document["stages"][1]["precisions"][2] = "int3"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    with pytest.raises(TesselError, match=r"stages\[1\].*precisions\[2\] is 'int3'"):
        load_plan(path)
    for command in (["simulate", "--plan", str(path)], ["chunk", "--plan", str(path), "--seq-len", "64"]):
        result = CliRunner().invoke(app, command)
        assert isinstance(result.exception, TesselError), result.output
        assert "stages[1]" in str(result.exception) and "precisions[2]" in str(result.exception)
    ran = subprocess.run(
        [sys.executable, "-m", "tessel.cli", "simulate", "--plan", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert "precisions[2] is 'int3'" in " ".join(ran.stderr.split())


@pytest.mark.slow
def test_simulator_agrees_with_the_planner_on_a_mixed_precision_plan(tmp_path: Path) -> None:
    """`tessel plan --precisions fp16,int8` on the default model and cluster, then `tessel simulate`
    in the regime the planner priced: the plan mixes precisions and its simulated throughput is
    within the planner-vs-simulator tolerance of the prediction (400 requests: steady state)."""
    plan_path = tmp_path / "plan.json"
    args = [
        "plan",
        "--solver",
        "dp",
        "--time-limit",
        "5",
        "--precisions",
        "fp16,int8",
        "--json",
        str(plan_path),
    ]
    made = CliRunner().invoke(app, args)
    assert made.exit_code == 0, made.output
    plan = load_plan(plan_path)
    used = {q for stage in plan.stages for q in stage.precisions}
    assert used == {"fp16", "int8"}, used
    out = tmp_path / "sim.json"
    args = ["simulate", "--plan", str(plan_path), "--requests", "400", "--seed", "1", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    run = json.loads(out.read_text())["results"]["plan"]
    simulated, predicted = run["metrics"]["throughput_tok_s"], run["predicted"]["throughput_tok_s"]
    assert abs(simulated - predicted) <= THROUGHPUT_RTOL * predicted, (simulated, predicted)


def test_simulate_shows_the_precisions_it_priced(tmp_path: Path) -> None:
    model, cluster = _tiny_model(), load_cluster(CLUSTER)
    workload = _workload(4, 128, 8)
    instance = build_instance(model, cluster, workload, precisions=("fp16", "int8"), theta=0.0)
    split = Solution((Stage(0, 0, 3), Stage(1, 3, 8))).with_precisions([0, 0, 1, 1, 1, 0, 0, 0])
    plan, _ = _plan_file(instance, split, workload, model, cluster)
    path = tmp_path / "mixed.json"
    plan.write(path)
    result = CliRunner().invoke(
        app, ["simulate", "--plan", str(path), "--requests", "3"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert "precisions" in result.output and "fp16 x2, int8 x1" in result.output
    assert "int8 x2, fp16 x3" in result.output
