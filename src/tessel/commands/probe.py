"""`tessel probe`: this machine's GPUs and CPU as a cluster file (`tessel plan --cluster FILE`).

    tessel probe --out cluster.yaml --json profile.json     # find, measure, write both
    tessel probe --merge a.yaml b.yaml --out c.yaml --network-gbps 100 --network-latency-us 5
    tessel probe --ray --out c.yaml           # every machine of the running Ray cluster, every link
    torchrun --nnodes 2 --nproc-per-node 1 ... -m tessel.cli probe --out c.yaml   # measures the network

Discovery is `tessel.catalog.local_machine` (GPUs, topology, CPU), measurement
`tessel.profiling.device_bench` (needs torch; `--no-measure` skips it), joining
`tessel.plan.files.cluster_merge` and the network under torchrun `tessel.pipeline.comm.link_bench`.
`tessel plan --cluster local` plans on the same cluster without writing it. The cluster file keeps
the datasheet vocabulary (types, counts, nvlink / pcie); what was measured goes into its comments and
the profile JSON.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from pathlib import Path

import typer

from tessel.commands.options import RAY_ADDRESS_OPTION, optional_float, output_file
from tessel.errors import TesselError
from tessel.plan.files.cluster import MAX_LINK_GBPS, MAX_LINK_LATENCY_US
from tessel.units import GIB

LOCAL_CLUSTER = "local"  # `tessel plan --cluster local`: this machine, discovered when planning
PROFILE_FORMAT = 1  # the profile JSON's "format"
MIN_NETWORK_GBPS = 0.001  # 1 Mbit/s: below any network a pipeline's hidden states could cross


def probe(
    files: list[Path] | None = typer.Argument(
        None, help="With --merge: the cluster files to join, one per machine (from `tessel probe --out`)."
    ),
    out: Path | None = output_file(
        None, "--out", help="Write the cluster YAML here (refused if the file exists, unless --overwrite)."
    ),
    json_path: Path | None = output_file(
        None,
        "--json",
        help="Write the profile JSON here: what was found, how it is wired, what was measured.",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace existing --out / --json files."),
    merge: bool = typer.Option(
        False, "--merge", help="Join the cluster files FILES into one cluster (one node per machine)."
    ),
    network_gbps: float | None = optional_float(
        "--network-gbps",
        low=MIN_NETWORK_GBPS,
        high=MAX_LINK_GBPS,
        help="With --merge: the link between machines, Gb/s.",
    ),
    network_latency_us: float | None = optional_float(
        "--network-latency-us",
        low=0.0,
        high=MAX_LINK_LATENCY_US,
        help="With --merge: that link's one-way latency, us.",
    ),
    measure: bool = typer.Option(
        True, "--measure/--no-measure", help="Time GEMM, memory bandwidth and copies on every device (torch)."
    ),
    ray: bool = typer.Option(
        False,
        "--ray",
        help="Probe every machine of the running Ray cluster where it is (node names: their "
        "tessel.node labels) and measure every pair's link; one cluster file.",
    ),
    ray_address: str | None = RAY_ADDRESS_OPTION,
) -> None:
    """Find this machine's GPUs (NVML or nvidia-smi), their links and its CPU, measure them, and write
    them as a cluster; or join several machines' cluster files (--merge)."""
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 150)
    outputs = [(path, flag) for path, flag in ((out, "--out"), (json_path, "--json")) if path is not None]
    _check_outputs(outputs, overwrite)
    if files and not merge:
        raise TesselError(f"{len(files)} file argument(s) given without --merge; give --merge to join them")
    if merge:
        _merge(console, list(files or []), out, json_path, network_gbps, network_latency_us)
        return
    if ray_address is not None and not ray:
        raise TesselError("--ray-address goes with --ray")
    if ray:
        _probe_ray(console, out, ray_address)
        return
    if network_gbps is not None or network_latency_us is not None:
        raise TesselError(
            "--network-gbps / --network-latency-us go with --merge (or are measured under torchrun)"
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _probe_torchrun(console, out, json_path)
        return
    _probe_here(console, out, json_path, measure)


def _probe_ray(console, out: Path | None, address: str | None) -> None:  # noqa: ANN001
    """Every machine of the Ray cluster and every pair's link, as one cluster (printed, and --out)."""
    import yaml

    from tessel.files import write_text_file
    from tessel.pipeline.ray_probe import probe_cluster
    from tessel.plan.files.cluster import parse_cluster

    data, notes = probe_cluster(address)
    cluster = parse_cluster(data, source="ray")
    _notes(notes)
    console.print(f"the Ray cluster: {len(cluster.nodes)} machines, {len(cluster.devices)} devices")
    for link in data.get("links", []):
        a, b = link["between"]
        console.print(f"{a} <-> {b}: {link['bandwidth_gbps']:.3f} Gb/s, {link['latency_us']:.1f} us one way")
    if out is not None:
        header = "# the running Ray cluster, probed by `tessel probe --ray` (links measured pairwise)\n"
        write_text_file(out, header + yaml.safe_dump(data, sort_keys=False), "--out")
        console.print(f"wrote {out}; plan on it with `tessel plan --cluster {out}`")


def ray_cluster(address: str | None = None):  # noqa: ANN201 (Cluster; imported lazily)
    """The running Ray cluster as a planner cluster (`tessel plan --cluster ray`)."""
    from tessel.pipeline.ray_probe import probed_cluster

    return probed_cluster(address)


def _check_outputs(outputs: list[tuple[Path, str]], overwrite: bool) -> None:
    from tessel.files import check_output_path

    for path, flag in outputs:
        check_output_path(path, flag)
        if path.expanduser().exists() and not overwrite:
            raise TesselError(f"{flag} {path} exists; give another file name or --overwrite to replace it")
    if len(outputs) == 2 and outputs[0][0].expanduser().resolve() == outputs[1][0].expanduser().resolve():
        raise TesselError("--out and --json name the same file; give two files")


def _probe_here(console, out: Path | None, json_path: Path | None, measure: bool) -> None:  # noqa: ANN001
    from tessel.catalog.local_machine import cluster_data, cluster_yaml, discover_machine
    from tessel.files import write_json_file, write_text_file

    machine = discover_machine()
    cluster = local_cluster(machine)
    print_cluster(console, machine, cluster)
    speeds, notes = measure_devices(machine) if measure else ([], ["--no-measure: nothing timed"])
    _notes(notes)
    if speeds:
        print_speeds(console, speeds)
        for item in speeds:
            ratio = versus_catalog(machine, item)
            console.print(
                f"{item.device}: GEMM {ratio['gemm_of_catalog_peak']:.1%} and memory "
                f"{ratio['memory_of_catalog_peak']:.1%} of the catalog's {ratio['catalog_type']} peaks "
                "(what the planner assumes)",
                highlight=False,
            )
    if out is not None:
        write_text_file(out, cluster_yaml(machine) + speeds_comments(speeds), "--out")
        console.print(f"wrote {out}; plan on it with `tessel plan --cluster {out}`")
    if json_path is not None:
        write_json_file(json_path, profile_json(machine, cluster_data(machine), speeds, notes), "--json")
        console.print(f"wrote {json_path}")


def _notes(notes: list[str]) -> None:
    """What was not read or not measured, on stderr (stdout keeps the result)."""
    from rich.console import Console

    for note in notes:
        Console(stderr=True).print(f"note: {note}", highlight=False)


def measure_devices(machine) -> tuple[list, list[str]]:  # noqa: ANN001 (LocalMachine)
    """Each GPU's and the CPU's measured speeds (`DeviceSpeeds`), or none and a note without torch."""
    try:
        import torch

        from tessel.profiling.device_bench import measure_device
    except ImportError as error:
        return [], [f"not measured: {error.name or 'torch'} is not installed (pip install 'tessel[runtime]')"]
    from tessel.commands.progress import step_progress

    notes = []
    gpus = [gpu.cuda_index for gpu in machine.gpus]
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and seen < len(gpus):
        notes.append(f"torch sees {seen} CUDA device(s) of the {len(gpus)} GPUs found: GPUs not measured")
        gpus = []
    devices = [f"cuda:{k}" for k in gpus] + ["cpu"]
    speeds = []
    with step_progress() as progress:
        for done, device in enumerate(devices):
            progress("measure", done, len(devices))
            speeds.append(measure_device(device, peers=gpus if device != "cpu" else []))
        progress("measure", len(devices), len(devices))
    return speeds, notes


def print_speeds(console, speeds: list) -> None:  # noqa: ANN001
    from rich.table import Table

    table = Table(title="measured (best of the timed runs)")
    for column in (
        "device",
        "GEMM TFLOP/s",
        "memory GB/s",
        "host->dev GB/s",
        "dev->host GB/s",
        "dev->dev GB/s",
    ):
        table.add_column(column, justify="left" if column == "device" else "right")
    for s in speeds:
        peers = ", ".join(f"{k}: {v:.1f}" for k, v in s.peer_gbs.items()) or "-"
        table.add_row(
            s.device,
            f"{s.gemm_tflops:.3g} ({s.gemm_dtype})",
            f"{s.memory_gbs:.1f}",
            "-" if s.h2d_gbs is None else f"{s.h2d_gbs:.1f}",
            "-" if s.d2h_gbs is None else f"{s.d2h_gbs:.1f}",
            peers,
        )
    console.print(table)


def speeds_comments(speeds: list) -> str:
    """The measured figures as comment lines under the cluster file (the planner reads the catalog's)."""
    if not speeds:
        return ""
    lines = ["# measured by tessel probe (best of the timed runs; the planner uses the catalog's figures):"]
    for s in speeds:
        line = (
            f"#   {s.device}: GEMM {s.gemm_tflops:.3g} TFLOP/s {s.gemm_dtype}, memory {s.memory_gbs:.1f} GB/s"
        )
        if s.h2d_gbs is not None:
            line += f", host->dev {s.h2d_gbs:.1f} GB/s, dev->host {s.d2h_gbs:.1f} GB/s"
        line += "".join(f", ->{k} {v:.1f} GB/s" for k, v in s.peer_gbs.items())
        lines.append(line)
    return "\n".join(lines) + "\n"


def profile_json(machine, cluster: dict, speeds: list, notes: list[str]) -> dict:  # noqa: ANN001
    """What `--json` writes: the machine as found, its wiring, the NCCL version and the measurements."""
    from dataclasses import asdict

    nccl = None
    try:
        from tessel.profiling.device_bench import nccl_version

        nccl = nccl_version()
    except ImportError:
        pass
    return {
        "format": PROFILE_FORMAT,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "source": machine.source,
        "cpu": asdict(machine.cpu),
        "gpus": [{**asdict(gpu), "memory_gib": gpu.memory_gib} for gpu in machine.gpus],
        "topology": machine.topology.as_dict() if machine.topology is not None else None,
        "nvlink_gbs": list(machine.nvlink_gbs),
        "nvlink_active": list(machine.nvlink_active),
        "nccl_version": nccl,
        "measured": [{**s.as_dict(), **versus_catalog(machine, s)} for s in speeds],
        "cluster": cluster,
        "notes": list(machine.notes) + list(notes),
    }


def catalog_type(machine, device: str) -> str:  # noqa: ANN001 (LocalMachine)
    """The catalog type of a measured device ("cpu", or the type of GPU K for "cuda:K")."""
    if device == "cpu":
        return "cpu"
    return machine.gpus[int(device.partition(":")[2])].gpu_type


def versus_catalog(machine, speeds) -> dict:  # noqa: ANN001 (LocalMachine, DeviceSpeeds)
    """The measured figures as fractions of the catalog's peaks for the device's type (what the
    planner assumes): GEMM against the peak of its dtype, the copy against the memory bandwidth."""
    from tessel.catalog.gpus import get_gpu

    gpu_type = catalog_type(machine, speeds.device)
    spec = get_gpu(gpu_type)
    dtype = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[speeds.gemm_dtype]
    return {
        "catalog_type": gpu_type,
        "gemm_of_catalog_peak": speeds.gemm_tflops * 1e12 / spec.peak_flops_per_s[dtype],
        "memory_of_catalog_peak": speeds.memory_gbs * 1e9 / spec.mem_bandwidth_bytes_per_s,
    }


def _merge(console, files: list[Path], out, json_path, gbps, latency_us) -> None:  # noqa: ANN001
    import yaml

    from tessel.files import read_text_file, write_json_file, write_text_file
    from tessel.plan.files.cluster import load_cluster, parse_cluster
    from tessel.plan.files.cluster_merge import merge_clusters

    if (gbps is None) != (latency_us is None):
        raise TesselError("give both --network-gbps and --network-latency-us (the link between machines)")
    parts = []
    for path in files:
        load_cluster(path)  # a bad file is refused here, naming its line and field
        parts.append((path.stem, str(path), yaml.safe_load(read_text_file(path, "cluster file"))))
    network = None if gbps is None else {"bandwidth_gbps": gbps, "latency_us": latency_us}
    merged, notes = merge_clusters(parts, network=network)
    cluster = parse_cluster(merged, source="merged")
    _notes(notes)
    console.print(
        f"merged {len(files)} machines: "
        + ", ".join(f"{node.name} ({len(node.device_names)} devices)" for node in cluster.nodes)
    )
    header = [f"# joined by `tessel probe --merge` from {', '.join(str(f) for f in files)}"]
    if network is not None:
        header.append("# network between machines: as given (--network-gbps, --network-latency-us)")
    header += [f"# note: {note}" for note in notes]
    if out is not None:
        write_text_file(out, "\n".join(header) + "\n" + yaml.safe_dump(merged, sort_keys=False), "--out")
        console.print(f"wrote {out}; plan on it with `tessel plan --cluster {out}`")
    if json_path is not None:
        write_json_file(
            json_path,
            {
                "format": PROFILE_FORMAT,
                "merged_from": [str(f) for f in files],
                "cluster": merged,
                "notes": notes,
            },
            "--json",
        )


def _probe_torchrun(console, out: Path | None, json_path: Path | None) -> None:  # noqa: ANN001
    """Under torchrun: every rank probes its machine; rank 0 measures the links and writes the files."""
    import yaml

    from tessel.catalog.local_machine import cluster_data, discover_machine
    from tessel.files import write_json_file, write_text_file
    from tessel.pipeline.comm.link_bench import probe_over_torchrun

    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        raise TesselError(
            "tessel probe under torchrun runs one process per machine: give --nproc-per-node 1 "
            f"(LOCAL_WORLD_SIZE is {os.environ['LOCAL_WORLD_SIZE']})"
        )
    machine = discover_machine()
    merged, links, notes = probe_over_torchrun(cluster_data(machine))
    if merged is None:
        return  # not rank 0
    for link in links:
        console.print(
            f"rank 0 <-> rank {link.peer}: {link.bandwidth_gbps:.2f} Gb/s, {link.latency_us:.1f} us one way"
        )
    header = ["# joined by `tessel probe` under torchrun; network: the slowest measured pair from rank 0"]
    header += [f"# note: {note}" for note in notes]
    if out is not None:
        write_text_file(out, "\n".join(header) + "\n" + yaml.safe_dump(merged, sort_keys=False), "--out")
        console.print(f"wrote {out}; plan on it with `tessel plan --cluster {out}`")
    if json_path is not None:
        measured = [{"peer": link.peer, **link.as_network()} for link in links]
        write_json_file(json_path, {"format": PROFILE_FORMAT, "links": measured, "cluster": merged}, "--json")


def local_cluster(machine=None):  # noqa: ANN001, ANN201 (LocalMachine -> Cluster; imported lazily)
    """This machine as a planner cluster; what discovery could not read is printed on stderr."""
    from rich.console import Console

    from tessel.catalog.local_machine import cluster_data, discover_machine
    from tessel.plan.files.cluster import parse_cluster

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
    if cluster.nodes[0].intra_link and machine.topology is not None:
        console.print(f"GPU links from {machine.topology.source}: {machine.topology.intra_link()[1]}")
    console.print("the planner uses the catalog's speeds per type (tessel/catalog/gpus.yaml)")
