"""Tile configurations for the GEMM and conv kernels, tuned once per GPU and shape, kept on disk.

A kernel launch asks `Autotuner.pick(key, bench)` for a `TileConfig`. The answer comes from, in order:
1. this process's memory;
2. the JSON file of this GPU: `<cache dir>/autotune/<gpu-name>.json`, where the cache dir is
   `$TESSEL_CACHE_DIR`, else `$XDG_CACHE_HOME/tessel`, else `~/.cache/tessel`;
3. a benchmark of every candidate with `triton.testing.do_bench` (CUDA only), the fastest of which
   is written back to that file, so the next process that meets the same shape skips the benchmark;
4. the default config, when benchmarking is not possible (Triton interpreter, `TESSEL_AUTOTUNE=0`).

A benchmark runs on the call that first meets a shape key, so a server that first meets a row count
mid-request stalls that request for it: warm-ups tune the row counts they can foresee
(`tessel.layers.linear.tune_linears`), and every tuner counts its benchmarks and their seconds
(`tuning_totals()`), so a benchmark can tell tuning from running.

This does what `triton.autotune(configs, key)` does, but owns its cache: Triton's own
`cache_results` keys files by compiler hash under `~/.triton`, while a cluster of different GPUs
wants one readable file per GPU model that can be shipped with a deployment.
"""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CACHE_DIR_ENV = "TESSEL_CACHE_DIR"
AUTOTUNE_ENV = "TESSEL_AUTOTUNE"
SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class TileConfig:
    """One launch configuration of a tiled GEMM-like kernel (the meta-parameters of a triton.Config)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            # tl.dot needs every block side >= 16 and a power of two.
            if value < 16 or value & (value - 1):
                raise ValueError(f"TileConfig.{name}={value} must be a power of two >= 16")
        if self.group_m < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"TileConfig has a non-positive field: {self}")

    def meta(self) -> dict[str, int]:
        """Keyword arguments for a kernel launch: the constexpr block sizes plus warps and stages."""
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "GROUP_M": self.group_m,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TileConfig:
        return cls(**{name: int(data[name]) for name in cls.__dataclass_fields__ if name in data})


def _c(bm: int, bn: int, bk: int, warps: int, stages: int) -> TileConfig:
    return TileConfig(bm, bn, bk, group_m=8, num_warps=warps, num_stages=stages)


# Decode-step tiles (few rows: the weight's bytes are the cost): narrow column tiles, so that a
# 2048-column weight still spreads over more programs than an H100/H200 has SMs, and deep K tiles
# with more stages in flight. Added after the tutorial lists proved too wide for Llama-1B's
# decoder linears at 1 and 32 rows on an H200 (`benchmarks/cuda_linear.py --parts tiles`: each of
# these won some of those shapes; W8A16's 8192 -> 2048 down projection most).
FLOAT_DECODE_TILES: tuple[TileConfig, ...] = (
    _c(16, 32, 256, 4, 4),
    _c(16, 32, 128, 4, 4),
    _c(16, 16, 128, 2, 5),
    _c(16, 64, 256, 4, 3),
    _c(32, 64, 128, 4, 4),
)
INT8_DECODE_TILES: tuple[TileConfig, ...] = (
    _c(16, 64, 256, 4, 5),
    _c(16, 32, 256, 4, 5),
    _c(16, 16, 256, 2, 5),
)

# fp16/bf16 GEMM candidates: the Triton matmul tutorial's CUDA list, two small-M tiles, and the
# decode tiles. A tile that does not fit a GPU (shared memory, registers) is skipped by the tuner.
FLOAT_GEMM_CONFIGS: tuple[TileConfig, ...] = (
    _c(128, 256, 64, 8, 3),
    _c(64, 256, 32, 4, 4),
    _c(128, 128, 32, 4, 4),
    _c(128, 64, 32, 4, 4),
    _c(64, 128, 32, 4, 4),
    _c(128, 32, 32, 4, 4),
    _c(64, 32, 32, 2, 5),
    _c(32, 64, 32, 2, 5),
    _c(16, 64, 128, 4, 4),
    _c(16, 128, 64, 4, 4),
    *FLOAT_DECODE_TILES,
)

# int8 GEMM candidates: the tutorial's int8 list (deeper K tiles: an int8 element is half the
# bytes), and the decode tiles.
INT8_GEMM_CONFIGS: tuple[TileConfig, ...] = (
    _c(128, 256, 128, 8, 3),
    _c(256, 128, 128, 8, 3),
    _c(256, 64, 128, 4, 4),
    _c(64, 256, 128, 4, 4),
    _c(128, 128, 128, 4, 4),
    _c(128, 64, 64, 4, 4),
    _c(64, 128, 64, 4, 4),
    _c(128, 32, 64, 4, 4),
    _c(32, 64, 128, 4, 4),
    _c(16, 64, 256, 4, 4),
    _c(16, 128, 128, 4, 4),
    *INT8_DECODE_TILES,
)

# conv2d as implicit GEMM: K = C*KH*KW is usually small, so the K tiles are shallow.
CONV_CONFIGS: tuple[TileConfig, ...] = (
    _c(128, 128, 32, 4, 3),
    _c(128, 64, 32, 4, 4),
    _c(64, 128, 32, 4, 4),
    _c(64, 64, 32, 4, 4),
    _c(128, 32, 32, 4, 4),
    _c(32, 64, 32, 2, 4),
    _c(64, 32, 16, 2, 4),
)

# Under the Triton interpreter every tile runs as numpy on the CPU: small tiles keep tests quick.
INTERPRETER_CONFIG = TileConfig(32, 32, 32, group_m=4, num_warps=4, num_stages=1)


def cache_dir() -> Path:
    """tessel's cache root: $TESSEL_CACHE_DIR, else $XDG_CACHE_HOME/tessel, else ~/.cache/tessel."""
    override = os.environ.get(CACHE_DIR_ENV, "").strip()
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tessel"


