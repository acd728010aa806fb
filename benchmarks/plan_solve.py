"""Planner benchmark: solve time and gap at 80 layers x 8 / 16 / 42 devices, and plan quality.

Part 1 (solve): Llama-3-70B (80 layers) on clusters of 8 devices (`llmpq-t4-v100-a100`-like, built
here), 16 devices (4 types) and the bundled 42-GPU `helix-like-42`; for each, the DP alone and
`solve(..., solver="milp")` as `tessel plan` runs it (counts relaxation bound and its plans, then
DP + HiGHS only when the gap is not yet proven), with time, objective, proven gap (against the
larger of the counts bound and HiGHS's dual bound), status and which step gave the plan.
Part 2 (quality): on every bundled cluster the model fits, tessel's plan against the baselines,
as predicted throughput ratios (same cost model for all).

    python benchmarks/plan_solve.py            # full: time limits 10 s (8, 16) and 120 s (42)
    python benchmarks/plan_solve.py --quick    # smoke run: 3 s limits, fewer clusters

Writes benchmarks/results/plan_solve.json. The machine is shared: times are wall-clock under
whatever load there is; the JSON records the time limits used.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tessel.errors import TesselError
from tessel.plan.baselines import run_baselines
from tessel.plan.build import build_instance, capacity_shortfall_bytes
from tessel.plan.cluster import list_bundled_clusters, load_cluster, parse_cluster
from tessel.plan.dp import solve_dp
from tessel.plan.report import predict
from tessel.plan.solve import solve
from tessel.plan.workload import load_workload

MODEL = "llama-3-70b"
RESULTS = Path(__file__).parent / "results" / "plan_solve.json"


def _cluster_16() -> dict:
    """16 GPUs of 4 types on 4 nodes (2 A100-80G, 4 V100-32G, 4 A10, 6 T4)."""
    return {
        "name": "mixed-16",
        "nodes": [
            {
                "name": "a",
                "gpus": {"type": "A100-80G", "count": 2},
                "intra_link": "nvlink",
                "host_memory_gib": 512,
            },
            {
                "name": "b",
                "gpus": {"type": "V100-32G", "count": 4},
                "intra_link": "nvlink",
                "host_memory_gib": 384,
            },
            {"name": "c", "gpus": {"type": "A10", "count": 4}, "intra_link": "pcie", "host_memory_gib": 256},
            {"name": "d", "gpus": {"type": "T4", "count": 6}, "intra_link": "pcie", "host_memory_gib": 256},
        ],
        "network": {"bandwidth_gbps": 25, "latency_us": 20},
    }


def _cluster_8() -> dict:
    """8 GPUs of 3 types on 3 nodes (1 A100-80G, 3 V100-32G, 4 T4)."""
    return {
        "name": "mixed-8",
        "nodes": [
            {
                "name": "a",
                "gpus": {"type": "A100-80G", "count": 1},
                "intra_link": "nvlink",
                "host_memory_gib": 256,
            },
            {
                "name": "b",
                "gpus": {"type": "V100-32G", "count": 3},
                "intra_link": "nvlink",
                "host_memory_gib": 256,
            },
            {"name": "c", "gpus": {"type": "T4", "count": 4}, "intra_link": "pcie", "host_memory_gib": 256},
        ],
        "network": {"bandwidth_gbps": 25, "latency_us": 20},
    }


def solve_rows(quick: bool) -> list[dict]:
    cases = [
        ("8", parse_cluster(_cluster_8()), 3 if quick else 10),
        ("16", parse_cluster(_cluster_16()), 3 if quick else 10),
    ]
    if not quick:
        cases.append(("42", load_cluster("helix-like-42"), 120))
    rows = []
    for label, cluster, limit in cases:
        instance = build_instance(MODEL, cluster, "default")
        row = {
            "devices": instance.n_devices,
            "cluster": cluster.name,
            "layers": 80,
            "time_limit_s": limit,
            "types": len(cluster.gpu_types),
        }
        started = time.perf_counter()
        dp = solve_dp(instance, time_limit_s=limit, rel_gap=0.01)
        row["dp"] = {
            "time_s": time.perf_counter() - started,
            "objective": _obj(dp.evaluation),
            "bound": _finite(dp.bound),
            "exact": dp.exact,
            "calls": dp.dp_calls,
            "orders": f"{dp.orders_searched}/{dp.orders_total}",
        }
        started = time.perf_counter()
        result = solve(instance, time_limit_s=limit, mip_gap=0.01)
        row["milp"] = {
            "time_s": time.perf_counter() - started,
            "objective": result.evaluation.objective,
            "bound": result.bound,
            "gap": result.gap,
            "status": result.status,
            "plan_from": result.detail.get("plan_from"),
            "counts_bound": result.detail.get("counts_bound"),
            "highs_bound": result.detail.get("highs_bound"),
            "highs": result.detail.get("highs", "run"),
            "cols": result.detail.get("milp_cols"),
            "rows": result.detail.get("milp_rows"),
        }
        rows.append(row)
        del label
    return rows


def quality_rows(quick: bool) -> list[dict]:
    workload = load_workload("default")
    rows = []
    clusters = list_bundled_clusters()
    if quick:
        clusters = [c for c in clusters if c in ("mixed-a100-v100-t4", "llmpq-t4-v100")] or clusters[:2]
    for name in clusters:
        instance = build_instance(MODEL, name, workload)
        row = {"cluster": name, "devices": instance.n_devices}
        if capacity_shortfall_bytes(instance) > 0:
            row["skipped"] = (
                f"{MODEL} does not fit ({capacity_shortfall_bytes(instance) / 2**30:.0f} GiB short)"
            )
            rows.append(row)
            continue
        limit = 3.0 if quick else 10.0  # `tessel plan`'s default
        try:
            result = solve(instance, time_limit_s=limit)
        except TesselError as error:
            row["skipped"] = str(error).split(":")[0]
            rows.append(row)
            continue
        ours = predict(instance, result.evaluation, workload.micro_batch_size)
        row.update(
            {
                "throughput_tok_s": ours.throughput_tok_s,
                "objective": result.evaluation.objective,
                "gap": result.gap,
                "baselines": {},
            }
        )
        for base_name, base in run_baselines(instance).items():
            if base.feasible:
                theirs = predict(instance, base.evaluation, workload.micro_batch_size)
                row["baselines"][base_name] = {"speedup": ours.throughput_tok_s / theirs.throughput_tok_s}
            else:
                row["baselines"][base_name] = {"speedup": None, "reason": base.reason}
        rows.append(row)
    return rows


def _obj(evaluation) -> float | None:
    return None if evaluation is None else evaluation.objective


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: short limits, fewer clusters")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    console = Console(width=160)

    solve_data = solve_rows(args.quick)
    table = Table(title=f"{MODEL}: 80 layers, solve time and gap")
    for column in (
        "devices",
        "types",
        "limit s",
        "DP s",
        "DP obj",
        "DP exact",
        "solve s",
        "solve obj",
        "bound",
        "gap %",
        "status",
        "plan from",
        "HiGHS",
    ):
        table.add_column(column, justify="right")
    for row in solve_data:
        dp, milp = row["dp"], row["milp"]
        table.add_row(
            str(row["devices"]),
            str(row["types"]),
            f"{row['time_limit_s']:.0f}",
            f"{dp['time_s']:.1f}",
            _fmt(dp["objective"], ".3f"),
            str(dp["exact"]),
            f"{milp['time_s']:.1f}",
            _fmt(milp["objective"], ".3f"),
            _fmt(milp["bound"], ".3f"),
            _fmt(None if milp["gap"] is None else 100 * milp["gap"], ".2f"),
            milp["status"],
            str(milp["plan_from"]),
            "not run" if milp["highs"] != "run" else "run",
        )
    console.print(table)

    quality = quality_rows(args.quick)
    table = Table(title="predicted throughput: tessel / baseline (same cost model)")
    for column in (
        "cluster",
        "GPUs",
        "tessel tok/s",
        "uniform",
        "memory_prop",
        "compute_prop",
        "petals_greedy",
    ):
        table.add_column(column, justify="right")
    for row in quality:
        if "skipped" in row:
            table.add_row(
                row["cluster"], str(row["devices"]), f"skipped: {row['skipped'][:40]}", "", "", "", ""
            )
            continue
        cells = [
            "infeasible" if b["speedup"] is None else f"{b['speedup']:.2f}x"
            for b in (
                row["baselines"][n]
                for n in ("uniform", "memory_proportional", "compute_proportional", "petals_greedy")
            )
        ]
        table.add_row(row["cluster"], str(row["devices"]), f"{row['throughput_tok_s']:.1f}", *cells)
    console.print(table)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "plan_solve",
                "model": MODEL,
                "quick": args.quick,
                "host": platform.node(),
                "note": "wall-clock on a shared 2-core machine; other jobs were running",
                "solve": solve_data,
                "quality": quality,
            },
            indent=2,
        )
        + "\n"
    )
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
