"""SLOs on simulated runs and the goodput search: the search against a latency model whose answer is
known in closed form, bad SLOs refused, and `tessel simulate` end to end on a small plan."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sim.sim_plans import write_plan
from tessel.cli import app
from tessel.errors import TesselError
from tessel.plan.files.workload import parse_workload
from tessel.sim.sim_metrics import Metrics, Summary
from tessel.sim.slo import FLOOR_SHARE, STEPS, Slo, find_goodput


def _metrics(ttft_p90_s: float, tpot_p90_s: float) -> Metrics:
    ttft, tpot = Summary(ttft_p90_s, ttft_p90_s, ttft_p90_s, ttft_p90_s), Summary(*(tpot_p90_s,) * 4)
    return Metrics(1, 1, 1, ttft, tpot, ttft, 1.0, 1.0, 1.0, (), (), 0.0, 1.0, 1)


@pytest.mark.parametrize("slo_ttft_s", [0.3, 0.5, 1.0, 4.0])
@pytest.mark.parametrize("capacity", [0.7, 12.0])
def test_goodput_is_the_highest_rate_meeting_the_slo(slo_ttft_s: float, capacity: float) -> None:
    """p90 TTFT = base / (1 - rate / capacity), as a queue near saturation: the SLO holds up to
    rate* = capacity (1 - base / SLO). The search never claims a rate that misses, and lands within
    its geometric step of rate*."""
    base = 0.2

    def run_at(rate: float) -> Metrics:
        load = rate / capacity
        return _metrics(math.inf if load >= 1 else base / (1 - load), 0.05)

    found = find_goodput(run_at, capacity, Slo(slo_ttft_s, 0.1))
    exact = capacity * (1 - base / slo_ttft_s)
    assert found.rate_req_s <= exact * (1 + 1e-12)
    step = (1 / FLOOR_SHARE) ** (1 / 2**STEPS)
    assert found.rate_req_s >= exact / step
    assert all(c.met == (c.ttft_p90_s <= slo_ttft_s) for c in found.checks)
    assert len(found.checks) == 2 + STEPS  # capacity, floor, bisection: always ends


def test_goodput_is_the_capacity_when_it_meets_the_slo() -> None:
    found = find_goodput(lambda rate: _metrics(0.1, 0.01), 3.0, Slo(1.0, 0.1))
    assert found.rate_req_s == 3.0 and len(found.checks) == 1


def test_unreachable_slos_say_what_the_plan_reaches() -> None:
    with pytest.raises(TesselError, match=r"out of this plan's reach.*p90 TTFT is 5\.000 s.*TPOT 80\.00 ms"):
        find_goodput(lambda rate: _metrics(5.0, 0.08), 2.0, Slo(1.0, 0.05))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_bad_slos_are_refused(bad: float) -> None:
    with pytest.raises(TesselError, match="finite number of seconds > 0"):
        Slo(bad, 0.1)
    with pytest.raises(TesselError, match="finite number of seconds > 0"):
        Slo(1.0, bad)


@pytest.mark.parametrize("bad", ["0", "-2", ".nan", ".inf"])
def test_a_workload_files_bad_slo_is_refused(bad: str) -> None:
    data = {"name": "w", "prompt_tokens": 100, "output_tokens": 10, "arrival_rate_per_s": 2,
            "slo": {"ttft_p90_s": float(bad.replace(".", "")), "tpot_p90_s": 0.1}}  # fmt: skip
    with pytest.raises(TesselError, match="slo.ttft_p90_s"):
        parse_workload(data)


def _workload(tmp_path: Path, slo: str = "") -> Path:
    path = tmp_path / "w.yaml"
    path.write_text(
        "name: short\nprompt_tokens: {mean: 300, max: 2000}\noutput_tokens: {mean: 12, max: 40}\n"
        f"arrival_rate_per_s: 20\n{slo}"
    )
    return path


def test_simulate_checks_the_workloads_slo_and_finds_the_goodput(tmp_path: Path) -> None:
    plan, workload = write_plan(tmp_path), _workload(tmp_path, "slo: {ttft_p90_s: 2.0, tpot_p90_s: 0.5}\n")
    args = ["simulate", "--plan", str(plan), "--workload", str(workload), "--requests", "30"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "SLO met" in result.output or "SLO missed" in result.output
    result = CliRunner().invoke(app, [*args, "--goodput", "--json", str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output
    assert "goodput:" in result.output
    assert '"goodput_req_s"' in (tmp_path / "s.json").read_text()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--slo-ttft-p90-s", "0", "--slo-tpot-p90-s", "1"], "below 1e-06"),
        (["--slo-ttft-p90-s", "-3", "--slo-tpot-p90-s", "1"], "below 1e-06"),
        (["--slo-ttft-p90-s", "nan", "--slo-tpot-p90-s", "1"], "NaN is not a number"),
        (["--slo-ttft-p90-s", "1"], "give both"),
        (["--goodput"], "--goodput needs SLOs"),
        (["--slo-ttft-p90-s", "1e-6", "--slo-tpot-p90-s", "1e-6", "--goodput"], "out of this plan's reach"),
    ],
)
def test_bad_slo_options_exit_2(tmp_path: Path, extra: list[str], message: str) -> None:
    plan, workload = write_plan(tmp_path), _workload(tmp_path)
    args = ["simulate", "--plan", str(plan), "--workload", str(workload), "--requests", "20", *extra]
    assert _refused(CliRunner().invoke(app, args), message)


def _refused(result, message: str) -> bool:  # noqa: ANN001
    """Exit 2 with `message`: click's usage error, or a TesselError (`tessel.cli.main` exits 2)."""
    if isinstance(result.exception, TesselError):
        return result.exception.exit_code == 2 and message in str(result.exception)
    return result.exit_code == 2 and message in " ".join(result.output.split())


