"""`tessel probe`: recorded machines through the CLI (--out / --json read back by `tessel plan`), the
CPU measured for real, `--merge` of machines, and what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tests.catalog.test_gpu_topology import recorded
from tests.catalog.test_local_machine import fake_smi
from tests.cli.cli_helpers import user_error
from typer.testing import CliRunner

from tessel.cli import app
from tessel.plan.files.cluster import load_cluster


def probe_recorded(tmp_path: Path, name: str, monkeypatch, *extra: str) -> tuple[Path, Path]:  # noqa: ANN001
    folder = tmp_path / name
    folder.mkdir()
    smi = fake_smi(
        folder, recorded(name, "query"), topo=recorded(name, "topo"), nvlink=recorded(name, "nvlink")
    )
    monkeypatch.setenv("TESSEL_NVIDIA_SMI", smi)
    out, profile = folder / "cluster.yaml", folder / "profile.json"
    result = CliRunner().invoke(
        app, ["probe", "--out", str(out), "--json", str(profile), "--no-measure", *extra]
    )
    assert result.exit_code == 0, result.output
    return out, profile


def test_a_recorded_dgx1_through_the_cli_plans(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    out, profile = probe_recorded(tmp_path, "dgx1_v100", monkeypatch)
    cluster = load_cluster(out)
    assert [d.gpu_type for d in cluster.devices] == ["V100-32G"] * 8 + ["cpu"]
    assert cluster.nodes[0].intra_link == "nvlink"
    found = json.loads(profile.read_text())
    assert found["topology"]["nvlink_groups"] == [list(range(8))]
    assert found["topology"]["matrix"][0][:3] == ["X", "NV2", "NV1"]
    assert found["nvlink_active"] == [6] * 8 and found["cluster"] == yaml.safe_load(out.read_text())
    plan_json = tmp_path / "plan.json"
    result = CliRunner().invoke(
        app, ["plan", "--cluster", str(out), "--model", "llama-2-7b", "--json", str(plan_json)]
    )
    assert result.exit_code == 0, result.output
    stages = json.loads(plan_json.read_text())["stages"]
    assert {s["device"] for s in stages} <= {d.name for d in cluster.devices}


def test_no_gpu_probes_the_cpu_and_measures_it(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("TESSEL_NVIDIA_SMI", str(tmp_path / "no-nvidia-smi"))
    out, profile = tmp_path / "c.yaml", tmp_path / "p.json"
    result = CliRunner().invoke(app, ["probe", "--out", str(out), "--json", str(profile)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "no GPU: the CPU is the only device" in said and "no-nvidia-smi not found" in said
    assert [d.gpu_type for d in load_cluster(out).devices] == ["cpu"]
    (cpu,) = json.loads(profile.read_text())["measured"]
    assert cpu["device"] == "cpu" and cpu["gemm_tflops"] > 0 and cpu["memory_gbs"] > 0
    assert (
        cpu["catalog_type"] == "cpu" and cpu["gemm_of_catalog_peak"] > 0 and cpu["memory_of_catalog_peak"] > 0
    )
    assert "# measured by tessel probe" in out.read_text() and "cpu: GEMM" in out.read_text()


def test_merge_joins_machines_over_the_given_network(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    dgx1, _ = probe_recorded(tmp_path, "dgx1_v100", monkeypatch)
    t4, _ = probe_recorded(tmp_path, "t4x4", monkeypatch)
    a, b = tmp_path / "dgx1.yaml", tmp_path / "t4box.yaml"
    a.write_text(dgx1.read_text())
    b.write_text(t4.read_text())
    out = tmp_path / "both.yaml"
    runner = CliRunner()
    args = ["probe", "--merge", str(a), str(b), "--out", str(out)]
    assert "--network-gbps" in user_error(args)
    result = runner.invoke(app, [*args, "--network-gbps", "50", "--network-latency-us", "5"])
    assert result.exit_code == 0, result.output
    cluster = load_cluster(out)
    assert [(n.name, n.intra_link, len(n.device_names)) for n in cluster.nodes] == [
        ("dgx1", "nvlink", 8),
        ("t4box", "pcie", 4),
    ]
    link = cluster.link("dgx1/gpu0", "t4box/gpu3")
    assert link.bandwidth_bytes_per_s == pytest.approx(50e9 / 8) and link.latency_s == pytest.approx(5e-6)
    assert "left out CPU node 'localhost-cpu'" in out.read_text()


def test_probe_refuses_what_it_cannot_do(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    one = tmp_path / "one.yaml"
    one.write_text("name: x\nnodes:\n  - name: n\n    gpus: {type: T4, count: 1}\n")
    cases = [
        (["probe", str(one)], "without --merge"),
        (["probe", "--merge", str(one), "--network-gbps", "10", "--network-latency-us", "1"], "two or more"),
        (["probe", "--network-gbps", "10"], "go with --merge"),
        (["probe", "--out", str(one)], "exists"),
        (["probe", "--out", str(tmp_path / "s"), "--json", str(tmp_path / "s")], "same file"),
    ]
    for args, said in cases:
        assert said in user_error(args), args
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert "--nproc-per-node 1" in user_error(["probe", "--no-measure"])
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    # an nvidia-smi whose topology tessel cannot read is refused, naming the cell
    smi = fake_smi(tmp_path, recorded("t4x4", "query"), topo=recorded("t4x4", "topo").replace("PHB", "P?B"))
    monkeypatch.setenv("TESSEL_NVIDIA_SMI", smi)
    message = user_error(["probe", "--no-measure"])
    assert "'P?B'" in message and "topo -m" in message


def test_measured_gpus_are_set_against_their_own_catalog_type(tmp_path: Path) -> None:
    from tests.catalog.test_local_machine import make_proc

    from tessel.catalog.gpus import get_gpu
    from tessel.catalog.local_machine import discover_machine
    from tessel.commands.probe import versus_catalog
    from tessel.profiling.device_bench import DeviceSpeeds

    smi = fake_smi(tmp_path, "0, NVIDIA A100-SXM4-80GB, 81920\n1, Tesla T4, 15360\n")
    machine = discover_machine(nvidia_smi=smi, proc_root=make_proc(tmp_path / "proc"), environ={})
    t4 = get_gpu("T4")
    speeds = DeviceSpeeds(
        "cuda:1", t4.peak_flops_per_s["fp16"] / 2e12, "float16", t4.mem_bandwidth_bytes_per_s / 4e9
    )
    assert versus_catalog(machine, speeds) == {
        "catalog_type": "T4",
        "gemm_of_catalog_peak": pytest.approx(0.5),
        "memory_of_catalog_peak": pytest.approx(0.25),
    }
