"""`tessel probe` under torchrun: two gloo processes on this machine gather their cluster files and
measure the link between them (a real ping-pong over loopback TCP; figures only checked for sense)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

from tessel.pipeline.comm.link_bench import LinkMeasure, probe_over_torchrun, slowest
from tessel.plan.files.cluster import parse_cluster

CPU_MACHINE = {
    "name": "local",
    "nodes": [{"name": "localhost-cpu", "gpus": [{"type": "cpu", "memory_gib": 8.0}]}],
}


def _rank(rank: int, init_file: str, result_file: str) -> None:
    merged, links, notes = probe_over_torchrun(
        CPU_MACHINE, init_method=f"file://{init_file}", rank=rank, world_size=2, bandwidth_bytes=2**20
    )
    if rank == 0:
        Path(result_file).write_text(
            json.dumps({"merged": merged, "links": [link.as_network() for link in links]})
        )
    else:
        assert merged is None and links == [] and notes == []


def test_two_processes_measure_their_link_and_merge(tmp_path: Path) -> None:
    result = tmp_path / "result.json"
    fork = multiprocessing.get_context("fork")  # the children inherit the imports: no second start-up
    args = (str(tmp_path / "init"), str(result))
    ranks = [fork.Process(target=_rank, args=(rank, *args)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    assert [process.exitcode for process in ranks] == [0, 0]
    found = json.loads(result.read_text())
    (link,) = found["links"]
    assert link["bandwidth_gbps"] > 0 and link["latency_us"] > 0
    cluster = parse_cluster(found["merged"])
    assert len(cluster.nodes) == 2 and [d.gpu_type for d in cluster.devices] == ["cpu", "cpu"]
    names = [node.name for node in cluster.nodes]
    assert names[1] == f"{names[0].removesuffix('-cpu')}-1-cpu"  # one host twice: numbered
    assert found["merged"]["network"] == link


def test_the_slowest_pair_is_the_network() -> None:
    links = [LinkMeasure(1, 5.0, 90.0), LinkMeasure(2, 12.0, 40.0)]
    assert slowest(links) == {"bandwidth_gbps": 40.0, "latency_us": 12.0}