def test_goodput_refuses_an_offline_batch(tmp_path: Path) -> None:
    plan = write_plan(tmp_path)
    args = ["simulate", "--plan", str(plan), "--workload", "offline-batch", "--requests", "20"]
    result = CliRunner().invoke(app, [*args, "--slo-ttft-p90-s", "5", "--slo-tpot-p90-s", "1", "--goodput"])
    assert _refused(result, "offline batch")


@pytest.mark.parametrize(
    "rate, latency, message",
    [
        (4.0, "", r"above the 0\.\d+ req/s the best plan serves with 8 micro-batches"),
        (0.05, "", r"set latency_estimate_s: \d"),
        (0.02, "latency_estimate_s: 100\n", None),
    ],
)
def test_plan_refuses_an_slo_workload_above_its_capacity(
    tmp_path: Path, rate: float, latency: str, message: str | None
) -> None:
    """Llama-3-70B on the default cluster serves about 0.6 chat requests/s with 8 micro-batches in
    flight: 4 req/s with SLOs would queue without bound (exit 2); 0.05 req/s sized by the nominal TPOT
    puts one request in flight, too few, and the message gives the latency to size it by; with that
    estimate, 0.02 req/s plans as usual."""
    from tessel.plan.api import PlanSettings, make_plan

    workload = tmp_path / "chat-slo.yaml"
    workload.write_text(
        "name: chat-slo\nprompt_tokens: {mean: 512, max: 2048}\noutput_tokens: {mean: 256, max: 1024}\n"
        f"arrival_rate_per_s: {rate}\n{latency}max_micro_batch: 8\nslo: {{ttft_p90_s: 5, tpot_p90_s: 0.5}}\n"
    )
    settings = PlanSettings(time_limit_s=5.0, max_tp=1)  # the pipeline-only plan's capacity (docstring)
    if message is not None:
        with pytest.raises(TesselError, match=message) as error:
            make_plan("llama-3-70b", "mixed-a100-v100-t4", str(workload), settings)
        assert error.value.exit_code == 2
    else:
        assert make_plan("llama-3-70b", "mixed-a100-v100-t4", str(workload), settings).predicted.ttft_s > 0
