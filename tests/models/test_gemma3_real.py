"""The real Gemma 3 270M (`tessel example-model gemma3-270m`: PyPI wheels, Q4_K_M GGUF read by tessel's
own GGUF reader) against transformers loading the same GGUF file: greedy tokens equal for 32 new
tokens on four prompts, one of them longer than the model's 512-token sliding window; and for 64 new
tokens on 20 prompts of 64 tokens, with perplexity within 0.5% of transformers'. Built once
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


@pytest.mark.slow
def test_gemma3_270m_on_20_prompts_and_its_perplexity_match_transformers(gemma) -> None:
    """20 prompts of BOS + 63 tokens of the evaluation text, 64 greedy new tokens each: tessel's tokens
    equal transformers' on the same GGUF; perplexity over 4 windows of BOS + 511 tokens within 0.5%
    of transformers' (`benchmarks/gemma3_fidelity.py` runs the same at 8192 tokens)."""
    import math
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tessel.engine.scheduler import SchedulerOutput
    from tessel.engine.sequence import Sequence

    checkpoint, gguf = gemma
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = (Path(__file__).parents[2] / "benchmarks" / "data" / "kjv_evaluation.txt").read_text(
        encoding="utf-8"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    prompts = [[bos, *ids[i * 63 : (i + 1) * 63]] for i in range(20)]
    windows = [[bos, *ids[i * 511 : (i + 1) * 511]] for i in range(4)]
    llm = LLM(checkpoint, max_model_len=640)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64), use_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ours_nll = theirs_nll = 0.0
    with torch.no_grad():
        for out, prompt in zip(outputs, prompts, strict=True):
            x = torch.tensor([prompt])
            want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False)
            assert out.token_ids == want[0, len(prompt) :].tolist(), tokenizer.decode(prompt[1:8])
        for i, window in enumerate(windows):
            target = torch.tensor(window[1:])
            theirs = hf(torch.tensor([window])).logits[0, :-1].double()
            seq = Sequence(f"w{i}", window, SamplingParams(temperature=0), llm.config.block_size)
            llm.block_manager.allocate(seq, 0)
            ours = llm.runner.forward_logits(SchedulerOutput(prefills=[(seq, len(window))]))[:-1].double()
            llm.block_manager.free(seq)
            ours_nll += float(torch.nn.functional.cross_entropy(ours, target, reduction="sum"))
            theirs_nll += float(torch.nn.functional.cross_entropy(theirs, target, reduction="sum"))
    ratio = math.exp((ours_nll - theirs_nll) / (511 * len(windows)))
    assert abs(ratio - 1) < 0.005, ratio
