"""One pipeline stage's compute: its decoder layers over its share of the paged KV cache.

The first stage embeds the tokens; every stage runs its layers; a stage that is not the last hands
on the residual stream (hidden + residual, the next layer's input-norm sum, so the next stage's
first layer sees exactly what it would see in one process); the last stage applies the final
norm, projects the sampled rows and samples them, with the logprobs asked for. Sampling here keeps
each seeded request's `torch.Generator` on the last stage, where its logits are.

A stage with an emulated speed s < 1 sleeps (1/s - 1) x its measured compute time after every
micro-batch: emulation of a slower device on one CPU, not a model of one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tessel.dist.comm import BatchMessage
from tessel.dist.sampled import SampledRows
from tessel.engine.model_runner import ModelRunner, sampled_logprobs, score_prompt
from tessel.engine.sampling_params import SamplingParams
from tessel.layers.attention import AttentionMetadata
from tessel.models.layer_filter import LayerFilter
from tessel.models.llama import LlamaForCausalLM
from tessel.models.loader import load_model
from tessel.quant.load_quantize import quantize_layers


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
        precisions of the plan, rounded here (`tessel.quant.load_quantize`)."""
        model = load_model(path, dtype, device, layers=part)
        if precisions:
            quantize_layers(model, precisions, dtype)
        return cls(model, part, speed, weight_bytes=tensor_bytes(model))

    def attach_kv(self, num_blocks: int, block_size: int, dtype: torch.dtype, pack: bool) -> None:
        """Allocate this stage's KV blocks (its layers only) and pack its CPU linears."""
        self.runner = ModelRunner(self.model, num_blocks, block_size, dtype, pack)
        if not self.part.embed and self.part.needs_embedding:
            self.model.model.embed_tokens = torch.nn.Identity()  # the packed head has its own copy

    @torch.inference_mode()
    def forward(
        self,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        input_ids: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (first stage) or the received residual stream -> this stage's output."""
        inner = self.model.model
        hidden = inner.embed_tokens(input_ids) if self.part.embed else hidden
        residual = None
        for index in range(self.part.layer_start, self.part.layer_end):
            hidden, residual = inner.layers[index](positions, hidden, residual, meta)
        if self.part.head:
            hidden, _ = inner.norm(hidden, residual)
            return hidden
        return hidden + residual

    @torch.inference_mode()
    def sample(self, hidden: torch.Tensor, message: BatchMessage) -> SampledRows:
        """Last stage: the tokens of the message's sampled rows, with the logprobs their requests
        asked for and the prompt logprobs of its chunks (as the single-process `ModelRunner.run`)."""
        for seq_id in message.released:
            self._generators.pop(seq_id, None)
        prompt_logprobs = [score_prompt(self.model, hidden, s) for s in message.prompt_scorings]
        if not message.sample_rows:
            return SampledRows([], [], prompt_logprobs)
        logits = self.model.compute_logits(hidden[message.sample_rows])
        rows = [_Row(params, self._generator(seq_id, params)) for seq_id, params in message.sample]
        tokens = self.runner.sample(logits.float(), rows).tolist()
        logprobs = sampled_logprobs(logits, tokens, [row.params for row in rows])
        return SampledRows(tokens, logprobs, prompt_logprobs)

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
