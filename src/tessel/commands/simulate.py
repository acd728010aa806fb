"""`tessel simulate`: run a plan (and its baselines) through the discrete-event simulator."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Literal

import typer

from tessel.commands.options import (
    FORCE_PROFILE_OPTION,
    input_file,
    optional_count,
    optional_float,
    output_file,
    with_option_groups,
)
from tessel.commands.remap_options import REMAP_OPTIONS, RemapFlags
from tessel.plan.files.workload import MAX_ARRIVAL_RATE_PER_S
from tessel.sim.api import MAX_BATCH_TOKENS, MAX_SEQUENCES
from tessel.sim.measured import MeasuredComparison, compare_metrics
from tessel.sim.request_trace import MAX_REQUESTS
from tessel.sim.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS

MIN_SLO_S = 1e-6
MAX_SLO_S = 1e7
# A request every 30 years at the slowest: the simulator's time is events, not seconds, so a slow
# arrival rate costs nothing (the remap replay skips the idle stretches, tessel.sim.remap)
MIN_RATE_PER_S = 1e-9


@with_option_groups
def simulate(
    plan: Path = input_file(..., "--plan", help="Plan JSON written by `tessel plan --json`."),
    workload: str = typer.Option(
        "default", "--workload", help="Bundled workload name, a workload YAML, or a trace (.csv/.jsonl)."
    ),
    requests: int | None = optional_count(
        "--requests", limit=MAX_REQUESTS, help="Number of requests (default 200; a trace: its first N rows)."
    ),
    seed: int = typer.Option(0, "--seed", min=0, max=2**63 - 1, help="Seed of the arrivals and lengths."),
    rate: float | None = optional_float(
        "--rate",
        low=MIN_RATE_PER_S,
        high=MAX_ARRIVAL_RATE_PER_S,
        help="Override the workload's arrival rate (req/s).",
    ),
    gantt: Path | None = output_file(None, "--gantt", help="Write a Gantt chart of the plan (.png/.svg)."),
    gantt_until_s: float | None = optional_float(
        "--gantt-until-s", low=0.0, high=1e12, help="Cut the chart at this time."
    ),
    json_out: Path | None = output_file(None, "--json", help="Write all metrics as JSON."),
    compare: bool = typer.Option(False, "--compare", help="Also simulate the plan's feasible baselines."),
    regime: Literal["plan", "continuous"] = typer.Option(
        "plan",
        "--regime",
        help="plan: the regime the planner priced (m pinned micro-batch slots, m x b sequences, KV "
        "limited to the plan's kv_gib); continuous: one shared pool, 256 sequences, one micro-batch per "
        "stage in flight (vLLM V1). The flags below override either.",
    ),
    max_num_seqs: int | None = optional_count(
        "--max-num-seqs", limit=MAX_SEQUENCES, help="Sequences admitted at once."
    ),
    max_num_batched_tokens: int | None = optional_count(
        "--max-num-batched-tokens",
        limit=MAX_BATCH_TOKENS,
        help="Token budget per micro-batch (default 2048).",
    ),
    max_running: int | None = optional_count(  # the old spelling of --max-num-seqs
        "--max-running", limit=MAX_SEQUENCES, hidden=True
    ),
    max_batch_tokens: int | None = optional_count(  # the old spelling of --max-num-batched-tokens
        "--max-batch-tokens", limit=MAX_BATCH_TOKENS, hidden=True
    ),
    max_in_flight: int | None = optional_count(
        "--max-in-flight", limit=MAX_SEQUENCES, help="Micro-batches in the pipeline at once."
    ),
    enable_chunked_prefill: bool = typer.Option(
        True,
        "--chunked-prefill/--no-chunked-prefill",
        help="Split long prompts across steps within the token budget, as the engine does.",
    ),
    cpp: bool = typer.Option(False, "--cpp", help="Cut prompts with the CPP chunk planner, pipelined."),
    kv_limit: bool | None = typer.Option(
        None,
        "--kv-limit/--no-kv-limit",
        help="Admit requests only while their KV fits what the plan reserved (kv_gib).",
    ),
    pinned: bool | None = typer.Option(
        None, "--pinned/--no-pinned", help="Pin each request to one in-flight slot (vLLM V0 virtual engines)."
    ),
    mix: Literal["sum", "max"] = typer.Option("sum", "--mix", help="Cost of a mixed prefill+decode batch."),
    profile: list[Path] = input_file(
        [], "--profile", help="Profile JSON from `tessel profile` (repeatable)."
    ),
    force_profile: bool = FORCE_PROFILE_OPTION,
    remap: RemapFlags = REMAP_OPTIONS,
    slo_ttft_p90_s: float | None = optional_float(
        "--slo-ttft-p90-s",
        low=MIN_SLO_S,
        high=MAX_SLO_S,
        floor_reason="an SLO is a time > 0",
        help="p90 TTFT target (s); with --slo-tpot-p90-s, overrides the workload's `slo`.",
    ),
    slo_tpot_p90_s: float | None = optional_float(
        "--slo-tpot-p90-s",
        low=MIN_SLO_S,
        high=MAX_SLO_S,
        floor_reason="an SLO is a time > 0",
        help="p90 TPOT target (s).",
    ),
    goodput: bool = typer.Option(
        False, "--goodput", help="Find the highest arrival rate whose run meets the SLOs (a few runs)."
    ),
    measured: Path | None = input_file(
        None,
        "--measured",
        help="A `tessel launch --json` file of PLAN: simulate its requests (a batch at t=0, its "
        "micro-batches) and print predicted vs measured with the error.",
    ),
) -> None:
    """Simulate serving a workload with a plan: TTFT, TPOT, throughput, stage use, bubbles; with
    --remap auto, the remap decision `tessel serve --remap auto` would take on the run."""
    from rich.console import Console

    from tessel.commands.render.simulate import (
        predicted_vs_measured_table,
        print_load,
        print_simulation,
        write_gantt,
    )
    from tessel.errors import TesselError
    from tessel.files import check_output_path, staged_file, write_json_file
    from tessel.sim.api import SimulationSettings, simulate_plan
    from tessel.sim.gantt import check_gantt_path
    from tessel.sim.load import check_load

    inputs = (plan, workload, *profile, *((measured,) if measured is not None else ()))
    for path, option in ((gantt, "--gantt"), (json_out, "--json")):
        if path is not None:
            check_output_path(path, option, inputs)
    if gantt is not None and json_out is not None and gantt.resolve() == json_out.resolve():
        raise TesselError(f"--gantt and --json both name {gantt}; give two files")
    if gantt is not None:
        check_gantt_path(gantt)
    if rate is None and measured is None:
        rate = online_plan_rate(plan, workload)  # an online plan is checked at its rate
    settings = SimulationSettings(
        requests, seed, rate, compare, regime,
        max_num_seqs if max_num_seqs is not None else max_running,
        max_num_batched_tokens or max_batch_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_in_flight, enable_chunked_prefill, cpp, kv_limit, pinned, mix,
    )  # fmt: skip
    if remap.mode == "auto":
        if measured is not None:
            raise TesselError("--remap auto decides on a simulated serving run; drop --measured")
        settings = replace(settings, remap=remap.settings)
    slo = command_slo(workload, slo_ttft_p90_s, slo_tpot_p90_s, goodput)
    if slo is not None and measured is not None:
        raise TesselError("--measured compares a launch run; SLOs and --goodput apply to simulated serving")
    console = Console()
    if measured is not None:
        given = {"--workload": workload != "default", "--requests": requests is not None, "--rate": rate,
                 "--compare": compare, "--seed": seed != 0}  # fmt: skip
        clashing = [flag for flag, set_ in given.items() if set_]
        if clashing:
            raise TesselError(f"--measured simulates the run's own requests; drop {', '.join(clashing)}")
        report, comparison = simulate_measured(plan, measured, mix, profile, force_profile)
        print_simulation(console, report)
        console.print(predicted_vs_measured_table(comparison.rows, f"Predicted vs measured ({measured})"))
        document = {**report.to_json(), "measured": comparison.to_json()}
    else:
        report = simulate_plan(plan, workload, settings, profiles=profile, force_profile=force_profile)
        run = report.runs[0]
        planned = run.variant.predicted.get("throughput_tok_s")
        load = check_load(run.result, run.metrics, planned)
        print_simulation(console, report)
        print_load(console, load)
        if report.remap is not None:  # the server's decision on this run (tessel.sim.remap)
            console.print(f"remap: {report.remap.summary()}", highlight=False)
        document = {**report.to_json(), "load": None if load is None else load.to_json()}
        if slo is not None:
            document["slo"] = report_slo(console, report, slo, goodput, plan, workload, settings)
    if gantt is not None:
        with staged_file(gantt, "--gantt", inputs) as staging:  # same suffix: the chart's format
            cut_s = write_gantt(report, staging, gantt_until_s)
        window = (
            ""
            if cut_s is None or gantt_until_s is not None
            else (
                f" (its first {cut_s:,.3f} s of {report.runs[0].metrics.makespan_s:,.3f} s; "
                "--gantt-until-s draws more)"
            )
        )
        console.print(f"Gantt chart written to {gantt}{window}", highlight=False)
    if json_out is not None:
        write_json_file(json_out, document, "--json", inputs)
        console.print(f"metrics written to {json_out}", highlight=False)


def simulate_measured(  # noqa: ANN201
    plan: Path, run_file: Path, mix: str, profiles: list[Path], force_profile: bool = False
):
    """Simulate the requests of a `tessel launch --json` run of PLAN as launch ran them: all at
    t = 0, its micro-batches in flight (pinned slots), its per-slot sequence limit and token budget,
    no KV limit (the runtime sizes its own pool). -> (report, comparison)."""
    from tessel.errors import TesselError
    from tessel.plan.files.plan_file import load_plan
    from tessel.sim.api import SimulationSettings, simulate_plan
    from tessel.sim.measured import check_same_plan, load_run
    from tessel.sim.request_trace import RequestSet

    run = load_run(run_file)
    plan_file = load_plan(plan)
    if run.identity.replica is not None or plan_file.replicas:
        raise TesselError(
            f"--measured compares one pipeline; {plan} has replicas (run {run.identity.replica}): "
            "make a plan of that replica's stages, launch it and compare that"
        )
    check_same_plan(run.identity, plan_file, plan_file.main.stages, f"run file {run_file}")
    m = run.identity.micro_batches
    settings = SimulationSettings(
        max_num_seqs=min(m * run.identity.max_num_seqs, MAX_SEQUENCES),
        max_num_batched_tokens=run.identity.max_num_batched_tokens,
        max_in_flight=m, kv_limit=False, pinned=m > 1, mix=mix,
    )  # fmt: skip
    n = len(run.requests)
    trace = RequestSet(run.requests, f"the {n} requests of {run_file}, all at t=0")
    report = simulate_plan(
        plan_file, str(run_file), settings, profiles=profiles, trace=trace, force_profile=force_profile
    )
    return report, MeasuredComparison(run, compare_metrics(report.runs[0].metrics, run.metrics))


def online_plan_rate(plan: Path, workload: str) -> float | None:
    """The rate an online plan (`tessel plan --objective goodput`) was made for, the rate its
    simulation then runs at unless --rate says otherwise; None for other plans or a trace."""
    from tessel.plan.files.plan_file import load_plan
    from tessel.sim.request_trace import TRACE_SUFFIXES

    if Path(workload).suffix.lower() in TRACE_SUFFIXES:
        return None
    plan_file = load_plan(plan)
    rate = plan_file.workload.get("arrival_rate_per_s") if isinstance(plan_file.workload, dict) else None
    return rate if plan_file.solver.get("name") == "online" and rate else None


def command_slo(workload: str, ttft_s: float | None, tpot_s: float | None, goodput: bool):  # noqa: ANN201
    """The SLO of the command line (both flags) or of the workload file's `slo`; None: none."""
    from tessel.errors import TesselError
    from tessel.sim.request_trace import TRACE_SUFFIXES
    from tessel.sim.slo import Slo

    if (ttft_s is None) != (tpot_s is None):
        raise TesselError(
            "give both --slo-ttft-p90-s and --slo-tpot-p90-s, or neither (the workload's `slo`)"
        )
    if ttft_s is not None:
        return Slo(ttft_s, tpot_s)
    spec = None
    if Path(workload).suffix.lower() not in TRACE_SUFFIXES:
        from tessel.plan.files.workload import load_workload

        spec = load_workload(workload).slo
    if spec is None:
        if goodput:
            raise TesselError(
                "--goodput needs SLOs: --slo-ttft-p90-s and --slo-tpot-p90-s, or `slo` in the workload"
            )
        return None
    return Slo(spec.ttft_p90_s, spec.tpot_p90_s)


