"""A model whose every layer has a sliding window (Mistral with `sliding_window`) returns the KV blocks
behind the window to the pool as it decodes, and still generates transformers' tokens.

Oracle: HF `generate` (greedy) on the tiny random Mistral with W = 12, blocks of 4 tokens: a
sequence never holds more than W / block_size + 2 = 5 blocks while it decodes; prefix-cache hits on
freed blocks, chunked prefill of prompts longer than the window and several sequences at once keep
the tokens equal. Gemma 3 (full layers among the sliding ones) frees nothing early.
"""

from __future__ import annotations

import pytest

from hf_oracle import TEXTS, assert_matches_hf, hf_greedy
from tessel import LLM, SamplingParams
from tessel.engine.block_manager import FREED

WINDOW, BLOCK = 12, 4
LONG = "The cat sat on the mat. The dog sat on the log. The bird sang in the tree, and the sun was warm."


def _held(seq) -> int:
    return sum(block != FREED for block in seq.block_table)


@pytest.mark.parametrize("new_tokens", [60])
def test_a_long_generation_holds_at_most_window_blocks_plus_two(checkpoints, new_tokens) -> None:
    path = checkpoints("mistral_window")
    llm = LLM(path, max_model_len=256, block_size=BLOCK)
    assert llm.block_manager.window_tokens == WINDOW
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.add_request("a", TEXTS[0], params)
    seq = llm._requests["a"]
    most_held, most_used, freed_seen = 0, 0, False
    while llm.has_unfinished_requests():
        llm.step()
        if not seq.is_finished:
            most_held = max(most_held, _held(seq))
            most_used = max(most_used, llm.num_total_blocks - llm.num_free_blocks)
            freed_seen |= FREED in seq.block_table
    assert freed_seen and len(seq) > 4 * WINDOW
    assert most_held <= WINDOW // BLOCK + 2 and most_used <= WINDOW // BLOCK + 2, (most_held, most_used)
    assert seq.output_token_ids == hf_greedy(path, seq.prompt_token_ids, new_tokens, ignore_eos=True)
    assert llm.num_free_blocks == llm.num_total_blocks


def test_chunked_prefill_prefix_hits_and_batches_keep_hf_tokens(checkpoints) -> None:
    """Prompts longer than the window in 8-token chunks, the same long prompt again (its freed blocks
    revived from the prefix cache), and other prompts beside them."""
    path = checkpoints("mistral_window")
    llm = LLM(path, max_model_len=256, block_size=BLOCK, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=40)  # HF's min_new_tokens would mask EOS
    first = llm.generate([LONG, *TEXTS[:2]], params, use_progress=False)
    again = llm.generate([LONG, LONG + " And"], params, use_progress=False)
    assert again[0].metrics.num_cached_tokens > WINDOW  # blocks behind the window came back from the cache
    assert_matches_hf(path, [*first, *again], max_new_tokens=40)
    assert llm.num_free_blocks == llm.num_total_blocks


def test_models_with_full_attention_layers_keep_every_block(checkpoints) -> None:
    for variant in ("gemma3", "qwen3"):
        assert (
            LLM(checkpoints(variant), max_model_len=64, block_size=BLOCK).block_manager.window_tokens is None
        )
