"""The compiled CPU decode step (`tessel.engine.cpu_graph`): one row with the linears' one-row forms
traced in, several rows with graphs between the GEMMs.

Oracles: HF transformers' forward for the model's logits (each row of a teacher-forced batch against
its own sequence), float64 softmax attention for the attention graph; the eager engine for what must
not change (fallbacks, steps the graph does not take). The float models run with unpacked linears
(`pack_cpu_linears=False`) for the one-row forms; oneDNN's packed weights have none and are called
between the graphs. The engine takes several rows only where some linear is split (W8A8 on fbgemm /
fp16codes: tests/quant/test_cpu_graph_quantized.py); here the graph is installed with `all_rows` on
float models, whose logits HF gives exactly, to test the graphs themselves: the buckets, the padding,
the attention between them, four architectures.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from decode_steps import CountingGraph, batch_decode_logits, decode_logits
from hf_oracle import GREEDY, TEXTS, assert_matches_hf, hf_model
from tessel import LLM, SamplingParams
from tessel.engine import cpu_graph as cg
from tessel.kernels import cpu_compile
from tessel.layers.activation import SiluAndMul
from tessel.layers.buckets import BUCKET_STEP, bucket_rows
from tessel.layers.norm import RMSNorm
from tessel.models.llama import LlamaAttention

pytestmark = pytest.mark.skipif(not cpu_compile.compiler_available(), reason="no C++ compiler for inductor")


def _count_calls(llm: LLM) -> list[int]:
    """Wrap the engine's CPU graph; -> a list that gets one entry (its rows) per step it ran."""
    counting = llm.runner.cpu_graph = CountingGraph(llm.runner.cpu_graph)
    return counting.rows


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["llama", "llama31_tied", "qwen2", "mistral_head_dim", "qwen3"])
def test_decode_steps_match_hf_forward(checkpoints, variant: str) -> None:
    """80 tokens at block size 8: the attention graph's bucket grows from 8 to 16 blocks on the way."""
    path = checkpoints(variant)
    llm = LLM(path, max_model_len=128, block_size=8, pack_cpu_linears=False)
    assert llm.runner.cpu_graph is not None and llm.runner.cpu_graph.row_forms
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(4, llm.model_config.vocab_size, (80,), generator=g).tolist()
    got, graph_steps = decode_logits(llm, ids, prefill=5)
    assert graph_steps == 75  # every decode step ran as the graph
    with torch.no_grad():
        expected = hf_model(path)(torch.tensor([ids])).logits[0].float()
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * scale)


def test_greedy_generation_matches_hf_and_only_single_sequence_steps_take_the_graph(checkpoints) -> None:
    path = checkpoints("llama")
    llm = LLM(path, max_model_len=256, pack_cpu_linears=False)
    calls = _count_calls(llm)
    batch = llm.generate(TEXTS, GREEDY)  # several rows decode together until the shorter ones finish
    assert_matches_hf(path, batch)
    graph_steps = len(calls)
    single = llm.generate(TEXTS[:1], GREEDY)
    assert_matches_hf(path, single)
    assert len(calls) - graph_steps == single[0].num_output_tokens - 1  # all its decode steps
    eager = LLM(path, max_model_len=256, pack_cpu_linears=False, enforce_eager=True)
    assert eager.runner.cpu_graph is None
    assert [o.token_ids for o in eager.generate(TEXTS, GREEDY)] == [o.token_ids for o in batch]


def test_a_model_without_traced_forms_runs_eager(checkpoints) -> None:
    path = checkpoints("llama")
    assert LLM(path, max_model_len=64).runner.cpu_graph is None  # oneDNN-packed float linears
    llm = LLM(path, max_model_len=64, pack_cpu_linears=False)
    model = llm.runner.model
    assert cg.CpuGraph.for_model(model) is not None
    model.model.norm = nn.Identity()  # as a pipeline stage without the final norm holds it
    assert cg.CpuGraph.for_model(model) is None


def test_a_failed_compile_warns_once_and_the_step_runs_eager(checkpoints, monkeypatch) -> None:
    path = checkpoints("llama")
    prompt = "Once upon a time"
    expected = LLM(path, max_model_len=64, enforce_eager=True).generate([prompt], GREEDY)[0].token_ids
    monkeypatch.setattr(cpu_compile._State, "broken", None)  # restored after the test

    def fail(*_args):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(cpu_compile, "compile_graph", fail)
    llm = LLM(path, max_model_len=64, pack_cpu_linears=False)
    with pytest.warns(UserWarning, match="compiled decode step failed.*no compiler today"):
        out = llm.generate([prompt], GREEDY)[0]
    assert out.token_ids == expected
    assert not cpu_compile.compiler_available()  # nothing compiles again in this process


