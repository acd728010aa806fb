"""Autotune persistence on CPU: configs written per GPU name and shape, read back by a fresh process."""

from __future__ import annotations

import json
import os
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


def test_unwritable_cache_warns_but_still_picks(monkeypatch: pytest.MonkeyPatch, tmp_cache: Path) -> None:
    blocker = tmp_cache / "not-a-dir"
    blocker.write_text("a file where the cache directory should go")
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(blocker))
    tuner = Autotuner("int8_gemm", CONFIGS, default=CONFIGS[0])
    with pytest.warns(UserWarning, match="could not write autotune cache"):
        assert tuner.pick("k", FakeBench(CONFIGS[2]), device=H100) == CONFIGS[2]
    assert tuner.pick("k", FakeBench(CONFIGS[1]), device=H100) == CONFIGS[2]  # still remembered in memory


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


def test_tuning_totals_count_benchmarks_not_memory_hits(tmp_cache: Path) -> None:
    """A benchmark compares two readings of `tuning_totals`: only a shape key's benchmark adds to them."""
    tuner = Autotuner("tuning_totals_test", CONFIGS, default=CONFIGS[0])
    before = autotune.tuning_totals()["tuning_totals_test"]
    tuner.pick("k", FakeBench(CONFIGS[1]), device=H100)
    after_tuning = autotune.tuning_totals()["tuning_totals_test"]
    tuner.pick("k", FakeBench(CONFIGS[2]), device=H100)  # memory answers
    Autotuner("tuning_totals_test", CONFIGS, default=CONFIGS[0]).pick("k", FakeBench(CONFIGS[2]), device=H100)
    after_hits = autotune.tuning_totals()["tuning_totals_test"]
    assert after_tuning.benchmarks == before.benchmarks + 1 and after_tuning.seconds >= before.seconds
    assert after_hits == after_tuning


def test_cuda_bench_runs_each_candidate_briefly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The candidates' timing is short (TUNE_WARMUP_MS / TUNE_REP_MS of GPU time), not do_bench's default."""
    triton_testing = pytest.importorskip("triton.testing")
    seen: list[dict] = []

    def fake_do_bench(fn, **options):
        fn()
        seen.append(options)
        return 0.25

    monkeypatch.setattr(triton_testing, "do_bench", fake_do_bench)
    launched: list[TileConfig] = []
    assert autotune.cuda_bench(launched.append)(CONFIGS[0]) == 0.25
    assert launched == [CONFIGS[0]]
    assert seen == [{"warmup": autotune.TUNE_WARMUP_MS, "rep": autotune.TUNE_REP_MS, "return_mode": "median"}]
    assert autotune.TUNE_REP_MS <= 5  # a key's candidates then take a tenth of a second or less


def test_gemm_kernel_is_not_specialised_on_the_rows() -> None:
    """A compiled `_gemm_kernel` takes any M without a new compile (Triton specialises ints on == 1
    and on multiples of 16 unless told not to); checked on the JIT function, outside the interpreter."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    script = "from tessel.kernels.gemm import _gemm_kernel as k; print(list(k.do_not_specialize))"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "['M']"


# ---- the kernels compile for real GPUs (Triton's CUDA backend runs on this CPU-only machine) ----

_COMPILE_SCRIPT = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

arch = int(sys.argv[1])
I32 = "i32"
TILE = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8)


def compile_kernel(module, name, pointers, constexprs):
    fn = getattr(importlib.import_module(module), name)
    signature = {a: "constexpr" if a in constexprs else pointers.get(a, I32) for a in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4, "num_stages": 2})


cases = {
    "int8_gemm": ("tessel.kernels.gemm", "_gemm_kernel",
                  dict(A_ptr="*i8", W_ptr="*i8", Out_ptr="*fp16", A_scale_ptr="*fp32", W_scale_ptr="*fp32",
                       Bias_ptr="*fp32"),
                  dict(HAS_A_SCALE=True, HAS_W_SCALE=True, HAS_BIAS=True,
                       DOT="int8" if arch >= 80 else "int8_as_fp16", **TILE)),
    "w8a16_gemm bf16": ("tessel.kernels.gemm", "_gemm_kernel",
                        dict(A_ptr="*bf16", W_ptr="*i8", Out_ptr="*bf16", A_scale_ptr="*fp32",
                             W_scale_ptr="*fp32", Bias_ptr="*fp32"),
                        dict(HAS_A_SCALE=False, HAS_W_SCALE=True, HAS_BIAS=True, DOT="native", **TILE)),
    "linear fp32": ("tessel.kernels.gemm", "_gemm_kernel",
                    dict(A_ptr="*fp32", W_ptr="*fp32", Out_ptr="*fp32", A_scale_ptr="*fp32",
                         W_scale_ptr="*fp32", Bias_ptr="*fp32"),
                    dict(HAS_A_SCALE=False, HAS_W_SCALE=False, HAS_BIAS=True, DOT="fp32", **TILE)),
    "quantize_per_token": ("tessel.kernels.quantize_rows", "_quantize_per_token_kernel",
                           dict(X_ptr="*fp16", Q_ptr="*i8", Scale_ptr="*fp32"),
                           dict(SINGLE_PASS=True, BLOCK_K=1024)),
    "transpose": ("tessel.kernels.transpose", "_transpose_kernel",
                  dict(X_ptr="*fp16", Out_ptr="*fp16"), dict(BLOCK_M=64, BLOCK_N=64)),
    "conv2d": ("tessel.kernels.conv2d", "_conv2d_kernel",
               dict(X_ptr="*fp16", W_ptr="*fp16", Out_ptr="*fp16", Bias_ptr="*fp16"),
               dict(KH=3, KW=3, HAS_BIAS=True, DOT="native", **TILE)),
}
results = {}
for name in sys.argv[2].split(","):
    module, kernel, pointers, constexprs = cases[name]
    try:
        compile_kernel(module, kernel, pointers, constexprs)
        results[name] = "ok"
    except Exception as err:
        results[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
print(json.dumps(results))
"""

ALL_KERNELS = "int8_gemm,w8a16_gemm bf16,linear fp32,quantize_per_token,transpose,conv2d"


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,kernels",
    [(90, ALL_KERNELS), (80, ALL_KERNELS), (75, "int8_gemm")],  # sm_75 (T4): the fp16 fallback of int8_gemm
    ids=["sm_90", "sm_80", "sm_75"],
)
def test_kernels_compile_to_cubin_for_cuda(arch: int, kernels: str) -> None:
    """Compile every kernel (Triton -> PTX -> cubin with the bundled ptxas) for a GPU target.

    No GPU is needed to compile, so type errors that the interpreter forgives (say, an op that
    does not broadcast) fail here. Running the cubins still needs a GPU: see benchmarks/kernels.py.
    """
    pytest.importorskip("triton")
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT, str(arch), kernels], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results == {name: "ok" for name in kernels.split(",")}
