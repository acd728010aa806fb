"""The compiled decode step of several sequences (`tessel.engine.batch_decode_graph`).

Oracles: HF transformers' forward for the model's logits (each row of a teacher-forced batch
against its own sequence); the eager engine for fallbacks. The engine compiles these graphs only
for models with split linears (W8A8 on fbgemm / fp16codes: tests/quant/test_decode_graph_quantized.py);
here they are installed on float models, whose logits HF gives exactly, to test the graphs
themselves: the buckets, the padding, the attention between them, four architectures.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from decode_steps import batch_decode_logits
from hf_oracle import GREEDY, TEXTS, assert_matches_hf, hf_model
from tessel import LLM
from tessel.engine import batch_decode_graph as bdg
from tessel.kernels import cpu_compile
from tessel.layers.buckets import BUCKET_STEP, bucket_rows

pytestmark = pytest.mark.skipif(not cpu_compile.compiler_available(), reason="no C++ compiler for inductor")


def _with_graphs(llm: LLM) -> LLM:
    """`llm` with the batch decode graphs installed (a float model: not worth compiling by default)."""
    assert llm.runner.batch_decode_graph is None
    llm.runner.batch_decode_graph = bdg.BatchDecodeGraph.for_model(llm.runner.model)
    assert llm.runner.batch_decode_graph is not None and not llm.runner.batch_decode_graph.splits_a_linear
    return llm


def _prompts(llm: LLM, rows: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, llm.model_config.vocab_size, (rows, length), generator=g).tolist()


def _assert_rows_match_hf(path, prompts: list[list[int]], got: torch.Tensor, prefill: int) -> None:
    """got [steps, rows, V]: decode step s of row r is position prefill + s of prompts[r]."""
    with torch.no_grad():
        expected = hf_model(path)(torch.tensor(prompts)).logits.float()  # [rows, length, V]
    expected = expected[:, prefill:].transpose(0, 1)  # [steps, rows, V]
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize(
    ("variant", "rows", "packed"),
    [
        ("llama", 1, True),  # one row of a model without one-row traced forms (packed float linears)
        ("llama", 3, True),  # 3 rows in a bucket of 4: padded graphs, GEMMs on the real rows
        ("llama", 4, False),  # a full bucket, plain nn.Linear calls
        ("llama", 17, True),  # past 16: a bucket of 32
        ("llama31_tied", 2, True),
        ("qwen2", 5, True),  # q/k/v biases
        ("mistral_head_dim", 3, True),  # head_dim * heads != hidden
    ],
)
def test_batch_decode_steps_match_hf_forward(checkpoints, variant: str, rows: int, packed: bool) -> None:
    path = checkpoints(variant)
    llm = _with_graphs(LLM(path, max_model_len=128, block_size=8, pack_cpu_linears=packed, max_num_seqs=32))
    prompts = _prompts(llm, rows, 30, seed=rows)
    got, graph_steps = batch_decode_logits(llm, prompts, prefill=6)
    assert graph_steps == 24  # every decode step ran as the graphs
    assert {key[1] for key in llm.runner.batch_decode_graph._graphs} == {bucket_rows(rows)}
    _assert_rows_match_hf(path, prompts, got, prefill=6)


def test_greedy_batches_match_hf_and_take_the_graphs_as_they_shrink(checkpoints) -> None:
    path = checkpoints("llama")
    llm = _with_graphs(LLM(path, max_model_len=256))  # oneDNN-packed float linears, called between
    graph = llm.runner.batch_decode_graph
    rows_per_step: list[int] = []
    llm.runner.batch_decode_graph = lambda ids, *rest: rows_per_step.append(len(ids)) or graph(ids, *rest)
    outputs = llm.generate(TEXTS, GREEDY)  # the shorter ones finish first: the batch shrinks
    assert_matches_hf(path, outputs)
    assert rows_per_step and max(rows_per_step) == len(TEXTS) and len(set(rows_per_step)) > 1
    # packed float linears have no one-row traced form (`decode_graph`): these graphs take one row too
    assert llm.runner.decode_graph is None
    single = llm.generate(TEXTS[1:2], GREEDY)
    assert_matches_hf(path, single)
    assert rows_per_step.count(1) == single[0].num_output_tokens - 1
    buckets = {key[1] for key in graph._graphs}
    assert buckets == {bucket_rows(n) for n in rows_per_step}


def test_float_models_enforce_eager_and_models_the_graphs_cannot_hold_run_eager(checkpoints) -> None:
    path = checkpoints("llama")
    assert LLM(path, max_model_len=64).runner.batch_decode_graph is None  # not worth compiling
    model = LLM(path, max_model_len=64).runner.model
    assert bdg.BatchDecodeGraph.for_model(model) is not None
    model.model.norm = nn.Identity()  # as a pipeline stage without the final norm holds it
    assert bdg.BatchDecodeGraph.for_model(model) is None


def test_a_failed_compile_warns_once_and_the_batch_runs_eager(checkpoints, monkeypatch) -> None:
    path = checkpoints("llama")
    prompts = TEXTS[:3]
    eager = LLM(path, max_model_len=64, enforce_eager=True)
    expected = [o.token_ids for o in eager.generate(prompts, GREEDY)]
    monkeypatch.setattr(cpu_compile._State, "broken", None)  # restored after the test

    def fail(*_args):
        raise RuntimeError("no compiler today")

    llm = _with_graphs(LLM(path, max_model_len=64))
    monkeypatch.setattr(cpu_compile, "compile_graph", fail)
    with pytest.warns(UserWarning, match="compiled batch decode step failed.*no compiler today"):
        out = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == expected


@given(rows=st.integers(1, 600))
def test_bucket_is_the_smallest_allowed_row_count_holding_the_rows(rows: int) -> None:
    bucket = bucket_rows(rows)
    allowed = [1, 2, 4, 8, 16] + list(range(32, 640 + 1, BUCKET_STEP))
    assert bucket == min(b for b in allowed if b >= rows)
