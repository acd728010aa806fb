"""GPU catalog: every entry complete and consistent with its datasheet figures."""

from __future__ import annotations

import pytest

from tessel.catalog import DTYPES, get_gpu, known_gpus
from tessel.errors import TesselError

REQUIRED = (
    "T4",
    "L4",
    "V100-16G",
    "V100-32G",
    "A10",
    "A100-40G",
    "A100-80G",
    "H100",
    "H200",
    "RTX-4090",
    "cpu",
)


def test_required_gpus_are_present() -> None:
    assert set(REQUIRED) <= set(known_gpus())


@pytest.mark.parametrize("name", REQUIRED)
def test_entries_are_complete_and_sourced(name: str) -> None:
    spec = get_gpu(name)
    assert spec.name == name
    assert set(spec.peak_flops_per_s) == set(DTYPES)
    assert spec.sources and all(spec.sources)
    assert 0 < spec.reserved_bytes < spec.memory_bytes
    assert spec.usable_bytes == spec.memory_bytes - spec.reserved_bytes
    # Tensor-core fp16 is never slower than fp32, and int8 never slower than fp16 except where
    # the GPU lacks int8 tensor cores (V100: DP4A).
    assert spec.peak_flops_per_s["fp16"] >= spec.peak_flops_per_s["fp32"]
    if not name.startswith("V100"):
        assert spec.peak_flops_per_s["int8"] >= spec.peak_flops_per_s["fp16"]


def test_datasheet_figures_in_bytes_and_flops() -> None:
    a100 = get_gpu("A100-80G")
    assert a100.memory_bytes == 80 * 1024**3
    assert a100.peak_flops_per_s["fp16"] == pytest.approx(312e12)
    assert a100.mem_bandwidth_bytes_per_s == pytest.approx(2039e9)
    assert a100.nvlink_bytes_per_s == pytest.approx(300e9)
    t4 = get_gpu("T4")
    assert t4.nvlink_bytes_per_s is None
    assert t4.pcie_h2d_bytes_per_s == pytest.approx(12.9e9)
    assert t4.pcie_d2h_bytes_per_s < t4.pcie_h2d_bytes_per_s  # FlexGen's asymmetry
    h100 = get_gpu("H100")
    assert h100.peak_flops_per_s["int8"] == pytest.approx(2 * h100.peak_flops_per_s["fp16"])


def test_names_are_case_insensitive() -> None:
    assert get_gpu("a100-80g") is get_gpu("A100-80G")
    assert get_gpu(" rtx-4090 ").name == "RTX-4090"
    assert get_gpu("CPU").name == "cpu"


def test_unknown_gpu_lists_known_ones() -> None:
    with pytest.raises(TesselError) as info:
        get_gpu("B200-ish")
    message = str(info.value)
    assert "B200-ish" in message
    assert all(name in message for name in REQUIRED)


def test_unknown_dtype_is_a_user_error() -> None:
    with pytest.raises(TesselError, match="fp8"):
        get_gpu("H100").peak_flops("fp8")


def test_specs_are_hashable_cache_keys() -> None:
    specs = {get_gpu(name): name for name in REQUIRED}
    assert specs[get_gpu("h100")] == "H100"
