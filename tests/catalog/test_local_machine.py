"""Discovery of this machine (tessel.catalog.local_machine) from recorded nvidia-smi output and /proc text.

nvidia-smi is a fake script named through the `nvidia_smi` argument (or $TESSEL_NVIDIA_SMI); /proc is
a folder of recorded files (`proc_root`); CUDA_VISIBLE_DEVICES comes in through `environ`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tessel.catalog.gpus import get_gpu
from tessel.catalog.local_machine import (
    catalog_gpu_type,
    cluster_data,
    cluster_yaml,
    discover_machine,
    parse_nvidia_smi,
)
from tessel.errors import TesselError
from tessel.plan.files.cluster import load_cluster, parse_cluster
from tessel.units import GIB

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_tile amx_bf16

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_tile amx_bf16
"""
# 64 GiB in all, 48 GiB available
MEMINFO = "MemTotal:       67108864 kB\nMemFree:        10000000 kB\nMemAvailable:   50331648 kB\n"
H100_SMI = "0, NVIDIA H100 80GB HBM3, 81559\n"
EIGHT_H100_SMI = "".join(f"{i}, NVIDIA H100 80GB HBM3, 81559\n" for i in range(8))


def make_proc(root: Path, cpuinfo: str = CPUINFO, meminfo: str = MEMINFO) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpuinfo").write_text(cpuinfo)
    (root / "meminfo").write_text(meminfo)
    return root


def fake_smi(
    folder: Path, stdout: str, exit_code: int = 0, *, topo: str | None = None, nvlink: str | None = None
) -> str:
    """An executable that answers the GPU query with `stdout` and exit `exit_code`, as nvidia-smi
    would; `topo -m` and `nvlink --status` print `topo` / `nvlink`, or fail as an old driver does."""
    answers = {"query": stdout, "topo": topo, "nvlink": nvlink}
    for name, text in answers.items():
        if text is not None:
            (folder / f"smi-{name}.txt").write_text(text)
    lines = ["#!/bin/sh", 'case "$1" in', "  topo) name=topo ;;", "  nvlink) name=nvlink ;;"]
    lines += ["  *) name=query ;;"]
    lines += ["esac", f'file="{folder}/smi-$name.txt"']
    lines += ['if [ ! -f "$file" ]; then echo "Invalid combination of input arguments." >&2; exit 2; fi']
    lines += ['cat "$file"', f'if [ "$name" = query ]; then exit {exit_code}; fi', "exit 0"]
    script = folder / "nvidia-smi"
    script.write_text("\n".join(lines) + "\n")
    script.chmod(0o755)
    return str(script)


def machine(tmp_path: Path, smi_stdout: str | None, environ: dict | None = None, **proc):  # noqa: ANN201
    smi = str(tmp_path / "absent-nvidia-smi") if smi_stdout is None else fake_smi(tmp_path, smi_stdout)
    proc_root = make_proc(tmp_path / "proc", **proc)
    return discover_machine(nvidia_smi=smi, proc_root=proc_root, environ=environ or {})


@pytest.mark.parametrize(
    ("name", "mib", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "H100"),
        ("NVIDIA H100 PCIe", 81559, "H100"),
        ("NVIDIA H200", 143771, "H200"),
        ("NVIDIA A100-SXM4-40GB", 40960, "A100-40G"),
        ("NVIDIA A100-PCIE-40GB", 40960, "A100-40G"),
        ("NVIDIA A100-SXM4-80GB", 81920, "A100-80G"),
        ("NVIDIA A100 80GB PCIe", 81920, "A100-80G"),
        ("Tesla T4", 15360, "T4"),
        ("Tesla V100-SXM2-16GB", 16384, "V100-16G"),
        ("Tesla V100-SXM2-32GB", 32768, "V100-32G"),
        ("Tesla V100S-PCIE-32GB", 32768, "V100-32G"),
        ("NVIDIA L4", 23034, "L4"),
        ("NVIDIA A10", 23028, "A10"),
        ("NVIDIA GeForce RTX 4090", 24564, "RTX-4090"),
    ],
)
def test_nvidia_smi_names_map_to_catalog_types(name: str, mib: int, expected: str) -> None:
    assert catalog_gpu_type(name, mib * 2**20) == expected
    get_gpu(expected)  # a catalog entry


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA L40S", "NVIDIA GeForce RTX 3090", "Quadro RTX 8000"])
def test_an_unknown_gpu_is_refused_naming_it_and_how_to_add_it(name: str) -> None:
    with pytest.raises(TesselError) as error:
        catalog_gpu_type(name, 24 * GIB)
    message = str(error.value)
    assert repr(name) in message and "gpus.yaml" in message and "GPU_NAME_RULES" in message


