"""One pipeline stage: its part of the model (`LayerFilter`), run by the engine's own `ModelRunner`.

The model is stage-aware (`tessel.models.llama.LlamaModel.forward`): the first stage embeds the
tokens, a later one takes the residual stream it received; a stage that is not the last returns the
stream to send on, the last the final hidden states. `ModelRunner.run_stage` runs it as one process
runs its model (eager or the compiled decode graphs), and `ModelRunner.sample_hidden` samples the
last stage's rows with the logprobs asked for. Sampling here keeps each seeded request's
`torch.Generator` on the last stage, where its logits are.

A stage with an emulated speed s < 1 sleeps (1/s - 1) x its measured compute time after every
micro-batch: emulation of a slower device on one CPU, not a model of one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tessel.engine.model_runner import ModelRunner, SampledRows
from tessel.engine.sampling_params import SamplingParams
from tessel.models.layer_filter import LayerFilter
from tessel.models.llama import LlamaForCausalLM
from tessel.models.loader import load_model
from tessel.models.quantized.load_quantize import quantize_layers
from tessel.pipeline.comm import BatchMessage


@dataclass(slots=True)
class _Row:
    """What `ModelRunner.sample` reads of a sequence."""

    params: SamplingParams
    generator: torch.Generator | None


@dataclass(slots=True)
class StageStats:
    batches: int = 0
    compute_s: float = 0.0  # wall time in this stage's layers (+ sampling on the last)
    emulation_sleep_s: float = 0.0
    tokens: int = 0
    cpp_prompts: int = 0  # prompts cut into CPP chunks (stage 0)
    cpp_chunks: int = 0


@dataclass(slots=True)
class StageExecutor:
    model: LlamaForCausalLM
    part: LayerFilter
    emulate_speed: float = 1.0
    runner: ModelRunner | None = None  # set once the KV pool size is known
    weight_bytes: int = 0  # parameters and buffers loaded for this stage
    stats: StageStats = field(default_factory=StageStats)
    _generators: dict[int, torch.Generator] = field(default_factory=dict)

    @classmethod
    def load(
        cls,
        path: Path,
        part: LayerFilter,
        dtype: torch.dtype,
        device: torch.device,
        speed: float,
        precisions: dict[int, tuple[str, str]] | None = None,
    ):
        """The stage's layers from the checkpoint; `precisions`: layer -> (attention, MLP) weight
        precisions of the plan, rounded here (`tessel.models.quantized.load_quantize`)."""
        model = load_model(path, dtype, device, layers=part)
        if precisions:
            quantize_layers(model, precisions, dtype)
        return cls(model, part, speed, weight_bytes=tensor_bytes(model))

    def attach_kv(self, num_blocks: int, block_size: int, dtype: torch.dtype, pack: bool) -> None:
        """Allocate this stage's KV blocks (its layers only) and pack its CPU linears."""
        self.runner = ModelRunner(self.model, num_blocks, block_size, dtype, pack)
        if not self.part.embed and self.part.needs_embedding:
            self.model.model.embed_tokens = torch.nn.Identity()  # the packed head has its own copy

    def sample(self, hidden: torch.Tensor, message: BatchMessage) -> SampledRows:
        """Last stage: the tokens of the message's sampled rows, with the logprobs their requests
        asked for and the prompt logprobs of its chunks (`ModelRunner.sample_hidden`, as `run`)."""
        for seq_id in message.released:
            self._generators.pop(seq_id, None)
        rows = [_Row(params, self._generator(seq_id, params)) for seq_id, params in message.sample]
        return self.runner.sample_hidden(hidden, message.sample_rows, rows, message.prompt_scorings)

    def _generator(self, seq_id: int, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None:
            return None
        if seq_id not in self._generators:
            self._generators[seq_id] = torch.Generator().manual_seed(params.seed)
        return self._generators[seq_id]

    def account(self, started_s: float, tokens: int) -> None:
        """Count a micro-batch that began at `started_s` (perf_counter) and emulate the slowdown."""
        compute_s = time.perf_counter() - started_s
        self.stats.batches += 1
        self.stats.compute_s += compute_s
        self.stats.tokens += tokens
        if self.emulate_speed < 1.0:
            pause_s = (1.0 / self.emulate_speed - 1.0) * compute_s
            time.sleep(pause_s)
            self.stats.emulation_sleep_s += pause_s


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
