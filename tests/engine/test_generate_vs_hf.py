"""The engine against HF transformers on tiny random checkpoints: greedy tokens and logits."""

from __future__ import annotations

import pytest
import torch

from hf_oracle import GREEDY, TEXTS, assert_matches_hf, hf_greedy, hf_model
from tessel import LLM, SamplingParams
from tessel.engine.scheduler import SchedulerOutput
from tessel.engine.sequence import Sequence


@pytest.mark.parametrize(
    "variant", ["llama", "llama31_tied", "llama_linear_mha", "qwen2", "mistral_head_dim", "llama_sharded"]
)
def test_greedy_batch_matches_hf_generate(checkpoints, variant: str) -> None:
    path = checkpoints(variant)
    llm = LLM(path, max_model_len=256)
    outputs = llm.generate(TEXTS, GREEDY)
    assert [o.prompt for o in outputs] == TEXTS  # input order
    assert_matches_hf(path, outputs)
    assert llm.num_free_blocks == llm.num_total_blocks


@pytest.mark.parametrize("variant", ["llama", "llama31_tied", "qwen2", "mistral_head_dim"])
def test_logits_match_hf_forward_in_prefill_chunks_and_decode(checkpoints, variant: str) -> None:
    """Prefill 20 tokens, a 9-token chunk on top of that cached prefix, then 3 single-token decodes."""
    path = checkpoints(variant)
    llm = LLM(path, max_model_len=128, block_size=8)
    ids = torch.randint(4, llm.model_config.vocab_size, (32,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(path)(ids[None]).logits[0].float()
    seq = Sequence("x", ids.tolist(), GREEDY, block_size=8)
    llm.block_manager.allocate(seq, 0)
    got = []
    for n in (20, 9, 1, 1, 1):
        batch = SchedulerOutput(decodes=[seq]) if n == 1 else SchedulerOutput(prefills=[(seq, n)])
        got.append(llm.runner.forward_logits(batch))
        seq.num_computed_tokens += n
    got = torch.cat(got)
    scale = expected.abs().max()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(scale))


def shared_prefix_prompts(llm: LLM, n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(4, llm.model_config.vocab_size, (37,), generator=g).tolist()
    return [prefix + torch.randint(4, 300, (i * 3 + 1,), generator=g).tolist() for i in range(n)]


def test_prefix_caching_reuses_blocks_and_keeps_outputs(checkpoints) -> None:
    path = checkpoints("llama")
    llm = LLM(path, max_model_len=128, block_size=4, enable_prefix_caching=True)
    prompts = shared_prefix_prompts(llm)
    first = llm.generate(prompts[:1], GREEDY)  # fills the cache with the shared prefix
    rest = llm.generate(prompts[1:], GREEDY)
    assert all(o.metrics.num_cached_tokens >= 36 for o in rest)
    again = llm.generate(prompts, GREEDY)  # prompts wholly cached (but the last token) too
    assert [o.token_ids for o in again] == [o.token_ids for o in first + rest]
    assert_matches_hf(path, first + rest)
    assert llm.num_free_blocks == llm.num_total_blocks


def test_chunked_prefill_with_a_tiny_token_budget(checkpoints) -> None:
    path = checkpoints("llama31_tied")
    llm = LLM(path, max_model_len=128, max_num_batched_tokens=7, enable_chunked_prefill=True)
    outputs = llm.generate(shared_prefix_prompts(llm, 4) + TEXTS, GREEDY)
    assert_matches_hf(path, outputs)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_by_recompute_when_the_kv_pool_runs_out(checkpoints, prefix_caching: bool) -> None:
    path = checkpoints("qwen2")
    llm = LLM(
        path,
        max_model_len=96,
        block_size=4,
        num_kv_blocks=26,
        max_num_seqs=8,
        enable_prefix_caching=prefix_caching,
        max_num_batched_tokens=32,
        preemption_mode="recompute",  # swap and auto: tests/engine/test_preemption.py
    )
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = shared_prefix_prompts(llm, 5)
    outputs = llm.generate(prompts, params)
    assert llm.scheduler.num_preemptions > 0
    for out in outputs:
        assert out.token_ids == hf_greedy(path, out.prompt_token_ids, 40, ignore_eos=True)
        assert out.finish_reason == "length"
    assert llm.num_free_blocks == llm.num_total_blocks


def test_bf16_checkpoint_loads_in_float32_exactly_and_in_bf16_closely(checkpoints) -> None:
    path = checkpoints("llama_bf16")
    fp32 = LLM(path, dtype="float32", max_model_len=128)
    assert_matches_hf(path, fp32.generate(TEXTS, GREEDY))

    bf16 = LLM(path, dtype="bfloat16", max_model_len=128)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert bf16.runner.kv_cache.dtype == torch.bfloat16
    ids = bf16.tokenize(TEXTS[3])
    seq = Sequence("x", ids, GREEDY, block_size=16)
    bf16.block_manager.allocate(seq, 0)
    got = bf16.runner.forward_logits(SchedulerOutput(prefills=[(seq, len(ids))]))
    with torch.no_grad():
        expected = hf_model(path, torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05 * float(expected.abs().max()))


def test_one_token_prompts_and_block_aligned_prompts(checkpoints) -> None:
    path = checkpoints("llama")
    llm = LLM(path, max_model_len=128, block_size=4)
    prompts = [[1], [1, 40, 50, 60], [1, 40, 50, 60, 70, 80, 90, 99]]  # 1 token, one block, two blocks
    assert_matches_hf(path, llm.generate(prompts, GREEDY))
    assert_matches_hf(path, llm.generate(prompts, GREEDY))  # again, from the prefix cache
