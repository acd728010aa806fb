"""The running Ray cluster as one cluster file: every machine probed where it is, every pair of
machines' link measured (`tessel probe --ray`, `tessel plan --cluster ray`).

Each labelled machine (`ray start ... --labels tessel.node=NAME`) runs the one-machine probe
(`tessel.catalog.local_machine`) as a Ray task pinned to it, and one task per machine joins a gloo
process group (rendezvous at the first machine, gloo bound to each machine's own interface) in
which every pair plays ping-pong (`tessel.pipeline.comm.link_bench.measure_pairs`: a small message
for the latency, a large one for the bandwidth, one way = half the round trip). The cluster file
names each machine's node by its label, so a plan made on it names the machines Ray places stages
on: a machine with GPUs is its GPU node (its CPU node left out, as `tessel probe --merge` does), one
without is its CPU. Each pair's measured link goes into `links` (the planner and the simulator price
that pair by it, so a slow link changes the split); `network` is the slowest pair's.
"""

from __future__ import annotations

from datetime import timedelta

from tessel.pipeline.supervision.ray_stages import connect, free_port_on, import_ray, interface_of, this_node

PAIR_BANDWIDTH_BYTES = 8 * 2**20  # 8 MiB: past a LAN's latency-bandwidth product, 0.7 s at 100 Mbit/s
PAIR_REPEATS = 3
JOIN_TIMEOUT = timedelta(seconds=120)
CPU_TYPE = "cpu"


def _machine() -> dict:
    """This machine as a cluster mapping (runs on each machine, as a Ray task)."""
    from tessel.catalog.local_machine import cluster_data, discover_machine

    return cluster_data(discover_machine())


def _pairs(rank: int, world: int, master: str, pairs: list[tuple[int, int]], address: str) -> list:
    """One machine's part of the pairwise ping-pong (runs on each machine, as a Ray task)."""
    import os

    import torch.distributed as dist

    from tessel.pipeline.comm.link_bench import measure_pairs

    interface = interface_of(address)
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    dist.init_process_group("gloo", init_method=master, rank=rank, world_size=world, timeout=JOIN_TIMEOUT)
    try:
        found = measure_pairs(pairs, bandwidth_bytes=PAIR_BANDWIDTH_BYTES, repeats=PAIR_REPEATS)
    finally:
        dist.destroy_process_group()
    return [(a, b, link.as_network()) for a, b, link in found]


def _main_node(label: str, data: dict) -> dict:
    """The machine's node, named by its label: its GPU node, else its CPU node."""
    nodes = data["nodes"]
    with_gpus = [n for n in nodes if any(str(g.get("type", "")).lower() != CPU_TYPE for g in _groups(n))]
    return {**(with_gpus or nodes)[0], "name": label}


def _groups(node: dict) -> list[dict]:
    return node["gpus"] if isinstance(node["gpus"], list) else [node["gpus"]]


def probe_cluster(address: str | None) -> tuple[dict, list[str]]:
    """(the cluster mapping of every labelled machine of the Ray cluster at `address`, this machine
    first, with each pair's measured link; notes)."""
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = connect(address)
    here = this_node(nodes).name  # first: a plan's stage 0 runs where the command does
    names = [here, *sorted(name for name in nodes if name != here)]

    def on(name: str) -> dict:
        return {
            "num_cpus": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(nodes[name].node_id, soft=False),
        }

    machine = ray.remote(_machine)
    machines = ray.get([machine.options(**on(name)).remote() for name in names])
    cluster = {
        "name": "ray",
        "nodes": [_main_node(name, data) for name, data in zip(names, machines, strict=True)],
    }
    notes = [f"{name}: node {nodes[name].address}" for name in names]
    if len(names) > 1:
        first = nodes[names[0]].address
        port = ray.get(ray.remote(free_port_on).options(**on(names[0])).remote(first))
        pairs = [(a, b) for a in range(len(names)) for b in range(a + 1, len(names))]
        task = ray.remote(_pairs)
        refs = [
            task.options(**on(name)).remote(
                rank, len(names), f"tcp://{first}:{port}", pairs, nodes[name].address
            )
            for rank, name in enumerate(names)
        ]
        measured = ray.get(refs)[0]
        links = [{"between": [names[a], names[b]], **link} for a, b, link in measured]
        cluster["links"] = links
        cluster["network"] = {
            "bandwidth_gbps": min(link["bandwidth_gbps"] for link in links),
            "latency_us": max(link["latency_us"] for link in links),
        }
    return cluster, notes


def probed_cluster(address: str | None):  # noqa: ANN201 (tessel.plan.files.cluster.Cluster)
    """The running Ray cluster as a planner cluster (`tessel plan --cluster ray`, `--remap auto` over
    Ray)."""
    from tessel.plan.files.cluster import RAY_CLUSTER, parse_cluster

    data, _ = probe_cluster(address)
    return parse_cluster(data, source=RAY_CLUSTER)
