"""Topology from recorded `nvidia-smi topo -m` / `nvlink --status` outputs and NVML fakes of three real
machines (tests/catalog/data/): a DGX A100 (8x A100-SXM4-40GB, NV12 through NVSwitch), a DGX-1 (8x
V100-SXM2-32GB in a hybrid cube-mesh, NV1/NV2) and a PCIe box of four T4s (PIX/PHB/SYS). Each must
give the cluster file a person writes from the datasheets: exact types, counts and link kinds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tests.catalog.nvml_fake import FakeNvml
from tests.catalog.test_local_machine import fake_smi, make_proc

from tessel.catalog.gpu_topology import parse_nvlink_status, parse_topo_matrix
from tessel.catalog.local_machine import cluster_data, cluster_yaml, discover_machine
from tessel.errors import TesselError
from tessel.plan.files.cluster import load_cluster

DATA = Path(__file__).parent / "data"
GIB = 2**30
# machine -> (nvidia-smi name, MiB, catalog type, the intra_link a person writes from the datasheet)
MACHINES = {
    "dgx_a100": ("NVIDIA A100-SXM4-40GB", 40960, "A100-40G", "nvlink"),
    "dgx1_v100": ("Tesla V100-SXM2-32GB", 32510, "V100-32G", "nvlink"),
    "t4x4": ("Tesla T4", 15360, "T4", "pcie"),
}
# The DGX-1's NVLinks per pair (NVIDIA's DGX-1V diagram, as MSCCL's dgx1() topology writes it)
DGX1_LINKS = [
    [int(v) for v in line.split()] for line in (DATA / "dgx1_v100_links.txt").read_text().splitlines()
]


def recorded(name: str, part: str) -> str:
    suffix = {"topo": "topo_m.txt", "nvlink": "nvlink_status.txt", "query": "query.csv"}[part]
    return (DATA / f"{name}_{suffix}").read_text()


def smi_machine(tmp_path: Path, name: str, environ: dict | None = None):  # noqa: ANN201
    smi = fake_smi(
        tmp_path, recorded(name, "query"), topo=recorded(name, "topo"), nvlink=recorded(name, "nvlink")
    )
    return discover_machine(nvidia_smi=smi, proc_root=make_proc(tmp_path / "proc"), environ=environ or {})


def fake_nvml(name: str) -> FakeNvml:
    """NVML of the machine, built from its datasheet wiring (not from the topo -m text)."""
    gpu_name, mib, _, _ = MACHINES[name]
    n = 4 if name == "t4x4" else 8
    gpus = [(gpu_name, mib * 2**20)] * n
    if name == "dgx_a100":  # 12 NVLinks per GPU, two to each of six NVSwitches
        links = [[("switch", k // 2) for k in range(12)] for _ in range(n)]
        levels = [[0 if i == j else (20 if i // 2 == j // 2 else 50) for j in range(n)] for i in range(n)]
    elif name == "dgx1_v100":
        links = [[("gpu", j) for j in range(n) for _ in range(DGX1_LINKS[i][j])] for i in range(n)]
        levels = [[0 if i == j else (30 if (i < 4) == (j < 4) else 50) for j in range(n)] for i in range(n)]
    else:  # GPU0/1 behind one switch, GPU2 on socket 0's host bridge, GPU3 on socket 1
        links = [[] for _ in range(n)]
        level = {(0, 1): 10, (0, 2): 30, (1, 2): 30, (0, 3): 50, (1, 3): 50, (2, 3): 50}
        levels = [[0 if i == j else level[min(i, j), max(i, j)] for j in range(n)] for i in range(n)]
    return FakeNvml(gpus, levels, links)


@pytest.mark.parametrize("name", list(MACHINES))
@pytest.mark.parametrize("how", ["nvidia-smi", "NVML"])
def test_recorded_machines_give_the_datasheet_cluster(tmp_path: Path, name: str, how: str) -> None:
    gpu_name, mib, gpu_type, link = MACHINES[name]
    if how == "NVML":
        found = discover_machine(nvml=fake_nvml(name), proc_root=make_proc(tmp_path / "proc"), environ={})
    else:
        found = smi_machine(tmp_path, name)
    assert found.source == how and found.notes == ()
    data = cluster_data(found)
    gpu_node = data["nodes"][0]
    count = 4 if name == "t4x4" else 8
    assert gpu_node["gpus"] == [{"type": gpu_type, "count": count, "memory_gib": mib / 1024}]
    assert gpu_node["intra_link"] == link
    path = tmp_path / "cluster.yaml"
    path.write_text(cluster_yaml(found))
    cluster = load_cluster(path)  # what `tessel plan --cluster cluster.yaml` reads
    assert [d.gpu_type for d in cluster.devices] == [gpu_type] * count + ["cpu"]
    assert yaml.safe_load(path.read_text()) == data


def test_nvml_and_topo_m_agree_pair_by_pair(tmp_path: Path) -> None:
    for name in MACHINES:
        by_smi = smi_machine(tmp_path, name).topology
        by_nvml = discover_machine(
            nvml=fake_nvml(name), proc_root=make_proc(tmp_path / "proc"), environ={}
        ).topology
        assert by_smi.pairs == by_nvml.pairs, name


def test_the_dgx1_cube_mesh_in_detail(tmp_path: Path) -> None:
    found = smi_machine(tmp_path, "dgx1_v100")
    topology = found.topology
    assert [[topology.nvlinks(i, j) for j in range(8)] for i in range(8)] == DGX1_LINKS
    assert topology.nvlink_groups() == [tuple(range(8))]
    path = topology.nvlink_path()
    assert sorted(path) == list(range(8)) and all(
        topology.nvlinks(a, b) for a, b in zip(path, path[1:], strict=False)
    )
    kind, why = topology.intra_link()
    assert kind == "nvlink" and "12 of 28 pairs have no direct NVLink" in why
    assert topology.pairs[0][5] == "SYS" and topology.cpu_affinity[4] == "20-39,60-79"
    assert found.nvlink_gbs == pytest.approx((6 * 25.781,) * 8) and found.nvlink_active == (6,) * 8
    text = cluster_yaml(found)
    assert "hybrid" not in text and "NVLink group cuda 0,1,2,3,4,5,6,7: 0-1:NV2" in text
    # a visible subset keeps the CUDA order: GPUs 4 and 0 share two NVLinks, 5 and 0 none
    pair = smi_machine(tmp_path, "dgx1_v100", {"CUDA_VISIBLE_DEVICES": "4,0"})
    assert pair.topology.pairs == (("X", "NV2"), ("NV2", "X"))
    apart = smi_machine(tmp_path, "dgx1_v100", {"CUDA_VISIBLE_DEVICES": "0,5"})
    assert cluster_data(apart)["nodes"][0]["intra_link"] == "pcie"


def test_the_dgx_a100_and_the_t4_box_in_detail(tmp_path: Path) -> None:
    a100 = smi_machine(tmp_path, "dgx_a100")
    assert {a100.topology.nvlinks(i, j) for i in range(8) for j in range(8) if i != j} == {12}
    assert a100.nvlink_gbs == (300.0,) * 8  # 12 links x 25 GB/s: the catalog's 300 GB/s per direction
    assert a100.topology.numa_affinity == ("3", "3", "1", "1", "7", "7", "5", "5")
    t4 = smi_machine(tmp_path, "t4x4")
    assert t4.topology.pairs[0] == ("X", "PIX", "PHB", "SYS") and t4.nvlink_gbs == (0.0,) * 4
    kind, why = t4.topology.intra_link()
    assert kind == "pcie" and "PIX, PHB, SYS" in why


def test_nvlink_bridged_pairs_of_pcie_cards_stay_pcie() -> None:
    text = "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\n"
    rows = [
        ("X", "NV4", "SYS", "SYS"),
        ("NV4", "X", "SYS", "SYS"),
        ("SYS", "SYS", "X", "NV4"),
        ("SYS", "SYS", "NV4", "X"),
    ]
    text += "".join(f"GPU{i}\t" + "\t".join(row) + "\t0-15\n" for i, row in enumerate(rows))
    topology = parse_topo_matrix(text)
    assert topology.nvlink_groups() == [(0, 1), (2, 3)] and topology.nvlink_path() is None
    kind, why = topology.intra_link()
    assert kind == "pcie" and "0,1; 2,3" in why


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("GPU0\tGPU1\tCPU Affinity\nGPU0\t X \tQPX\t0-7\nGPU1\tQPX\t X \t0-7\n", "'QPX'"),
        ("Failed to initialize NVML: Driver/library version mismatch\n", "no header line"),
        ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tPIX\t0-7\n", "2 GPU columns but 1 GPU rows"),
        ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tPIX\t0-7\nGPU1\tPHB\t X \t0-7\n", "GPU0 to GPU1 is PIX but"),
        ("\tGPU0\tGPU2\tCPU Affinity\nGPU0\t X \tPIX\t0-7\n", "not GPU0..GPU1"),
    ],
)
def test_a_topology_tessel_does_not_understand_is_named(text: str, named: str) -> None:
    with pytest.raises(TesselError, match="nvidia-smi topo -m") as error:
        parse_topo_matrix(text)
    assert named in str(error.value)


def test_bad_nvlink_status_and_a_failing_topo_command(tmp_path: Path) -> None:
    with pytest.raises(TesselError, match="nvlink --status printed 'Link zero: fast'"):
        parse_nvlink_status("GPU 0: Tesla V100-SXM2-32GB (UUID: GPU-1)\n\t Link zero: fast\n")
    assert parse_nvlink_status("GPU 0: X (UUID: u)\n\t Link 0: <inactive>\n\t Link 1: 25 GB/s\n") == {
        0: (None, 25.0)
    }
    down = "GPU 0: NVIDIA A100 80GB PCIe (UUID: u)\n"
    down += "\t NVML: Unable to retrieve NVLink information as all links are inActive\n"
    assert parse_nvlink_status(down) == {0: ()}
    one = parse_topo_matrix("\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-63\t0\t\tN/A\n")
    assert one.pairs == (("X",),) and one.intra_link() == ("pcie", "one GPU: no GPU-to-GPU link")
    # an nvidia-smi whose topo fails: GPUs found, links from the catalog, and a note naming the command
    smi = fake_smi(tmp_path, recorded("t4x4", "query"))
    found = discover_machine(nvidia_smi=smi, proc_root=make_proc(tmp_path / "proc"), environ={})
    assert found.topology is None and len(found.gpus) == 4
    assert any("topo -m exited 2" in note and "catalog" in note for note in found.notes)
    # a topology with another GPU count than the query is refused
    smi = fake_smi(tmp_path, recorded("t4x4", "query"), topo=recorded("dgx_a100", "topo"))
    with pytest.raises(TesselError, match="shows 8 GPUs but the GPU query lists 4"):
        discover_machine(nvidia_smi=smi, proc_root=make_proc(tmp_path / "proc"), environ={})


def test_nvml_that_cannot_start_falls_back_to_nvidia_smi(tmp_path: Path) -> None:
    broken = fake_nvml("t4x4")

    def fail() -> None:
        raise broken.NVMLError("Driver Not Loaded")

    broken.nvmlInit = fail
    found = discover_machine(
        nvml=broken, nvidia_smi=str(tmp_path / "none"), proc_root=make_proc(tmp_path / "p")
    )
    assert found.gpus == () and "NVML could not start (Driver Not Loaded)" in found.notes[0]
    assert [d["type"] for node in cluster_data(found)["nodes"] for d in node["gpus"]] == ["cpu"]
