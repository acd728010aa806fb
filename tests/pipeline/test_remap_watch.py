"""The server's remap watcher on a stand-in engine: stage counters from stage 0 and heartbeats,
the decision, the remap it asks for, and /metrics."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tessel.pipeline.supervision.heartbeat import Heartbeat, StageProgress
from tessel.pipeline.supervision.remap_watch import RemapWatch
from tessel.pipeline.supervision.supervisor import RemapReport
from tessel.plan.api import PlanSettings, make_plan
from tessel.plan.files.plan_file import load_plan
from tessel.plan.remap.remap_decision import RemapSettings, predicted_step_s
from tessel.server.prometheus import RemapCollector
from tessel.sim.api import SimulationSettings, simulate_plan

CLUSTER = """\
name: two-a100
nodes:
  - name: a
    gpus: {type: A100-80G}
  - name: b
    gpus: {type: A100-80G}
network: {bandwidth_gbps: 100, latency_us: 10}
"""
WORKLOAD = """\
name: short-chat
prompt_tokens: {mean: 128, max: 512}
output_tokens: {mean: 48, max: 128}
arrival_rate_per_s: 4
"""


class _Engine:
    """What the watcher reads of a served pipeline engine's executor (`ProcessExecutor`): its plan,
    stage 0's stats, the stages' run dir. The stand-in is its own executor."""

    def __init__(self, plan_path: Path, run_dir: Path) -> None:
        plan = load_plan(plan_path)
        self.plan = SimpleNamespace(plan_file=plan, stages=plan.stages, path=plan_path, paths=())
        self.stage = SimpleNamespace(stats=SimpleNamespace(batches=0, compute_s=0.0, emulation_sleep_s=0.0))
        self.stages = SimpleNamespace(run_dir=run_dir)
        run_dir.mkdir(exist_ok=True)

    @property
    def executor(self) -> _Engine:
        return self

    def run(self, batches: int, step_s: list[float]) -> None:
        """Every stage computes `batches` more micro-batches of `step_s[k]` seconds each."""
        stats = self.stage.stats
        stats.batches += batches
        stats.compute_s += batches * step_s[0]
        for rank in range(1, len(step_s)):
            progress = getattr(self, f"_p{rank}", None) or StageProgress()
            progress.batches += batches
            progress.busy_s += batches * step_s[rank]
            setattr(self, f"_p{rank}", progress)
            Heartbeat(self.stages.run_dir, rank, 1.0, progress).beat()


class _Server:
    """What the watcher calls on the `AsyncEngine`: the engine it drives, `on_outputs`, `remap`."""

    def __init__(self, engine: _Engine, tmp: Path) -> None:
        self.engine, self.on_outputs, self.asked, self.tmp = engine, None, [], tmp

    def remap(self, path: Path, reason: str) -> Future:
        self.asked.append((path, reason))
        self.engine = _Engine(path, self.tmp / f"run{len(self.asked)}")  # the switch
        done: Future = Future()
        done.set_result(RemapReport(reason, str(path), ok=True, moved=3, max_gap_s=0.5))
        return done


@pytest.fixture
def served(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    outcome = make_plan("llama-2-7b", tmp_path / "cluster.yaml", "default", PlanSettings(solver="dp"))
    outcome.plan_file().write(tmp_path / "plan.json")
    return _Server(_Engine(tmp_path / "plan.json", tmp_path / "run0"), tmp_path)


def test_a_slowed_stage_is_seen_in_its_step_times_and_remapped(served):
    lines = []
    settings = RemapSettings(interval_s=1.0, window_s=4.0, confirm=2, cooldown_s=60.0)
    watch = RemapWatch(served, settings, "auto", echo=lines.append)
    predicted = predicted_step_s(served.engine.plan.plan_file)
    outcomes = []
    for t in range(12):
        slow = 1 / 0.3 if t >= 4 else 1.0
        served.engine.run(10, [predicted[0], predicted[1] * slow])
        decision = watch.tick(1000.0 + t)
        outcomes.append(decision.outcome)
        if decision.taken:
            break
    assert outcomes[0] == "insufficient" and "steady" in outcomes and outcomes[-1] == "remap"
    assert len(served.asked) == 1
    new_plan = load_plan(served.asked[0][0])
    assert [(s.layer_start, s.layer_end) for s in new_plan.stages] != [
        (s.layer_start, s.layer_end) for s in load_plan(served.tmp / "plan.json").stages
    ]
    assert any(line.startswith("tessel: remap decision") and "gain" in line for line in lines)
    assert any(line.startswith("tessel: remapped (3 requests moved") for line in lines)
    assert watch.decider.plan is not None and watch.decider.last_remap_s is not None

    registry = CollectorRegistry()
    registry.register(RemapCollector(watch))
    text = generate_latest(registry).decode()
    assert 'tessel:remap_decisions_total{outcome="remap"} 1.0' in text
    assert 'source="predicted"' in text and "tessel:stage_step_seconds" in text


def test_watching_without_remap_only_measures(served):
    watch = RemapWatch(served, RemapSettings(interval_s=1.0, window_s=4.0), "off", echo=lambda _: None)
    predicted = predicted_step_s(served.engine.plan.plan_file)
    for t in range(6):
        served.engine.run(10, [predicted[0], predicted[1] * 3])
        assert watch.tick(1000.0 + t) is None
    steps = watch.stage_steps()
    assert steps[1].measured_s == pytest.approx(3 * predicted[1])
    assert steps[0].measured_s == pytest.approx(predicted[0])
    assert served.asked == []
    registry = CollectorRegistry()
    registry.register(RemapCollector(watch))
    text = generate_latest(registry).decode()
    assert 'source="measured"' in text and "remap_decisions" not in text


@pytest.mark.parametrize("speed", [0.3, 0.8])
def test_the_server_path_and_the_simulator_reach_the_same_decision(tmp_path, speed):
    """A simulated run with a slowing stage, fed to the server's watcher as a live pipeline would be
    (stage 0's stats, heartbeats, outputs) at the watcher's cadence, decides as `tessel simulate
    --remap auto` does on the same run: remap (to the same split) or not."""
    cluster = CLUSTER.replace("gpus: {type: A100-80G}\nnetwork", "gpus: {type: A100-80G}\n    emulate: "
                              f"{{speed: 1.0, schedule: [[10, {speed}]]}}\nnetwork")  # fmt: skip
    (tmp_path / "cluster.yaml").write_text(cluster)
    (tmp_path / "workload.yaml").write_text(WORKLOAD)
    files = (tmp_path / "cluster.yaml", tmp_path / "workload.yaml")
    outcome = make_plan("llama-2-7b", *files, PlanSettings(solver="dp"))
    outcome.plan_file().write(tmp_path / "plan.json")
    settings = RemapSettings(interval_s=2.0, window_s=6.0, confirm=2)
    simulated_settings = SimulationSettings(requests=120, remap=settings)
    report = simulate_plan(tmp_path / "plan.json", str(tmp_path / "workload.yaml"), simulated_settings)
    result = report.runs[0].result

    server = _Server(_Engine(tmp_path / "plan.json", tmp_path / "run0"), tmp_path)
    watch = RemapWatch(server, settings, "auto", echo=lambda _: None)
    boxes = [i for i in result.intervals if i.kind == "compute"]
    started, finished = set(), set()
    for tick in range(1, len(report.remap.decisions) + 1):
        now = tick * settings.interval_s
        done = [[i for i in boxes if i.stage == k and i.end_s <= now] for k in (0, 1)]
        engine = server.engine
        engine.stage.stats.batches = len(done[0])
        engine.stage.stats.compute_s = sum(i.end_s - i.start_s for i in done[0])
        progress = StageProgress(batches=len(done[1]), busy_s=sum(i.end_s - i.start_s for i in done[1]))
        Heartbeat(engine.stages.run_dir, 1, 1.0, progress).beat()
        outputs = []  # each request's first token, then its finish, once each
        for record in result.records:
            rid = record.request.id
            if rid not in started and record.first_token_s <= now:
                started.add(rid)
                outputs.append(_output(record, finished=False))
            if rid in started and rid not in finished and record.finish_s <= now:
                finished.add(rid)
                outputs.append(_output(record, finished=True))
        watch.observe_outputs(outputs, now)
        decision = watch.tick(now)
        if decision.taken:
            break
    simulated = report.remap.taken
    served = next((d for d in watch.history if d.taken), None)
    assert (served is None) == (simulated is None) == (speed > 0.5)
    if served is not None:
        assert served.new_layers == simulated.new_layers and served.time_s == simulated.time_s


def _output(record, finished: bool):
    request = record.request
    metrics = SimpleNamespace(arrival_time=request.arrival_s)
    return SimpleNamespace(
        request_id=str(request.id), new_token_ids=[0], metrics=metrics,
        num_prompt_tokens=request.prompt_tokens, finished=finished, num_output_tokens=request.output_tokens,
    )  # fmt: skip


def test_a_replica_server_watches_its_own_replicas_stages(tmp_path):
    from pipeline_plans import write_replica_plan
    from tessel.pipeline.run_plan import load_run_plan
    from tessel.pipeline.supervision.remap_watch import served_plan

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 4}')
    path = write_replica_plan(tmp_path / "plan.json", model)
    for replica, devices in ((0, ["localhost/cpu0", "localhost/cpu1"]), (1, ["localhost/cpu2"])):
        engine = SimpleNamespace(plan=load_run_plan(path, replica))
        assert [s.device for s in served_plan(engine).stages] == devices
    assert served_plan(SimpleNamespace(plan=load_run_plan(tmp_path / "plan.json", 0))).replicas == []
