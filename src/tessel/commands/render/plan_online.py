"""What `tessel plan --objective goodput` prints: the pipelines, the goodput against the baseline,
and the simulator's check at the planned rate."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def print_online(console: Console, plan, workload, cluster, ceiling_req_s: float | None) -> None:  # noqa: ANN001
    from tessel.plan.online.latency import predict_p90

    b = plan.micro_batch_size
    devices = plan.instances[b].devices
    title = (
        f"online plan on {cluster.name}, workload {workload.name}: SLOs p90 TTFT {plan.slo[0]:g} s, "
        f"p90 TPOT {plan.slo[1] * 1e3:g} ms; micro-batches of {b}"
    )
    table = Table(title=title, title_justify="left")
    for column in (
        "pipeline",
        "GPUs",
        "layers per GPU",
        "in flight",
        "req/s",
        "weight",
        "p90 TTFT s",
        "p90 TPOT ms",
    ):
        table.add_column(column, justify="right")
    for index, (pipeline, weight) in enumerate(zip(plan.pipelines, plan.weights, strict=True)):
        at = predict_p90(pipeline.times, plan.shape, pipeline.goodput_req_s)
        stages = pipeline.placement.solution.stages
        names = " > ".join(f"{devices[pipeline.placement.devices[s.device]].gpu_type}" for s in stages)
        counts = ",".join(str(s.unit_end - s.unit_start) for s in stages)
        table.add_row(
            str(index), names, counts, f"{pipeline.micro_batches} x {b}", f"{pipeline.goodput_req_s:.3f}",
            f"{weight:.3f}", f"{at.ttft_p90_s:.2f}", f"{at.tpot_p90_s * 1e3:.1f}",
        )  # fmt: skip
    console.print(table)
    console.print(goodput_line(plan), highlight=False)
    rate = workload.arrival_rate_per_s
    if rate > plan.goodput_req_s:
        ceiling = (
            "" if ceiling_req_s is None else f" (no plan serves more than {ceiling_req_s:.4g} without SLOs)"
        )
        console.print(
            f"note: the workload asks for {rate:g} requests/s; within the SLOs this plan serves "
            f"{plan.goodput_req_s:.4g}{ceiling}",
            highlight=False,
        )


def goodput_line(plan) -> str:  # noqa: ANN001
    baseline = plan.baseline
    if baseline is None:
        versus = "no separate same-type pipeline meets the SLOs (baseline goodput 0)"
    else:
        versus = (
            f"separate same-type pipelines (uniform split, Helix's baseline) {baseline.goodput_req_s:.4g} "
            f"requests/s with micro-batches of {baseline.micro_batch_size}: {plan.ratio:.2f}x"
        )
    return (
        f"goodput: {plan.goodput_req_s:.4g} requests/s ({plan.kind}, {len(plan.pipelines)} pipelines, "
        f"{plan.placements_priced} placements priced, {plan.time_s:.1f} s); {versus}"
    )


def print_confirmation(console: Console, plan, confirmed) -> None:  # noqa: ANN001
    from tessel.sim.slo import Slo

    slo = Slo(*plan.slo)
    first = confirmed.checks[0]
    console.print(f"simulator at the planned rate: {first.text(slo)}", highlight=False)
    if not first.met and confirmed.rate_req_s <= 0:
        floor = confirmed.checks[-1]
        console.print(
            f"simulator: the SLOs are missed even at half the planned rate: {floor.text(slo)}",
            highlight=False,
        )
    elif not first.met:
        console.print(
            f"simulator: the SLOs hold up to {confirmed.rate_req_s:.4g} requests/s "
            f"({len(confirmed.checks)} runs), "
            f"{confirmed.rate_req_s / plan.goodput_req_s:.2f}x the planned rate; the plan file (--json) "
            "carries this rate",
            highlight=False,
        )
