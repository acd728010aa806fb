"""Planner benchmark for issue 31 (item 3): evicted KV brought back by swap or recompute, per stage.

On the bundled `t4-gen3-a100-gen4` cluster (a T4 on PCIe Gen3, an A100-80G on Gen4) and the
bundled `kv-pressure` and `default` workloads, for LLaMA-2-7B and -13B:

- per device: seconds per GiB of evicted KV brought back by swap (out to host and back: 1/d2h +
  1/h2d) and by recompute (the device's prefill of that context, roofline), and the cheaper;
- per stage of tessel's plan (MILP): KV evicted, what one pass pays to bring back its 1/m share by
  each mode (swap s, recompute s), the mode chosen, and the offload time the stage is charged;
- the plan's objective (predicted seconds: one request's prefill + decode makespans) with the
  choice per stage, against plans made with one mode everywhere (`swap` only, `recompute` only:
  the other mode priced the same as it), and the brute force's objective as the oracle.

All figures are the cost model's predictions (no measured time except the solve time, wall-clock on
a shared machine). Appends a record to benchmarks/results/offload_plan.jsonl.

    python benchmarks/offload_plan.py
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import _harness
from rich.console import Console
from rich.table import Table

from tessel.plan.build import build_instance
from tessel.plan.instance import KvRestore
from tessel.plan.solvers.brute import brute_force
from tessel.plan.solvers.milp import solve_milp
from tessel.units import GIB

CLUSTER = "t4-gen3-a100-gen4"
MODELS = ("llama-2-7b", "llama-2-13b")
WORKLOADS = ("kv-pressure", "default")
MODES = ("swap", "recompute")


def _one_mode(instance, mode: str):
    """The instance with `mode` the only way back (the other mode priced the same as it)."""
    restore = instance.kv_restore
    rates = restore.swap_s_per_byte if mode == "swap" else restore.recompute_s_per_byte
    return replace(instance, kv_restore=KvRestore(rates.copy(), rates.copy()))


def run_case(model: str, workload: str) -> dict:
    instance = build_instance(model, CLUSTER, workload)
    restore, m = instance.kv_restore, instance.micro_batches
    devices = [
        {
            "device": d.name,
            "gpu_type": d.gpu_type,
            "swap_s_per_gib": float(restore.swap_s_per_byte[j]) * GIB,
            "recompute_s_per_gib": float(restore.recompute_s_per_byte[j]) * GIB,
            "cheaper": restore.modes()[j],
        }
        for j, d in enumerate(instance.devices)
    ]
    with _harness.stopwatch() as elapsed:
        result = solve_milp(instance, mip_gap=0.0, time_limit_s=30)
    stages = []
    for se in result.evaluation.stages:
        j = se.stage.device
        share = se.kv_evicted_bytes / m  # what one pass brings back
        stages.append(
            {
                "device": instance.devices[j].name,
                "layers": [instance.units[u].layer for u in (se.stage.unit_start, se.stage.unit_end - 1)],
                "kv_evicted_gib": se.kv_evicted_bytes / GIB,
                "streamed_weights_gib": (se.offload_bytes - se.kv_evicted_bytes) / GIB,
                "swap_s": share * float(restore.swap_s_per_byte[j]),
                "recompute_s": share * float(restore.recompute_s_per_byte[j]),
                "chosen": se.kv_preemption,
                "offload_s": se.offload_s,
            }
        )
    single = {mode: solve_milp(_one_mode(instance, mode), mip_gap=0.0, time_limit_s=30) for mode in MODES}
    brute = brute_force(instance)
    objective = result.evaluation.objective
    return {
        "model": model,
        "workload": workload,
        "micro_batches": m,
        "devices": devices,
        "stages": stages,
        "objective_s": objective,
        "brute_force_objective_s": brute.evaluation.objective,
        "swap_only_objective_s": single["swap"].evaluation.objective,
        "recompute_only_objective_s": single["recompute"].evaluation.objective,
        "swap_only_over_chosen": single["swap"].evaluation.objective / objective,
        "recompute_only_over_chosen": single["recompute"].evaluation.objective / objective,
        "milp_status": result.status,
        "milp_wall_s": elapsed.wall_s,
    }


def _print(console: Console, case: dict) -> None:
    title = f"{case['model']} on {CLUSTER}, workload {case['workload']} (m = {case['micro_batches']})"
    table = Table(title=title, title_justify="left")
    for name in ("stage", "device", "layers", "KV evicted GiB", "weights streamed GiB", "swap s/pass",
                 "recompute s/pass", "chosen", "offload s/pass"):  # fmt: skip
        table.add_column(name, justify="left" if name in ("device", "chosen") else "right")
    for index, stage in enumerate(case["stages"]):
        table.add_row(
            str(index), stage["device"], f"{stage['layers'][0]}-{stage['layers'][1]}",
            f"{stage['kv_evicted_gib']:.2f}", f"{stage['streamed_weights_gib']:.2f}",
            f"{stage['swap_s']:.4f}",
            f"{stage['recompute_s']:.4f}", stage["chosen"], f"{stage['offload_s']:.4f}",
        )  # fmt: skip
    console.print(table)
    rates = ", ".join(
        f"{d['gpu_type']}: swap {d['swap_s_per_gib']:.3f} s/GiB, "
        f"recompute {d['recompute_s_per_gib']:.3f} s/GiB"
        for d in case["devices"]
    )
    console.print(f"  {rates}", highlight=False)
    console.print(
        f"  objective {case['objective_s']:.3f} s (brute force {case['brute_force_objective_s']:.3f} s); "
        f"swap everywhere {case['swap_only_over_chosen']:.3f}x, recompute everywhere "
        f"{case['recompute_only_over_chosen']:.3f}x; MILP {case['milp_status']}, {case['milp_wall_s']:.2f} s",
        highlight=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _harness.add_record_options(parser, "offload_plan")
    args = parser.parse_args()
    console = Console(width=160)
    console.print(_harness.machine_line(), highlight=False)
    cases = [run_case(model, workload) for model in MODELS for workload in WORKLOADS]
    for case in cases:
        _print(console, case)
    _harness.append_record(args.out, "offload_plan", {"cluster": CLUSTER, "cases": cases}, args.label)


if __name__ == "__main__":
    main()
