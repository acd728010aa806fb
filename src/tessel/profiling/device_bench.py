"""Measured speeds of this machine's devices, for `tessel probe --json`.

    speeds = measure_device("cpu")                    # the CPU's GEMM FLOP/s and memory bandwidth
    speeds = measure_device("cuda:0", peers=[1])      # + host<->device and device-to-device copies

Per device:
- GEMM: `torch.matmul` of two n x n matrices, 2*n^3 FLOPs per run (fp32 on CPU, fp16 on CUDA);
- memory bandwidth: `dst.copy_(src)` of a large buffer, reading and writing it (2 x its bytes);
  `measure_read_gbs` alone: a buffer summed, each byte read once (what streaming weights needs);
- host-to-device / device-to-host (CUDA): a pinned host buffer copied in and out;
- device-to-device (CUDA): a buffer copied to each peer GPU (NVLink or PCIe peer-to-peer).
Each figure is the best of `repeats` timed runs after `warmup` untimed ones, timed with the clock
`tessel profile` uses (`tessel.profiling.layer.make_clock`: CUDA events on a GPU, wall time on CPU),
best rather than median because a shared machine only ever slows a run down.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from tessel.errors import TesselError
from tessel.profiling.timing import make_clock, time_runs

GB = 1e9
TERA = 1e12
MIB = 2**20


@dataclass(frozen=True, slots=True)
class BenchSettings:
    gemm_size: int  # n of the n x n x n GEMM
    gemm_dtype: str  # torch dtype name
    copy_bytes: int  # buffer of the memory-bandwidth copy
    transfer_bytes: int  # buffer of host<->device and device<->device copies
    warmup: int = 1
    repeats: int = 5

    def __post_init__(self) -> None:
        if min(self.gemm_size, self.copy_bytes, self.transfer_bytes, self.repeats) <= 0 or self.warmup < 0:
            raise TesselError("benchmark sizes and repeats must be positive")


# CPU: a 1024^3 GEMM is ~2 GFLOP (a few ms on a laptop core) and 64 MiB is past any L3 cache.
CPU_SETTINGS = BenchSettings(
    gemm_size=1024, gemm_dtype="float32", copy_bytes=64 * MIB, transfer_bytes=64 * MIB
)
# CUDA: an 8192^3 fp16 GEMM (1.1 TFLOP) fills an H100; 1 GiB copies are past its 50 MB L2; 256 MiB
# transfers reach PCIe and NVLink steady state (NVIDIA's bandwidthTest uses 32 MiB and up).
CUDA_SETTINGS = BenchSettings(
    gemm_size=8192, gemm_dtype="float16", copy_bytes=1024 * MIB, transfer_bytes=256 * MIB, repeats=10
)


@dataclass(frozen=True, slots=True)
class DeviceSpeeds:
    device: str  # "cpu" or "cuda:K"
    gemm_tflops: float  # measured dense GEMM TFLOP/s in `gemm_dtype`
    gemm_dtype: str
    memory_gbs: float  # copy bandwidth, GB/s (bytes read + written)
    h2d_gbs: float | None = None  # pinned host -> this device
    d2h_gbs: float | None = None  # this device -> pinned host
    peer_gbs: dict[str, float] = field(default_factory=dict)  # "cuda:J" -> GB/s from this device
    settings: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def settings_for(device: str) -> BenchSettings:
    """The default sizes for a device string ("cpu", "cuda", "cuda:K")."""
    kind = device_kind(device)
    return CPU_SETTINGS if kind == "cpu" else CUDA_SETTINGS


def device_kind(device: str) -> str:
    """ "cpu" or "cuda" of a device string; anything else is refused."""
    head, _, index = device.partition(":")
    if head == "cpu" and not index:
        return "cpu"
    if head == "cuda" and (not index or index.isdigit()):
        return "cuda"
    raise TesselError(f"device {device!r}: use cpu, cuda or cuda:<index>")


def gemm_flops(n: int) -> float:
    """FLOPs of an n x n by n x n matrix product: n^2 dot products of n multiply-adds."""
    return 2.0 * n**3


def measure_device(
    device: str, *, peers: Sequence[int] = (), settings: BenchSettings | None = None
) -> DeviceSpeeds:
    """GEMM, memory bandwidth and (CUDA) transfers of `device`; `peers`: other CUDA indices to copy to."""
    import torch

    kind = device_kind(device)
    settings = settings or settings_for(device)
    if kind == "cuda" and not torch.cuda.is_available():
        raise TesselError(f"{device}: torch sees no CUDA device here")
    target = torch.device(device)
    clock = make_clock("cuda" if kind == "cuda" else "wall")

    def best_s(fn: Callable[[], object]) -> float:
        (runs,) = time_runs([fn], clock, warmup=settings.warmup, repeats=settings.repeats)
        return max(min(runs), 1e-9)

    dtype = getattr(torch, settings.gemm_dtype)
    n = settings.gemm_size
    on_gpu = torch.cuda.device(target) if kind == "cuda" else contextlib.nullcontext()
    with torch.inference_mode(), on_gpu:  # CUDA events and synchronize act on the current device
        gemm_s = _gemm_s(torch, target, dtype, n, best_s)
        copy_s = _copy_s(torch, target, settings.copy_bytes, best_s)
        h2d = d2h = None
        peer_gbs: dict[str, float] = {}
        if kind == "cuda":
            h2d, d2h, peer_gbs = _transfers(torch, target, peers, settings, best_s)
    return DeviceSpeeds(
        device=device,
        gemm_tflops=gemm_flops(n) / gemm_s / TERA,
        gemm_dtype=settings.gemm_dtype,
        memory_gbs=2 * settings.copy_bytes / copy_s / GB,
        h2d_gbs=h2d,
        d2h_gbs=d2h,
        peer_gbs=peer_gbs,
        settings=asdict(settings),
    )


def measure_read_gbs(device: str = "cpu", n_bytes: int = 2**30, warmup: int = 1, repeats: int = 7) -> float:
    """The memory read bandwidth of `device`, GB/s: a float32 buffer of `n_bytes` summed, each byte read
    once, the best of `repeats` runs (on CPU with the threads torch has now): the ceiling of a decode
    that streams its weights, which `measure_device`'s copy (read and write) is not."""
    import torch

    target = torch.device(device)
    clock = make_clock("cuda" if device_kind(device) == "cuda" else "wall")
    buffer = torch.ones(n_bytes // 4, device=target, dtype=torch.float32)
    (runs,) = time_runs([buffer.sum], clock, warmup=warmup, repeats=repeats)
    return buffer.numel() * 4 / max(min(runs), 1e-9) / GB


def _gemm_s(torch, target, dtype, n: int, best_s) -> float:  # noqa: ANN001 (torch module and objects)
    a = torch.randn(n, n, device=target, dtype=dtype)
    b = torch.randn(n, n, device=target, dtype=dtype)
    return best_s(lambda: torch.matmul(a, b))


def _copy_s(torch, target, n_bytes: int, best_s) -> float:  # noqa: ANN001
    src = torch.ones(n_bytes // 4, device=target, dtype=torch.float32)
    dst = torch.empty_like(src)
    return best_s(lambda: dst.copy_(src))


def _transfers(torch, target, peers: Sequence[int], settings: BenchSettings, best_s):  # noqa: ANN001, ANN202
    """(host->device GB/s, device->host GB/s, {peer: GB/s}) over pinned host memory and peer copies."""
    elements = settings.transfer_bytes // 4
    host = torch.ones(elements, dtype=torch.float32).pin_memory()
    on_device = torch.empty(elements, device=target, dtype=torch.float32)
    h2d_s = best_s(lambda: on_device.copy_(host, non_blocking=True))
    d2h_s = best_s(lambda: host.copy_(on_device, non_blocking=True))
    peer_gbs = {}
    for peer in peers:
        if peer == target.index:
            continue
        remote = torch.empty(elements, device=f"cuda:{peer}", dtype=torch.float32)
        seconds = []
        for run in range(settings.warmup + settings.repeats):  # wall time, both GPUs synchronized
            torch.cuda.synchronize(target)
            torch.cuda.synchronize(peer)
            begin = time.perf_counter()
            remote.copy_(on_device)
            torch.cuda.synchronize(target)
            torch.cuda.synchronize(peer)
            if run >= settings.warmup:
                seconds.append(time.perf_counter() - begin)
        peer_gbs[f"cuda:{peer}"] = settings.transfer_bytes / max(min(seconds), 1e-9) / GB
        del remote
    size = settings.transfer_bytes
    return size / h2d_s / GB, size / d2h_s / GB, peer_gbs


def nccl_version() -> str | None:
    """The NCCL version torch was built with ("2.21.5"), or None (a CPU build, or no NCCL)."""
    try:
        import torch

        version = torch.cuda.nccl.version()
    except (ImportError, AttributeError, RuntimeError):
        return None
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version)
    if isinstance(version, int):  # torch < 1.13 packed it as major*1000 + minor*100 + patch
        return f"{version // 1000}.{version % 1000 // 100}.{version % 100}"
    return str(version)


def measure_machine(cuda_count: int, *, cpu_settings: BenchSettings | None = None) -> list[DeviceSpeeds]:
    """Every CUDA device (with copies to each other one) and the CPU."""
    results = [measure_device(f"cuda:{k}", peers=range(cuda_count)) for k in range(cuda_count)]
    return results + [measure_device("cpu", settings=cpu_settings)]
