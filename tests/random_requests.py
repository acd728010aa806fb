"""Random sampling settings for engine tests that hold one way of running requests to another (bulk
against per-request token application, async scheduling against none)."""

from __future__ import annotations

import random

from tessel import SamplingParams


def random_params(rng: random.Random, i: int) -> SamplingParams:
    """Request i's settings: greedy or sampled (seed i), EOS ignored or not, stop token ids, stop
    strings, max_tokens from 1 to 40 or none, logprobs and prompt logprobs now and then."""
    return SamplingParams(
        temperature=rng.choice([0.0, 0.0, 0.9]),
        seed=i,
        max_tokens=rng.choice([None, 1, rng.randint(2, 40)]),
        ignore_eos=rng.random() < 0.3,
        stop_token_ids=rng.sample(range(5, 300), rng.choice([0, 0, 8])),
        stop=rng.choice([[], [], ["e", "th"]]),
        logprobs=rng.choice([None, None, 0, 2]),
        prompt_logprobs=rng.choice([None, None, None, 1]),
    )
