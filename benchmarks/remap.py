"""Serving through change: a `tessel serve --plan` pipeline under steady load while its split changes;
print a table, write JSON (benchmarks/results/remap.jsonl).

    python benchmarks/remap.py [--scenario kill] [--quick] [--model DIR] [--streams N] [--new-tokens N]

The server is the one `tessel serve --plan` runs (`Supervisor.serve`'s engine driven by an
`AsyncEngine`, this process stage 0, the other stages child processes), fed by `--streams` clients
that each stream greedy requests back to back (`SteadyLoad`: prompts taken in turn from `PROMPTS`,
`--new-tokens` each, EOS ignored), SmolLM2-135M float32 (`tessel example-model`) by default. Every
finished request's tokens are held against one process's engine (`LLM`) on the same prompt: the
undisturbed run.

Scenarios (`SCENARIOS`; each is a function of the parsed arguments and a scratch directory that
returns its result, so another one plugs in beside them):

    slowdown    2 stages as the planner splits them on two local CPUs, the second slowing to
                `--slow-speed` at `--slow-at-s` (its cluster's emulated schedule), served twice for
                `--slowed-s` more seconds: `--remap off` and `--remap auto` (`RemapWatch`).
                Reported: throughput over the slowed phase, auto / off (target >= 1.3x), failed
                requests (target 0), the longest gap between two tokens (target <= 2 s), and the
                simulator's decision on the same requests and schedule beside the server's.
    switch      2 stages (halves); after `--switch-after-s` the server is asked to remap live to
                another split (`AsyncEngine.remap`): failed requests (target 0), equal tokens, the
                time the new split loaded beside the old, the switch's pause, the requests moved
                and the longest gap between two tokens of a stream (the server's and the clients').

    kill        3 stages (the layers in thirds); once the load runs (`--kill-after-s`), stage 2 is
                killed (SIGKILL). Reported: failed requests (target 0), whether every request's
                tokens equal the undisturbed run's, the seconds from the kill until a new request
                sent right after it (`Probe`) gets its first token (target <= 30 s) and until the
                server is healthy, the
                longest gap between two tokens of any stream (and of the streams in flight at the
                kill), the rebuild's own figures (`AsyncEngine.last_recovery`).

Timings on a shared machine move with its load; the figures that matter here are counts (failed
requests, equal tokens) and seconds against a 30 s target, not ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import _harness
from rich.console import Console
from rich.table import Table

PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle gear works.",
    "List three facts about the moon.",
    "What is the capital of France, and why is it famous?",
    "Describe the water cycle in simple words.",
    "Give me a recipe for pancakes.",
)
DEADLINE_S = 600.0  # no request of a scenario may take longer: a hang fails the run


@dataclass(slots=True)
class Finished:
    """One request of the load: what it got and when."""

    prompt: int  # index into PROMPTS
    sent_s: float  # monotonic
    token_times_s: list[float] = field(default_factory=list)  # monotonic, per output token
    tokens: list[int] = field(default_factory=list)
    error: str | None = None


class SteadyLoad:
    """`streams` clients on their own event loop (a thread), each sending the next request as soon
    as its previous one finished, until `stop()`."""

    def __init__(self, async_engine, streams: int, new_tokens: int) -> None:
        from tessel.engine.sampling_params import SamplingParams

        self.async_engine, self.streams = async_engine, streams
        self.params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        self.finished: list[Finished] = []
        self.running: dict[str, Finished] = {}
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> SteadyLoad:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(DEADLINE_S)

    async def _run(self) -> None:
        await asyncio.gather(*(self._client(i) for i in range(self.streams)))

    async def _client(self, client: int) -> None:
        turn = client
        while not self._stop.is_set():
            request_id = f"load-{next(self._ids)}"
            record = Finished(turn % len(PROMPTS), time.monotonic())
            turn += 1
            self.running[request_id] = record
            try:
                stream = await self.async_engine.add(request_id, PROMPTS[record.prompt], self.params)
                async with asyncio.timeout(DEADLINE_S):
                    async for out in stream:
                        now = time.monotonic()
                        record.tokens.extend(out.new_token_ids)
                        record.token_times_s.extend([now] * len(out.new_token_ids))
            except Exception as error:  # noqa: BLE001 - a failed request is what this counts
                record.error = f"{type(error).__name__}: {error}"
                await asyncio.sleep(0.5)  # a client's back-off after an error
            self.running.pop(request_id, None)
            self.finished.append(record)


class Probe:
    """One new request sent at `since_s` (monotonic), again after each error, until one gets its first
    token: `served_s` is that token's time from `since_s`, `errors` the errors before it."""

    def __init__(self, async_engine, since_s: float) -> None:
        self.async_engine, self.since_s = async_engine, since_s
        self.served_s: float | None = None
        self.errors: list[str] = []
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> Probe:
        self._thread.start()
        return self

    def join(self) -> None:
        self._thread.join(DEADLINE_S)

    async def _run(self) -> None:
        from tessel.engine.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        for attempt in itertools.count():
            if time.monotonic() - self.since_s > DEADLINE_S:
                return
            try:
                stream = await self.async_engine.add(f"probe-{attempt}", PROMPTS[0], params)
                async for out in stream:
                    if out.new_token_ids and self.served_s is None:
                        self.served_s = time.monotonic() - self.since_s
                return
            except Exception as error:  # noqa: BLE001 - counted, then sent again
                self.errors.append(f"{type(error).__name__}: {error}")
                await asyncio.sleep(0.5)


