"""What `tessel profile` prints: the fitted forms, their held-out error, the implied efficiencies."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def print_profile(console: Console, result, report, data, out) -> None:  # noqa: ANN001 (profiler types)
    """`result` a Profile, `report` its FitReport, `data` the Measurements, `out` where it was written."""
    table = Table(title=f"profile on {result.device_type}: one decoder layer, and the other priced parts")
    table.add_column("fit")
    table.add_column("coefficients")
    table.add_column("points", justify="right")
    table.add_column("held-out error", justify="right")
    pre, dec = result.prefill, result.decode
    table.add_row(
        "prefill t(c,p)",
        f"a0={pre.a0:.3e} a1={pre.a1:.3e} a2={pre.a2:.3e} a3={pre.a3:.3e}",
        str(len(data.prefill_times_s)),
        f"{report.prefill_heldout_error:.1%}",
    )
    table.add_row(
        "decode t(B,S)",
        f"g(B) through {len(dec.knots)} batch knots, b2={dec.b2:.3e}"
        if dec.knots
        else f"b0={dec.b0:.3e} b1={dec.b1:.3e} b2={dec.b2:.3e}",
        str(len(data.decode_times_s)),
        f"{report.decode_heldout_error:.1%}",
    )
    for name, fit in result.components.items():
        table.add_row(
            f"{name} t({fit.unit})",
            f"through {len(fit.knots)} knots" if fit.knots else f"c0={fit.c0:.3e} c1={fit.c1:.3e}",
            str(fit.n_points),
            f"{fit.heldout_rel_error:.1%}",
        )
    console.print(table)
    if result.cpu_cores is not None:
        console.print(f"host: {result.cpu_cores} usable cores, timed with {result.threads} thread(s)")
    contention = result.components.get("contention:decode")
    if contention is not None:
        slowdown = contention.time_s(1)
        console.print(f"decode beside another stage on this host: {slowdown:.2f}x (memory contention)")
    efficiencies = []
    if result.compute_efficiency is not None:
        efficiencies.append(f"compute {result.compute_efficiency:.1%} of catalog peak")
    if result.memory_efficiency is not None:
        efficiencies.append(f"memory {result.memory_efficiency:.1%} of catalog bandwidth")
    if efficiencies:
        console.print("implied efficiency: " + ", ".join(efficiencies))
    console.print(f"held-out mean relative error {result.heldout_rel_error:.1%}; wrote {out}")
