"""`tessel simulate`: run a plan (and its baselines) through the discrete-event simulator."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import typer

from tessel.commands.options import input_file, optional_count, output_file
from tessel.sim.api import MAX_BATCH_TOKENS, MAX_SEQUENCES
from tessel.sim.request_trace import MAX_REQUESTS
from tessel.sim.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS


def simulate(
    plan: Path = input_file(..., "--plan", help="Plan JSON written by `tessel plan --json`."),
    workload: str = typer.Option(
        "default", "--workload", help="Bundled workload name, a workload YAML, or a trace (.csv/.jsonl)."
    ),
    requests: int | None = optional_count(
        "--requests", limit=MAX_REQUESTS, help="Number of requests (default 200; a trace: its first N rows)."
    ),
    seed: int = typer.Option(0, "--seed", min=0, max=2**63 - 1, help="Seed of the arrivals and lengths."),
    rate: float | None = typer.Option(
        None, "--rate", min=1e-9, max=1e6, help="Override the workload's arrival rate (req/s)."
    ),
    gantt: Path | None = output_file(None, "--gantt", help="Write a Gantt chart of the plan (.png/.svg)."),
    gantt_until_s: float | None = typer.Option(
        None, "--gantt-until-s", min=0, max=1e12, help="Cut the chart at this time."
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
    enable_chunked_prefill: bool = typer.Option(True, "--chunked-prefill/--no-chunked-prefill"),
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
) -> None:
    """Simulate serving a workload with a plan: TTFT, TPOT, throughput, stage use, bubbles."""
    from rich.console import Console

    from tessel.commands.render.simulate import print_simulation, write_gantt
    from tessel.errors import TesselError
    from tessel.files import check_output_path, staged_file, write_json_file
    from tessel.sim.api import SimulationSettings, simulate_plan
    from tessel.sim.gantt import check_gantt_path

    inputs = (plan, workload, *profile)
    for path, option in ((gantt, "--gantt"), (json_out, "--json")):
        if path is not None:
            check_output_path(path, option, inputs)
    if gantt is not None and json_out is not None and gantt.resolve() == json_out.resolve():
        raise TesselError(f"--gantt and --json both name {gantt}; give two files")
    if gantt is not None:
        check_gantt_path(gantt)
    settings = SimulationSettings(
        requests, seed, rate, compare, regime,
        max_num_seqs if max_num_seqs is not None else max_running,
        max_num_batched_tokens or max_batch_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_in_flight, enable_chunked_prefill, cpp, kv_limit, pinned, mix,
    )  # fmt: skip
    report = simulate_plan(plan, workload, settings, profiles=profile)
    console = Console()
    print_simulation(console, report)
    if gantt is not None:
        with staged_file(gantt, "--gantt", inputs) as staging:  # same suffix: the chart's format
            write_gantt(report, staging, gantt_until_s)
        console.print(f"Gantt chart written to {gantt}", highlight=False)
    if json_out is not None:
        write_json_file(json_out, report.to_json(), "--json", inputs)
        console.print(f"metrics written to {json_out}", highlight=False)
