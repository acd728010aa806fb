"""A stand-in for the `pynvml` module (nvidia-ml-py) describing a recorded machine: the calls
`tessel.catalog.local_machine.read_nvml` and `gpu_topology.nvml_topology` make, answering as NVML does
(bytes for names and bus ids, NVMLError past a GPU's last NVLink or on a GPU without NVLink)."""

from __future__ import annotations

from types import SimpleNamespace

NVML_NVLINK_MAX_LINKS = 18  # pynvml's constant (NVLink 4: 18 links per GPU)
GPU, SWITCH = 0, 2  # NVML_NVLINK_DEVICE_TYPE_GPU / _SWITCH


class NVMLError(Exception):
    pass


class FakeNvml:
    """gpus: [(name, memory bytes)]; levels[i][j]: nvmlGpuTopologyLevel; links[i]: per NVLink of
    GPU i, ("gpu", j) or ("switch", k)."""

    NVMLError = NVMLError
    NVML_NVLINK_MAX_LINKS = NVML_NVLINK_MAX_LINKS

    def __init__(
        self, gpus: list[tuple[str, int]], levels: list[list[int]], links: list[list[tuple[str, int]]]
    ):
        self.gpus, self.levels, self.links = gpus, levels, links
        self.started = False

    def nvmlInit(self) -> None:  # noqa: N802 (pynvml's names)
        self.started = True

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.started = False

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        assert self.started
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes:  # noqa: N802
        return self.gpus[handle][0].encode()

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(total=self.gpus[handle][1], free=self.gpus[handle][1], used=0)

    def nvmlDeviceGetPciInfo(self, handle: int) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(busId=f"00000000:{0x07 + 0x10 * handle:02X}:00.0".encode())

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:  # noqa: N802
        if link >= len(self.links[handle]):
            raise NVMLError("Not Supported")
        return 1

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: int, link: int) -> int:  # noqa: N802
        return SWITCH if self.links[handle][link][0] == "switch" else GPU

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: int, link: int) -> SimpleNamespace:  # noqa: N802
        kind, peer = self.links[handle][link]
        if kind == "switch":
            return SimpleNamespace(busId=f"00000000:{0xC0 + peer:02X}:00.0".encode())
        return self.nvmlDeviceGetPciInfo(peer)

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:  # noqa: N802
        return self.levels[a][b]