def reference_tokens(model: Path, new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens from one process's engine: the undisturbed run."""
    from tessel.engine.llm_engine import LLM
    from tessel.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [out.token_ids for out in LLM(model).generate(list(PROMPTS), params, use_progress=False)]


def serve(model: Path, plan: Path):
    """The server's engine for `plan`, watched and driven as `tessel serve --plan` does."""
    from tessel.pipeline.options import RunOptions
    from tessel.pipeline.supervision.supervisor import Supervisor
    from tessel.server.async_engine import AsyncEngine
    from tessel.server.limits import DEFAULT_MAX_ENGINE_RESTARTS

    engine = Supervisor.serve(RunOptions(plan, model), DEFAULT_MAX_ENGINE_RESTARTS)
    async_engine = AsyncEngine(engine, max_pending=64)
    async_engine.start()
    return async_engine


def thirds_plan(model: Path, root: Path, stages: int = 3) -> Path:
    import json

    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    bounds = [round(k * layers / stages) for k in range(stages + 1)]
    plans = _harness.tests_module("pipeline_plans")
    return plans.write_plan(root / f"plan{stages}.json", model, list(itertools.pairwise(bounds)))


def max_gap_s(records: list[Finished]) -> float:
    gaps = [b - a for r in records for a, b in itertools.pairwise(r.token_times_s)]
    return max(gaps, default=0.0)


# ---- scenarios -------------------------------------------------------------------------------------
def kill_scenario(args: argparse.Namespace, root: Path) -> dict:
    """3 stages under steady load; stage 2 is killed; the server re-plans on stages 0-1."""
    model = _harness.example_model(args.model)
    expected = reference_tokens(model, args.new_tokens)
    async_engine = serve(model, thirds_plan(model, root))
    first = async_engine.engine.executor
    load = SteadyLoad(async_engine, args.streams, args.new_tokens).start()
    try:
        time.sleep(args.kill_after_s)
        in_flight_at_kill = dict(load.running)
        killed_at = time.monotonic()
        os.kill(first.stages.procs[-1].pid, signal.SIGKILL)  # stage 2, the last
        probe = Probe(async_engine, killed_at).start()  # a new request sent right after the kill
        healthy_s = None
        while time.monotonic() - killed_at < DEADLINE_S:
            if healthy_s is None and async_engine.engine.executor is not first and async_engine.healthy:
                healthy_s = time.monotonic() - killed_at
            served = [r for r in load.finished if r.sent_s > killed_at and r.token_times_s]
            if served and probe.served_s is not None and time.monotonic() - killed_at > args.after_kill_s:
                break
            time.sleep(0.1)
        load.stop()
        probe.join()
    finally:
        async_engine.stop()
        async_engine.engine.supervisor.close()
    records = load.finished
    after = [r for r in records if r.sent_s > killed_at and r.token_times_s]
    first_served_s = min((r.token_times_s[0] - killed_at for r in after), default=None)
    complete = [r for r in records if r.error is None]
    recovery = async_engine.last_recovery
    return {
        "scenario": "kill",
        "model": str(model),
        "stages_before": [[s.layer_start, s.layer_end] for s in first.plan.stages],
        "stages_after": [[s.layer_start, s.layer_end] for s in async_engine.engine.executor.plan.stages],
        "streams": args.streams,
        "new_tokens": args.new_tokens,
        "requests": len(records),
        "failed_requests": len(records) - len(complete),
        "failures": sorted({r.error for r in records if r.error})[:5],
        "in_flight_at_kill": len(in_flight_at_kill),
        "in_flight_at_kill_completed": sum(r.error is None for r in in_flight_at_kill.values()),
        "tokens_equal_undisturbed": all(r.tokens == expected[r.prompt] for r in complete),
        "unequal_requests": sum(r.tokens != expected[r.prompt] for r in complete),
        "new_request_served_after_kill_s": probe.served_s,  # its first token, from the kill
        "new_request_errors": probe.errors,
        "load_request_sent_after_kill_served_s": first_served_s,
        "healthy_after_kill_s": healthy_s,
        "max_gap_s": max_gap_s(records),
        "max_gap_in_flight_at_kill_s": max_gap_s(list(in_flight_at_kill.values())),
        "rebuild": None if recovery is None else asdict(recovery),
    }


SLOWDOWN_CLUSTER = """\
name: local-cpu-slowing
nodes:
  - name: localhost
    gpus: {{type: cpu}}
  - name: localhost-slowing
    gpus: {{type: cpu}}
    emulate: {{speed: 1.0, schedule: [[{at_s}, {speed}]]}}
network: {{bandwidth_gbps: 80, latency_us: 50}}
"""
SLOWDOWN_WORKLOAD = """\
name: steady-streams
prompt_tokens: {{mean: {prompt}, max: 64}}
output_tokens: {{mean: {output}, max: {output}}}
batch_size: {streams}
max_micro_batch: 2
"""


def slowdown_plan(model: Path, root: Path, args: argparse.Namespace) -> Path:
    """The planner's 2-stage split of `model` on two local CPUs, the second of which slows to
    `--slow-speed` at `--slow-at-s` (its cluster's emulated schedule; the plan records it), for the
    load `SteadyLoad` sends."""
    from tessel.plan.api import PlanSettings, make_plan

    cluster = root / "cluster.yaml"
    cluster.write_text(SLOWDOWN_CLUSTER.format(at_s=args.slow_at_s, speed=args.slow_speed))
    workload = root / "workload.yaml"
    workload.write_text(SLOWDOWN_WORKLOAD.format(prompt=10, output=args.new_tokens, streams=args.streams))
    settings = PlanSettings(solver="dp", dtype="fp32", kv_dtype="fp32")
    make_plan(model, cluster, workload, settings).plan_file().write(root / "slowdown-plan.json")
    return root / "slowdown-plan.json"


def slowed_run(model: Path, plan: Path, settings, mode: str, args: argparse.Namespace) -> dict:
    """Serve `plan` under steady load for `--slow-at-s` + `--slowed-s` seconds, watched with
    `--remap <mode>`; the tokens' times, the failures and the server's decisions."""
    import torch

    from tessel.engine.emulation import EMULATE_EPOCH_ENV
    from tessel.pipeline.supervision.remap_watch import RemapWatch

    os.environ.pop(EMULATE_EPOCH_ENV, None)  # the schedule counts from this run's first micro-batch
    torch.set_num_threads(1)  # stage 0 as the stage processes (`--threads 1`): like devices, like threads
    async_engine = serve(model, plan)
    lines: list[str] = []
    watch = RemapWatch(async_engine, settings, mode, echo=lines.append).start()
    load = SteadyLoad(async_engine, args.streams, args.new_tokens).start()
    origin, origin_wall = time.monotonic(), time.time()  # ~ the first micro-batch: the schedule's zero
    try:
        time.sleep(args.slow_at_s + args.slowed_s)
        end = time.monotonic()
        prompt_tokens = [len(async_engine.engine.tokenize(p)) for p in PROMPTS]
        load.stop()
    finally:
        watch.stop()
        async_engine.stop()
        async_engine.engine.supervisor.close()
    records = load.finished
    slowed_from = origin + args.slow_at_s

    def rate(start: float, stop: float) -> float:
        tokens = sum(start <= t <= stop for r in records for t in r.token_times_s)
        return tokens / (stop - start)

    taken = next((d for d in watch.history if d.taken), None)
    before = [
        d.speeds for d in watch.history if d.outcome == "steady" and d.time_s - origin_wall < args.slow_at_s
    ]
    return {
        "mode": mode,
        "tok_s_before_slowdown": rate(origin + min(2.0, args.slow_at_s / 2), slowed_from),
        "tok_s_slowed_phase": rate(slowed_from, end),
        "requests": len(records),
        "failed_requests": sum(r.error is not None for r in records),
        "failures": sorted({r.error for r in records if r.error})[:5],
        "max_gap_s": max_gap_s(records),
        "speeds_seen_before_slowdown": before[-1] if before else None,
        "decision": None if taken is None else {
            "time_s": taken.time_s - origin_wall,
            "old_layers": [list(r) for r in taken.old_layers],
            "new_layers": [list(r) for r in taken.new_layers],
            "old_devices": list(taken.old_devices),
            "new_devices": list(taken.new_devices),
            "speeds": list(taken.speeds),
            "gain": taken.gain,
        },
        "decisions": dict(watch.decisions),
        "log": lines,
        "trace": [(r.sent_s - origin, prompt_tokens[r.prompt]) for r in records],
    }  # fmt: skip


def simulated_decision(plan: Path, run: dict, settings, new_tokens: int) -> dict:
    """The simulator's decision on the remap-off run's requests (sent times, prompt lengths) and the
    plan's emulated schedule (`tessel simulate --remap auto`)."""
    from tessel.sim.api import SimulationSettings, simulate_plan
    from tessel.sim.request_trace import RequestSet
    from tessel.sim.requests import Request

    requests = [Request(i, max(t, 0.0), p, new_tokens) for i, (t, p) in enumerate(sorted(run["trace"]))]
    report = simulate_plan(
        plan, "steady-streams", SimulationSettings(remap=settings), trace=RequestSet(requests, "slowdown run")
    )
    taken = report.remap.taken
    return {
        "remap": taken is not None,
        "time_s": None if taken is None else taken.time_s,
        "new_layers": None if taken is None else [list(r) for r in taken.new_layers],
        "new_devices": None if taken is None else list(taken.new_devices),
        "speeds": None if taken is None else list(taken.speeds),
        "summary": report.remap.summary(),
    }


def slowdown_scenario(args: argparse.Namespace, root: Path) -> dict:
    """2 stages under steady load; stage 1's device slows to --slow-speed at --slow-at-s: the
    slowed phase's throughput with --remap auto against off, failures, the longest gap between two
    tokens, and the simulator's decision beside the server's."""
    from tessel.plan.remap.remap_decision import RemapSettings

    model = _harness.example_model(args.model)
    plan = slowdown_plan(model, root, args)
    # a short window and few batches in it: on a loaded CPU a micro-batch takes a good part of a second
    settings = RemapSettings(interval_s=1.0, window_s=6.0, min_batches=4, confirm=2, cooldown_s=args.slowed_s)
    runs = {mode: slowed_run(model, plan, settings, mode, args) for mode in ("off", "auto")}
    simulated = simulated_decision(plan, runs["off"], settings, args.new_tokens)
    off, auto = runs["off"], runs["auto"]
    for run in runs.values():
        run.pop("trace")
    from tessel.plan.files.plan_file import load_plan

    return {
        "scenario": "slowdown",
        "model": str(model),
        "stages_planned": [[s.layer_start, s.layer_end] for s in load_plan(plan).stages],
        "streams": args.streams,
        "new_tokens": args.new_tokens,
        "slow_at_s": args.slow_at_s,
        "slowed_s": args.slowed_s,
        "slow_speed": args.slow_speed,
        "tok_s_slowed_off": off["tok_s_slowed_phase"],
        "tok_s_slowed_auto": auto["tok_s_slowed_phase"],
        "slowed_throughput_ratio": auto["tok_s_slowed_phase"] / off["tok_s_slowed_phase"],
        # each run's slowed phase over its own first seconds: what the machine's load between the two
        # runs does to both phases of one run cancels
        "slowed_over_before_off": off["tok_s_slowed_phase"] / off["tok_s_before_slowdown"],
        "slowed_over_before_auto": auto["tok_s_slowed_phase"] / auto["tok_s_before_slowdown"],
        "failed_requests": off["failed_requests"] + auto["failed_requests"],
        "max_gap_auto_s": auto["max_gap_s"],
        "max_gap_off_s": off["max_gap_s"],
        "server_remapped": auto["decision"] is not None,
        # a decision before the schedule's change answered something else (a stage starved of CPU)
        "server_decided_before_slowdown": auto["decision"] is not None
        and auto["decision"]["time_s"] < args.slow_at_s,
        "simulator_remapped": simulated["remap"],
        "same_decision": (auto["decision"] is not None) == simulated["remap"],
        "server_decision": auto["decision"],
        "simulator_decision": simulated,
        "runs": runs,
    }


def switch_scenario(args: argparse.Namespace, root: Path) -> dict:
    """2 stages (halves) under steady load; after `--switch-after-s` the server is asked to remap to
    another split (a third and two thirds) on the same devices: the live switch alone, no decision."""
    model = _harness.example_model(args.model)
    expected = reference_tokens(model, args.new_tokens)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    plans = _harness.tests_module("pipeline_plans")
    halves = plans.write_plan(root / "halves.json", model, [(0, layers // 2), (layers // 2, layers)])
    third = plans.write_plan(root / "third.json", model, [(0, layers // 3), (layers // 3, layers)])
    async_engine = serve(model, halves)
    load = SteadyLoad(async_engine, args.streams, args.new_tokens).start()
    try:
        time.sleep(args.switch_after_s)
        asked_at = time.monotonic()
        future = async_engine.remap(third, "benchmark: another split")
        report = future.result(DEADLINE_S)
        time.sleep(args.after_kill_s)
        load.stop()
    finally:
        async_engine.stop()
        async_engine.engine.supervisor.close()
    records = load.finished
    complete = [r for r in records if r.error is None]
    switch_at = asked_at + report.load_s  # the switch began within a step of this
    across = [r for r in records if r.token_times_s and r.token_times_s[0] < switch_at < r.token_times_s[-1]]
    return {
        "scenario": "switch",
        "model": str(model),
        "stages_after": [[s.layer_start, s.layer_end] for s in async_engine.engine.executor.plan.stages],
        "streams": args.streams,
        "new_tokens": args.new_tokens,
        "requests": len(records),
        "failed_requests": len(records) - len(complete),
        "failures": sorted({r.error for r in records if r.error})[:5],
        "tokens_equal_undisturbed": all(r.tokens == expected[r.prompt] for r in complete),
        "unequal_requests": sum(r.tokens != expected[r.prompt] for r in complete),
        "remap_ok": report.ok,
        "load_beside_s": report.load_s,
        "switch_s": report.switch_s,
        "requests_moved": report.moved,
        "max_gap_moved_s": report.max_gap_s,  # the server's own measure over the moved streams
        "max_gap_s": max_gap_s(records),  # every stream, as its client saw it
        "max_gap_streams_across_switch_s": max_gap_s(across),
    }


SCENARIOS: dict[str, Callable[[argparse.Namespace, Path], dict]] = {
    "kill": kill_scenario,
    "slowdown": slowdown_scenario,
    "switch": switch_scenario,
}


def show(console: Console, result: dict) -> None:
    table = Table(title=f"remap scenario {result['scenario']}")
    table.add_column("figure")
    table.add_column("value")
    for key, value in result.items():
        if key in ("rebuild", "failures", "model", "runs", "server_decision", "simulator_decision"):
            continue
        table.add_row(key, f"{value:.2f}" if isinstance(value, float) else str(value))
    console.print(table)
    if result.get("rebuild"):
        rebuild = result["rebuild"]
        console.print(
            f"rebuild: {rebuild['switch_s']:.1f} s on the engine thread, {rebuild['moved']} requests moved, "
            f"longest gap of a moved stream {rebuild['max_gap_s'] or 0:.2f} s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="kill")
    parser.add_argument("--quick", action="store_true", help="2 streams, 16 tokens: a smoke run")
    parser.add_argument("--model", type=Path, help="HF model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--streams", type=int, default=4, help="concurrent streaming clients")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--kill-after-s", type=float, default=8.0, help="load before the kill")
    parser.add_argument("--after-kill-s", type=float, default=10.0, help="load kept after recovery")
    parser.add_argument("--switch-after-s", type=float, default=8.0, help="switch: load before the remap")
    parser.add_argument("--slow-at-s", type=float, default=10.0, help="slowdown: when stage 1 slows")
    parser.add_argument("--slowed-s", type=float, default=30.0, help="slowdown: seconds served slowed")
    parser.add_argument("--slow-speed", type=float, default=0.3, help="slowdown: stage 1's speed then")
    _harness.add_record_options(parser, "remap")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.new_tokens, args.kill_after_s, args.after_kill_s = 2, 16, 4.0, 3.0
        args.slow_at_s, args.slowed_s = 6.0, 15.0
    console = Console(highlight=False)
    console.print(_harness.machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        result = SCENARIOS[args.scenario](args, Path(tmp))
    show(console, result)
    _harness.append_record(args.out, "remap", result, args.label)


if __name__ == "__main__":
    main()
