"""GPU + CPU plans on this machine's cluster (`--cluster local`, `--gpu-memory-gib`) and `tessel probe`.

The GPU is a fake nvidia-smi (an executable named by $TESSEL_NVIDIA_SMI or passed to discovery); the
model is SmolLM2-135M's shape (its config.json, no weights). The oracle for the split is the brute
force over every plan of the two devices (tessel.plan.solvers.brute).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tessel.catalog.local_machine import cluster_data, discover_machine
from tessel.cli import app
from tessel.errors import TesselError
from tessel.plan.api import PlanSettings, make_plan, prepare_plan
from tessel.plan.files.cluster import cap_gpu_memory, parse_cluster
from tessel.plan.solvers.brute import brute_force
from tessel.units import GIB

# SmolLM2-135M-Instruct's config.json (the shape fields the planner reads)
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
}
NUM_LAYERS = SMOLLM2_CONFIG["num_hidden_layers"]
H100_SMI = "0, NVIDIA H100 80GB HBM3, 81559\n"
CAP_GIB = 2.0  # under the default workload's KV cache, about half of SmolLM2's layers fit in 2 GiB
CPUINFO = "processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: avx2 fma\n"
MEMINFO = "MemTotal: 67108864 kB\nMemAvailable: 50331648 kB\n"


@pytest.fixture
def smollm2_shape(tmp_path: Path) -> Path:
    folder = tmp_path / "smollm2-135m-instruct"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    return folder


def fake_smi(folder: Path, stdout: str) -> str:
    (folder / "smi-out.txt").write_text(stdout)
    script = folder / "nvidia-smi"
    # the GPU query answers; `topo -m` and `nvlink --status` fail as on an old driver (links from the catalog)
    script.write_text(
        f"#!/bin/sh\ncase \"$1\" in --query*) cat '{folder / 'smi-out.txt'}' ;; "
        "*) echo 'Invalid combination of input arguments.' >&2; exit 2 ;; esac\n"
    )
    script.chmod(0o755)
    return str(script)


def h100_machine_cluster(tmp_path: Path):  # noqa: ANN201 (Cluster)
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cpuinfo").write_text(CPUINFO)
    (proc / "meminfo").write_text(MEMINFO)
    machine = discover_machine(nvidia_smi=fake_smi(tmp_path, H100_SMI), proc_root=proc, environ={})
    return parse_cluster(cluster_data(machine), source="local")


def test_a_capped_h100_takes_about_half_the_layers_as_the_brute_force_does(tmp_path, smollm2_shape) -> None:
    cluster = cap_gpu_memory(h100_machine_cluster(tmp_path), CAP_GIB)
    settings = PlanSettings(time_limit_s=20)
    problem = prepare_plan(str(smollm2_shape), cluster, "default", settings)
    instance = problem.instance
    outcome = make_plan(str(smollm2_shape), cluster, "default", settings)
    evaluation = outcome.result.evaluation
    oracle = brute_force(instance)  # every order and split of two devices: 60 plans
    # (and each plan that evicts KV once per swap / recompute mode of each stage)
    assert oracle.plans_evaluated >= 2 + 2 * (NUM_LAYERS - 1)
    assert evaluation.objective == pytest.approx(oracle.evaluation.objective, rel=1e-9)
    chosen = [(s.stage.device, s.stage.unit_start, s.stage.unit_end) for s in evaluation.stages]
    assert chosen == [(s.device, s.unit_start, s.unit_end) for s in oracle.solution.stages]

    names = [instance.devices[s.stage.device].name for s in evaluation.stages]
    # The CPU takes the first layers and the H100 the rest with the LM head (the costliest single
    # piece of SmolLM2 on a CPU): the brute force's order too.
    assert names == ["localhost-cpu/gpu0", "localhost/gpu0"]
    gpu_stage = evaluation.stages[1]
    gpu_layers = gpu_stage.stage.n_units
    assert NUM_LAYERS // 3 <= gpu_layers <= 2 * NUM_LAYERS // 3  # about half
    # consistent with the cap: what the GPU holds fits under it, and one layer more would not
    assert gpu_stage.held_bytes <= CAP_GIB * GIB and gpu_stage.offload_bytes == 0
    extra = gpu_stage.stage.unit_start - 1
    assert gpu_stage.held_bytes + instance.weight_bytes[extra] + instance.kv_bytes[extra] > CAP_GIB * GIB

    # what the runtime reads: GPU stages "<node>/gpu<K>" of a catalog GPU, the CPU stage of type cpu
    stages = outcome.plan_file().stages
    assert [(s.device, s.gpu_type, s.layer_start, s.layer_end) for s in stages] == [
        ("localhost-cpu/gpu0", "cpu", 0, NUM_LAYERS - gpu_layers),
        ("localhost/gpu0", "H100", NUM_LAYERS - gpu_layers, NUM_LAYERS),
    ]


def test_without_a_cap_the_h100_takes_every_layer(tmp_path, smollm2_shape) -> None:
    outcome = make_plan(str(smollm2_shape), h100_machine_cluster(tmp_path), "default", PlanSettings())
    assert [(s.device, s.layer_start, s.layer_end) for s in outcome.plan_file().stages] == [
        ("localhost/gpu0", 0, NUM_LAYERS)
    ]


def test_plan_cluster_local_with_a_cap(tmp_path, smollm2_shape, monkeypatch) -> None:
    monkeypatch.setenv("TESSEL_NVIDIA_SMI", fake_smi(tmp_path, H100_SMI))
    out = tmp_path / "plan.json"
    args = ["plan", "--cluster", "local", "--model", str(smollm2_shape), "--gpu-memory-gib", str(CAP_GIB)]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    stages = json.loads(out.read_text())["stages"]
    assert [(s["device"], s["gpu_type"]) for s in stages] == [
        ("localhost-cpu/gpu0", "cpu"),
        ("localhost/gpu0", "H100"),
    ]
    assert stages[1]["weights_gib"] + stages[1]["kv_gib"] <= CAP_GIB


def _tessel(*args: str, nvidia_smi: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TESSEL_NVIDIA_SMI": nvidia_smi}
    return subprocess.run(
        [sys.executable, "-m", "tessel.cli", *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_a_cap_above_the_gpu_or_without_a_gpu_is_refused_before_planning(tmp_path, smollm2_shape) -> None:
    model = ["--model", str(smollm2_shape)]
    above = _tessel(
        "plan",
        "--cluster",
        "local",
        *model,
        "--gpu-memory-gib",
        "100",
        nvidia_smi=fake_smi(tmp_path, H100_SMI),
    )
    assert above.returncode == 2 and "Traceback" not in above.stderr
    message = " ".join(above.stderr.split())
    assert (
        "--gpu-memory-gib of 100 GiB is above the memory of localhost/gpu0 (H100: 78.65 GiB usable" in message
    )
    assert "predicted" not in above.stdout
    no_gpu = _tessel(
        "plan", "--cluster", "local", *model, "--gpu-memory-gib", "1", nvidia_smi=str(tmp_path / "none")
    )
    assert no_gpu.returncode == 2 and "Traceback" not in no_gpu.stderr
    assert "applies to GPUs, but cluster local has none" in " ".join(no_gpu.stderr.split())
    with pytest.raises(TesselError, match="has none"):  # a cluster file of CPUs alike
        CliRunner().invoke(
            app, ["plan", "--cluster", "local-cpu", *model, "--gpu-memory-gib", "1"], catch_exceptions=False
        )


def test_probe_writes_a_cluster_that_plan_reads_and_never_overwrites(
    tmp_path, smollm2_shape, monkeypatch
) -> None:
    monkeypatch.setenv("TESSEL_NVIDIA_SMI", str(tmp_path / "no-nvidia-smi"))  # this machine, without GPUs
    out = tmp_path / "cluster.yaml"
    runner = CliRunner()
    result = runner.invoke(app, ["probe", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "localhost-cpu/gpu0" in result.output and "no GPU" in result.output
    plan_path = tmp_path / "plan.json"
    result = runner.invoke(
        app, ["plan", "--cluster", str(out), "--model", str(smollm2_shape), "--json", str(plan_path)]
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(plan_path.read_text())
    assert [(s["device"], s["gpu_type"], s["layer_start"], s["layer_end"]) for s in plan["stages"]] == [
        ("localhost-cpu/gpu0", "cpu", 0, NUM_LAYERS)
    ]
    assert plan["cluster"]["source"] == str(out)

    out.write_text("# mine\n")
    result = runner.invoke(app, ["probe", "--out", str(out)])
    assert isinstance(result.exception, TesselError) and "exists" in str(result.exception)
    assert out.read_text() == "# mine\n"
    result = runner.invoke(app, ["probe", "--out", str(out), "--overwrite"])
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith("# This machine")


def test_a_probed_gpu_file_plans_as_cluster_local(tmp_path, smollm2_shape, monkeypatch) -> None:
    monkeypatch.setenv("TESSEL_NVIDIA_SMI", fake_smi(tmp_path, H100_SMI))
    runner = CliRunner()
    out = tmp_path / "cluster.yaml"
    assert runner.invoke(app, ["probe", "--out", str(out)]).exit_code == 0
    stages = {}
    for cluster in ("local", str(out)):
        plan_path = tmp_path / f"plan-{len(stages)}.json"
        args = ["plan", "--cluster", cluster, "--model", str(smollm2_shape), "--gpu-memory-gib", str(CAP_GIB)]
        result = runner.invoke(app, [*args, "--json", str(plan_path)])
        assert result.exit_code == 0, result.output
        plan = json.loads(plan_path.read_text())
        stages[cluster] = [(s["device"], s["layer_start"], s["layer_end"]) for s in plan["stages"]]
    assert stages["local"] == stages[str(out)] and len(stages["local"]) == 2


def test_memory_gib_in_a_cluster_file_and_the_cap_on_a_mixed_cluster(tmp_path) -> None:
    from tessel.plan.files.cluster import load_cluster

    path = tmp_path / "c.yaml"
    path.write_text("name: c\nnodes:\n  - name: n\n    gpus: {type: H100, count: 1, memory_gib: 0.5}\n")
    with pytest.raises(
        TesselError, match=r"c.yaml:4: nodes\[0\].gpus\[0\]: memory_gib 0.5 is not above the 1 GiB"
    ):
        load_cluster(path)
    mixed = load_cluster("mixed-a100-v100-t4")  # 2x A100-80G, 4x V100-32G, 4x T4
    with pytest.raises(TesselError) as error:
        cap_gpu_memory(mixed, 20.0)
    message = str(error.value)
    assert "T4: 15.00 GiB usable of 16.00 GiB" in message and "A100" not in message and "V100" not in message
    capped = cap_gpu_memory(mixed, 10.0)
    assert {d.spec.usable_bytes for d in capped.devices} == {10 * GIB}
    assert [d.name for d in capped.devices] == [d.name for d in mixed.devices]
