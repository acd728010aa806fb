"""`tessel probe`: this machine's GPUs and CPU as a cluster file (`tessel plan --cluster FILE`).

Discovery is `tessel.catalog.local_machine`; `tessel plan --cluster local` plans on the same cluster
without writing it. No torch needed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from tessel.commands.options import output_file
from tessel.errors import TesselError
from tessel.units import GIB

LOCAL_CLUSTER = "local"  # `tessel plan --cluster local`: this machine, discovered when planning


def probe(
    out: Path | None = output_file(
        None, "--out", help="Write the cluster YAML here (refused if the file exists, unless --overwrite)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out file."),
) -> None:
    """Find this machine's GPUs (nvidia-smi) and CPU (/proc) and print them as a cluster."""
    from rich.console import Console

    from tessel.catalog.local_machine import cluster_yaml, discover_machine
    from tessel.files import check_output_path, write_text_file

    if out is not None:
        check_output_path(out, "--out")
        if out.expanduser().exists() and not overwrite:
            raise TesselError(f"--out {out} exists; give another file name or --overwrite to replace it")
    machine = discover_machine()
    cluster = local_cluster(machine)
    console = Console(width=None if sys.stdout.isatty() else 150)
    print_cluster(console, machine, cluster)
    if out is not None:
        write_text_file(out, cluster_yaml(machine), "--out")
        console.print(f"wrote {out}; plan on it with `tessel plan --cluster {out}`")


def local_cluster(machine=None):  # noqa: ANN001, ANN201 (LocalMachine -> Cluster; imported lazily)
    """This machine as a planner cluster; what discovery could not read is printed on stderr."""
    from rich.console import Console

    from tessel.catalog.local_machine import cluster_data, discover_machine
    from tessel.plan.cluster import parse_cluster

    machine = discover_machine() if machine is None else machine
    for note in machine.notes:
        Console(stderr=True).print(f"note: {note}", highlight=False)
    return parse_cluster(cluster_data(machine), source=LOCAL_CLUSTER)


def print_cluster(console, machine, cluster) -> None:  # noqa: ANN001 (rich Console, LocalMachine, Cluster)
    from rich.table import Table

    table = Table(title=f"this machine as cluster {cluster.name!r}")
    for column in ("device", "type", "found", "memory GiB", "torch device"):
        table.add_column(column, justify="right" if column == "memory GiB" else "left")
    for gpu in machine.gpus:
        device = cluster.devices[gpu.cuda_index]
        table.add_row(
            device.name,
            device.gpu_type,
            f"{gpu.name} (nvidia-smi {gpu.smi_index})",
            f"{device.spec.memory_bytes / GIB:.2f}",
            f"cuda:{gpu.cuda_index}",
        )
    cpu, device = machine.cpu, cluster.devices[-1]
    table.add_row(
        device.name,
        device.gpu_type,
        f"{cpu.model_name}, {cpu.logical_cores} cores, {' '.join(cpu.isa) or '-'}",
        f"{device.spec.memory_bytes / GIB:.2f} free of {cpu.memory_total_bytes / GIB:.2f}",
        "cpu",
    )
    console.print(table)
    if len(cluster.devices) > 1:
        gpu, cpu_device = cluster.devices[0], cluster.devices[-1]
        link = cluster.link(gpu, cpu_device)
        console.print(
            f"GPU <-> CPU: {link.bandwidth_bytes_per_s / 1e9:g} GB/s, {link.latency_s * 1e6:g} us (PCIe, "
            "the catalog's figure); GPU <-> GPU: "
            + (cluster.nodes[0].intra_link if isinstance(cluster.nodes[0].intra_link, str) else "as given")
        )
    else:
        console.print("no GPU: the CPU is the only device")
    console.print("speeds are the catalog's figures per type (tessel/catalog/gpus.yaml), not measured")