def device_slug(device_name: str) -> str:
    """A file-name-safe form of a GPU name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.strip().lower()).strip("-")
    return slug or "unknown-device"


def device_name(device: Any = None) -> str:
    """The name configs are keyed by: the CUDA device's marketing name, else 'cpu'."""
    import torch

    if device is not None and torch.device(device).type != "cuda":
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    index = torch.device(device).index if device is not None else None
    return _cuda_device_name(torch.cuda.current_device() if index is None else index)


@functools.cache
def _cuda_device_name(index: int) -> str:
    import torch

    return torch.cuda.get_device_name(index)


def shape_key(**fields: Any) -> str:
    """A stable text key for one problem shape, e.g. shape_key(m=256, n=4096) -> 'm=256;n=4096'."""
    return ";".join(f"{name}={fields[name]}" for name in sorted(fields))


def bucket_m(m: int) -> int:
    """Round a row count up to a power of two (min 16): decode batches of 3 and 5 share one tuning."""
    return max(16, 1 << (max(m, 1) - 1).bit_length())


class AutotuneCache:
    """The tuned configs of one GPU model, mirrored to `<cache dir>/autotune/<gpu-slug>.json`.

    File layout: {"schema": 1, "device": name, "kernels": {kernel: {shape key: {"config": {...},
    "ms": best time}}}}. Writes merge with what is on disk and replace the file atomically, so two
    processes tuning different shapes do not lose each other's entries.
    """

    def __init__(self, device_name: str, directory: Path | None = None) -> None:
        self.device_name = device_name
        self.path = (directory or cache_dir() / "autotune") / f"{device_slug(device_name)}.json"
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, dict[str, Any]]] = self._read()

    def _read(self) -> dict[str, dict[str, dict[str, Any]]]:
        try:
            data = json.loads(self.path.read_text())
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except (OSError, ValueError) as err:
            warnings.warn(f"ignoring unreadable autotune cache {self.path}: {err}", stacklevel=3)
            return {}
        if not isinstance(data, dict) or data.get("schema") != SCHEMA_VERSION:
            return {}
        kernels = data.get("kernels", {})
        return kernels if isinstance(kernels, dict) else {}

    def get(self, kernel: str, key: str) -> TileConfig | None:
        """The stored config, re-reading the file on a miss (another process may have tuned it since)."""
        entry = self._entries.get(kernel, {}).get(key)
        if entry is None:
            with self._lock:
                self._merge_from_disk()
            entry = self._entries.get(kernel, {}).get(key)
        if entry is None:
            return None
        try:
            return TileConfig.from_dict(entry["config"])
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, kernel: str, key: str, config: TileConfig, ms: float | None = None) -> None:
        """Record a tuned config and write the file (merged with entries other processes wrote)."""
        with self._lock:
            self._merge_from_disk()
            self._entries.setdefault(kernel, {})[key] = {"config": config.to_dict(), "ms": ms}
            self._write()

    def _merge_from_disk(self) -> None:
        merged = self._read()
        for name, entries in self._entries.items():
            merged.setdefault(name, {}).update(entries)
        self._entries = merged

    def _write(self) -> None:
        payload = {"schema": SCHEMA_VERSION, "device": self.device_name, "kernels": self._entries}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as handle:
                json.dump(payload, handle, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as err:  # a read-only home must not break inference
            warnings.warn(f"could not write autotune cache {self.path}: {err}", stacklevel=3)


def autotune_enabled() -> bool:
    return os.environ.get(AUTOTUNE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


_ALL_TUNERS: list[Autotuner] = []  # every tuner made (one per kernel module), for `tuning_totals`


class Autotuner:
    """Picks the fastest of `configs` for one kernel, per shape key, remembering the choice on disk."""

    def __init__(self, kernel: str, configs: tuple[TileConfig, ...], default: TileConfig) -> None:
        if not configs:
            raise ValueError(f"Autotuner({kernel!r}) needs at least one config")
        self.kernel = kernel
        self.configs = configs
        self.default = default
        self._memory: dict[tuple[str, str], TileConfig] = {}
        self._caches: dict[str, AutotuneCache] = {}
        self.benchmarks_run = 0  # shape keys benchmarked (each times every candidate)
        self.tune_s = 0.0  # wall seconds those benchmarks took (compiling the candidates included)
        _ALL_TUNERS.append(self)

    def cache_for(self, device: str) -> AutotuneCache:
        directory = cache_dir() / "autotune"
        cache = self._caches.get(device)
        if cache is None or cache.path.parent != directory:
            cache = self._caches[device] = AutotuneCache(device, directory)
        return cache

    def pick(
        self,
        key: str,
        bench: Callable[[TileConfig], float] | None,
        device: str = "cpu",
    ) -> TileConfig:
        """The config for `key` on `device`; `bench(config)` -> milliseconds, or None to skip tuning."""
        found = self._memory.get((device, key))
        if found is not None:
            return found
        if bench is None or not autotune_enabled():
            cached = self.cache_for(device).get(self.kernel, key) if bench is not None else None
            return cached or self.default
        cache = self.cache_for(device)
        found = cache.get(self.kernel, key)
        if found is None:
            found, best_ms = self._benchmark(bench)
            cache.put(self.kernel, key, found, best_ms)
        self._memory[(device, key)] = found
        return found

    def _benchmark(self, bench: Callable[[TileConfig], float]) -> tuple[TileConfig, float | None]:
        self.benchmarks_run += 1
        timings: dict[TileConfig, float] = {}
        start = time.perf_counter()
        try:
            for config in self.configs:
                try:
                    timings[config] = float(bench(config))
                except Exception as err:  # out of shared memory or registers: skip that config
                    if type(err).__name__ not in ("OutOfResources", "PTXASError", "CompilationError"):
                        raise
        finally:
            self.tune_s += time.perf_counter() - start
        if not timings:
            return self.default, None
        best = min(timings, key=timings.__getitem__)
        return best, timings[best]


@dataclass(frozen=True, slots=True)
class TuningTotals:
    """What one tuner has spent: shape keys benchmarked and their wall seconds."""

    benchmarks: int
    seconds: float


def tuning_totals() -> dict[str, TuningTotals]:
    """kernel -> benchmarks and seconds so far in this process, summed over that kernel's tuners (a
    benchmark compares two readings: a difference during a timed run is tuning, not running)."""
    totals: dict[str, TuningTotals] = {}
    for tuner in _ALL_TUNERS:
        seen = totals.get(tuner.kernel, TuningTotals(0, 0.0))
        benchmarks, seconds = seen.benchmarks + tuner.benchmarks_run, seen.seconds + tuner.tune_s
        totals[tuner.kernel] = TuningTotals(benchmarks, seconds)
    return totals


# How long `cuda_bench` runs each candidate: triton.testing.do_bench's `warmup` and `rep`, in ms of
# GPU time (each timed run clears the L2 cache first). With the 5 / 25 ms used before, one shape
# key of the int8 GEMM cost its 11 candidates then x ~30 ms by do_bench's own sizing, about a third of a
# second, paid by the request that first meets the key (issue 29: the 32-request benchmark of the
# W8A8 engine on Llama-3.2-1B shapes met a new prefill row count, 512, in its timed run). A decode
# step's GEMMs take microseconds (tens of runs in 3 ms), a prefill's up to about a millisecond (a
# few runs): enough to rank tiles that differ by tens of percent.
TUNE_WARMUP_MS = 1
TUNE_REP_MS = 3


def cuda_bench(launch: Callable[[TileConfig], object]) -> Callable[[TileConfig], float]:
    """A `bench` for `Autotuner.pick` that times `launch(config)` with triton.testing.do_bench (ms)."""
    import triton.testing

    def bench(config: TileConfig) -> float:
        return triton.testing.do_bench(
            lambda: launch(config), warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS, return_mode="median"
        )

    return bench


def launch_tuned(
    tuner: Autotuner, key: str, tensor: Any, launch: Callable[[TileConfig], object]
) -> TileConfig:
    """Launch a kernel with the config `tuner` picks for `key` (benchmarking on CUDA when unknown)."""
    from tessel.kernels._utils import interpreting

    if interpreting() or not tensor.is_cuda:
        config = tuner.pick(key, None)
    else:
        config = tuner.pick(key, cuda_bench(launch), device_name(tensor.device))
    launch(config)
    return config
