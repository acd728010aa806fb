"""How a step runs (`tessel.engine.step_plan`) and the one bucket ladder (`tessel.layers.buckets`).

Oracles: the table in step_plan's docstring for each input combination; the eager engine for the
tokens of a failed compile; the ladders each site used before they became one (written out here).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from hf_oracle import GREEDY, TEXTS, assert_matches_hf
from tessel import LLM
from tessel.engine import step_plan
from tessel.engine.cpu_graph import CpuGraph
from tessel.engine.step_plan import GraphFamily, StepMode, StepPlan, graph_family
from tessel.kernels import cpu_compile
from tessel.layers import buckets
from tessel.layers.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from tessel.models.llama import StepInputs

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
needs_compiler = pytest.mark.skipif(not cpu_compile.compiler_available(), reason="no C++ compiler")


@pytest.mark.parametrize(
    ("device", "eager", "sized", "family"),
    [
        (CPU, False, True, GraphFamily.CPU),
        (CPU, False, False, GraphFamily.CPU),  # no CUDA sizes: CPU graphs still
        (CPU, True, True, GraphFamily.NONE),
        (CUDA, False, True, GraphFamily.CUDA),  # a whole model or a pipeline stage alike
        (CUDA, False, False, GraphFamily.NONE),  # no max_num_seqs / max_model_len to size them
        (CUDA, True, True, GraphFamily.NONE),
    ],
)
def test_graph_family_from_device_and_config(device, eager, sized, family) -> None:
    assert graph_family(device, eager, sized) is family


class _Graph:
    """A stand-in graph: records its calls, returns `hidden` (None: a failed compile or capture); a
    CPU graph takes one row (`one_row`: the linears' one-row forms only) or any row count."""

    def __init__(self, hidden: torch.Tensor | None = None, fits: bool = True, one_row: bool = False) -> None:
        self.hidden, self._fits, self.one_row, self.calls = hidden, fits, one_row, 0

    def __call__(self, *args):
        self.calls += 1
        return self.hidden

    def fits(self, meta) -> bool:
        return self._fits

    def takes(self, rows: int) -> bool:
        return rows == 1 or not self.one_row


def _meta(decode_rows: int, prefill: bool = False) -> AttentionMetadata:
    meta = AttentionMetadata(torch.zeros(decode_rows + prefill, dtype=torch.int64), decode_rows)
    if decode_rows:
        lens = torch.ones(decode_rows, dtype=torch.int32)
        tables = torch.zeros(decode_rows, 1, dtype=torch.int32)
        meta.decode_groups.append(DecodeGroup(0, decode_rows, tables, lens))
    if prefill:
        meta.prefills.append(PrefillChunk(decode_rows, 1, 1, None))
    return meta


CPU_G, CUDA_G, EAGER = StepMode.CPU_GRAPH, StepMode.CUDA_GRAPH, StepMode.EAGER


@pytest.mark.parametrize(
    ("graphs", "rows", "prefill", "mode"),
    [
        ((), 1, False, EAGER),
        (("one_row",), 1, False, CPU_G),  # every linear with a one-row form
        (("one_row",), 3, False, EAGER),  # several rows, every linear called whole (float32 models)
        (("cpu",), 1, False, CPU_G),  # some linear split: any row count
        (("cpu",), 3, False, CPU_G),
        (("cpu",), 1, True, EAGER),  # a prefill in the step
        (("cpu",), 0, True, EAGER),
        (("cpu",), 0, False, EAGER),
        (("cuda",), 1, False, CUDA_G),
        (("cuda",), 7, False, CUDA_G),
        (("cuda",), 7, True, EAGER),
        (("cuda_unfit",), 7, False, EAGER),  # past max_num_seqs, or tables wider than the buffers
    ],
)
def test_each_combination_picks_its_mode(graphs, rows: int, prefill: bool, mode: StepMode) -> None:
    cpu = {"cpu", "one_row"} & set(graphs)
    plan = StepPlan(
        cpu_graph=_Graph(one_row="one_row" in graphs) if cpu else None,
        cuda_graphs=_Graph(fits="cuda" in graphs) if {"cuda", "cuda_unfit"} & set(graphs) else None,
    )
    assert plan.mode(_meta(rows, prefill)) is mode


@pytest.mark.parametrize("mode", [CPU_G, CUDA_G])
def test_a_failed_graph_is_recorded_and_its_later_steps_run_eager(mode: StepMode) -> None:
    failing = _Graph(None)
    plan = StepPlan(cpu_graph=failing) if mode is CPU_G else StepPlan(cuda_graphs=failing)
    meta = _meta(3)
    assert plan.mode(meta) is mode and plan.run(mode, StepInputs(torch.zeros(3), meta)) is None
    assert plan.failed == {mode} and failing.calls == 1
    assert plan.mode(meta) is EAGER and plan.mode(_meta(1)) is EAGER  # every row count


def _modes(monkeypatch) -> list[StepMode]:
    """Wrap the plans' choice; -> the list of the modes they pick, one per step."""
    seen: list[StepMode] = []
    choose = StepPlan.mode
    monkeypatch.setattr(StepPlan, "mode", lambda plan, meta: seen.append(choose(plan, meta)) or seen[-1])
    return seen


def test_enforce_eager_runs_every_step_eager(checkpoints, monkeypatch) -> None:
    """Unpacked float linears have one-row forms: enforce_eager builds no graph, and every step
    (prefills, one row, several) runs eager."""
    path = checkpoints("llama")
    llm = LLM(path, max_model_len=128, pack_cpu_linears=False, enforce_eager=True)
    plan = llm.runner.plan
    assert (plan.cpu_graph, plan.cuda_graphs) == (None, None)
    assert StepPlan.build(GraphFamily.NONE, llm.runner.model) == StepPlan()
    modes = _modes(monkeypatch)
    assert_matches_hf(path, llm.generate(TEXTS, GREEDY) + llm.generate(TEXTS[:1], GREEDY))
    assert len(modes) > 10 and set(modes) == {EAGER}
    assert not llm.warm_up()


@needs_compiler
def test_a_failed_compile_warns_once_is_recorded_and_is_not_retried(checkpoints, monkeypatch) -> None:
    path = checkpoints("llama")
    expected = LLM(path, max_model_len=64, enforce_eager=True).generate(TEXTS[:1], GREEDY)
    monkeypatch.setattr(cpu_compile._State, "broken", None)  # restored after the test
    attempts: list[int] = []

    def fail(*_args):
        attempts.append(1)
        raise RuntimeError("no compiler today")

    llm = LLM(path, max_model_len=64, pack_cpu_linears=False)
    assert llm.runner.plan.cpu_graph is not None
    monkeypatch.setattr(cpu_compile, "compile_graph", fail)
    modes = _modes(monkeypatch)
    with pytest.warns(UserWarning, match="compiled decode step failed.*no compiler today"):
        out = llm.generate(TEXTS[:1], GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in expected]
    assert llm.runner.plan.failed == {CPU_G} and len(attempts) == 1  # the later steps did not retry
    assert modes.count(CPU_G) == 1 and modes.count(EAGER) == len(modes) - 1 > 2


@needs_compiler
def test_warm_up_compiles_every_batch_bucket_up_to_max_num_seqs(checkpoints, monkeypatch) -> None:
    """Packed float linears: no one-row forms; the graph installed taking every row count (as the
    engine's does for split linears); warm-up compiles buckets 1, 2, 4 and 8 (5 rows). With only
    the one-row forms (unpacked float linears) it compiles one row."""
    path = checkpoints("llama")
    one_row = LLM(path, max_model_len=128, max_num_seqs=5, pack_cpu_linears=False)
    assert one_row.runner.plan.warm_up_rows(5) == [1]
    llm = LLM(path, max_model_len=128, max_num_seqs=5)
    graph = llm.runner.cpu_graph = CpuGraph.for_model(llm.runner.model, all_rows=True)
    assert llm.runner.plan.warm_up_rows(5) == [1, 2, 4, 5]
    assert llm.warm_up() and {key[1] for key in graph._graphs} == {1, 2, 4, 8}
    assert llm.num_free_blocks == llm.num_total_blocks and not llm.has_unfinished_requests()
    compiled = len(graph._graphs)
    modes = _modes(monkeypatch)
    assert_matches_hf(path, llm.generate(TEXTS, GREEDY))
    assert CPU_G in modes and len(graph._graphs) == compiled  # nothing left to compile


# ---- the ladder ---------------------------------------------------------------------------------------
def test_one_ladder_definition_in_the_sources() -> None:
    src = Path(step_plan.__file__).parents[1]
    found = [
        (path.relative_to(src).as_posix(), line.strip())
        for path in sorted(src.rglob("*.py"))
        for line in path.read_text().splitlines()
        if re.match(r"(\w*BUCKET_STEP\s*=|\s*def (bucket_rows|row_buckets|batch_buckets)\b)", line)
    ]
    assert [where for where, _ in found] == ["layers/buckets.py"] * 3, found


def _old_cpu_graph_bucket(rows: int) -> int:  # the CPU batch graph's bucket_rows before the one ladder
    return 1 << (rows - 1).bit_length() if rows <= 16 else -(-rows // 16) * 16


def _old_packed_bucket(rows: int) -> int:  # dense.bucket_rows before the one ladder
    return 1 << (rows - 1).bit_length() if rows <= 32 else -(-rows // 32) * 32


def _old_cuda_buckets(max_rows: int) -> list[int]:  # cuda_graph.batch_buckets before the one ladder
    small = [b for b in (1, 2, 4, 8) if b < max_rows]
    return small + list(range(16, max_rows, 16)) + [max_rows]


def test_each_site_keeps_its_ladder() -> None:
    from tessel.engine import cpu_graph, cuda_graph
    from tessel.layers.linear import TILE_ROWS, dense

    assert cpu_graph.bucket_rows is buckets.bucket_rows and buckets.BUCKET_STEP == 16
    rows = range(1, 700)
    assert [buckets.bucket_rows(n) for n in rows] == [_old_cpu_graph_bucket(n) for n in rows]
    assert (
        dense.packed_bucket_rows.keywords == {"step": buckets.PACKED_ROWS_STEP}
        and buckets.PACKED_ROWS_STEP == 32
    )
    packed = [dense.packed_bucket_rows(n) for n in range(1, TILE_ROWS + 1)]
    assert packed == [_old_packed_bucket(n) for n in range(1, TILE_ROWS + 1)]
    assert cuda_graph.row_buckets is buckets.row_buckets
    for max_rows in range(1, 130):
        ladder = buckets.row_buckets(max_rows)
        assert ladder == _old_cuda_buckets(max_rows)
        # the old bisect over the list: the smallest bucket holding the rows, None past the last
        old = [min(b for b in ladder if b >= n) for n in range(1, max_rows + 1)] + [None]
        assert [buckets.capped_bucket(n, max_rows) for n in range(1, max_rows + 2)] == old
