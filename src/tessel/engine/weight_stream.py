"""Streamed weights: the layers a plan offloads keep their weights in host memory and are copied to
the device just before they run, the next one's copy overlapping the current one's compute.

The plan says which decoder layers of a stage stream (`RunStage.offload_layers`, the stage's last
layers: `tessel.plan.streamed`). The stage's model is loaded with those layers in host memory
(`LayerFilter.host_layers`), the engine's `ModelRunner` is built as usual (eager: a graph would not
call the hooks below), then `start_streaming` binds every tensor of a streamed layer to a view of
one of `STREAM_BUFFERS` device buffers (streamed layer k uses buffer k mod 2: a double buffer, as
FlexGen and accelerate do) and hooks the stage's layers:

    before the stage's first layer   issue the copy of the first streamed layer (it overlaps the
                                     resident layers before it)
    before streamed layer k          issue the copy of layer k + 1 into the other buffer (once layer
                                     k - 1, its previous holder, has run), then wait for layer k's
    after streamed layer k           mark its buffer free once its compute is done

A buffer already holding the layer it needs is not copied again (a stage streaming at most two
layers copies them once). The model's forward and the runner are unchanged.

Two movers copy:
- CUDA: pinned host tensors, `non_blocking` copies on a side `torch.cuda.Stream`, ordered by
  events (the copy waits for the buffer's last compute, the layer waits for the copy). Copy and
  exposed (stall) times come from CUDA events, read when the stage accounts its micro-batch.
- CPU (emulation): a separate host copy of the layer, copied by a side thread into the buffer; with
  an emulated host link (`emulate_host_gbps`) the copy then sleeps until bytes / bandwidth has
  passed, so a CPU stage behaves like a device behind that link. A float32 linear the runner packed
  for oneDNN keeps its packed weight as the host copy and is copied in by cloning it (outputs
  bit-identical to the resident run). Emulation on one CPU, never a GPU figure.

Per micro-batch the stage counts (`StreamStats`): copies, bytes, copy seconds, exposed seconds (the
compute waiting for a copy) and hidden seconds (copy seconds the compute did not wait for), plus,
under emulation, the seconds the emulated link accounts (bytes / bandwidth).
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn

from tessel.engine.emulation import hold_link
from tessel.errors import TesselError
from tessel.models.config import ModelConfig
from tessel.models.layer_filter import LayerFilter
from tessel.plan.streamed import STREAM_BUFFERS
from tessel.units import GBPS, GIB

ALIGN_BYTES = 256  # every tensor in a device buffer starts at a multiple of this (vectorised loads)


# ---- which layers, which buffer, in which order (pure logic) ---------------------------------------
@dataclass(frozen=True, slots=True)
class StreamSchedule:
    """The copies of one stage step: its layers [layer_start, layer_end), the streamed ones."""

    layer_start: int
    layer_end: int
    streamed: tuple[int, ...]

    def __post_init__(self) -> None:
        if list(self.streamed) != sorted(set(self.streamed)) or not all(
            self.layer_start <= layer < self.layer_end for layer in self.streamed
        ):
            raise ValueError(f"streamed layers {self.streamed} are not ascending layers of the stage")

    @property
    def buffers(self) -> int:
        return min(STREAM_BUFFERS, len(self.streamed))

    def buffer_of(self, layer: int) -> int:
        return self.streamed.index(layer) % self.buffers

    def copies_before(self, layer: int) -> tuple[int, ...]:
        """The streamed layers whose copies are issued just before `layer` runs, in issue order."""
        issued = []
        if layer == self.layer_start and self.streamed:
            issued.append(self.streamed[0])
        if layer in self.streamed:
            k = self.streamed.index(layer)
            if k + 1 < len(self.streamed) and self.streamed[k + 1] not in issued:
                issued.append(self.streamed[k + 1])
        return tuple(issued)

    def step_copies(self, holders: list[int | None]) -> list[tuple[int, int]]:
        """(layer, buffer) of every copy one step makes, in order, from buffers holding `holders`
        (updated in place): what the hooks do, for tests and for sizing a step's transfer."""
        copies = []
        for layer in range(self.layer_start, self.layer_end):
            for streamed in self.copies_before(layer):
                buffer = self.buffer_of(streamed)
                if holders[buffer] != streamed:
                    holders[buffer] = streamed
                    copies.append((streamed, buffer))
        return copies


