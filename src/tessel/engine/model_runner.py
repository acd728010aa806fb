"""Turn a scheduled step into tensors, run the model over the paged KV cache, and sample.

The step's tokens are flattened: one per decoding sequence first, then each prefill chunk.
`slot_mapping` says where each token's k/v go in the cache; decode rows get padded block
tables and context lengths for one batched paged-attention call. On CPU the model's float32
linear layers are packed for oneDNN first (`tessel.layers.linear.pack_linears`). How a step runs
(eager, the compiled CPU graph, a captured CUDA graph) is
`tessel.engine.step_plan`'s choice, asked once per step in `_forward`.

A pipeline stage runs here too (`run_stage`, then `sample_hidden` on the last stage): its model
holds a part of the layers (`LlamaModel.part`) and takes and returns the residual stream, through
the same `_forward` as one process, so a stage gets the same graphs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np
import torch

from tessel.engine.block_manager import FREED
from tessel.engine.decode_rows import DecodeInputs, DecodeRows
from tessel.engine.outputs import TokenLogprobs
from tessel.engine.sampling_params import SamplingParams
from tessel.engine.scheduler import SchedulerOutput
from tessel.engine.sequence import Sequence
from tessel.engine.step_plan import CudaSizes, GraphFamily, StepMode, StepPlan, graph_family
from tessel.kernels.paged_decode import decode_gather
from tessel.layers.attention import Attention, AttentionMetadata, DecodeGroup, PrefillChunk
from tessel.layers.linear import pack_linears
from tessel.layers.sampler import Sampler, apply_token_bitmask
from tessel.models.llama import LlamaForCausalLM, StepInputs


def kv_cache_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block over the attention layers `model` holds (a pipeline stage: its own)."""
    c = model.config
    layers = sum(isinstance(m, Attention) for m in model.modules())
    return 2 * layers * block_size * c.num_key_value_heads * c.head_dim * dtype.itemsize


# a step's (input_ids, positions, attention metadata, flat rows whose logits get sampled)
Prepared = tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]


@dataclass(slots=True)
class StepResult:
    """`seqs` got `tokens` (and `logprobs`, None where not asked); `prompt_logprobs` holds
    (seq, first prompt position, TokenLogprobs per position) for chunks that asked for them."""

    seqs: list[Sequence] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[tuple[Sequence, int, list[TokenLogprobs]]] = field(default_factory=list)

    def extend(self, other: StepResult) -> None:
        self.seqs += other.seqs
        self.tokens += other.tokens
        self.logprobs += other.logprobs
        self.prompt_logprobs += other.prompt_logprobs


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprobs]:
    """logprobs [N, V] (log-softmax rows), the token at each row, k alternatives -> one per row."""
    index = torch.tensor(token_ids, dtype=torch.int64, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, index).squeeze(1).tolist()
    if k == 0:
        return [TokenLogprobs(t, lp, []) for t, lp in zip(token_ids, chosen, strict=True)]
    values, indices = logprobs.topk(k, dim=-1)
    return [
        TokenLogprobs(t, lp, list(zip(ids, vals, strict=True)))
        for t, lp, ids, vals in zip(token_ids, chosen, indices.tolist(), values.tolist(), strict=True)
    ]


