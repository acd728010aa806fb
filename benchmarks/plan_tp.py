"""Planner benchmark for issue 45: tensor-parallel stages against the best pipeline-only plan.

Llama-3-70B on the bundled `a100x8-t4x4` (one 8x A100-80G NVLink machine, one 4x T4 PCIe machine),
for two bundled workloads: `single-stream` (one request at a time: TPOT is one token's pass through
every stage) and `default` (chat, 8 micro-batches in flight). For each, in the same run:

- the best pipeline-only plan (`--max-tp 1`: every stage one GPU) and the plan with tensor-parallel
  stages (`--max-tp` default: the largest a machine allows), each with its stages (GPUs, degree,
  layers, decode ms) and predicted TTFT, TPOT and throughput; the ratios TPOT(pp) / TPOT(tp) and
  throughput(tp) / throughput(pp); the wall time of each `make_plan` (a shared machine: the load
  average is recorded beside it);
- the simulator on both plans (`tessel simulate`, regime `plan`): simulated TPOT and throughput
  against the predicted ones;
- the oracle on small clusters: `solve_tp` against brute force over every partition of every
  machine's GPUs and every layer split (`tessel.plan.tp.brute`).

All times but the solve wall times are cost-model predictions or simulations, not measured runs.
Appends a record to benchmarks/results/plan_tp.jsonl.

    python benchmarks/plan_tp.py [--requests 240]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import _harness
from rich.console import Console
from rich.table import Table

from tessel.catalog.models import load_model
from tessel.plan.api import PlanSettings, make_plan
from tessel.plan.build import build_instance
from tessel.plan.files.cluster import parse_cluster
from tessel.plan.files.workload import parse_workload
from tessel.plan.report import gpus_text
from tessel.plan.tp.brute import brute_force_tp
from tessel.plan.tp.search import solve_tp
from tessel.plan.tp.tp_instance import TpContext
from tessel.sim.api import SimulationSettings, simulate_plan

MODEL = "llama-3-70b"
CLUSTER = "a100x8-t4x4"
WORKLOADS = {"single-stream": 20, "default": None}  # simulated requests (None: --requests)
TIME_LIMIT_S = 10.0


def _stages(outcome) -> list[dict]:
    instance = outcome.instance
    return [
        {
            "gpus": list(instance.devices[se.stage.device].gpus),
            "tp_degree": instance.devices[se.stage.device].tp_degree,
            "gpu_type": instance.devices[se.stage.device].gpu_type,
            "layers": [
                instance.units[se.stage.unit_start].layer,
                instance.units[se.stage.unit_end - 1].layer,
            ],
            "decode_ms": se.time_decode_s * 1e3,
            "prefill_ms": se.time_prefill_s * 1e3,
        }
        for se in outcome.result.evaluation.stages
    ]


def _plan(workload: str, max_tp: int | None) -> dict:
    load_before = os.getloadavg()[0]
    with _harness.stopwatch() as elapsed:
        outcome = make_plan(MODEL, CLUSTER, workload, PlanSettings(time_limit_s=TIME_LIMIT_S, max_tp=max_tp))
    predicted = outcome.predicted
    tp = outcome.tp
    return {
        "max_tp": max_tp,
        "stages": _stages(outcome),
        "ttft_s": predicted.ttft_s,
        "tpot_s": predicted.tpot_s,
        "throughput_tok_s": predicted.throughput_tok_s,
        "objective_s": outcome.result.evaluation.objective,
        "solver_status": outcome.result.status,
        "gap": outcome.result.gap,
        "groupings_planned": None if tp is None else tp.solved,
        "groupings_ruled_out": None if tp is None else tp.skipped,
        "groupings_out_of_time": None if tp is None else tp.out_of_time,
        "gap_over_degrees": None if tp is None else tp.gap,
        "plan_wall_s": elapsed.wall_s,
        "load_1min": [load_before, os.getloadavg()[0]],
        "_outcome": outcome,
    }


def _simulate(outcome, workload: str, requests: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        outcome.plan_file().write(path)
        report = simulate_plan(path, workload, SimulationSettings(requests=requests, seed=0))
    metrics = report.runs[0].metrics
    return {
        "requests": requests,
        "tpot_mean_s": metrics.tpot_s.mean,
        "ttft_mean_s": metrics.ttft_s.mean,
        "throughput_tok_s": metrics.throughput_tok_s,
    }


def run_workload(workload: str, requests: int) -> dict:
    pp, tp = _plan(workload, 1), _plan(workload, None)
    for plan in (pp, tp):
        plan["simulated"] = _simulate(plan.pop("_outcome"), workload, requests)
        plan["simulated_over_predicted_tpot"] = plan["simulated"]["tpot_mean_s"] / plan["tpot_s"]
        plan["simulated_over_predicted_throughput"] = (
            plan["simulated"]["throughput_tok_s"] / plan["throughput_tok_s"]
        )
    return {
        "workload": workload,
        "pipeline_only": pp,
        "tensor_parallel": tp,
        "tpot_pp_over_tp": pp["tpot_s"] / tp["tpot_s"],
        "throughput_tp_over_pp": tp["throughput_tok_s"] / pp["throughput_tok_s"],
        "simulated_tpot_pp_over_tp": pp["simulated"]["tpot_mean_s"] / tp["simulated"]["tpot_mean_s"],
        "simulated_throughput_tp_over_pp": tp["simulated"]["throughput_tok_s"]
        / pp["simulated"]["throughput_tok_s"],
    }


ORACLE_CASES = {
    "2x A100-80G nvlink + 2x T4 pcie, 4 layers": (
        (("a", "A100-80G", 2, "nvlink"), ("b", "T4", 2, "pcie")), {"batch_size": 4, "max_micro_batch": 2}, 4),
    "3x V100-32G nvlink, 5 layers": (
        (("v", "V100-32G", 3, "nvlink"),), {"batch_size": 8, "max_micro_batch": 4}, 5),
}  # fmt: skip


def run_oracle() -> list[dict]:
    """solve_tp (DP and MILP) against brute force over degrees and splits, on small clusters."""
    rows = []
    for name, (nodes, shape, layers) in ORACLE_CASES.items():
        cluster = parse_cluster(
            {
                "name": "oracle",
                "nodes": [
                    {"name": n, "gpus": {"type": t, "count": c}, "intra_link": k, "host_memory_gib": 16}
                    for n, t, c, k in nodes
                ],  # fmt: skip
                **({"network": {"bandwidth_gbps": 25, "latency_us": 20}} if len(nodes) > 1 else {}),
            }
        )
        workload = parse_workload({"name": "oracle", "prompt_tokens": 256, "output_tokens": 64, **shape})
        model = replace(load_model(MODEL), num_layers=layers)
        base = build_instance(model, cluster, workload)
        ctx = TpContext(model, cluster, workload)
        brute = brute_force_tp(base, ctx, 8)
        degrees = [len(brute.instance.devices[s.stage.device].gpus) for s in brute.evaluation.stages]
        row = {"case": name, "brute_objective_s": brute.evaluation.objective, "partitions": brute.groupings}
        row["brute_degrees"] = degrees
        for solver in ("dp", "milp"):
            found = solve_tp(base, ctx, 8, solver=solver, time_limit_s=20, mip_gap=0.0)
            row[f"{solver}_objective_s"] = found.result.evaluation.objective
            row[f"{solver}_degrees"] = list(found.degrees)
        rows.append(row)
    return rows


def _print(console: Console, case: dict) -> None:
    table = Table(title=f"{MODEL} on {CLUSTER}, workload {case['workload']}", title_justify="left")
    for name in ("plan", "stages (GPUs xdegree: layers)", "TTFT s", "TPOT ms", "tok/s", "sim TPOT ms",
                 "sim tok/s", "plan wall s"):  # fmt: skip
        table.add_column(name, justify="left" if name.startswith(("plan", "stages")) else "right")
    for label, key in (("pipeline-only (--max-tp 1)", "pipeline_only"), ("TP + PP", "tensor_parallel")):
        plan = case[key]
        stages = "; ".join(
            f"{gpus_text(s['gpus'])} x{s['tp_degree']}: {s['layers'][0]}-{s['layers'][1]}"
            for s in plan["stages"]
        )
        sim = plan["simulated"]
        table.add_row(
            label, stages, f"{plan['ttft_s']:.3f}", f"{plan['tpot_s'] * 1e3:.2f}",
            f"{plan['throughput_tok_s']:.1f}", f"{sim['tpot_mean_s'] * 1e3:.2f}",
            f"{sim['throughput_tok_s']:.1f}", f"{plan['plan_wall_s']:.2f}",
        )  # fmt: skip
    console.print(table)
    console.print(
        f"  TPOT {case['tpot_pp_over_tp']:.2f}x lower, throughput {case['throughput_tp_over_pp']:.2f}x "
        f"(simulated: {case['simulated_tpot_pp_over_tp']:.2f}x, "
        f"{case['simulated_throughput_tp_over_pp']:.2f}x); "
        f"load {case['tensor_parallel']['load_1min'][0]:.2f}",
        highlight=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=240, help="requests simulated for the chat workload")
    _harness.add_record_options(parser, "plan_tp")
    args = parser.parse_args()
    console = Console(width=170)
    console.print(_harness.machine_line(), highlight=False)
    cases = [run_workload(w, n or args.requests) for w, n in WORKLOADS.items()]
    for case in cases:
        _print(console, case)
    oracle = run_oracle()
    for row in oracle:
        console.print(
            f"oracle {row['case']}: brute force {row['brute_objective_s']:.6f} s (degrees "
            f"{row['brute_degrees']}, {row['partitions']} partitions); dp {row['dp_objective_s']:.6f} s, "
            f"milp {row['milp_objective_s']:.6f} s",
            highlight=False,
        )
    result = {
        "model": MODEL,
        "cluster": CLUSTER,
        "time_limit_s": TIME_LIMIT_S,
        "cases": cases,
        "oracle": oracle,
    }
    _harness.append_record(args.out, "plan_tp", result, args.label)


if __name__ == "__main__":
    main()
