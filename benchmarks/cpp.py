"""CPP chunk planner: predicted TTFT against the baselines, and the planner's own run time.

    python benchmarks/cpp.py [--quick] [--model llama-3-70b] [--out benchmarks/results/cpp.jsonl]

Pipelines: the first S devices (S in 2, 4, 8) of bundled clusters, layers split evenly (memory is
not checked: this measures chunking, not placement), priced by the analytic cost model. For each
prompt length: the planner's chunks and TTFT, every baseline's TTFT, the speedup over the best
baseline, and two run times: the TeraPipe DP alone (`dp_s`, the part with the 2 s target at 128K
on a 64-token grid) and the whole planner (`planner_s`: DP + local/beam search on non-uniform
pipelines). Times are process CPU seconds (immune to other processes sharing the cores) next to
wall seconds. Each run appends a record to benchmarks/results/cpp.jsonl (`_harness`).
"""

from __future__ import annotations

import argparse

import _harness
from rich.console import Console
from rich.table import Table

from tessel.catalog.models import load_model
from tessel.chunk.baselines import baseline_plans
from tessel.chunk.bounds import lower_bound_s
from tessel.chunk.from_plan import even_split_pipeline
from tessel.chunk.planner import ChunkProblem, plan_chunks
from tessel.plan.files.cluster import load_cluster

FULL = {
    "clusters": [
        ("mixed-a100-v100-t4", (2, 4, 8)),
        ("a100-8x80g", (2, 4, 8)),
        ("llmpq-t4-v100-a100", (4, 7)),
    ],
    "seq_lens": (4096, 16384, 65536, 131072),
}
QUICK = {"clusters": [("mixed-a100-v100-t4", (4,)), ("a100-8x80g", (4,))], "seq_lens": (4096, 32768)}


def run(model_name: str, config: dict, grid: int) -> list[dict]:
    model = load_model(model_name)
    rows = []
    for cluster_name, stage_counts in config["clusters"]:
        cluster = load_cluster(cluster_name)
        for n_stages in stage_counts:
            priced = even_split_pipeline(model, cluster, n_stages)
            for seq_len in config["seq_lens"]:
                problem = ChunkProblem(
                    priced.pipeline,
                    (seq_len,),
                    grid,
                    tail_s=priced.tail_s,
                    flops_linear_tokens=priced.flops_linear_tokens,
                )
                with _harness.stopwatch() as dp_time:
                    dp = plan_chunks(problem, exact=False, local_search=False)
                baselines = baseline_plans(problem)
                seeds = [base.chunks for base in baselines.values()]
                with _harness.stopwatch() as planner_time:
                    plan = plan_chunks(problem, seeds=seeds)
                best_name = min(baselines, key=lambda name: baselines[name].ttft_s)
                rows.append(
                    {
                        "cluster": cluster_name,
                        "stages": [s.gpu_type for s in priced.stages],
                        "n_stages": n_stages,
                        "seq_len": seq_len,
                        "grid_tokens": grid,
                        "cpp_ttft_s": plan.ttft_s,
                        "cpp_chunks": len(plan.chunks),
                        "cpp_bubble_fraction": plan.bubble_fraction,
                        "method": plan.method,
                        "optimal": plan.optimal,
                        "lower_bound_s": lower_bound_s(problem),
                        "dp_ttft_s": dp.ttft_s,
                        "dp_s": dp_time.cpu_s,
                        "dp_wall_s": dp_time.wall_s,
                        "planner_s": planner_time.cpu_s,
                        "planner_wall_s": planner_time.wall_s,
                        "baselines": {
                            name: {"ttft_s": base.ttft_s, "chunks": len(base.chunks)}
                            for name, base in baselines.items()
                        },
                        "best_baseline": best_name,
                        "speedup_vs_best_baseline": baselines[best_name].ttft_s / plan.ttft_s,
                        "speedup_vs_none": baselines["none"].ttft_s / plan.ttft_s,
                    }
                )
    return rows


def show(rows: list[dict], console: Console) -> None:
    table = Table(title="CPP chunk planner: predicted TTFT (s) and planner time")
    columns = ["cluster", "S", "tokens", "CPP", "chunks", "none", "fixed-512", "fixed-2048", "fixed-best"]
    columns += ["seq1f1b", "sglang", "vs best", "DP cpu s", "planner cpu s", "vs bound", "proof"]
    for column in columns:
        table.add_column(column, justify="left" if column == "cluster" else "right")
    for row in rows:
        base = row["baselines"]
        table.add_row(
            row["cluster"],
            str(row["n_stages"]),
            str(row["seq_len"]),
            f"{row['cpp_ttft_s']:.3f}",
            str(row["cpp_chunks"]),
            *(f"{base[name]['ttft_s']:.3f}" for name in ("none", "fixed-512", "fixed-2048", "fixed-best")),
            f"{base['seq1f1b']['ttft_s']:.3f}" if "seq1f1b" in base else "-",
            f"{base['sglang-dynamic']['ttft_s']:.3f}",
            f"{row['speedup_vs_best_baseline']:.3f}x",
            f"{row['dp_s']:.2f}",
            f"{row['planner_s']:.2f}",
            f"{row['cpp_ttft_s'] / row['lower_bound_s'] - 1:.2%}",
            "optimal" if row["optimal"] else "-",
        )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="Two pipelines, 4K and 32K tokens.")
    parser.add_argument("--model", default="llama-3-70b")
    parser.add_argument("--grid", type=int, default=64)
    _harness.add_record_options(parser, "cpp")
    args = parser.parse_args()
    config = QUICK if args.quick else FULL
    rows = run(args.model, config, args.grid)
    console = Console(width=200)
    show(rows, console)
    document = {"model": args.model, "quick": args.quick, "rows": rows}
    _harness.append_record(args.out, "cpp", document, args.label)


if __name__ == "__main__":
    main()
