"""The engine on a CUDA GPU: weights, KV cache and step tensors on the device, tessel's Triton kernels
(flash attention, paged decode, RMSNorm, RoPE, SiLU-and-mul) in the model, decode steps replayed as
CUDA graphs (`tessel.engine.cuda_graph`). Oracles: HF transformers on the same GPU, and the engine's
eager steps for the graphs' padding. Skipped where PyTorch sees no GPU; run there with
TRITON_INTERPRET=0 (tests/conftest.py sets 1 when unset, which would interpret the kernels).

On the CPU, `device="cpu"` and the refusals of devices this machine lacks are checked.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_steps import decode_logits
from hf_oracle import TEXTS, hf_model
from tessel import LLM, SamplingParams
from tessel.errors import TesselError

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ARCHS = ["llama", "llama31_tied", "qwen2", "mistral_head_dim"]


def _hf_logits(path, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    model = hf_model(path, dtype).to("cuda")
    with torch.no_grad():
        return model(torch.tensor([ids], device="cuda")).logits[0].float()


@needs_cuda
def test_kernels_run_compiled_not_interpreted() -> None:
    import os

    assert os.environ.get("TRITON_INTERPRET") != "1", "run the CUDA tests with TRITON_INTERPRET=0"


@needs_cuda
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_steps_match_hf_on_cuda(checkpoints, arch: str) -> None:
    """float32: a 40-token prefill, then 30 single decode steps (paged decode over 8-token blocks)."""
    path = checkpoints(arch)
    llm = LLM(path, device="cuda", max_model_len=128, block_size=8)
    assert llm.runner.kv_cache.is_cuda and llm.runner.cpu_graph is None
    ids = torch.randint(4, 300, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    got, _ = decode_logits(llm, ids, prefill=40)
    assert llm.runner.cuda_graphs.replays == 30  # every decode step replayed the 1-row graph
    expected = _hf_logits(path, ids, torch.float32)
    assert got.is_cuda
    scale = float(expected.abs().max())
    torch.testing.assert_close(got.float(), expected, rtol=1e-4, atol=1e-4 * scale)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_stay_near_hf_float32(checkpoints, dtype: torch.dtype) -> None:
    path = checkpoints("llama")
    llm = LLM(path, device="cuda", dtype=dtype, max_model_len=128, block_size=8)
    ids = torch.randint(4, 300, (50,), generator=torch.Generator().manual_seed(6)).tolist()
    got, _ = decode_logits(llm, ids, prefill=20)
    expected = _hf_logits(path, ids, torch.float32)
    relative = float((got.float() - expected).norm() / expected.norm())
    assert relative < (2e-2 if dtype == torch.bfloat16 else 3e-3), relative


@needs_cuda
def test_greedy_batch_with_chunked_prefill_matches_hf_on_cuda(checkpoints) -> None:
    """Five prompts batched, prefills cut into 16-token chunks (a chunk attends to its cached prefix)."""
    from hf_oracle import assert_matches_hf

    path = checkpoints("llama")
    llm = LLM(path, device="cuda", max_model_len=256, block_size=8, max_num_batched_tokens=16)
    outputs = llm.generate(TEXTS, SamplingParams(temperature=0.0, max_tokens=24))
    assert_matches_hf(path, outputs)
    assert llm.runner.cuda_graphs.replays > 0


@needs_cuda
def test_seeded_sampling_is_the_same_on_cuda_and_cpu(checkpoints) -> None:
    """A request's generator lives on the CPU: its noise is the same whichever device samples."""
    path = checkpoints("llama")
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True)
    cpu = LLM(path, max_model_len=128).generate(["Hello world!"], params)[0].token_ids
    cuda = LLM(path, device="cuda", max_model_len=128).generate(["Hello world!"], params)[0].token_ids
    # float32 on both; the logits differ by rounding only, so the same draws pick the same tokens
    assert cuda == cpu


@needs_cuda
def test_logprobs_on_cuda(checkpoints) -> None:
    path = checkpoints("llama")
    llm = LLM(path, device="cuda", max_model_len=128)
    out = llm.generate(["Hello world!"], SamplingParams(temperature=0, max_tokens=4, logprobs=2))[0]
    assert len(out.logprobs) == 4 and all(len(lp.top) == 2 for lp in out.logprobs)


