"""tune_linears: which layers a warm-up tunes, at which row buckets (the CUDA path, run here on the
Triton interpreter, where the tuner picks its default instead of benchmarking)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessel.errors import TesselError
from tessel.kernels import autotune
from tessel.kernels.autotune import bucket_m
from tessel.layers.linear import (
    Linear,
    W8A8Linear,
    W8A16Linear,
    packed_linear,
    quantize_int8_weight,
    tune_linears,
    tune_rows,
    tuned_kernel,
)


def int8_layer(cls, n: int, k: int, bias: bool = False):
    weight, scale = quantize_int8_weight(torch.randn(n, k))
    return cls(weight, scale, torch.randn(n) if bias else None)


def float_layer(n: int, k: int) -> Linear:
    return Linear.from_linear(nn.Linear(k, n))


@pytest.mark.parametrize("max_rows", [1, 15, 16, 17, 32, 33, 100, 512, 2048, 2049])
def test_tune_rows_are_the_buckets_of_every_row_count(max_rows: int) -> None:
    """Brute force: the buckets of 1..max_rows rows, each once, in increasing order."""
    expected = sorted({bucket_m(rows) for rows in range(1, max_rows + 1)})
    assert tune_rows(max_rows) == expected


def test_tune_rows_wants_a_row() -> None:
    with pytest.raises(TesselError, match="max_rows >= 1"):
        tune_rows(0)


def test_tuned_kernel_follows_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSEL_KERNEL_BACKEND", "torch")  # paths are chosen at construction
    cpu = [int8_layer(W8A8Linear, 8, 16), int8_layer(W8A16Linear, 8, 16), float_layer(8, 16)]
    packed = packed_linear(torch.randn(8, 16), None)
    assert [tuned_kernel(m) for m in (*cpu, packed, nn.Linear(16, 8))] == [None] * 5
    monkeypatch.setenv("TESSEL_KERNEL_BACKEND", "triton")
    gpu = [int8_layer(W8A8Linear, 8, 16), int8_layer(W8A16Linear, 8, 16), float_layer(8, 16)]
    assert [tuned_kernel(m) for m in gpu] == ["int8_gemm", "w8a16_gemm", "linear"]
    meta = W8A8Linear(torch.zeros(8, 16, dtype=torch.int8, device="meta"), torch.ones(8, device="meta"))
    assert tuned_kernel(meta) is None


def test_tune_linears_runs_each_shape_once_per_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSEL_KERNEL_BACKEND", "torch")
    cpu_layer = int8_layer(W8A8Linear, 24, 40)  # a CPU path: never tuned
    monkeypatch.setenv("TESSEL_KERNEL_BACKEND", "triton")
    model = nn.ModuleDict(
        {
            "a": int8_layer(W8A8Linear, 24, 40),
            "b": int8_layer(W8A8Linear, 24, 40),  # the same GEMM as "a": tuned once
            "c": int8_layer(W8A8Linear, 24, 40, bias=True),  # a bias is another key
            "d": int8_layer(W8A16Linear, 40, 24),
            "e": float_layer(16, 24),
            "on_cpu": cpu_layer,
        }
    )
    picked: list[tuple[str, str]] = []
    real_pick = autotune.Autotuner.pick

    def recording_pick(self, key, bench, device="cpu"):
        picked.append((self.kernel, key))
        return real_pick(self, key, bench, device)

    monkeypatch.setattr(autotune.Autotuner, "pick", recording_pick)
    calls: dict[str, int] = {}
    for name, layer in model.items():
        layer.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))

    tuned = tune_linears(model, max_rows=40, dtype=torch.float32)

    assert tuned == [
        ("int8_gemm", 24, 40, False),
        ("int8_gemm", 24, 40, True),
        ("w8a16_gemm", 40, 24, False),
        ("linear", 16, 24, True),
    ]
    assert calls == {"a": 3, "c": 3, "d": 3, "e": 3}  # rows 16, 32, 64
    keys = {kernel: sorted({k for name, k in picked if name == kernel}) for kernel, _ in picked}
    ms = {kernel: sorted({int(part[2:]) for k in ks for part in k.split(";") if part.startswith("m=")})
          for kernel, ks in keys.items()}  # fmt: skip
    assert ms == {"int8_gemm": [16, 32, 64], "w8a16_gemm": [16, 32, 64], "linear": [16, 32, 64]}
    assert len(keys["int8_gemm"]) == 6  # two GEMMs (with and without bias) x three buckets
    assert all("out=float32" in k for k in keys["int8_gemm"])  # the activation dtype is in the keys
    assert all("x=float32" in k for k in keys["linear"])
