"""Cluster files: bundled clusters, links, host memory, and errors that point at the line."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tessel.catalog import get_gpu, known_gpus
from tessel.errors import TesselError
from tessel.plan.files.cluster import (
    NVLINK_LATENCY_S,
    PCIE_P2P_LATENCY_S,
    list_bundled_clusters,
    load_cluster,
    parse_cluster,
)
from tessel.units import GIB


def test_bundled_clusters_load() -> None:
    names = list_bundled_clusters()
    assert len(names) >= 6
    for name in names:
        cluster = load_cluster(name)
        assert cluster.devices and len({d.name for d in cluster.devices}) == len(cluster.devices)
    assert load_cluster("mixed-a100-v100-t4.yaml").name == "mixed-a100-v100-t4"


def test_default_cluster_shape() -> None:
    cluster = load_cluster("mixed-a100-v100-t4")
    assert [d.gpu_type for d in cluster.devices] == ["A100-80G"] * 2 + ["V100-32G"] * 4 + ["T4"] * 4
    assert cluster.devices[0].name == "node-a/gpu0" and cluster.devices[-1].name == "node-c/gpu3"
    assert cluster.total_memory_bytes == (2 * 80 + 4 * 32 + 4 * 16) * GIB
    assert cluster.gpu_types == ["A100-80G", "V100-32G", "T4"]


def test_helix_like_cluster_has_42_gpus_on_24_nodes() -> None:
    cluster = load_cluster("helix-like-42")
    assert len(cluster.devices) == 42 and len(cluster.nodes) == 24
    assert set(cluster.gpu_types) == {"A100-80G", "L4", "T4"}


def test_helix_like_24_is_three_regions_that_plan() -> None:
    """24 one-GPU nodes (4 A100-80G, 8 L4, 12 T4) in three regions: 10 Gb/s inside a region, 100 Mb/s
    between regions; LLaMA-2-70B offline plans on it within a small time limit."""
    from tessel.plan.build import build_instance
    from tessel.plan.solvers.solve import solve

    cluster = load_cluster("helix-like-24")
    assert len(cluster.devices) == 24 and len(cluster.nodes) == 24
    types = [d.gpu_type for d in cluster.devices]
    assert (types.count("A100-80G"), types.count("L4"), types.count("T4")) == (4, 8, 12)
    inside = cluster.link("r2-l4-0/gpu0", "r2-t4-0/gpu0")
    between = cluster.link("r1-a100-0/gpu0", "r2-l4-0/gpu0")
    assert inside.bandwidth_bytes_per_s == pytest.approx(10e9 / 8) and inside.latency_s == pytest.approx(1e-3)
    assert between.bandwidth_bytes_per_s == pytest.approx(0.1e9 / 8)
    assert between.latency_s == pytest.approx(0.05)
    instance = build_instance("llama-2-70b", cluster, "offline-batch")
    result = solve(instance, time_limit_s=3.0, mip_gap=0.05)
    assert result.evaluation is not None and result.evaluation.feasible


def test_links_follow_the_rules() -> None:
    cluster = load_cluster("mixed-a100-v100-t4")
    a0, a1, v0, t0, t1 = (
        cluster.device(n) for n in ("node-a/gpu0", "node-a/gpu1", "node-b/gpu0", "node-c/gpu0", "node-c/gpu1")
    )
    nvlink = cluster.link(a0, a1)
    assert nvlink.bandwidth_bytes_per_s == get_gpu("A100-80G").nvlink_bytes_per_s
    assert nvlink.latency_s == NVLINK_LATENCY_S
    pcie = cluster.link(t0, t1)
    assert pcie.bandwidth_bytes_per_s == get_gpu("T4").pcie_h2d_bytes_per_s
    assert pcie.latency_s == PCIE_P2P_LATENCY_S
    network = cluster.link("node-a/gpu0", "node-b/gpu0")
    assert network.bandwidth_bytes_per_s == pytest.approx(25e9 / 8)  # 25 Gb/s
    assert network.latency_s == pytest.approx(20e-6)
    assert cluster.link(v0, t0) == cluster.link(t0, v0)
    assert cluster.link(a0, a0).bandwidth_bytes_per_s == float("inf")


def test_network_is_capped_by_pcie_and_custom_links() -> None:
    bandwidth_gbps = random.uniform(1, 40)
    cluster = parse_cluster(
        {
            "name": "x",
            "nodes": [
                {
                    "name": "n0",
                    "gpus": {"type": "t4", "count": 2},
                    "intra_link": {"bandwidth_gbps": bandwidth_gbps},
                },
                {
                    "name": "n1",
                    "gpus": [{"type": "H100"}, {"type": "A10", "count": 2}],
                    "host_memory_gib": 300,
                },
            ],
            "network": {"bandwidth_gbps": 400, "latency_us": 3},
        }
    )
    assert [d.name for d in cluster.devices] == ["n0/gpu0", "n0/gpu1", "n1/gpu0", "n1/gpu1", "n1/gpu2"]
    assert [d.gpu_type for d in cluster.devices] == ["T4", "T4", "H100", "A10", "A10"]
    assert cluster.link("n0/gpu0", "n0/gpu1").bandwidth_bytes_per_s == pytest.approx(bandwidth_gbps * 1e9 / 8)
    assert (
        cluster.link("n0/gpu0", "n1/gpu0").bandwidth_bytes_per_s == get_gpu("T4").pcie_h2d_bytes_per_s
    )  # 400 Gb/s > PCIe 3
    assert (
        cluster.link("n1/gpu0", "n1/gpu1").bandwidth_bytes_per_s == get_gpu("A10").pcie_h2d_bytes_per_s
    )  # default pcie
    assert cluster.host_bytes("n1/gpu1") == pytest.approx(100 * GIB)
    assert cluster.host_bytes("n0/gpu0") == 0


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def _error(path: Path) -> str:
    with pytest.raises(TesselError) as info:
        load_cluster(path)
    return str(info.value)


def test_unknown_gpu_names_file_line_and_known_types(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "name: c\nnodes:\n  - name: a\n    gpus: {type: A100-80G, count: 1}\n"
        "  - name: b\n    gpus:\n      type: Z9000\n      count: 2\nnetwork: {bandwidth_gbps: 10}\n",
    )
    message = _error(path)
    assert f"{path}:7:" in message and "nodes[1].gpus[0].type" in message and "Z9000" in message
    assert all(name in message for name in known_gpus())


def test_bad_link_and_count_and_typo_point_at_their_lines(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "name: c\n"
        "nodes:\n"
        "  - name: a\n"
        "    gpus: {type: T4, count: 0}\n"
        "    intra_link: infiniband\n"
        "    host_mem_gib: 4\n",
    )
    message = _error(path)
    assert f"{path}:4: nodes[0].gpus[0].count" in message
    assert f"{path}:5: nodes[0].intra_link" in message and "nvlink, pcie" in message
    assert f"{path}:6: nodes[0].host_mem_gib: unknown field" in message and "host_memory_gib" in message


def test_nvlink_on_a_gpu_without_it(tmp_path: Path) -> None:
    path = _write(
        tmp_path, "name: c\nnodes:\n  - name: a\n    gpus: {type: L4, count: 2}\n    intra_link: nvlink\n"
    )
    message = _error(path)
    assert f"{path}:5: nodes[0].intra_link" in message and "L4 has no NVLink" in message


def test_cluster_level_errors(tmp_path: Path) -> None:
    two_nodes = "name: c\nnodes:\n  - name: a\n    gpus: {type: T4}\n  - name: a\n    gpus: {type: T4}\n"
    message = _error(_write(tmp_path, two_nodes))
    assert "unique" in message and "network" not in message.split("unique")[0]
    message = _error(
        _write(
            tmp_path,
            two_nodes.replace("name: a\n    gpus: {type: T4}\n", "name: b\n    gpus: {type: T4}\n", 1),
        )
    )
    assert "needs network" in message
    assert "not valid YAML" in _error(_write(tmp_path, "name: c\nnodes: [\n"))
    assert "top level" in _error(_write(tmp_path, "- 1\n- 2\n"))


def test_unknown_file_lists_bundled_clusters() -> None:
    with pytest.raises(TesselError) as info:
        load_cluster("no-such-cluster")
    assert "mixed-a100-v100-t4" in str(info.value)
    with pytest.raises(TesselError, match="no device"):
        load_cluster("a100-8x80g").device("dgx/gpu8")
