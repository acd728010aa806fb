"""One pipeline stage: its part of the model (`LayerFilter`), run by the engine's own `ModelRunner`.

The model is stage-aware (`tessel.models.llama.LlamaModel.forward`): the first stage embeds the
tokens, a later one takes the residual stream it received; a stage that is not the last returns the
stream to send on, the last the final hidden states. `ModelRunner.run_stage` runs it as one process
runs its model (eager or the compiled decode graphs), and `ModelRunner.sample_hidden` samples the
last stage's rows with the logprobs asked for. Sampling here keeps each seeded request's
`torch.Generator` on the last stage, where its logits are.

A stage of an emulated slower device (`tessel.engine.emulation.SlowDevice`: a speed, or a speed
schedule) sleeps (1/s - 1) x its measured compute time after every micro-batch: emulation of a
slower device on one CPU, not a model of one. `StageStats` and, where attached, the heartbeat's
`StageProgress` count its micro-batches, tokens and busy seconds (compute + emulation): what the remap
watcher reads (`tessel.pipeline.supervision.remap_watch`).

A stage whose plan offloads layers streams their weights from host memory
(`tessel.engine.weight_stream`) and counts the copies' exposed and hidden seconds in its stats;
the emulated slowdown scales its compute without the time it waited for copies.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tessel.engine.emulation import SlowDevice
from tessel.engine.engine_config import DEFAULT_KV_CACHE_BYTES
from tessel.engine.guided.decoder import BitmaskRow
from tessel.engine.host_kv_pool import HostKvPool
from tessel.engine.model_runner import ModelRunner, SampledRows
from tessel.engine.sampling_params import SamplingParams
from tessel.engine.weight_stream import HostWeights, WeightStreamer, host_copy, start_streaming
from tessel.kernels.paged_decode import decode_gather
from tessel.layers.sampler import exponential_noise
from tessel.models.layer_filter import LayerFilter
from tessel.models.llama import LlamaForCausalLM
from tessel.models.loader import load_model
from tessel.models.quantized.load_quantize import quantize_layers
from tessel.parallel.runner import LeaderRunner
from tessel.parallel.stage import TPStage, load_tp_stage
from tessel.pipeline.comm.messages import BatchMessage, KvLayout
from tessel.pipeline.supervision.heartbeat import StageProgress


@dataclass(slots=True)
class _Row:
    """What `ModelRunner.sample` reads of a sequence."""

    params: SamplingParams
    generator: torch.Generator | None
    token_bitmask: BitmaskRow | None = None


@dataclass(slots=True)
class StageStats:
    batches: int = 0
    compute_s: float = 0.0  # wall time in this stage's layers (+ sampling on the last)
    emulation_sleep_s: float = 0.0
    compute_cpu_s: float = 0.0  # process CPU seconds (time.process_time) over the compute_s spans
    # the computing thread's own CPU seconds over them (time.thread_time): compute_cpu_s less what the
    # process's other threads (receiving, sending, heartbeats) ran meanwhile
    compute_thread_cpu_s: float = 0.0
    # outside the compute spans, on the stage's loop thread: waiting for and receiving a micro-batch
    # (wall, and its thread's CPU), repeating stage 0's KV copies and building the attention's gather
    # (`adopt`), sending the result on (wall)
    recv_s: float = 0.0
    recv_thread_cpu_s: float = 0.0
    adopt_s: float = 0.0
    send_s: float = 0.0
    # the same two over the batches that hold prompt tokens: a loaded host lends long prefill passes
    # fewer of its cores than short decode steps, so the two phases are measured apart
    prefill_compute_s: float = 0.0
    prefill_compute_cpu_s: float = 0.0
    process_cpu_s: float = 0.0  # process CPU seconds (all threads) while serving the timed requests
    tokens: int = 0
    cpp_prompts: int = 0  # prompts cut into CPP chunks (stage 0)
    cpp_chunks: int = 0
    # streamed weights (`tessel.engine.weight_stream`; all 0 when the stage streams none)
    stream_layers: int = 0  # layers whose weights stay in host memory
    stream_host_bytes: int = 0  # their host copy
    stream_buffer_bytes: int = 0  # the device buffers they are copied into
    stream_copies: int = 0
    stream_copy_bytes: int = 0
    stream_copy_s: float = 0.0  # the copies' time (emulated: the emulated link's where longer)
    stream_exposed_s: float = 0.0  # compute waiting for a copy
    stream_hidden_s: float = 0.0  # copy time the compute did not wait for
    stream_emulated_s: float = 0.0  # copied bytes / the emulated host link (0 on a real link)
    stream_exposed_s_per_step: float = 0.0  # per micro-batch
    stream_hidden_s_per_step: float = 0.0


@dataclass(slots=True)
class StageRunner:
    model: LlamaForCausalLM
    part: LayerFilter
    slow: SlowDevice = field(default_factory=SlowDevice)  # its emulated speed (1: none)
    runner: ModelRunner | None = None  # set once the KV pool size is known
    weight_bytes: int = 0  # parameters and buffers loaded for this stage
    stats: StageStats = field(default_factory=StageStats)
    _generators: dict[int, torch.Generator] = field(default_factory=dict)
    progress: StageProgress | None = None  # the heartbeat's: counts batches, tokens and busy seconds too
    host_weights: HostWeights | None = None  # streamed layers' host copy, until streaming starts
    host_gbps: float | None = None  # a CPU stage's emulated host link (the plan's emulate_host_gbps)
    streamer: WeightStreamer | None = None
    host_kv: HostKvPool | None = None  # swapped KV of this stage's layers, made at the first copy
    kv_host_gbps: float | None = None  # its copies' emulated link (--emulate-host-gbps, else the plan's)
    tp: TPStage | None = None  # the stage's tensor-parallel ranks (`tessel.parallel.stage`), if split

    @classmethod
    def load(
        cls,
        path: Path,
        part: LayerFilter,
        dtype: torch.dtype,
        device: torch.device,
        slow: SlowDevice,
        precisions: dict[int, tuple[str, str]] | None = None,
        tp_degree: int = 1,
        tp_gpus: list[int] | None = None,
        run_dir: Path | None = None,
        rank: int = 0,
    ):
        """The stage's layers from the checkpoint; `precisions`: layer -> (attention, MLP) weight
        precisions of the plan, rounded here (`tessel.models.quantized.load_quantize`); `slow`: the
        plan's emulated speed for its device; `tp_degree` > 1: split over that many ranks, this
        process their leader (`tessel.parallel.stage`; followers log into `run_dir`)."""
        tp = None
        if tp_degree > 1:  # the ranks round the plan's precisions as they load
            tp = load_tp_stage(path, dtype, str(device), part, tp_degree, rank, tp_gpus, run_dir, precisions)
            model = tp.model
        else:
            model = load_model(path, dtype, device, layers=part)
            if precisions:
                quantize_layers(model, precisions, dtype)
        runner = cls(model, part, slow, weight_bytes=tensor_bytes(model), tp=tp)
        runner.host_weights = host_copy(model, part) if part.host_layers else None  # before packing
        return runner

    def attach_kv(self, layout: KvLayout, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate this stage's KV blocks (its layers only) on `device`, pack its CPU linears, size
        its CUDA graphs as stage 0's engine (its max_num_seqs and max_model_len); a stage with
        streamed layers runs eager (the hooks that copy them in run in the model's forward)."""
        if self.tp is not None:
            self.runner = LeaderRunner(
                self.tp.group,
                self.model,
                layout.num_blocks,
                layout.block_size,
                dtype,
                layout.pack_cpu_linears,
            )
        else:
            self.runner = ModelRunner(
                self.model,
                layout.num_blocks,
                layout.block_size,
                dtype,
                layout.pack_cpu_linears,
                enforce_eager=self.host_weights is not None,
                device=device,
                max_num_seqs=layout.max_num_seqs,
                max_model_len=layout.max_model_len,
            )
        self.start_streaming(device)
        if not self.part.embed and self.part.needs_embedding:
            self.model.model.embed_tokens = torch.nn.Identity()  # the packed head has its own copy

    def stop_tp(self) -> None:
        """Stop the stage's tensor-parallel followers (told to, where the runner can still tell them)."""
        if self.tp is not None:
            tell = self.runner.stop_followers if isinstance(self.runner, LeaderRunner) else None
            self.tp.ranks.stop(tell)

    def start_streaming(self, device: torch.device) -> None:
        """Once the runner is built: stream the part's host layers (`tessel.engine.weight_stream`)."""
        if self.host_weights is None:
            return
        self.streamer = start_streaming(self.model, self.part, self.host_weights, device, self.host_gbps)
        self.host_weights = None

    def _account_stream(self) -> float:
        """Add the copies since the last micro-batch to the stats; -> the seconds compute waited."""
        streamer = self.streamer
        if streamer is None:
            return 0.0
        taken, stats = streamer.mover.take(), self.stats
        stats.stream_layers = len(streamer.layers)
        stats.stream_host_bytes = streamer.host_bytes
        stats.stream_buffer_bytes = streamer.buffer_bytes * streamer.schedule.buffers
        stats.stream_copies += taken.copies
        stats.stream_copy_bytes += taken.copy_bytes
        stats.stream_copy_s += taken.copy_s
        stats.stream_exposed_s += taken.exposed_s
        stats.stream_hidden_s += taken.hidden_s
        stats.stream_emulated_s += taken.emulated_s
        steps = max(stats.batches, 1)
        stats.stream_exposed_s_per_step = stats.stream_exposed_s / steps
        stats.stream_hidden_s_per_step = stats.stream_hidden_s / steps
        return taken.exposed_s

    def adopt(self, message: BatchMessage) -> None:
        """Repeat the KV copies stage 0 made before this batch (`BatchMessage.kv_copies`) on this
        stage's layers, and give the decode groups the CPU attention's batched gather where the
        sender (a GPU stage) could not build it."""
        cache = self.runner.kv_cache
        if message.kv_copies:  # stage 0 swapped KV blocks before this batch: the same on these layers
            if self.host_kv is None:
                self.host_kv = HostKvPool(message.host_kv_blocks, cache, self.kv_host_gbps)
            for direction, source, target in message.kv_copies:
                self.host_kv.repeat(direction, source, target)
        if cache.is_cuda or not cache.shape[1]:
            return
        for group in message.meta.decode_groups:
            if group.gather is None:
                group.gather = decode_gather(group.block_tables, group.context_lens, cache[0, 0])

    def sample(self, hidden: torch.Tensor, message: BatchMessage) -> SampledRows:
        """Last stage: the tokens of the message's sampled rows, with the logprobs their requests
        asked for and the prompt logprobs of its chunks (`ModelRunner.sample_hidden`, as `run`)."""
        for seq_id in message.released:
            self._generators.pop(seq_id, None)
        for seq_id, params in message.sample:
            if seq_id in message.resumed and params.seed is not None:
                self._generators[seq_id] = resumed_generator(
                    params.seed, message.resumed[seq_id], self.model.config.vocab_size
                )
        bitmasks = message.token_bitmasks or [None] * len(message.sample)
        rows = [
            _Row(params, self._generator(seq_id, params), None if mask is None else BitmaskRow(mask[None], 0))
            for (seq_id, params), mask in zip(message.sample, bitmasks, strict=True)
        ]
        return self.runner.sample_hidden(hidden, message.sample_rows, rows, message.prompt_scorings)

    def _generator(self, seq_id: int, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None:
            return None
        if seq_id not in self._generators:
            self._generators[seq_id] = torch.Generator().manual_seed(params.seed)
        return self._generators[seq_id]

    def account(
        self,
        started_s: float,
        tokens: int,
        cpu_started_s: float | None = None,
        prefill: bool = False,
        thread_started_s: float | None = None,
    ) -> None:
        """Count a micro-batch that began at `started_s` (perf_counter; `cpu_started_s`: process_time;
        `thread_started_s`: thread_time; `prefill`: it holds prompt tokens) and emulate the slowdown."""
        now = time.perf_counter()
        compute_s = now - started_s
        cpu_s = 0.0 if cpu_started_s is None else time.process_time() - cpu_started_s
        self.stats.compute_cpu_s += cpu_s
        if thread_started_s is not None:
            self.stats.compute_thread_cpu_s += time.thread_time() - thread_started_s
        if prefill:
            self.stats.prefill_compute_s += compute_s
            self.stats.prefill_compute_cpu_s += cpu_s
        self.stats.batches += 1
        self.stats.compute_s += compute_s
        self.stats.tokens += tokens
        waited_s = self._account_stream()  # the emulated slowdown scales compute, not copy waits
        self.stats.emulation_sleep_s += self.slow.pause(started_s, compute_s - waited_s)
        if self.progress is not None:
            self.progress.batches = self.stats.batches
            self.progress.tokens = self.stats.tokens
            self.progress.busy_s = self.stats.compute_s + self.stats.emulation_sleep_s


def resumed_generator(seed: int, draws: int, vocab_size: int) -> torch.Generator:
    """A seeded request's generator as it is after `draws` sampled tokens: the sampler draws one row
    of `vocab_size` float32 Exp(1) noise per token (`tessel.layers.sampler`), so a request moved to
    a new pipeline samples on as it would have on the old one."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(draws):
        exponential_noise(vocab_size, torch.float32, generator)
    return generator


@dataclass(frozen=True, slots=True)
class KvBudget:
    """What one stage may spend on KV blocks: `--kv-cache-gib` is the whole pipeline's (each stage
    takes its layers' share), else the plan's `kv_gib` for this stage, else the engine's default
    pool over this stage's layers; without `--kv-cache-gib`, never more blocks than
    max_num_seqs x max_model_len need."""

    kv_cache_gib: float | None  # the user's, for all stages together
    planned_kv_gib: float | None  # the plan's reservation for this stage
    layer_share: float  # this stage's layers / the model's

    def blocks(self, bytes_per_block: int, blocks_per_seq: int, max_num_seqs: int) -> int:
        if self.kv_cache_gib is not None:
            return int(self.kv_cache_gib * 2**30 * self.layer_share // bytes_per_block)
        budget = DEFAULT_KV_CACHE_BYTES * self.layer_share
        if self.planned_kv_gib:
            budget = self.planned_kv_gib * 2**30
        return max(blocks_per_seq, min(max_num_seqs * blocks_per_seq, int(budget // bytes_per_block)))


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers (shared tensors once)."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def rss_bytes() -> int:
    """Resident memory of this process (Linux /proc; 0 where it is not available)."""
    try:
        with open(f"/proc/{os.getpid()}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