def _shrinking_batch_matches_eager(path, **engine_args) -> LLM:
    """13 requests of different lengths through the graphs and through eager steps: decode steps of
    13 rows, then fewer as requests end, each at a bucket (16, 8, 4, 2, 1) with dummy rows. Asserts
    the same tokens and logprobs, and the scratch block outside the block manager's pool; -> the
    graphs' engine."""
    prompts = [list(range(5, 5 + 3 * i + 1)) for i in range(13)]
    params = [
        SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True, logprobs=1) for i in range(13)
    ]
    graphs = LLM(path, max_model_len=128, block_size=8, max_num_seqs=16, **engine_args)
    eager = LLM(path, max_model_len=128, block_size=8, max_num_seqs=16, enforce_eager=True, **engine_args)
    assert eager.runner.cuda_graphs is None
    got, want = graphs.generate(prompts, params), eager.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want, strict=True):
        assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-4)
    assert graphs.runner.kv_cache.shape[2] == graphs.num_total_blocks + 1
    assert graphs.num_free_blocks == graphs.num_total_blocks
    return graphs


@needs_cuda
def test_cuda_graphs_match_eager_steps_as_the_batch_shrinks(checkpoints) -> None:
    graphs = _shrinking_batch_matches_eager(checkpoints("llama31_tied"), device="cuda")
    assert set(graphs.runner.cuda_graphs.graphs) >= {16, 8, 4, 2, 1}


@needs_cuda
def test_warm_up_captures_every_bucket_then_generates(checkpoints) -> None:
    path = checkpoints("qwen2")
    llm = LLM(path, device="cuda", max_model_len=128, max_num_seqs=20)
    assert llm.warm_up()
    assert sorted(llm.runner.cuda_graphs.graphs) == [1, 2, 4, 8, 16, 20]
    assert llm.num_free_blocks == llm.num_total_blocks
    from hf_oracle import assert_matches_hf

    assert_matches_hf(path, llm.generate(TEXTS, SamplingParams(temperature=0.0, max_tokens=24)))


@needs_cuda
def test_a_failed_capture_warns_and_decodes_eagerly(checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_oracle import assert_matches_hf
    from tessel.engine import cuda_graph

    def refused(self, step):
        raise RuntimeError("capture refused (test)")

    monkeypatch.setattr(cuda_graph.CudaGraphDecoder, "_record", refused)
    path = checkpoints("llama")
    llm = LLM(path, device="cuda", max_model_len=128)
    with pytest.warns(RuntimeWarning, match="capture refused"):
        outputs = llm.generate(TEXTS, SamplingParams(temperature=0.0, max_tokens=24))
    assert_matches_hf(path, outputs)
    assert llm.runner.cuda_graphs.replays == 0


def test_cpu_device_is_the_default_and_explicit(checkpoints) -> None:
    llm = LLM(checkpoints("llama"), device="cpu", max_model_len=64)
    assert llm.config.device == "cpu" and llm.runner.kv_cache.device.type == "cpu"
    assert llm.runner.cuda_graphs is None and llm.runner.kv_cache.shape[2] == llm.num_total_blocks


@pytest.mark.parametrize(
    ("max_rows", "buckets"),
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (20, [1, 2, 4, 8, 16, 20]),
        (64, [1, 2, 4, 8, 16, 32, 48, 64]),
    ],
)
def test_cuda_graph_buckets(max_rows: int, buckets: list[int]) -> None:
    from tessel.engine.cuda_graph import CudaGraphDecoder
    from tessel.layers.buckets import row_buckets

    assert row_buckets(max_rows) == buckets
    decoder = CudaGraphDecoder.__new__(CudaGraphDecoder)
    decoder.buckets = buckets
    assert [decoder.bucket(n) for n in range(1, max_rows + 2)] == [
        min(b for b in buckets if b >= n) for n in range(1, max_rows + 1)
    ] + [None]


def test_generate_command_passes_the_device(checkpoints) -> None:
    from typer.testing import CliRunner

    from tessel.cli import app

    path = checkpoints("llama")
    args = ["generate", "--model", str(path), "--prompt", "Hello world", "--max-tokens", "6"]
    cpu = CliRunner().invoke(app, [*args, "--device", "cpu"])
    expected = LLM(path).generate(["Hello world"], SamplingParams(temperature=0, max_tokens=6))[0].text
    assert cpu.exit_code == 0 and expected.strip() in cpu.output, cpu.output
    if not torch.cuda.is_available():
        refused = CliRunner().invoke(app, [*args, "--device", "cuda"])
        assert isinstance(refused.exception, TesselError) and "sees no CUDA GPU" in str(refused.exception)


