"""The real Gemma 3 270M (`tessel example-model gemma3-270m`: PyPI wheels, Q4_K_M GGUF read by tessel's
own GGUF reader) against transformers loading the same GGUF file: greedy tokens equal for 32 new
tokens on four prompts, one of them longer than the model's 512-token sliding window. Built once
into the cache (about 1.3 GB with its GGUF file); skipped where the wheels cannot be had."""

from __future__ import annotations

import pytest
import torch

from tessel import LLM, SamplingParams
from tessel.example_models import gemma3

LONG = " ".join(f"Item {i} is a {('red', 'blue', 'green')[i % 3]} box on shelf {i % 7}." for i in range(60))
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,", LONG]


@pytest.fixture(scope="module")
def gemma() -> tuple:
    try:
        return gemma3.gemma3_model_dir(), gemma3.gemma3_gguf()
    except gemma3.ExampleModelUnavailable as error:
        pytest.skip(f"Gemma 3 270M unavailable here: {error}")


@pytest.mark.slow
def test_gemma3_270m_greedy_tokens_equal_transformers_on_the_same_gguf(gemma) -> None:
    from transformers import AutoModelForCausalLM

    checkpoint, gguf = gemma
    llm = LLM(checkpoint, max_model_len=1024)
    assert llm.model_config.layer_window(0) == 512 and llm.model_config.layer_window(5) is None
    outputs = llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_progress=False
    )
    assert len(outputs[-1].prompt_token_ids) > 512  # past the window
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    for out in outputs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        assert out.token_ids == want[0, ids.shape[1] :].tolist(), out.prompt[:40]
    assert "Paris" in outputs[0].text or "capital" in outputs[0].text
