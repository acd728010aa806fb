"""Autotune persistence on CPU: configs written per GPU name and shape, read back by a fresh process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tessel.kernels import autotune
from tessel.kernels.autotune import (
    INT8_GEMM_CONFIGS,
    AutotuneCache,
    Autotuner,
    TileConfig,
    bucket_m,
    cache_dir,
    device_slug,
    launch_tuned,
    shape_key,
)

H100 = "NVIDIA H100 80GB HBM3"
T4 = "Tesla T4"
CONFIGS = INT8_GEMM_CONFIGS[:4]


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TESSEL_AUTOTUNE", raising=False)
    return tmp_path


class FakeBench:
    """Stands in for do_bench: a fixed time per config, counting the calls."""

    def __init__(self, fastest: TileConfig) -> None:
        self.fastest = fastest
        self.calls = 0

    def __call__(self, config: TileConfig) -> float:
        self.calls += 1
        return 0.5 if config == self.fastest else 1.0 + config.block_m / 1000


def test_cache_dir_env_and_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert cache_dir() == tmp_path
    monkeypatch.delenv("TESSEL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "tessel"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "tessel"


def test_device_slug_and_keys() -> None:
    assert device_slug(H100) == "nvidia-h100-80gb-hbm3"
    assert device_slug("  ") == "unknown-device"
    assert shape_key(n=3, m=2) == shape_key(m=2, n=3) == "m=2;n=3"
    assert [bucket_m(m) for m in (1, 16, 17, 100, 256)] == [16, 16, 32, 128, 256]


def test_tile_config_validates_and_roundtrips() -> None:
    config = TileConfig(64, 128, 32, group_m=4, num_warps=8, num_stages=2)
    assert TileConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert config.meta()["BLOCK_N"] == 128 and config.meta()["num_warps"] == 8
    for bad in ((8, 32, 32), (48, 32, 32)):
        with pytest.raises(ValueError):
            TileConfig(*bad)


def test_tuned_config_is_written_and_reloaded_by_a_new_process(tmp_cache: Path) -> None:
    key = shape_key(m=256, n=4096, k=4096)
    bench = FakeBench(fastest=CONFIGS[2])
    first = Autotuner("int8_gemm", CONFIGS, default=CONFIGS[0])
    assert first.pick(key, bench, device=H100) == CONFIGS[2]
    assert bench.calls == len(CONFIGS)

    path = tmp_cache / "autotune" / "nvidia-h100-80gb-hbm3.json"
    data = json.loads(path.read_text())
    assert data["device"] == H100 and data["schema"] == autotune.SCHEMA_VERSION
    assert data["kernels"]["int8_gemm"][key]["config"] == CONFIGS[2].to_dict()
    assert data["kernels"]["int8_gemm"][key]["ms"] == 0.5

    # The same process: memory answers. A new process (new Autotuner): the file answers.
    assert first.pick(key, bench, device=H100) == CONFIGS[2]
    restarted = Autotuner("int8_gemm", CONFIGS, default=CONFIGS[0])
    assert restarted.pick(key, bench, device=H100) == CONFIGS[2]
    assert bench.calls == len(CONFIGS) and restarted.benchmarks_run == 0


def test_entries_are_keyed_by_device_and_shape(tmp_cache: Path) -> None:
    tuner = Autotuner("int8_gemm", CONFIGS, default=CONFIGS[0])
    key = shape_key(m=16, n=64, k=64)
    assert tuner.pick(key, FakeBench(CONFIGS[1]), device=H100) == CONFIGS[1]
    # Another GPU model tunes again into its own file, and may choose differently.
    t4_bench = FakeBench(CONFIGS[3])
    assert tuner.pick(key, t4_bench, device=T4) == CONFIGS[3] and t4_bench.calls == len(CONFIGS)
    # Another shape on the first GPU tunes again too.
    other = FakeBench(CONFIGS[0])
    assert tuner.pick(shape_key(m=32, n=64, k=64), other, device=H100) == CONFIGS[0] and other.calls
    assert sorted(p.name for p in (tmp_cache / "autotune").iterdir()) == [
        "nvidia-h100-80gb-hbm3.json",
        "tesla-t4.json",
    ]
    h100 = AutotuneCache(H100)
    assert h100.get("int8_gemm", key) == CONFIGS[1]
    assert h100.get("int8_gemm", shape_key(m=32, n=64, k=64)) == CONFIGS[0]
    assert h100.get("conv2d", key) is None


def test_writes_merge_with_entries_of_another_process(tmp_cache: Path) -> None:
    one, two = AutotuneCache(H100), AutotuneCache(H100)  # both loaded the (empty) file
    one.put("int8_gemm", "a", CONFIGS[0], 1.0)
    two.put("conv2d", "b", CONFIGS[1], 2.0)
    merged = AutotuneCache(H100)
    assert merged.get("int8_gemm", "a") == CONFIGS[0] and merged.get("conv2d", "b") == CONFIGS[1]


def test_corrupt_or_foreign_file_is_ignored_and_rewritten(tmp_cache: Path) -> None:
    path = tmp_cache / "autotune" / "tesla-t4.json"
    path.parent.mkdir(parents=True)
    path.write_text("{ not json")
    tuner = Autotuner("conv2d", CONFIGS, default=CONFIGS[0])
    with pytest.warns(UserWarning, match="unreadable autotune cache"):
        assert tuner.pick("k", FakeBench(CONFIGS[1]), device=T4) == CONFIGS[1]
    assert json.loads(path.read_text())["kernels"]["conv2d"]["k"]["config"] == CONFIGS[1].to_dict()
    path.write_text(json.dumps({"schema": 999, "kernels": {"conv2d": {"k": {"config": {}}}}}))
    assert AutotuneCache(T4).get("conv2d", "k") is None


def test_configs_that_do_not_fit_are_skipped() -> None:
    class OutOfResources(Exception):  # the name Triton's compiler raises
        pass

    def bench(config: TileConfig) -> float:
        if config.block_m >= 128:
            raise OutOfResources("shared memory")
        return float(config.block_n)

    tuner = Autotuner("int8_gemm", INT8_GEMM_CONFIGS, default=INT8_GEMM_CONFIGS[0])
    best = tuner.pick("k", bench, device=H100)
    assert best.block_m < 128 and best.block_n == min(c.block_n for c in INT8_GEMM_CONFIGS if c.block_m < 128)

    def broken(config: TileConfig) -> float:
        raise RuntimeError("a real bug must not be swallowed")

    with pytest.raises(RuntimeError):
        Autotuner("x", CONFIGS, default=CONFIGS[0]).pick("k", broken, device=H100)


def test_no_benchmark_when_disabled_or_interpreting(monkeypatch: pytest.MonkeyPatch, tmp_cache: Path) -> None:
    tuner = Autotuner("int8_gemm", CONFIGS, default=CONFIGS[3])
    bench = FakeBench(CONFIGS[1])
    assert tuner.pick("k", None) == CONFIGS[3]  # no bench (interpreter): the default
    monkeypatch.setenv("TESSEL_AUTOTUNE", "0")
    assert tuner.pick("k", bench, device=H100) == CONFIGS[3] and bench.calls == 0
    AutotuneCache(H100).put("int8_gemm", "k", CONFIGS[2])  # tuned earlier: still used when disabled
    assert tuner.pick("k", bench, device=H100) == CONFIGS[2] and bench.calls == 0


def test_launch_tuned_on_cpu_uses_the_default_without_benchmarking(tmp_cache: Path) -> None:
    tuner = Autotuner("int8_gemm", CONFIGS, default=CONFIGS[1])
    launched: list[TileConfig] = []
    chosen = launch_tuned(tuner, "k", torch.zeros(1), launched.append)
    assert chosen == CONFIGS[1] and launched == [CONFIGS[1]]
    assert not (tmp_cache / "autotune").exists()