@pytest.mark.parametrize(
    ("device", "message"),
    [("tpu", "not a device name|cpu or cuda"), ("mps", "cpu or cuda"), ("cuda:64", "CUDA")],
)
def test_unusable_devices_are_refused_by_name(checkpoints, device: str, message: str) -> None:
    with pytest.raises(TesselError, match=message):
        LLM(checkpoints("llama"), device=device, max_model_len=64)


def _eager_record(self, step):
    """A stand-in for CUDA graph capture on the CPU: replay re-runs the step on the static buffers
    and writes into the captured output, as a graph replay does."""
    hidden = step()
    return (lambda: hidden.copy_(step())), hidden


def test_graph_buffers_and_padding_on_the_cpu(checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder's bookkeeping (static buffers, buckets, dummy rows in the scratch block, the
    step's rows put back after a capture) with replay standing in for the graph: the same tokens
    and logprobs as eager steps, for 13 requests that end one by one."""
    from tessel.engine import cuda_graph, step_plan

    monkeypatch.setattr(step_plan, "capture_family", lambda device: step_plan.GraphFamily.CUDA)
    monkeypatch.setattr(cuda_graph.CudaGraphDecoder, "_record", _eager_record)
    decoder = _shrinking_batch_matches_eager(checkpoints("llama")).runner.cuda_graphs
    # one prefill step for all 13 prompts, then a decode step per token of the longest request
    assert set(decoder.graphs) == {16, 8, 4, 2, 1} and decoder.replays == (4 + 3 * 12) - 1


def test_a_failed_capture_falls_back_to_eager_on_the_cpu(
    checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tessel.engine import cuda_graph, step_plan

    def refused(self, step):
        raise RuntimeError("capture refused (test)")

    monkeypatch.setattr(step_plan, "capture_family", lambda device: step_plan.GraphFamily.CUDA)
    monkeypatch.setattr(cuda_graph.CudaGraphDecoder, "_record", refused)
    path = checkpoints("llama")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(path, max_model_len=64)
    with pytest.warns(RuntimeWarning, match="capture refused"):
        got = llm.generate(TEXTS, params)
    assert llm.runner.cuda_graphs.failed and llm.runner.cuda_graphs.replays == 0
    want = LLM(path, max_model_len=64, enforce_eager=True).generate(TEXTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert not llm.warm_up()


@given(
    st.text(max_size=24)
    | st.sampled_from(["cpu", "cuda", "cuda:0", "cuda:-1", "cuda:x", "meta", "CPU", " cpu"])
)
@settings(max_examples=200, deadline=None)
def test_any_device_string_is_a_device_or_a_named_refusal(text: str) -> None:
    """Whatever a user types for --device: the CPU, a CUDA GPU this PyTorch sees, or a TesselError
    that names the value; never another exception."""
    from tessel.engine.engine_config import parse_device

    try:
        device = parse_device(text)
    except TesselError as error:
        assert repr(text) in str(error)
        return
    assert device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available())


def test_warm_up_tunes_the_linears_before_it_captures(checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, warm_up tunes every GEMM's tiles up to a full prefill's rows, then captures the
    graphs (with the tuned tiles): no tile is tuned inside a request (issue 29's W8A8 slowdown)."""
    from tessel.engine import cuda_graph, llm_engine, step_plan

    monkeypatch.setattr(step_plan, "capture_family", lambda device: step_plan.GraphFamily.CUDA)
    monkeypatch.setattr(cuda_graph.CudaGraphDecoder, "_record", _eager_record)
    events = []
    monkeypatch.setattr(llm_engine, "tune_linears", lambda model, rows, dtype: events.append(("tune", rows)))
    capture = cuda_graph.CudaGraphDecoder.capture_all
    monkeypatch.setattr(
        cuda_graph.CudaGraphDecoder, "capture_all", lambda self: events.append(("capture",)) or capture(self)
    )
    llm = LLM(checkpoints("llama"), max_model_len=64, max_num_batched_tokens=256)
    assert llm.warm_up()
    assert events == [("tune", 256), ("capture",)]
