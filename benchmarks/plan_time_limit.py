"""Does `tessel plan --time-limit T` bound the whole command on large clusters?

Writes clusters of N GPUs (four types, one node of N/4 each), runs `tessel plan --time-limit T` on
each, and prints the wall time of the whole command next to the limit; each run appends a record to
benchmarks/results/plan_time_limit.jsonl.

    python benchmarks/plan_time_limit.py                 # N in 32, 64, 128; T = 5 s
    python benchmarks/plan_time_limit.py --gpus 256 --time-limit 10
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _harness
from rich.console import Console
from rich.table import Table

TYPES = (("A100-80G", 600), ("V100-32G", 300), ("T4", 64), ("L4", 64))  # (GPU, intra-node Gb/s)


def write_cluster(path: Path, gpus: int) -> Path:
    lines = [f"name: bench-{gpus}", "nodes:"]
    for gpu, gbps in TYPES:
        lines.append(
            f"  - {{name: {gpu.lower()}, gpus: {{type: {gpu}, count: {gpus // len(TYPES)}}}, "
            f"intra_link: {{bandwidth_gbps: {gbps}, latency_us: 5}}, host_memory_gib: 256}}"
        )
    lines.append("network: {bandwidth_gbps: 100, latency_us: 20}")
    path.write_text("\n".join(lines) + "\n")
    return path


def time_plan(cluster: Path, time_limit_s: float) -> dict:
    command = [sys.executable, "-m", "tessel.cli", "plan", "--cluster", str(cluster)]
    with _harness.stopwatch() as elapsed:
        done = subprocess.run([*command, "--time-limit", str(time_limit_s)], capture_output=True, text=True)
    solver = next((line for line in done.stdout.splitlines() if line.startswith("solver:")), "")
    return {"wall_s": elapsed.wall_s, "returncode": done.returncode, "solver": solver.strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--time-limit", type=float, default=5.0)
    _harness.add_record_options(parser, "plan_time_limit")
    args = parser.parse_args()
    console = Console(highlight=False)
    table = Table(title=f"tessel plan --time-limit {args.time_limit:g} (Llama-3-70B, 4 GPU types)")
    for column in ("GPUs", "wall s", "over the limit", "solver line"):
        table.add_column(column, justify="left" if column == "solver line" else "right")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for gpus in args.gpus:
            row = {
                "gpus": gpus,
                **time_plan(write_cluster(Path(tmp) / f"c{gpus}.yaml", gpus), args.time_limit),
            }
            rows.append(row)
            table.add_row(
                str(gpus), f"{row['wall_s']:.1f}", f"{row['wall_s'] / args.time_limit:.2f}x", row["solver"]
            )
    console.print(table)
    result = {
        "time_limit_s": args.time_limit,
        "rows": rows,
        "loadavg": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    _harness.append_record(args.out, "plan_time_limit", result, args.label)


if __name__ == "__main__":
    main()