@pytest.mark.parametrize("blocks", [1, 2, 3, 4, 5, 8, 9, 100, 128, 129])
@pytest.mark.parametrize("block_size", [1, 8, 16, 256])
def test_bucket_is_the_smallest_power_of_two_holding_the_context_and_the_minimum(
    blocks: int, block_size: int
) -> None:
    bucket = cg.bucket_blocks(blocks, block_size)
    least = math.ceil(cg.MIN_BUCKET_TOKENS / block_size)
    assert bucket >= blocks and bucket >= least
    assert bucket == least or (bucket & (bucket - 1) == 0 and bucket // 2 < max(blocks, least))


def _attention_reference(q, k_cache, v_cache, table: list[int], context: int, scale: float) -> torch.Tensor:
    """float64 softmax attention of one query row over the first `context` tokens of its blocks."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    k = k_cache[table].reshape(-1, num_kv_heads, head_dim)[:context].double()
    v = v_cache[table].reshape(-1, num_kv_heads, head_dim)[:context].double()
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q[0].double()[:, None, :] * k).sum(-1) * scale  # [Hq, L]
    return (scores.softmax(-1)[:, :, None] * v).sum(1)  # [Hq, D]


def _attention_case(heads, head_dim: int, block_size: int, context: int, seed: int):
    """(graph function, its inputs, the float64 expectation) for scattered blocks of random K/V."""
    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(seed)
    num_blocks = 200 // block_size + 2
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    used = math.ceil(context / block_size)
    blocks = torch.randperm(num_blocks, generator=g)[:used].tolist()  # scattered, out of order
    table = torch.zeros(cg.bucket_blocks(used, block_size), dtype=torch.int64)  # padding reads block 0
    table[:used] = torch.tensor(blocks)
    q = torch.randn(1, num_heads, head_dim, generator=g)
    scale = head_dim**-0.5
    fn = cg.attention_graph(num_heads, num_kv_heads, head_dim, scale)
    expected = _attention_reference(q, k_cache, v_cache, blocks, context, scale)
    return fn, [q, k_cache, v_cache, table, torch.tensor([context])], expected


@settings(max_examples=40, deadline=None)
@given(
    heads=st.sampled_from([(4, 4), (4, 2), (6, 1), (9, 3)]),
    head_dim=st.sampled_from([8, 32, 64]),
    block_size=st.sampled_from([1, 4, 16]),
    context=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_attention_graph_matches_float64_attention(heads, head_dim, block_size, context, seed) -> None:
    fn, inputs, expected = _attention_case(heads, head_dim, block_size, context, seed)
    got = fn(*inputs)[0].view(expected.shape)  # the function as traced, run eagerly
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("heads", "head_dim", "block_size", "context"),
    [((9, 3), 64, 16, 1), ((4, 2), 32, 4, 64), ((6, 1), 8, 1, 65), ((4, 4), 32, 16, 200)],
)
def test_compiled_attention_graph_matches_float64_attention(heads, head_dim, block_size, context) -> None:
    fn, inputs, expected = _attention_case(heads, head_dim, block_size, context, seed=context)
    got = cpu_compile.compile_graph(fn, inputs)(*inputs)[0].view(expected.shape)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_generate_command_passes_enforce_eager_to_the_engine(checkpoints, monkeypatch) -> None:
    from typer.testing import CliRunner

    from tessel.cli import app

    built: list[bool] = []
    for_model = cg.CpuGraph.for_model
    monkeypatch.setattr(cg.CpuGraph, "for_model", lambda model: built.append(True) or for_model(model))
    path = checkpoints("llama")
    args = ["generate", "--model", str(path), "--prompt", "Hello world", "--max-tokens", "6"]
    eager = CliRunner().invoke(app, [*args, "--enforce-eager"])
    assert eager.exit_code == 0 and not built, eager.output
    compiled = CliRunner().invoke(app, args)
    assert compiled.exit_code == 0 and built, compiled.output
    expected = LLM(path).generate(["Hello world"], SamplingParams(temperature=0, max_tokens=6))[0].text
    assert expected.strip() in eager.output and expected.strip() in compiled.output


def test_warm_up_compiles_the_step_and_leaves_the_engine_as_it_was(checkpoints) -> None:
    path = checkpoints("llama")
    llm = LLM(path, max_model_len=64, pack_cpu_linears=False)
    graphs = llm.runner.cpu_graph._graphs
    # the first layer's input, the layers between (one graph for all: their weights are its inputs),
    # the last layer's output, and the attention
    assert llm.warm_up() and sorted(key[0] for key in graphs) == ["attention", "graph", "graph", "graph"]
    assert llm.num_free_blocks == llm.num_total_blocks and not llm.has_unfinished_requests()
    calls = _count_calls(llm)
    compiled = len(graphs)
    out = llm.generate(TEXTS[:1], GREEDY)  # a short prompt: the bucket warm_up compiled
    assert_matches_hf(path, out)
    assert calls and len(graphs) == compiled  # nothing left to compile
    assert not LLM(path, max_model_len=64).warm_up()  # packed float linears: no compiled step


def test_the_graphs_trace_the_models_own_modules(checkpoints, monkeypatch) -> None:
    """The norms, the heads (split and rotary) and the activation inside the graphs are the model's
    own modules, called while a graph is traced and never by a compiled step; the layers share the
    graphs, so tracing calls them the same number of times however many layers there are."""
    path = checkpoints("llama")
    llm = LLM(path, max_model_len=64, pack_cpu_linears=False)
    calls: list[str] = []
    for cls, name in ((RMSNorm, "forward"), (SiluAndMul, "forward"), (LlamaAttention, "heads")):

        def counted(self, *args, original=getattr(cls, name), who=cls.__name__):
            calls.append(who)
            return original(self, *args)

        monkeypatch.setattr(cls, name, counted)
    _, graph_steps = decode_logits(llm, list(range(4, 16)), prefill=8)  # the prefill eager, 4 decodes
    layers = llm.model_config.num_hidden_layers
    assert graph_steps == 4 and layers >= 2
    eager = {"RMSNorm": 2 * layers + 1, "SiluAndMul": layers, "LlamaAttention": layers}
    # traced once each: the first layer's input (norm, heads); the layers between (post norm,
    # activation, next input norm, heads); the last layer's output (post norm, activation, final norm)
    traced = {"RMSNorm": 1 + 2 + 2, "SiluAndMul": 2, "LlamaAttention": 2}
    assert {who: calls.count(who) for who in eager} == {who: eager[who] + traced[who] for who in eager}


# ---- several rows --------------------------------------------------------------------------------------
def _with_graphs(llm: LLM) -> LLM:
    """`llm` with a graph that takes every row count installed (a float model: the engine's own
    graph takes one row at most, where the linears have one-row forms)."""
    engine_graph = llm.runner.cpu_graph
    assert engine_graph is None or not engine_graph.takes(2)
    llm.runner.cpu_graph = cg.CpuGraph.for_model(llm.runner.model, all_rows=True)
    assert llm.runner.cpu_graph is not None and not llm.runner.cpu_graph.splits_a_linear
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
        ("qwen3", 2, False),  # q/k norms, their weights graph inputs (the layers share the graphs)
    ],
)
def test_batch_decode_steps_match_hf_forward(checkpoints, variant: str, rows: int, packed: bool) -> None:
    path = checkpoints(variant)
    llm = _with_graphs(LLM(path, max_model_len=128, block_size=8, pack_cpu_linears=packed, max_num_seqs=32))
    prompts = _prompts(llm, rows, 30, seed=rows)
    got, graph_steps = batch_decode_logits(llm, prompts, prefill=6)
    assert graph_steps == 24  # every decode step ran as the graphs
    assert {key[1] for key in llm.runner.cpu_graph._graphs} == {bucket_rows(rows)}
    _assert_rows_match_hf(path, prompts, got, prefill=6)


def test_greedy_batches_match_hf_and_take_the_graphs_as_they_shrink(checkpoints) -> None:
    path = checkpoints("llama")
    llm = _with_graphs(LLM(path, max_model_len=256))  # oneDNN-packed float linears, called between
    graph = llm.runner.cpu_graph
    rows_per_step = _count_calls(llm)
    outputs = llm.generate(TEXTS, GREEDY)  # the shorter ones finish first: the batch shrinks
    assert_matches_hf(path, outputs)
    assert rows_per_step and max(rows_per_step) == len(TEXTS) and len(set(rows_per_step)) > 1
    # packed float linears have no one-row traced form: one row runs between the GEMMs too
    assert not graph.row_forms
    single = llm.generate(TEXTS[1:2], GREEDY)
    assert_matches_hf(path, single)
    assert rows_per_step.count(1) == single[0].num_output_tokens - 1
    buckets = {key[1] for key in graph._graphs}
    assert buckets == {bucket_rows(n) for n in rows_per_step}


def test_float_models_enforce_eager_and_models_the_graphs_cannot_hold_run_eager(checkpoints) -> None:
    path = checkpoints("llama")
    assert LLM(path, max_model_len=64).runner.cpu_graph is None  # not worth compiling
    model = LLM(path, max_model_len=64).runner.model
    assert cg.CpuGraph.for_model(model, all_rows=True) is not None
    model.model.norm = nn.Identity()  # as a pipeline stage without the final norm holds it
    assert cg.CpuGraph.for_model(model, all_rows=True) is None


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
    with pytest.warns(UserWarning, match="compiled decode step failed.*no compiler today"):
        out = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == expected


@given(rows=st.integers(1, 600))
def test_bucket_is_the_smallest_allowed_row_count_holding_the_rows(rows: int) -> None:
    bucket = bucket_rows(rows)
    allowed = [1, 2, 4, 8, 16] + list(range(32, 640 + 1, BUCKET_STEP))
    assert bucket == min(b for b in allowed if b >= rows)