def test_nvidia_smi_rows_and_a_line_of_another_shape() -> None:
    rows = parse_nvidia_smi("0, NVIDIA H100 80GB HBM3, 81559\n\n1, Tesla T4, 15360\n")
    assert [(r.index, r.name, r.memory_bytes) for r in rows] == [
        (0, "NVIDIA H100 80GB HBM3", 81559 * 2**20),
        (1, "Tesla T4", 15360 * 2**20),
    ]
    for bad in ("0, NVIDIA H100 80GB HBM3, [N/A]", "index, name, memory.total [MiB]", "0 NVIDIA H100 81559"):
        with pytest.raises(TesselError, match="does not understand") as error:
            parse_nvidia_smi(bad + "\n")
        assert bad[:20] in str(error.value)


def test_one_h100_and_the_cpu(tmp_path: Path) -> None:
    found = machine(tmp_path, H100_SMI)
    assert [(g.cuda_index, g.smi_index, g.gpu_type) for g in found.gpus] == [(0, 0, "H100")]
    assert found.gpus[0].memory_bytes == 81559 * 2**20
    cpu = found.cpu
    assert (cpu.model_name, cpu.logical_cores) == ("Intel(R) Xeon(R) Platinum 8480+", 2)
    assert cpu.isa == ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
    assert (cpu.memory_total_bytes, cpu.memory_available_bytes) == (64 * GIB, 48 * GIB)
    cluster = parse_cluster(cluster_data(found))
    gpu, host = cluster.devices
    assert (gpu.name, gpu.gpu_type, gpu.spec.memory_bytes) == ("localhost/gpu0", "H100", 81559 * 2**20)
    assert (host.name, host.gpu_type, host.spec.memory_bytes) == ("localhost-cpu/gpu0", "cpu", 48 * GIB)
    link = cluster.link(gpu, host)  # PCIe at the H100's catalog host-to-device rate
    assert link.bandwidth_bytes_per_s == pytest.approx(get_gpu("H100").pcie_h2d_bytes_per_s)
    assert cluster.link(host, gpu) == link
    assert cluster.host_bytes(gpu) == 0  # no offloading: the CPU is a device


def test_no_nvidia_smi_is_a_cpu_only_machine_with_a_note(tmp_path: Path) -> None:
    found = machine(tmp_path, None)
    assert found.gpus == () and "not found" in found.notes[0]
    cluster = parse_cluster(cluster_data(found))
    assert [(d.name, d.gpu_type) for d in cluster.devices] == [("localhost-cpu/gpu0", "cpu")]


def test_a_failing_nvidia_smi_is_no_gpus_with_its_message(tmp_path: Path) -> None:
    smi = fake_smi(tmp_path, "No devices were found\n", exit_code=6)
    found = discover_machine(nvidia_smi=smi, proc_root=make_proc(tmp_path / "proc"), environ={})
    assert found.gpus == ()
    assert "exited 6" in found.notes[0] and "No devices were found" in found.notes[0]


def test_the_environment_names_the_fake(tmp_path: Path) -> None:
    smi = fake_smi(tmp_path, H100_SMI)
    found = discover_machine(proc_root=make_proc(tmp_path / "proc"), environ={"TESSEL_NVIDIA_SMI": smi})
    assert [g.gpu_type for g in found.gpus] == ["H100"]


