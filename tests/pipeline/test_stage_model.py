"""A pipeline stage is the model's own forward over its part of the layers (`LlamaModel.part`), run
by the engine's own runner (`ModelRunner.run_stage`), so it takes the same decode graphs.

Oracle: the whole model in one runner. Eagerly, the stages' chain (token ids into the first, each
one's residual stream into the next) gives its final hidden states bit for bit. With the compiled
decode graph (`CpuGraph`: one row with the linears' one-row forms, several rows between the GEMMs)
every stage runs its own graphs, and the chain matches the eager chain to float32 rounding and picks
the whole model's tokens.
"""

from __future__ import annotations

import pytest
import torch

from decode_steps import CountingGraph
from tessel.engine.block_manager import BlockManager
from tessel.engine.cpu_graph import CpuGraph
from tessel.engine.model_runner import ModelRunner
from tessel.engine.sampling_params import SamplingParams
from tessel.engine.scheduler import SchedulerOutput
from tessel.engine.sequence import Sequence
from tessel.kernels import cpu_compile
from tessel.models.layer_filter import LayerFilter
from tessel.models.loader import load_model

NUM_BLOCKS, BLOCK_SIZE = 24, 4


def stage_runners(path, splits: list[tuple[int, int]], tied: bool, **kwargs) -> list[ModelRunner]:
    """One runner per stage of `splits`, each over a model loaded with only its part."""
    runners = []
    for i, (start, end) in enumerate(splits):
        part = LayerFilter(start, end, embed=i == 0, head=i == len(splits) - 1, tied=tied)
        model = load_model(path, torch.float32, layers=part)
        assert model.model.part == part
        runners.append(ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, torch.float32, **kwargs))
    return runners


def whole_runner(path, **kwargs) -> ModelRunner:
    return ModelRunner(load_model(path, torch.float32), NUM_BLOCKS, BLOCK_SIZE, torch.float32, **kwargs)


def chain(stages: list[ModelRunner], batch: SchedulerOutput) -> torch.Tensor:
    """The pipeline's step: stage 0 prepares it, each stage runs it on what the one before sent."""
    input_ids, positions, meta, _ = stages[0].prepare(batch)
    out = stages[0].run_stage(positions, meta, input_ids=input_ids)
    for runner in stages[1:]:
        out = runner.run_stage(positions, meta, stream=out)
    return out


def one_process(runner: ModelRunner, batch: SchedulerOutput) -> torch.Tensor:
    input_ids, positions, meta, _ = runner.prepare(batch)
    return runner.run_stage(positions, meta, input_ids=input_ids)


def teacher_forced(rows: int, length: int, prefill: int, seed: int):
    """(sequences, steps): each sequence's first `prefill` tokens in a step of its own, then one
    decode step of every row per remaining position."""
    blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False)
    ids = torch.randint(4, 300, (rows, length), generator=torch.Generator().manual_seed(seed)).tolist()
    seqs = [Sequence(f"r{i}", row, SamplingParams(temperature=0), BLOCK_SIZE) for i, row in enumerate(ids)]
    for seq in seqs:
        blocks.allocate(seq, 0)

    def steps():
        for seq in seqs:
            yield SchedulerOutput(prefills=[(seq, prefill)])
        for position in range(prefill, length):
            for seq in seqs:
                seq.num_computed_tokens = position
            yield SchedulerOutput(decodes=seqs)

    return steps()


@pytest.mark.parametrize(
    ("name", "splits"),
    [
        ("untied", [(0, 2), (2, 6)]),
        ("untied", [(0, 1), (1, 4), (4, 6)]),
        ("tied", [(0, 3), (3, 5)]),
    ],
)
def test_stages_chain_to_the_whole_models_hidden_states_bit_for_bit(tiny_dirs, name, splits):
    path = tiny_dirs[name]
    whole = whole_runner(path, enforce_eager=True)
    stages = stage_runners(path, splits, tied=name == "tied", enforce_eager=True)
    for rows in (1, 3):
        for batch in teacher_forced(rows, length=14, prefill=9, seed=rows):
            assert torch.equal(chain(stages, batch), one_process(whole, batch))


def test_first_stage_takes_ids_and_later_stages_the_stream(tiny_dirs):
    first, last = stage_runners(tiny_dirs["untied"], [(0, 2), (2, 6)], tied=False, enforce_eager=True)
    batch = next(teacher_forced(1, length=6, prefill=6, seed=0))
    input_ids, positions, meta, _ = first.prepare(batch)
    stream = first.run_stage(positions, meta, input_ids=input_ids)
    with pytest.raises(ValueError, match="residual stream"):
        first.run_stage(positions, meta, input_ids=input_ids, stream=stream)
    with pytest.raises(ValueError, match="residual stream"):
        last.run_stage(positions, meta, input_ids=input_ids)


def _counted(runner: ModelRunner) -> list[int]:
    """Wrap the runner's CPU decode graph; -> the rows of each step it runs."""
    assert runner.cpu_graph is not None
    counting = runner.cpu_graph = CountingGraph(runner.cpu_graph)
    return counting.rows


@pytest.mark.slow
@pytest.mark.skipif(not cpu_compile.compiler_available(), reason="no C++ compiler for inductor")
def test_stages_run_their_compiled_decode_graphs(tiny_dirs):
    """Unpacked float linears have one-row traced forms; the graph is installed taking several rows
    too, as the engine's does for split linears (a float model is not worth compiling them)."""
    path, splits = tiny_dirs["untied"], [(0, 2), (2, 6)]
    eager = stage_runners(path, splits, tied=False, pack_cpu_linears=False, enforce_eager=True)
    graphs = stage_runners(path, splits, tied=False, pack_cpu_linears=False)
    whole = whole_runner(path, pack_cpu_linears=False)
    calls: list[list[int]] = []
    for runner in [*graphs, whole]:
        runner.cpu_graph = CpuGraph.for_model(runner.model, all_rows=True)
        calls.append(_counted(runner))
    decode_steps = 0
    for rows in (1, 3):  # 3 rows run in a bucket of 4: the stream is padded
        for batch in teacher_forced(rows, length=12, prefill=8, seed=rows):
            decode_steps += bool(batch.decodes)
            got, expected = chain(graphs, batch), chain(eager, batch)
            scale = float(expected.abs().max())
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * scale)
            tokens = graphs[-1].model.compute_logits(got).argmax(-1)
            assert torch.equal(tokens, whole.model.compute_logits(one_process(whole, batch)).argmax(-1))
    for stage_calls in calls:  # every stage (and the whole model) ran every decode step as graphs
        assert stage_calls == [1] * 4 + [3] * (decode_steps - 4)