def report_slo(console, report, slo, goodput: bool, plan: Path, workload: str, settings) -> dict:  # noqa: ANN001
    """Print the run's SLO check and, with `goodput`, search the highest rate meeting it."""
    from tessel.errors import TesselError
    from tessel.plan.files.workload import load_workload
    from tessel.sim.api import simulate_plan
    from tessel.sim.slo import check_slo, find_goodput

    run = report.runs[0]
    check = check_slo(run.metrics, slo, settings.rate_per_s)
    console.print(check.text(slo), highlight=False)
    out = {"target": {"ttft_p90_s": slo.ttft_p90_s, "tpot_p90_s": slo.tpot_p90_s}, "run": check.to_json()}
    if not goodput:
        return out
    from tessel.sim.request_trace import TRACE_SUFFIXES

    if Path(workload).suffix.lower() in TRACE_SUFFIXES:
        raise TesselError("--goodput varies the arrival rate: give a workload file, not a trace")
    spec = load_workload(workload)
    if spec.arrival_rate_per_s is None:
        raise TesselError(f"--goodput varies the arrival rate: workload {spec.name} is an offline batch")
    planned = run.variant.predicted.get("throughput_tok_s")
    if not planned:
        raise TesselError(f"{plan} has no predicted throughput to start the goodput search from")
    capacity = planned / spec.output_tokens.mean_tokens

    def run_at(rate: float):  # noqa: ANN202
        again = simulate_plan(plan, workload, replace(settings, rate_per_s=rate, compare=False))
        return again.runs[0].metrics

    found = find_goodput(run_at, capacity, slo)
    console.print(
        f"goodput: {found.rate_req_s:.4g} req/s meets {slo.text()} (the plan serves {capacity:.4g} req/s; "
        f"{len(found.checks)} runs of {len(report.trace.requests)} requests)",
        highlight=False,
    )
    return {**out, "goodput": found.to_json()}
