"""Join machines' cluster files (`tessel probe --out`, one per machine) into one cluster.

    data, notes = merge_clusters([("a", "a.yaml", a_data), ("b", "b.yaml", b_data)],
                                 network={"bandwidth_gbps": 100, "latency_us": 5})

Each machine's nodes are renamed after it (`localhost` -> `<label>`, `localhost-cpu` -> `<label>-cpu`,
any other node -> `<label>-<node>`): node names must be unique in a cluster, and the devices become
`<label>/gpu<K>`. A cluster file has one `network` for every pair of nodes, so the CPU node of a
machine with GPUs is left out (its PCIe link to its own GPUs is not the network between machines);
a machine without GPUs keeps its CPU node. The network between machines is given (the NIC's rate,
e.g. 100 Gb/s InfiniBand EDR) or measured under torchrun (`tessel.pipeline.comm.link_bench`). Pure Python.
"""

from __future__ import annotations

import re

from tessel.errors import TesselError
from tessel.plan.files.cluster import parse_cluster

CPU_TYPE = "cpu"
LABEL_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")


def machine_label(text: str) -> str:
    """A node-name-safe label from a file stem or host name ("gpu-box.local" stays as it is)."""
    label = LABEL_CHARS.sub("-", text).strip("-")
    return label or "machine"


def unique_labels(labels: list[str]) -> list[str]:
    """The labels with repeats numbered: ["a", "a", "b"] -> ["a", "a-1", "b"]."""
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        count = seen.get(label, 0)
        seen[label] = count + 1
        out.append(label if count == 0 else f"{label}-{count}")
    return out


def _renamed(label: str, node: str) -> str:
    if node == "localhost":
        return label
    if node.startswith("localhost-"):
        return f"{label}-{node.removeprefix('localhost-')}"
    return f"{label}-{node}"


def _has_gpus(node: dict) -> bool:
    groups = node["gpus"] if isinstance(node["gpus"], list) else [node["gpus"]]
    return any(str(group.get("type", "")).lower() != CPU_TYPE for group in groups)


def merge_clusters(
    parts: list[tuple[str, str, object]], *, network: dict | None, name: str = "merged"
) -> tuple[dict, list[str]]:
    """(the merged cluster mapping, notes on what was left out). `parts`: (label, where it came from,
    cluster mapping) per machine, each checked as a cluster file first; `network`: {bandwidth_gbps,
    latency_us}."""
    if len(parts) < 2:
        raise TesselError(f"--merge joins two or more cluster files; got {len(parts)}")
    labels = unique_labels([machine_label(label) for label, _, _ in parts])
    nodes, notes = [], []
    for label, (_, source, data) in zip(labels, parts, strict=True):
        if not isinstance(data, dict):
            raise TesselError(f"{source}: expected a cluster file (a mapping with name and nodes)")
        parse_cluster(data, source=source)  # a bad file is named here, before anything is joined
        machine_has_gpus = any(_has_gpus(node) for node in data["nodes"])
        for node in data["nodes"]:
            if machine_has_gpus and not _has_gpus(node):
                notes.append(
                    f"{source}: left out CPU node {node['name']!r} (one network figure cannot also be "
                    "its PCIe link to its own GPUs)"
                )
                continue
            nodes.append({**node, "name": _renamed(label, node["name"])})
    if len(nodes) > 1 and network is None:
        raise TesselError(
            "the machines are joined by a network: give --network-gbps (the NIC's rate, e.g. 100 for "
            "100 Gb/s InfiniBand) and --network-latency-us, or run `tessel probe` under torchrun on "
            "every machine to measure it"
        )
    merged = {"name": name, "nodes": nodes}
    if len(nodes) > 1:
        merged["network"] = dict(network)
    parse_cluster(merged, source="the merged cluster")
    return merged, notes