def sampled_logprobs(
    logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]
) -> list[TokenLogprobs | None]:
    """Each sampled row's token logprob and its `params.logprobs` alternatives (None where not asked),
    from the raw logits [N, V] (before temperature)."""
    found: list[TokenLogprobs | None] = [None] * len(tokens)
    for i, p in enumerate(params):
        if p.logprobs is not None:
            rows = logits[i : i + 1].float().log_softmax(dim=-1)
            found[i] = token_logprobs(rows, [tokens[i]], p.logprobs)[0]
    return found


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of `logits` [N, V] (the first of equal maxima, as `torch.argmax`). On
    the CPU numpy's: torch's row argmax is several times slower there."""
    if logits.device.type == "cpu":
        return logits.numpy().argmax(axis=1).tolist()
    return logits.argmax(dim=-1).tolist()


@dataclass(slots=True)
class PromptScoring:
    """Rows [row, row + len(targets)) of a step's hidden states score the prompt tokens `targets`
    (the tokens at positions first, first + 1, ...) with `k` alternatives each."""

    row: int
    first: int
    targets: list[int]
    k: int


def prompt_scorings(batch: SchedulerOutput) -> list[tuple[Sequence, PromptScoring]]:
    """The step's chunks that asked for prompt logprobs: row p scores prompt token p + 1."""
    found = []
    row = 0
    # a decode row scores a prompt token only while its sequence is inside its prompt (recomputed)
    if not batch.prefills and not [
        1 for seq in batch.decodes if seq.num_computed_tokens < seq.num_prompt_tokens - 1
    ]:
        return found
    for seq, n in batch.scheduled():
        k = seq.params.prompt_logprobs
        if k is not None:
            start = seq.num_computed_tokens
            last = min(start + n, seq.num_prompt_tokens - 1)  # positions whose next token is in the prompt
            if start < last:
                found.append((seq, PromptScoring(row, start + 1, seq.token_ids[start + 1 : last + 1], k)))
        row += n
    return found


def score_prompt(
    model: LlamaForCausalLM, hidden: torch.Tensor, scoring: PromptScoring
) -> list[TokenLogprobs]:
    """The logprobs of `scoring.targets` from the model's final hidden states of the step."""
    rows = hidden[scoring.row : scoring.row + len(scoring.targets)]
    logits = model.compute_logits(rows).float()
    return token_logprobs(logits.log_softmax(dim=-1), scoring.targets, scoring.k)