def buffer_layout(sizes_bytes: list[int], align: int = ALIGN_BYTES) -> tuple[list[int], int]:
    """Byte offsets of tensors of `sizes_bytes` packed into one buffer, each aligned; -> (offsets, total)."""
    offsets, end = [], 0
    for size in sizes_bytes:
        start = -(-end // align) * align
        offsets.append(start)
        end = start + size
    return offsets, end


# ---- bad input, before loading -----------------------------------------------------------------------
def layer_weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one decoder layer's weights at `dtype`, as the runtime holds them (fused projections)."""
    from tessel.layers.rotary import RotaryEmbedding
    from tessel.models.llama import LlamaDecoderLayer

    with torch.device("meta"):
        rotary = RotaryEmbedding(config.head_dim, 16, config.rope_theta, None)
        layer = LlamaDecoderLayer(config, rotary)
    return sum(p.numel() for p in layer.parameters()) * torch.empty((), dtype=dtype).element_size()


def physical_memory_bytes() -> int:
    """This machine's RAM (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def check_offload(stages, config: ModelConfig, dtype: torch.dtype, local: list[int] | None = None) -> None:
    """Refuse, before anything loads, a plan whose streamed layers cannot run: a quantised streamed
    layer, an emulated memory below one layer, weights left on the device above that memory, streamed
    bytes above the stage's host memory or (for the stages on this machine, `local`: all when None)
    above this machine's RAM."""
    per_layer = layer_weight_bytes(config, dtype)
    on_host = 0
    for rank, stage in enumerate(stages):
        where = f"stage {stage.index} ({stage.device})"
        streamed = len(stage.offload_layers)
        quantized = sorted(set(stage.offload_layers) & set(stage.quantized_layers))
        if quantized:
            raise TesselError(
                f"{where}: layers {quantized[:3]} are both quantised and streamed from host memory; "
                "streamed layers run at the float dtype: plan them without --precisions"
            )
        cap = stage.emulate_memory_gib
        if cap is not None and cap * GIB < per_layer:
            raise TesselError(
                f"{where}: its emulated memory of {cap:g} GiB is below one decoder layer's weights "
                f"({per_layer / GIB:.4f} GiB at {dtype}); give emulate memory_gib at least that"
            )
        resident = (stage.num_layers - streamed + min(streamed, STREAM_BUFFERS)) * per_layer
        if cap is not None and streamed and resident > cap * GIB:
            raise TesselError(
                f"{where}: with layers {stage.offload_layers[0]}-{stage.offload_layers[-1]} streamed, "
                f"{resident / GIB:.3f} GiB of layer weights stay on the device (with its "
                f"{STREAM_BUFFERS} stream buffers), above its emulated {cap:g} GiB; plan again at "
                "this dtype"
            )
        host = streamed * per_layer
        if stage.host_gib is not None and host > stage.host_gib * GIB * (1 + 1e-6):
            raise TesselError(
                f"{where}: its {streamed} streamed layers hold {host / GIB:.3f} GiB in host memory, "
                f"above the {stage.host_gib:g} GiB the plan gives it; raise host_memory_gib and plan again"
            )
        if local is None or rank in local:
            on_host += host
    ram = physical_memory_bytes()
    if ram and on_host > ram:
        raise TesselError(
            f"the streamed layers of this machine's stages hold {on_host / GIB:.2f} GiB in host memory, "
            f"more than its {ram / GIB:.2f} GiB of RAM"
        )


def check_host_link(gbps: float | None) -> float | None:
    """An emulated host link in Gbit/s (None: copies run at the real speed)."""
    if gbps is None:
        return None
    if not (math.isfinite(gbps) and gbps > 0):
        raise TesselError(f"emulate host_gbps must be a positive number of Gbit/s, got {gbps!r}")
    return gbps


# ---- host copies and device buffers ------------------------------------------------------------------
@dataclass(slots=True)
class _Tensor:
    """One tensor of a streamed layer: its module and attribute, host copy and place in a buffer."""

    module: nn.Module
    name: str
    host: torch.Tensor
    offset: int = 0


@dataclass(slots=True)
class _Packed:
    """A float32 CPU linear the runner packed for oneDNN: its packed weight is the host copy, cloned
    (a copy of the packed bytes, bit-identical) into the layer when it is copied in."""

    module: nn.Module
    weight: torch.Tensor  # host copy, in oneDNN's layout
    bias: _Tensor | None


@dataclass(slots=True)
class _Layer:
    tensors: list[_Tensor]
    packed: list[_Packed]

    @property
    def host_bytes(self) -> int:
        dense = sum(t.host.numel() * t.host.element_size() for t in self.tensors)
        return dense + sum(p.weight.numel() * p.weight.element_size() for p in self.packed)

    @property
    def buffer_tensors(self) -> list[_Tensor]:
        return self.tensors + [p.bias for p in self.packed if p.bias is not None]


HostWeights = dict[int, dict[str, torch.Tensor]]  # layer -> tensor name within it -> host copy


def host_copy(model: nn.Module, part: LayerFilter) -> HostWeights:
    """Host copies of every tensor of the part's streamed layers, taken before the runner packs any
    (pinned where CUDA can pin; a separate copy on a CPU stage: its "host memory")."""
    pin = torch.cuda.is_available()
    weights: HostWeights = {}
    for index in sorted(part.host_layers):
        layer = model.model.layers[index]
        tensors = {**dict(layer.named_parameters()), **dict(layer.named_buffers())}
        weights[index] = {name: _host(tensor, pin) for name, tensor in tensors.items() if tensor is not None}
    return weights


def _host(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    copy = tensor.detach().to("cpu", copy=True).contiguous()
    return copy.pin_memory() if pin else copy


def _bind_layer(layer: nn.Module, host: dict[str, torch.Tensor]) -> _Layer:
    """The streamed tensors of `layer` (after the runner built it): a packed linear as one entry,
    every other parameter or buffer as another."""
    tensors, packed = [], []
    for path, module in layer.named_modules():
        prefix = f"{path}." if path else ""
        if getattr(module, "packed_weight", None) is not None:
            bias = host.get(f"{prefix}bias")
            bias_tensor = None if bias is None else _Tensor(module, "", bias)
            packed.append(_Packed(module, module.packed_weight.weight, bias_tensor))
            continue
        own = [*module._parameters.items(), *module._buffers.items()]
        tensors += [_Tensor(module, name, host[f"{prefix}{name}"]) for name, t in own if t is not None]
    return _Layer(tensors, packed)


def _place(layers: list[_Layer]) -> int:
    """Give each layer's buffer tensors their offsets; -> bytes one buffer needs (the largest layer)."""
    largest = 0
    for layer in layers:
        tensors = layer.buffer_tensors
        offsets, total = buffer_layout([t.host.numel() * t.host.element_size() for t in tensors])
        for tensor, offset in zip(tensors, offsets, strict=True):
            tensor.offset = offset
        largest = max(largest, total)
    return largest


def _view(buffer: torch.Tensor, tensor: _Tensor) -> torch.Tensor:
    size = tensor.host.numel() * tensor.host.element_size()
    return buffer[tensor.offset : tensor.offset + size].view(tensor.host.dtype).view(tensor.host.shape)


def _rebind(layer: _Layer, buffer: torch.Tensor) -> None:
    """Point the layer's tensors at their views in `buffer` (what was on the device is freed)."""
    for tensor in layer.tensors:
        view = _view(buffer, tensor)
        if tensor.name in tensor.module._parameters:  # a new Parameter: `.data` cannot change device
            tensor.module._parameters[tensor.name] = nn.Parameter(view, requires_grad=False)
        else:
            tensor.module._buffers[tensor.name] = view
    for packed in layer.packed:
        packed.module.packed_weight = None  # packed again from the host copy when the layer is copied in


# ---- the movers -------------------------------------------------------------------------------------
@dataclass(slots=True)
class StreamStats:
    copies: int = 0
    copy_bytes: int = 0
    copy_s: float = 0.0  # the copies' own time (under emulation: the emulated link's, if longer)
    exposed_s: float = 0.0  # compute waiting for a copy
    emulated_s: float = 0.0  # bytes / the emulated host link (0 on a real link)

    @property
    def hidden_s(self) -> float:
        return max(self.copy_s - self.exposed_s, 0.0)

    def add(self, other: StreamStats) -> None:
        self.copies += other.copies
        self.copy_bytes += other.copy_bytes
        self.copy_s += other.copy_s
        self.exposed_s += other.exposed_s
        self.emulated_s += other.emulated_s


def _copy_into(layer: _Layer, buffer: torch.Tensor, non_blocking: bool) -> None:
    for tensor in layer.buffer_tensors:
        _view(buffer, tensor).copy_(tensor.host, non_blocking=non_blocking)
    if layer.packed:
        from tessel.layers.linear import dense

        for packed in layer.packed:
            bias = None if packed.bias is None else _view(buffer, packed.bias)
            packed.module.packed_weight = dense.PackedWeight(packed.weight.clone(), bias)


def _evict(layer: _Layer | None) -> None:
    for packed in layer.packed if layer is not None else ():
        packed.module.packed_weight = None


class ThreadMover:
    """CPU stages: copies on a side thread, slowed to an emulated host link of `gbps` where given
    (`tessel.engine.emulation.hold_link`)."""

    def __init__(self, buffers: list[torch.Tensor], gbps: float | None) -> None:
        self.buffers, self.gbps = buffers, gbps
        # the copy thread takes the stage's thread count (an OpenMP team is per thread: its default
        # would be every core, fighting the stage's compute)
        self._pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="tessel-weight-stream",
            initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),),
        )
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self.stats = StreamStats()

    def issue(self, buffer: int, layer: _Layer, previous: _Layer | None) -> None:
        self._pending[buffer] = self._pool.submit(self._copy, buffer, layer, previous)

    def _copy(self, buffer: int, layer: _Layer, previous: _Layer | None) -> None:
        started = time.perf_counter()
        _evict(previous)
        _copy_into(layer, self.buffers[buffer], non_blocking=False)
        real_s = time.perf_counter() - started
        nbytes = layer.host_bytes
        hold_link(nbytes, real_s, self.gbps)
        emulated_s = 0.0 if self.gbps is None else nbytes / (self.gbps * GBPS)
        with self._lock:
            self.stats.add(StreamStats(1, nbytes, max(real_s, emulated_s), 0.0, emulated_s))

    def wait(self, buffer: int) -> None:
        future = self._pending.pop(buffer, None)
        if future is None:
            return
        started = time.perf_counter()
        future.result()  # re-raises a failed copy here, in the stage's thread
        with self._lock:
            self.stats.exposed_s += time.perf_counter() - started

    def release(self, buffer: int) -> None:
        """Compute on the CPU is synchronous: the buffer is free once the layer returned."""

    def take(self) -> StreamStats:
        with self._lock:
            stats, self.stats = self.stats, StreamStats()
        return stats

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CudaMover:
    """CUDA stages: pinned host tensors copied on a side stream; events order copies and compute."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self.stream = torch.cuda.Stream(buffers[0].device)
        self._free = [torch.cuda.Event() for _ in buffers]  # recorded after the buffer's last compute
        self._ready: list[torch.cuda.Event | None] = [None] * len(buffers)
        self._timings: list[tuple[str, torch.cuda.Event, torch.cuda.Event, int]] = []
        self.stats = StreamStats()

    def issue(self, buffer: int, layer: _Layer, previous: _Layer | None) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self._free[buffer])
            start.record(self.stream)
            _copy_into(layer, self.buffers[buffer], non_blocking=True)
            end.record(self.stream)
        self._ready[buffer] = end
        self._timings.append(("copy", start, end, layer.host_bytes))

    def wait(self, buffer: int) -> None:
        ready = self._ready[buffer]
        if ready is None:
            return
        self._ready[buffer] = None
        compute = torch.cuda.current_stream(self.buffers[buffer].device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        compute.wait_event(ready)
        after.record(compute)
        self._timings.append(("stall", before, after, 0))

    def release(self, buffer: int) -> None:
        self._free[buffer].record(torch.cuda.current_stream(self.buffers[buffer].device))

    def take(self) -> StreamStats:
        """The copies and stalls since the last call (waits for their events)."""
        stats = StreamStats()
        for kind, start, end, nbytes in self._timings:
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
            if kind == "copy":
                stats.add(StreamStats(1, nbytes, seconds))
            else:
                stats.exposed_s += seconds
        self._timings = []
        self.stats.add(stats)
        return stats

    def close(self) -> None:
        self.stream.synchronize()


# ---- the streamer -----------------------------------------------------------------------------------
@dataclass(slots=True)
class WeightStreamer:
    schedule: StreamSchedule
    layers: dict[int, _Layer]
    mover: ThreadMover | CudaMover
    buffer_bytes: int  # device bytes one buffer holds: the largest streamed layer's weights
    holders: list[int | None] = field(default_factory=list)  # which streamed layer each buffer holds
    _hooks: list = field(default_factory=list)

    @property
    def host_bytes(self) -> int:
        return sum(layer.host_bytes for layer in self.layers.values())

    def before(self, layer: int) -> None:
        for streamed in self.schedule.copies_before(layer):
            buffer = self.schedule.buffer_of(streamed)
            if self.holders[buffer] != streamed:
                previous = self.layers.get(self.holders[buffer])
                self.holders[buffer] = streamed
                self.mover.issue(buffer, self.layers[streamed], previous)
        if layer in self.layers:
            self.mover.wait(self.schedule.buffer_of(layer))

    def after(self, layer: int) -> None:
        if layer in self.layers:
            self.mover.release(self.schedule.buffer_of(layer))

    def install(self, model: nn.Module) -> None:
        """Hook the stage's layers: `before` ahead of each, `after` once each has run."""
        for index in range(self.schedule.layer_start, self.schedule.layer_end):
            module = model.model.layers[index]
            self._hooks.append(module.register_forward_pre_hook(lambda _m, _a, i=index: self.before(i)))
            self._hooks.append(module.register_forward_hook(lambda _m, _a, _o, i=index: self.after(i)))

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self.mover.close()


def start_streaming(
    model: nn.Module, part: LayerFilter, host: HostWeights, device: torch.device, host_gbps: float | None
) -> WeightStreamer:
    """After the runner is built: bind the streamed layers to `STREAM_BUFFERS` device buffers and
    hook the stage's layers. `host_gbps`: a CPU stage's emulated host link (ignored on CUDA, where
    the copies run for real)."""
    streamed = tuple(sorted(part.host_layers))
    schedule = StreamSchedule(part.layer_start, part.layer_end, streamed)
    layers = {index: _bind_layer(model.model.layers[index], host[index]) for index in streamed}
    size = _place(list(layers.values()))
    buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(schedule.buffers)]
    for index, layer in layers.items():
        _rebind(layer, buffers[schedule.buffer_of(index)])
    if device.type == "cuda":
        mover: ThreadMover | CudaMover = CudaMover(buffers)
    else:
        mover = ThreadMover(buffers, check_host_link(host_gbps))
    largest = max(layer.host_bytes for layer in layers.values())
    streamer = WeightStreamer(schedule, layers, mover, largest, [None] * schedule.buffers)
    streamer.install(model)
    return streamer
