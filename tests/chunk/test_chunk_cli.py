"""`tessel chunk` and `tessel profile` from the command line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tessel.cli import app

runner = CliRunner()


def _plan_file(tmp_path) -> str:
    stages, start = [], 0
    for index, (gpu, end) in enumerate([("A100-80G", 40), ("V100-32G", 60), ("V100-32G", 80)]):
        link = None if index == 2 else {"bandwidth_gbps": 25.0, "latency_us": 20.0}
        stages.append(
            {
                "index": index,
                "device": f"d{index}",
                "gpu_type": gpu,
                "unit_start": start,
                "unit_end": end,
                "layer_start": start,
                "layer_end": end,
                "link_to_next": link,
            }
        )
        start = end
    path = tmp_path / "plan.json"
    document = {
        "version": 1,
        "model": {"name": "llama-3-70b"},
        "cluster": {"name": "hand"},
        "dtype": "fp16",
        "kv_dtype": "fp16",
        "granularity": "layer",
        "stages": stages,
    }
    path.write_text(json.dumps(document))
    return str(path)


def test_chunk_from_plan_writes_json(tmp_path) -> None:
    out = tmp_path / "chunks.json"
    result = runner.invoke(
        app, ["chunk", "--plan", _plan_file(tmp_path), "--seq-len", "8192", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert sum(data["chunks"]) == 8192 and data["ttft_s"] > 0 and 0 <= data["bubble_fraction"] < 1
    assert 0 < data["lower_bound_s"] <= data["ttft_s"]
    for name, base in data["baselines"].items():
        assert sum(base["chunks"]) == 8192
        assert data["ttft_s"] <= base["ttft_s"] * (1 + 1e-12), name
    assert "CPP speedup" in result.output


def test_chunk_with_model_and_cluster_and_a_batch(tmp_path) -> None:
    out = tmp_path / "chunks.json"
    args = ["chunk", "--model", "llama-3-8b", "--cluster", "mixed-a100-v100-t4", "--stages", "3"]
    args += ["--seq-len", "3000,1000", "--grid", "32", "--max-chunk-tokens", "1024", "--json", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert sum(data["chunks"]) == 4000 and max(data["chunks"]) <= 1024
    assert len(data["request_ttft_s"]) == 2 and len(data["stages"]) == 3


@pytest.mark.parametrize(
    "args,message",
    [
        (["chunk", "--seq-len", "100"], "--plan"),
        (["chunk", "--model", "llama-3-8b", "--seq-len", "abc"], "--seq-len"),
        (
            ["chunk", "--model", "llama-3-8b", "--seq-len", "4096", "--max-chunk-tokens", "10"],
            "max chunk tokens",
        ),
        (["chunk", "--plan", "/nonexistent/plan.json", "--seq-len", "100"], "does not exist"),
        (["profile", "--device", "cuda", "--tiny-shape", "64,128,4,2"], "CUDA"),
    ],
)
def test_user_errors(args: list[str], message: str) -> None:
    """A TesselError from the work, or a usage error (exit 2) from typer's own checks of the options."""
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    if isinstance(result.exception, SystemExit):
        assert result.exit_code == 2 and message in result.output
    else:
        assert message in str(result.exception)


def test_profile_command_writes_a_profile(tmp_path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "p.json"
    args = [
        "profile",
        "--tiny-shape",
        "64,128,4,2",
        "--budget-s",
        "1",
        "--max-chunk",
        "64",
        "--max-offset",
        "256",
    ]
    result = runner.invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["device_type"] == "cpu" and data["model_shape"]["hidden_size"] == 64
    assert "held-out" in result.output


def test_profile_feeds_the_chunk_planner(tmp_path) -> None:
    """A profile for the model's exact shape on `cpu` makes the stage times the fit's, end to end."""
    from tessel.cost.profile import DecodeFit, PrefillFit, Profile

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 6,
        "vocab_size": 1000,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
    fit = PrefillFit(a0=2e-3, a1=1e-5, a2=1e-8, a3=4e-8)
    Profile("cpu", shape, "fp32", fit, DecodeFit(1e-3, 1e-5, 1e-8), 0.05).save(tmp_path / "p.json")
    out = tmp_path / "c.json"
    args = [
        "chunk",
        "--model",
        str(tmp_path),
        "--cluster",
        "local-cpu",
        "--dtype",
        "fp32",
        "--seq-len",
        "2048",
    ]
    args += ["--grid", "128", "--profile", str(tmp_path / "p.json"), "--json", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert sum(data["chunks"]) == 2048 and len(data["stages"]) == 2
    # the stages the command priced are the fit's: 3 layers each (+ embedding on the first)
    from tessel.catalog.models import load_model
    from tessel.chunk.from_plan import even_split_pipeline
    from tessel.chunk.schedule import evaluate_chunks
    from tessel.cost.profile import load_profile
    from tessel.plan.files.cluster import load_cluster

    priced = even_split_pipeline(
        load_model(str(tmp_path)),
        load_cluster("local-cpu"),
        dtype="fp32",
        profiles=[load_profile(tmp_path / "p.json")],
    )
    last = priced.pipeline.stages[1]
    for c, p in ((128, 0), (384, 1024), (2048, 0)):
        assert last.prefill_time_s(c, p) == pytest.approx(3 * fit.time_s(c, p), rel=1e-12)
    again = evaluate_chunks(priced.pipeline, data["chunks"], tail_s=priced.tail_s)
    assert data["ttft_s"] == pytest.approx(again.ttft_s, rel=1e-12)