@dataclass(slots=True)
class SampledRows:
    """A step's sampled `tokens` (one per sampled row), their `logprobs` (None where not asked) and
    the `prompt_logprobs` of each of its prompt scorings, in order."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.logprobs:
            self.logprobs = [None] * len(self.tokens)

    @property
    def has_logprobs(self) -> bool:
        return bool(self.prompt_logprobs) or any(entry is not None for entry in self.logprobs)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        pack_cpu_linears: bool = True,
        enforce_eager: bool = False,
        device: str | torch.device = "cpu",
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """`max_num_seqs` and `max_model_len` size the CUDA graphs' buffers (no graphs without them)."""
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = Sampler()
        c = model.config
        # One cache per attention layer the model holds (a pipeline stage holds some of them).
        attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        family = graph_family(self.device, enforce_eager, bool(max_num_seqs and max_model_len))
        cuda_graphs = family is GraphFamily.CUDA
        # zeros, not empty: masked-out cache rows must not hold NaNs (0 * NaN = NaN). With CUDA
        # graphs one more block than the block manager's: the scratch block of padded rows.
        self.kv_cache = torch.zeros(
            2,
            len(attention_layers),
            num_blocks + (1 if cuda_graphs else 0),
            block_size,
            c.num_key_value_heads,
            c.head_dim,
            dtype=dtype,
            device=self.device,
        )
        if pack_cpu_linears and not self.kv_cache.is_cuda:
            pack_linears(model)
        for i, attn in enumerate(attention_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        sizes = None
        if cuda_graphs:
            blocks = -(-max_model_len // block_size)
            sizes = CudaSizes(max_num_seqs, blocks, block_size, num_blocks, dtype)
        self.plan = StepPlan.build(family, model, sizes)
        self.decode_rows = DecodeRows(block_size)  # the decode rows' block tables, kept across steps

    # The plan's graphs, as tests and benchmarks reach them (and wrap or install one by assigning).
    @property
    def cpu_graph(self):
        return self.plan.cpu_graph

    @cpu_graph.setter
    def cpu_graph(self, graph) -> None:
        self.plan.cpu_graph = graph

    @property
    def cuda_graphs(self):
        return self.plan.cuda_graphs

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _decode_group(self, rows: DecodeInputs) -> DecodeGroup:
        """All decode rows in one paged-attention call: block tables padded with block 0."""
        group = DecodeGroup(
            0,
            len(rows.input_ids),
            self._array(rows.block_tables),
            self._tensor(rows.context_lens, torch.int32),
        )
        # the CPU's batched form, if it applies (one row never batches: `batched_fits`)
        if len(rows.input_ids) > 1 and not self.kv_cache.is_cuda and self.kv_cache.shape[1]:
            group.gather = decode_gather(group.block_tables, group.context_lens, self.kv_cache[0, 0])
        return group

    def prepare(self, batch: SchedulerOutput) -> Prepared:
        """-> (input_ids, positions, attention metadata, flat rows whose logits get sampled)."""
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64, device=self.device))
        meta.num_decode_tokens = len(batch.decodes)
        if batch.decodes:
            rows = self.decode_rows.inputs(batch.decodes)
            input_ids, positions, sample_rows = rows.input_ids, rows.positions, rows.sample_rows
            meta.decode_groups.append(self._decode_group(rows))
            slots = rows.slots
        else:
            input_ids, positions, slots, sample_rows = [], [], [], []
        for seq, n in batch.prefills:
            start, end, offset = seq.num_computed_tokens, seq.num_computed_tokens + n, len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slots(seq, start, end))
            table = None
            if start > 0:
                table = self._tensor(_readable(seq.block_table[: -(-end // self.block_size)]), torch.int64)
            meta.prefills.append(PrefillChunk(offset, n, end, table))
            if end == len(seq):
                sample_rows.append(offset + n - 1)
        meta.slot_mapping = self._tensor(slots, torch.int64)
        ids = self._tensor(input_ids, torch.int64)
        return ids, self._tensor(positions, torch.int64), meta, sample_rows

    def _array(self, values: np.ndarray) -> torch.Tensor:
        """A step's numpy index array as a tensor on the model's device (shared on the CPU)."""
        t = torch.from_numpy(values)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A step's index list on the model's device (built on the host, one copy per list; through
        numpy, whose list conversion is several times faster than `torch.tensor`'s)."""
        t = torch.from_numpy(np.array(values, dtype=_NUMPY_DTYPES[dtype]))
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput) -> StepResult:
        """Run one step: the sequences that got a new token, their tokens, and the logprobs asked for."""
        prepared = self.prepare(batch)
        if not batch.prefills and len(prepared[3]) == len(batch.decodes):
            seqs = batch.decodes  # every row samples (the decode steps)
        else:
            seqs = [seq for seq, n in batch.scheduled() if seq.num_computed_tokens + n == len(seq.token_ids)]
        return self.execute(prepared, seqs, prompt_scorings(batch))

    @torch.inference_mode()
    def execute(
        self, prepared: Prepared, seqs: list[Sequence], scorings: list[tuple[Sequence, PromptScoring]]
    ) -> StepResult:
        """The forward and the sampling of a step already prepared (`prepare`), whose sampled rows are
        `seqs`'s and whose prompt scorings are `scorings`: it reads nothing of the sequences but their
        sampling settings, generators and token masks, so an overlapped engine runs it on a worker
        thread while it prepares the next step."""
        input_ids, positions, meta, sample_rows = prepared
        hidden = self._forward(StepInputs(positions, meta, input_ids))
        sampled = self.sample_hidden(hidden, sample_rows, seqs, [s for _, s in scorings])
        prompt = [
            (seq, s.first, logprobs)
            for (seq, s), logprobs in zip(scorings, sampled.prompt_logprobs, strict=True)
        ]
        return StepResult(seqs, sampled.tokens, sampled.logprobs, prompt)

    @torch.inference_mode()
    def run_stage(
        self,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        input_ids: torch.Tensor | None = None,
        stream: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A pipeline stage's share of a prepared step: token ids (first stage) or the residual
        stream it received -> the final hidden states (last stage: `sample_hidden` samples them) or
        the residual stream to send on."""
        return self._forward(StepInputs(positions, meta, input_ids, stream))

    @torch.inference_mode()
    def sample_hidden(
        self, hidden: torch.Tensor, sample_rows: list[int], seqs: list, scorings: list[PromptScoring]
    ) -> SampledRows:
        """The tokens of the step's `sample_rows` of the final hidden states, one per entry of `seqs`
        (sequences, or anything with their `params` and `generator`), with the logprobs they asked
        for, and the prompt logprobs of `scorings`."""
        prompt_logprobs = [score_prompt(self.model, hidden, s) for s in scorings]
        if not sample_rows:
            return SampledRows([], [], prompt_logprobs)
        # rows are ascending and distinct: as many as the step has means every row, as it is
        rows = hidden if len(sample_rows) == hidden.shape[0] else hidden[sample_rows]
        logits = self.model.compute_logits(rows)
        params = list(map(_params, seqs))
        tokens = self.sample(logits.float(), seqs, params)
        if all(p.logprobs is None for p in _distinct(params)):
            return SampledRows(tokens, [], prompt_logprobs)
        return SampledRows(tokens, sampled_logprobs(logits, tokens, params), prompt_logprobs)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams]) -> list[int]:
        """One token per row of `logits` for `seqs` (with `params`, theirs), as a list: the step's
        one wait for the device."""
        logits = self._guided(logits, seqs)
        if all(p.greedy for p in _distinct(params)):
            return greedy_tokens(logits)
        temperatures = self._tensor([0.0 if p.greedy else p.temperature for p in params], torch.float32)
        top_k = self._tensor([p.top_k for p in params], torch.int64)
        top_p = self._tensor([p.top_p for p in params], torch.float32)
        generators = [seq.generator for seq in seqs]
        return self.sampler(logits, temperatures, top_k, top_p, generators).tolist()

    def _guided(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The logits with each guided row's disallowed tokens at -inf (`tessel.engine.guided`); the
        logprobs are taken from the logits before this, as vLLM does."""
        masks = list(map(_token_bitmask, seqs))
        if masks.count(None) == len(masks):
            return logits
        guided = [(i, mask) for i, mask in enumerate(masks) if mask is not None]
        bitmask = torch.from_numpy(np.stack([row.array() for _, row in guided]))
        rows = self._tensor([i for i, _ in guided], torch.int64)
        return apply_token_bitmask(logits, bitmask, rows)

    @torch.inference_mode()
    def forward_logits(self, batch: SchedulerOutput) -> torch.Tensor:
        """Logits of every token in the step, [T, V] (for tests that compare against HF)."""
        input_ids, positions, meta, _ = self.prepare(batch)
        return self.model.compute_logits(self._forward(StepInputs(positions, meta, input_ids)))

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """The model's output for the step (a pipeline stage's from the residual `stream` it received,
        `LlamaModel.forward`), run as `self.plan` chooses: a graph, or the eager model (also where
        the graph failed to compile or capture; the plan records it)."""
        mode = self.plan.mode(step.meta)
        if mode is not StepMode.EAGER:
            hidden = self.plan.run(mode, step)
            if hidden is not None:
                return hidden
        return self.model(step)


_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}
_params = attrgetter("params")
_token_bitmask = attrgetter("token_bitmask")


def _distinct(params: list[SamplingParams]) -> Iterable[SamplingParams]:
    """`params` without repeats of one object (a batch's requests often share theirs), in C loops."""
    return dict(zip(map(id, params), params, strict=True)).values()


def _readable(table: list[int]) -> list[int]:
    """A block table with its `FREED` entries (behind every layer's window: never read, the windowed
    attention masks them) pointing at block 0, so every entry indexes the cache."""
    return [block if block != FREED else 0 for block in table]
