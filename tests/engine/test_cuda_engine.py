"""The engine on a CUDA GPU: weights, KV cache and step tensors on the device, tessel's Triton kernels
(flash attention, paged decode, RMSNorm, RoPE, SiLU-and-mul) in the model. Oracle: HF transformers
on the same GPU. Skipped where PyTorch sees no GPU; run there with TRITON_INTERPRET=0 (tests/
conftest.py sets 1 when unset, which would interpret the kernels).

On the CPU, `device="cpu"` and the refusals of devices this machine lacks are checked.
"""

from __future__ import annotations

import pytest
import torch

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
    assert llm.runner.kv_cache.is_cuda and llm.runner.decode_graph is None
    ids = torch.randint(4, 300, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    got, _ = decode_logits(llm, ids, prefill=40)
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


def test_cpu_device_is_the_default_and_explicit(checkpoints) -> None:
    llm = LLM(checkpoints("llama"), device="cpu", max_model_len=64)
    assert llm.config.device == "cpu" and llm.runner.kv_cache.device.type == "cpu"


@pytest.mark.parametrize(
    ("device", "message"),
    [("tpu", "not a device name|cpu or cuda"), ("mps", "cpu or cuda"), ("cuda:64", "CUDA")],
)
def test_unusable_devices_are_refused_by_name(checkpoints, device: str, message: str) -> None:
    with pytest.raises(TesselError, match=message):
        LLM(checkpoints("llama"), device=device, max_model_len=64)