def test_eight_sxm_gpus_are_nvlinked_and_pcie_cards_are_not(tmp_path: Path) -> None:
    cluster = parse_cluster(cluster_data(machine(tmp_path, EIGHT_H100_SMI)))
    assert [d.name for d in cluster.devices[:8]] == [f"localhost/gpu{k}" for k in range(8)]
    nvlink = cluster.link("localhost/gpu0", "localhost/gpu7")
    assert nvlink.bandwidth_bytes_per_s == get_gpu("H100").nvlink_bytes_per_s
    two_cards = "0, NVIDIA H100 PCIe, 81559\n1, NVIDIA H100 PCIe, 81559\n"
    pcie = parse_cluster(cluster_data(machine(tmp_path, two_cards)))
    assert pcie.nodes[0].intra_link == "pcie"


def test_a_mixed_box_keeps_the_cuda_order(tmp_path: Path) -> None:
    smi = "0, NVIDIA A100-SXM4-80GB, 81920\n1, Tesla T4, 15360\n2, NVIDIA A100-SXM4-80GB, 81920\n"
    cluster = parse_cluster(cluster_data(machine(tmp_path, smi)))
    assert [(d.name, d.gpu_type) for d in cluster.devices] == [
        ("localhost/gpu0", "A100-80G"),
        ("localhost/gpu1", "T4"),
        ("localhost/gpu2", "A100-80G"),
        ("localhost-cpu/gpu0", "cpu"),
    ]
    assert cluster.nodes[0].intra_link == "pcie"  # the T4 has no NVLink
    # each GPU's link to the CPU is its own PCIe: the T4's is slower than the A100's
    assert cluster.link("localhost/gpu1", "localhost-cpu/gpu0").bandwidth_bytes_per_s == pytest.approx(
        get_gpu("T4").pcie_h2d_bytes_per_s
    )
    assert cluster.link("localhost/gpu0", "localhost-cpu/gpu0").bandwidth_bytes_per_s == pytest.approx(
        get_gpu("A100-80G").pcie_h2d_bytes_per_s
    )


def test_cuda_visible_devices_renumbers_and_refuses_uuids(tmp_path: Path) -> None:
    smi = "0, NVIDIA A100-SXM4-80GB, 81920\n1, Tesla T4, 15360\n2, NVIDIA L4, 23034\n"
    found = machine(tmp_path, smi, {"CUDA_VISIBLE_DEVICES": "2,0"})
    assert [(g.cuda_index, g.smi_index, g.gpu_type) for g in found.gpus] == [(0, 2, "L4"), (1, 0, "A100-80G")]
    assert machine(tmp_path, smi, {"CUDA_VISIBLE_DEVICES": ""}).gpus == ()
    for value in ("GPU-5d2c1f4e-0000", "0,7"):
        with pytest.raises(TesselError, match="CUDA_VISIBLE_DEVICES"):
            machine(tmp_path, smi, {"CUDA_VISIBLE_DEVICES": value})


def test_the_yaml_reads_back_as_the_same_cluster(tmp_path: Path) -> None:
    found = machine(tmp_path, "0, NVIDIA H100 80GB HBM3, 81559\n1, Tesla T4, 15360\n")
    path = tmp_path / "cluster.yaml"
    path.write_text(cluster_yaml(found))
    text = path.read_text()
    assert "NVIDIA H100 80GB HBM3" in text and "catalog's figures" in text and "MemAvailable" in text
    loaded, direct = load_cluster(path), parse_cluster(cluster_data(found))
    assert loaded.devices == direct.devices and loaded.network == direct.network


def test_proc_without_memory_and_a_full_machine_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TesselError, match="MemTotal"):
        machine(tmp_path, None, meminfo="Nothing: 1 kB\n")
    full = machine(tmp_path, None, meminfo="MemTotal: 67108864 kB\nMemAvailable: 1048576 kB\n")  # 1 GiB free
    with pytest.raises(TesselError, match="free"):
        cluster_data(full)
    with pytest.raises(TesselError, match="cannot read"):
        discover_machine(nvidia_smi=str(tmp_path / "none"), proc_root=tmp_path / "no-proc", environ={})
