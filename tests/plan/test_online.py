"""The online planner (`tessel plan --objective goodput`, issue 48): the queueing formulas against
their closed forms, the rate search against a sweep, the planned rate against a sweep of simulated
rates on a small cluster (the oracle), the plan file the simulator reads, and bad inputs (exit 2)."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tessel.cli import app
from tessel.errors import TesselError
from tessel.plan.files.plan_file import load_plan
from tessel.plan.files.workload import load_workload, parse_workload
from tessel.plan.online.latency import PipelineTimes, goodput_req_s, meets_slo, predict_p90
from tessel.plan.online.online_file import online_plan_file
from tessel.plan.online.online_plan import OnlineSettings, plan_online
from tessel.plan.online.queueing import erlang_c, wait_quantile_s
from tessel.plan.online.shape import OnlineShape

MODEL, CLUSTER = "llama-2-7b", "llmpq-t4-v100"  # 32 layers on 4 T4 + 2 V100: plans in about a second
SHAPE = OnlineShape.of(load_workload("chat-slo"))


def test_erlang_c_equals_the_poisson_sums() -> None:
    """C(c, a) = (a^c / c!) (c / (c - a)) / (sum_{n<c} a^n / n! + (a^c / c!) c / (c - a)), in float64."""
    rng = random.Random(7)
    for _ in range(50):
        servers = rng.randint(1, 60)
        offered = rng.uniform(0.01, 0.99) * servers
        top = offered**servers / math.factorial(servers) * servers / (servers - offered)
        exact = top / (sum(offered**n / math.factorial(n) for n in range(servers)) + top)
        assert erlang_c(servers, offered) == pytest.approx(exact, rel=1e-9)


def test_the_wait_quantile_is_the_mmc_tail() -> None:
    """Exponential stays (cs2 = 1): P(W > t) = C exp(-(c / S - lambda) t), exactly."""
    servers, rate, stay = 8, 1.5, 4.0
    t = wait_quantile_s(servers, rate, stay, 1.0, 0.9)
    waits = erlang_c(servers, rate * stay)
    assert waits > 0.1 and waits * math.exp(-(servers / stay - rate) * t) == pytest.approx(0.1)
    assert wait_quantile_s(servers, servers / stay, stay, 1.0, 0.9) == math.inf


def _random_times(rng: random.Random) -> PipelineTimes:
    stages = rng.randint(1, 6)
    decode = tuple(rng.uniform(0.002, 0.05) for _ in range(stages))
    prefill = tuple(rng.uniform(0.05, 2.0) for _ in range(stages))
    return PipelineTimes(decode, prefill, rng.randint(1, 8), rng.choice((1, 4, 16)))


def test_the_rate_search_finds_the_highest_rate_of_a_sweep() -> None:
    """Against a sweep of 400 rates: the bisection's rate meets the SLOs, and no swept rate above it
    by more than its tolerance does (the predictions grow with the rate)."""
    rng = random.Random(3)
    for _ in range(30):
        times = _random_times(rng)
        slo = (rng.uniform(0.5, 10.0), rng.uniform(0.05, 0.5))
        found = goodput_req_s(times, SHAPE, *slo)
        sweep = [r / 50 for r in range(1, 201)]
        met = [r for r in sweep if meets_slo(times, SHAPE, r, *slo)]
        if found == 0:
            assert not predict_p90(times, SHAPE, 0.0).meets(*slo) and not met
            continue
        assert predict_p90(times, SHAPE, found).meets(*slo)  # the quantiles themselves, not the shortcut
        assert all(r <= found * (1 + 1e-3) for r in met)
        ttfts = [predict_p90(times, SHAPE, r).ttft_p90_s for r in sweep[::10]]
        finite = [t for t in ttfts if math.isfinite(t)]
        assert finite == sorted(finite)


def test_the_packing_equals_brute_force_over_disjoint_sets() -> None:
    """Random candidates (devices, goodput) on 7 devices: the branch and bound's goodput equals the best
    over every set of pairwise disjoint candidates, and its pipelines share no device."""
    from itertools import combinations
    from types import SimpleNamespace

    from tessel.plan.online.packing import best_packing

    rng = random.Random(11)
    for _ in range(40):
        items = [
            SimpleNamespace(placement=SimpleNamespace(devices=tuple(rng.sample(range(7), rng.randint(1, 4)))),
                            goodput_req_s=rng.uniform(0.1, 3.0))
            for _ in range(rng.randint(1, 12))
        ]  # fmt: skip
        brute = max(
            sum(p.goodput_req_s for p in combo)
            for n in range(len(items) + 1)
            for combo in combinations(items, n)
            if len({d for p in combo for d in p.placement.devices})
            == sum(len(p.placement.devices) for p in combo)
        )
        packed = best_packing(items)
        used = [d for p in packed.pipelines for d in p.placement.devices]
        assert packed.exact and len(used) == len(set(used))
        assert packed.goodput_req_s == pytest.approx(brute, rel=1e-12)


@pytest.fixture(scope="module")
def small_plan():
    workload = load_workload("chat-slo")
    plan = plan_online(MODEL, CLUSTER, workload, OnlineSettings(time_limit_s=20.0))
    return plan, workload


def test_the_plan_is_never_below_the_baseline_and_adds_disjoint_pipelines(small_plan) -> None:
    """Also: at its micro-batch size, no pair or triple of disjoint candidates on the whole cluster
    serves more."""
    from itertools import combinations

    from tessel.plan.online.candidates import CandidatePlacements
    from tessel.plan.online.pipelines import price

    plan, _ = small_plan
    b = plan.micro_batch_size
    every = tuple(range(plan.instances[b].n_devices))
    candidates = CandidatePlacements(plan.instances[8], math.inf, plan.slo[1]).placements(every)
    priced = [
        q for c in candidates if (q := price(c, plan.instances[b], b, plan.shape, plan.slo)) is not None
    ]
    for n in (1, 2, 3):
        for combo in combinations(priced, n):
            devices = [d for q in combo for d in q.placement.devices]
            if len(devices) == len(set(devices)):
                assert sum(q.goodput_req_s for q in combo) <= plan.goodput_req_s * (1 + 1e-9)
    assert plan.baseline is not None and plan.goodput_req_s >= plan.baseline.goodput_req_s * (1 - 1e-12)
    used = [d for p in plan.pipelines for d in p.placement.devices]
    assert len(used) == len(set(used))
    assert sum(plan.weights) == pytest.approx(1.0)
    for pipeline in plan.pipelines:  # each meets the SLOs at its routed rate
        assert predict_p90(pipeline.times, plan.shape, pipeline.goodput_req_s).meets(*plan.slo)
        assert pipeline.evaluation.feasible and pipeline.instance.micro_batches == pipeline.micro_batches


def test_the_simulator_confirms_the_planned_rate_against_a_sweep(small_plan, tmp_path: Path) -> None:
    """The oracle: a sweep of simulated rates (80 requests each, one seed) on the plan file. The
    simulator meets the SLOs at half the planned rate or more, and the planned rate is at most 1.5x
    the highest swept rate that meets them (the model's error: docs/planner.md)."""
    from tessel.sim.api import SimulationSettings, simulate_plan
    from tessel.sim.request_trace import requests_from
    from tessel.sim.slo import Slo, check_slo

    plan, workload = small_plan
    file = online_plan_file(plan, model=_model(), cluster=_cluster(),
                            cluster_source=CLUSTER, workload=workload, dtype="fp16", kv_dtype="fp16",
                            granularity="layer")  # fmt: skip
    slo = Slo(*plan.slo)

    def met(rate: float) -> bool:
        trace = requests_from(workload, 80, 0, rate)
        settings = SimulationSettings(requests=80, rate_per_s=rate)
        return check_slo(simulate_plan(file, workload.name, settings, trace=trace).runs[0].metrics, slo).met

    planned = plan.goodput_req_s
    sweep = [planned * f for f in (0.5, 0.75, 1.0, 1.5)]
    highest = max((r for r in sweep if met(r)), default=0.0)
    assert highest >= planned * 0.5
    assert planned <= highest * 1.5


def _model():
    from tessel.catalog.models import load_model

    return load_model(MODEL)


def _cluster():
    from tessel.plan.files.cluster import load_cluster

    return load_cluster(CLUSTER)


def test_plan_goodput_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    args = ["plan", "--model", MODEL, "--cluster", CLUSTER, "--workload", "chat-slo",
            "--objective", "goodput", "--time-limit", "10", "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "goodput:" in result.output and "simulator at the planned rate: SLO" in result.output
    plan = load_plan(out)
    m, b = plan.workload["m"], plan.workload["micro_batch_size"]
    assert m == sum(r.micro_batches for r in plan.replicas) and b >= 1
    assert plan.workload["slo"] == {"ttft_p90_s": 5.0, "tpot_p90_s": 0.2}
    planned = plan.predicted.throughput_tok_s / 256.0  # the model's goodput; the file: what the simulator met
    assert 0.5 * planned * (1 - 1e-9) <= plan.workload["arrival_rate_per_s"] <= planned * (1 + 1e-9)
    rate = plan.workload["arrival_rate_per_s"]  # `tessel simulate` runs an online plan at its rate
    args = ["simulate", "--plan", str(out), "--workload", "chat-slo", "--requests", "40"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert f"Poisson requests at {rate:g}/s" in " ".join(result.output.split())
    assert (
        f"SLO met at {rate:.4g} req/s" in result.output or f"SLO missed at {rate:.4g} req/s" in result.output
    )


def _workload(tmp_path: Path, rate: float = 1.0, slo: str = "{ttft_p90_s: 5, tpot_p90_s: 0.2}") -> Path:
    path = tmp_path / "w.yaml"
    path.write_text(
        "name: w\nprompt_tokens: {mean: 512, max: 2048}\noutput_tokens: {mean: 256, max: 1024}\n"
        f"arrival_rate_per_s: {rate}\nslo: {slo}\n"
    )
    return path


def _exit_2(args: list[str], pattern: str) -> None:
    result = CliRunner().invoke(app, args)
    error = result.exception
    assert isinstance(error, TesselError) and error.exit_code == 2, result.output
    assert re.search(pattern, str(error)), str(error)


@pytest.mark.parametrize(
    "slo, pattern",
    [
        ("{ttft_p90_s: 5, tpot_p90_s: 0.001}", r"p90 TPOT SLO of 1 ms \(the best plan reaches \d+\.\d ms\)"),
        (
            "{ttft_p90_s: 0.01, tpot_p90_s: 0.2}",
            r"p90 TTFT SLO of 0\.01 s \(the best plan reaches \d\.\d+ s\)",
        ),
    ],
)
def test_unreachable_slos_name_which_and_what_the_best_plan_reaches(
    tmp_path: Path, slo: str, pattern: str
) -> None:
    workload = _workload(tmp_path, slo=slo)
    _exit_2(["plan", "--model", MODEL, "--cluster", CLUSTER, "--workload", str(workload), "--objective",
             "goodput", "--time-limit", "5"], pattern)  # fmt: skip


def test_a_rate_no_plan_can_serve_is_refused(tmp_path: Path) -> None:
    workload = _workload(tmp_path, rate=5000)
    pattern = r"asks for 5000 requests/s; no plan of llmpq-t4-v100 held in GPU memory serves more than"
    _exit_2(["plan", "--model", MODEL, "--cluster", CLUSTER, "--workload", str(workload), "--objective",
             "goodput", "--time-limit", "5"], pattern)  # fmt: skip


@pytest.mark.parametrize("bad", ["0", "-1", ".nan"])
def test_bad_slos_are_refused_at_read_naming_the_field_and_line(tmp_path: Path, bad: str) -> None:
    workload = _workload(tmp_path, slo=f"{{ttft_p90_s: 5, tpot_p90_s: {bad}}}")
    with pytest.raises(TesselError, match=r"w\.yaml:5: slo\.tpot_p90_s"):
        load_workload(workload)


def test_goodput_needs_slos_and_arrivals() -> None:
    with pytest.raises(TesselError, match="no `slo"):
        plan_online(MODEL, CLUSTER, load_workload("default"), OnlineSettings(time_limit_s=5.0))
    batch = parse_workload({"name": "b", "prompt_tokens": 10, "output_tokens": 10, "batch_size": 4,
                            "slo": {"ttft_p90_s": 1, "tpot_p90_s": 1}})  # fmt: skip
    with pytest.raises(TesselError, match="offline batch"):
        plan_online(MODEL, CLUSTER, batch, OnlineSettings(time_limit_s=5.0))
